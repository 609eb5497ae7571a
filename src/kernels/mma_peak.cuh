// The mma.sync ceiling: how fast this GPU runs the one tensor-core instruction the kernel
// may use (m16n8k16, bf16 in, fp32 accumulate). On sm_120 mma.sync is the native path; on
// the H200 it is the legacy one, well below wgmma, which cuBLAS (the bf16 matmul ceiling)
// uses. The roofline of code written for sm_120 and timed on an H200 takes this rate.
#pragma once

#include "mla_verify.cuh"

namespace sm120_mla {

constexpr int kPeakChains = 8;   // independent accumulators per warp: hides the mma latency

// Every warp runs kPeakChains chains of `iters` dependent mma.sync on register operands;
// the sums go to out (one float per thread) so nothing is optimised away.
__global__ void mma_sync_peak_kernel(float* out, int iters) {
  const uint32_t one = 0x3f803f80u;  // bf16 pair (1.0, 1.0): sums stay finite
  uint32_t a[4] = {one, one, one, one};
  float d[kPeakChains][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kPeakChains; ++c) mma_16816(d[c], a, one, one);
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < kPeakChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  out[static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x] = s;
}

}  // namespace sm120_mla
