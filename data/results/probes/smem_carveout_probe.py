"""Session 53 probe (smem_carveout.jsonl beside it holds its printed lines, transcribed).
FlashMLA's and fa2's kernels run 4-6 us longer after bench's read flush than after the written one
(flush_kernel_spans_probe.py), and session 52 found the same after any kernel with shared memory
(a sum of 8 values, a 64x64 GEMM) but not after an elementwise one (l2_flush_baselines.jsonl). A
hypothesis: an SM's split of its on-chip memory between L1 and shared memory (the carveout) stays as
the last kernel that used shared memory set it; an elementwise kernel leaves FlashMLA's own large
split from the replay before, a reduction sets a small one, and the next FlashMLA (or fa2) launch
waits for each SM to change it back. This kernel, one CTA an SM, uses `smem` bytes of dynamic shared
memory with a carveout preference (-1: none, else percent of the maximum shared memory), and
runs after the written flush (which leaves the split alone) or the read one. Predicted if the
hypothesis holds: FlashMLA and fa2 fast (as after the written flush alone) after 0 B and after 200
KB, slow after 16 KB, fast after 16 KB with a preference of 100; sm120_mla (at most 99 KB) the same
in every mode."""

import torch
from torch.utils.cpp_extension import load_inline

from sm120_workbook.kernels.bench import BUILDERS, Inputs, L2Flush, Shape, captured_graph, interleaved_medians_us

SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
template <int PREF> __global__ void touch_smem(int* out, int n) {
  extern __shared__ int s[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = i;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = n ? s[n - 1] : 0;
}
template <int PREF> void launch_one(torch::Tensor out, int64_t smem) {
  static bool set = false;
  if (!set) {
    cudaFuncSetAttribute(touch_smem<PREF>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
    if (PREF >= 0) cudaFuncSetAttribute(touch_smem<PREF>, cudaFuncAttributePreferredSharedMemoryCarveout, PREF);
    set = true;
  }
  touch_smem<PREF><<<out.numel(), 128, smem, c10::cuda::getCurrentCUDAStream()>>>(out.data_ptr<int>(), int(smem / 4));
}
void touch(torch::Tensor out, int64_t smem, int64_t pref) {
  if (pref == 100) launch_one<100>(out, smem);
  else if (pref == 0) launch_one<0>(out, smem);
  else launch_one<-1>(out, smem);
}
"""
mod = load_inline("smem_carveout_probe", cpp_sources="void touch(torch::Tensor out, int64_t smem, int64_t pref);",
                  cuda_sources=SRC, functions=["touch"], extra_cuda_cflags=["-O2"], verbose=False)
out = torch.zeros(torch.cuda.get_device_properties(0).multi_processor_count, dtype=torch.int32, device="cuda")
write, read = L2Flush("write"), L2Flush("read")


def then(flush, smem, pref=-1):
    def f():
        flush()
        mod.touch(out, smem, pref)
    return f


MODES = {"write": write, "read": read, "write+0B": then(write, 0), "write+16KB": then(write, 16 << 10),
         "write+200KB": then(write, 200 << 10), "write+16KB/pref100": then(write, 16 << 10, 100),
         "read+200KB": then(read, 200 << 10), "read+16KB/pref100": then(read, 16 << 10, 100)}
CASES = [("flashmla", Shape(1, 8, 16, 65536)), ("flashinfer_mla_fa2", Shape(1, 8, 16, 1024)),
         ("sm120_mla", Shape(1, 8, 16, 65536)), ("flashmla", Shape(1, 8, 16, 16384))]


for m in MODES.values():   # the attributes set and the kernel loaded before any timing
    m()
torch.cuda.synchronize()
print("case | " + " | ".join(MODES) + "  (median of 5 interleaved rounds, each a median of 50 replays, us)")
for impl, sh in CASES:
    x = Inputs(sh)
    fn = BUILDERS[impl](x)   # kept alive with x while the graph replays
    med = interleaved_medians_us(captured_graph(fn), MODES)
    print(f"{impl} {sh.label} | " + " | ".join(f"{v:.1f}" for v in med.values()), flush=True)
