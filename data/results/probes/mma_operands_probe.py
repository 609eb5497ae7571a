"""Session 56 probe (mma_operands.jsonl beside it holds what it wrote): does the mma.sync ceiling
(mma_peak.cuh, every operand the bf16 pair (1.0, 1.0)) read high because its data barely toggles?
METHOD.md: a bf16 matmul ran 13% faster on zeros than on random data on an H200. The same
register-only loop (8 chains of m16n8k16 a warp) with each thread's A and each chain's B loaded
once from a random bf16 buffer, beside the constant form and the shipped measure, in one run.
Predicted: random operands 0-10% slower.

    python3 data/results/probes/mma_operands_probe.py OUT.jsonl
"""
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

import sm120_workbook.kernels as kernels
from sm120_workbook.hardware import _time_ms
from sm120_workbook.kernels.bench import MMA_FLOPS, MMA_PEAK_CHAINS, measure_mma_sync_tflops
from sm120_workbook.kernels.build import NVCC_FLAGS, _arch_flags
from sm120_workbook.results import append_records

SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "mla_verify.cuh"
template <bool kRandom>
__global__ void peak(float* out, const uint32_t* data, int iters) {
  constexpr int C = 8;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t a[4], b[C][2];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = kRandom ? data[(t * 20 + i) & 0xFFFFF] : 0x3f803f80u;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    b[c][0] = kRandom ? data[(t * 20 + 4 + 2 * c) & 0xFFFFF] : 0x3f803f80u;
    b[c][1] = kRandom ? data[(t * 20 + 5 + 2 * c) & 0xFFFFF] : 0x3f803f80u;
  }
  float d[C][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < C; ++c) sm120_mla::mma_16816(d[c], a, b[c][0], b[c][1]);
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  out[t] = s;
}
void run(torch::Tensor out, torch::Tensor data, int64_t iters, int64_t threads, bool random) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks = out.numel() / threads;
  if (random) peak<true><<<blocks, threads, 0, stream>>>(out.data_ptr<float>(), (const uint32_t*)data.data_ptr(), iters);
  else peak<false><<<blocks, threads, 0, stream>>>(out.data_ptr<float>(), (const uint32_t*)data.data_ptr(), iters);
}
"""


def main(out_path):
    src = Path(kernels.__file__).parent
    mod = load_inline("mma_operands_probe", cpp_sources="void run(torch::Tensor out, torch::Tensor data, int64_t iters, int64_t threads, bool random);",
                      cuda_sources=SRC, functions=["run"], extra_include_paths=[str(src)],
                      extra_cuda_cflags=NVCC_FLAGS + _arch_flags(torch.cuda.get_device_capability()))   # the kernel's own flags
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    data = (torch.randn(1 << 21, device="cuda") * 0.05).to(torch.bfloat16)   # small: fp32 sums stay finite
    rows = []
    for blocks_per_sm in (4, 1):
        out = torch.empty(sms * blocks_per_sm * 256, device="cuda")
        flops = out.numel() // 32 * 4096 * MMA_PEAK_CHAINS * MMA_FLOPS
        got = {}
        for rnd in range(3):   # the order turns each round
            for form in (["constant", "random"] if rnd % 2 == 0 else ["random", "constant"]):
                ms = _time_ms(torch, lambda: mod.run(out, data, 4096, 256, form == "random"), 10, 2)
                got.setdefault(form, []).append(flops / (statistics.median(ms) * 1e9))
            got.setdefault("shipped", []).append(measure_mma_sync_tflops(blocks_per_sm=blocks_per_sm))
        for form, v in got.items():
            rows.append({"probe": "mma_operands", "form": form, "blocks_per_sm": blocks_per_sm,
                         "tflops": round(statistics.median(v), 1), "rounds_tflops": [round(x, 1) for x in v]})
        c, r, s = (statistics.median(got[k]) for k in ("constant", "random", "shipped"))
        print(f"{blocks_per_sm} blocks an SM: constant {c:.1f}, random {r:.1f} ({r / c:.3f}x), shipped {s:.1f} TFLOP/s",
              flush=True)
    # each record stamped with its provenance (GPU, driver, versions, commit, date, this command)
    append_records("probe", rows, command=" ".join(["python3"] + sys.argv), path=out_path)


if __name__ == "__main__":
    main(sys.argv[1])
