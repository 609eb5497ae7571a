// Torch launcher for the MLA verify kernels in mla_verify.cuh. Python (verify_attention.py)
// validates every argument (shapes, dtypes, devices, contiguity, alignment) and raises
// ValueErrors that name it; this file only re-checks what would fault the launch itself. Everything launches on torch's current stream, allocates
// nothing and never syncs, so the call can be captured in a CUDA graph.
//
// c10's CUDA headers, not ATen/cuda/CUDAContext.h: that one needs cuBLAS, cuSPARSE and cuSOLVER
// headers, which a bare nvcc (the CPU CI's) lacks, and then the launcher compiles there too
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "mla_verify.cuh"
#include "mla_verify_wide.cuh"
#include "mma_peak.cuh"

namespace {

template <int KEYS, int MT = 2, bool ROWS_AS_N = false>
void launch_split(const sm120_mla::Params& prm, const sm120_mla::Bounds& bounds, dim3 grid, cudaStream_t stream,
                  int device) {
  using Cfg = sm120_mla::TileConfig<KEYS>;
  // Above 48 KB a kernel must opt in to its dynamic shared memory, once per device.
  static std::once_flag flags[64];
  std::call_once(flags[device % 64], [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(sm120_mla::mla_verify_split_kernel<KEYS, MT, ROWS_AS_N>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  });
  sm120_mla::mla_verify_split_kernel<KEYS, MT, ROWS_AS_N><<<grid, sm120_mla::kThreads, Cfg::kSmemBytes, stream>>>(prm, bounds);
}

template <bool kBatched>
void launch_wide(const sm120_mla::Params& prm, const sm120_mla::Bounds& bounds, dim3 grid, cudaStream_t stream,
                 int device) {
  namespace wide = sm120_mla::wide;
  static std::once_flag flags[64];
  std::call_once(flags[device % 64], [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(wide::mla_verify_wide_kernel<kBatched>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, wide::kSmemBytes));
  });
  wide::mla_verify_wide_kernel<kBatched><<<grid, wide::kThreads, wide::kSmemBytes, stream>>>(prm, bounds);
}

// The current device's compute capability major (PDL and the wide kernel's pool from sm_90 on).
int compute_major() {
  int device = 0, major = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

// The combine step, as a programmatic dependent of the attention kernel where COMBINE_PDL and
// the device (sm_90 and newer) allow it; stream capture records that as a programmatic edge.
template <int kGroups, bool kBf16Partials, bool kPreload = false>
void launch_combine(const sm120_mla::Params& prm, dim3 grid, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(sm120_mla::kCombineThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = COMBINE_PDL && compute_major() >= 9 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, sm120_mla::mla_verify_combine_kernel<kGroups, kBf16Partials, kPreload>, prm));
}

// How many CTAs of the combine step (kGroups split groups, with or without the preload) the
// device holds at once.
template <int kGroups, bool kBf16Partials, bool kPreload>
int64_t combine_ctas(int device) {
  static std::once_flag flags[64];
  static int64_t ctas[64];
  std::call_once(flags[device % 64], [device] {
    int per_sm = 0, sms = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, sm120_mla::mla_verify_combine_kernel<kGroups, kBf16Partials, kPreload>, sm120_mla::kCombineThreads, 0));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    ctas[device % 64] = int64_t(per_sm) * sms;
  });
  return ctas[device % 64];
}

// The most splits one request may have: num_splits, or in a pooled batch (BALANCED_SPLITS) its
// own CTA plus every spare one, up to the kernels' bound.
int most_splits_of_a_request(const sm120_mla::Params& prm) {
  if (prm.balanced_splits == 0 || prm.batch == 1) return prm.num_splits;   // the combine step's Params
  return static_cast<int>(std::min<int64_t>(sm120_mla::kMaxSplits, 1 + int64_t(prm.batch) * (prm.num_splits - 1)));
}

// The combine step for `rows` rows of num_splits splits: with COMBINE_PRELOAD, the widest split
// groups (16, 8, 4) whose grid of rows x groups CTAs fits one wave of the preloading kernel;
// where none does, combine_groups' layout without the preload (one wave of its 32-40-register
// CTAs beats two waves of the preloading ones, v18c). Both depend on static shapes only, so a
// captured graph keeps its grid.
// COMBINE_POOL_GROUPS (v20): without the preload, the groups are sized for the most splits a row
// may have (most_splits_of_a_request), as far as one wave holds them. In a pooled batch a long
// request beside short ones takes most of the pool: at b32 decode (num_splits 4, so
// combine_groups gave 1) its rows had ~97 splits each, walked by one CTA with 4 loads in flight
// a thread, while the other SMs had finished.
template <bool kBf16Partials>
void launch_combine_for(const sm120_mla::Params& prm, int64_t rows, int device, cudaStream_t stream) {
  using sm120_mla::preload_groups_fit;
  const int S = prm.num_splits;
  auto grid = [rows](int groups) { return dim3(static_cast<unsigned>(rows), static_cast<unsigned>(groups)); };
  if (COMBINE_PRELOAD) {
    if (preload_groups_fit(16, S) && rows * 16 <= combine_ctas<16, kBf16Partials, true>(device))
      return launch_combine<16, kBf16Partials, true>(prm, grid(16), stream);
    if (preload_groups_fit(8, S) && rows * 8 <= combine_ctas<8, kBf16Partials, true>(device))
      return launch_combine<8, kBf16Partials, true>(prm, grid(8), stream);
    if (preload_groups_fit(4, S) && rows * 4 <= combine_ctas<4, kBf16Partials, true>(device))
      return launch_combine<4, kBf16Partials, true>(prm, grid(4), stream);
  }
  int groups = sm120_mla::combine_groups(S);   // groups column slices
  if (COMBINE_POOL_GROUPS && groups < 16) {
    const int most = sm120_mla::combine_groups(most_splits_of_a_request(prm));
    if (most >= 16 && rows * 16 <= combine_ctas<16, kBf16Partials, false>(device))
      groups = 16;
    else if (most >= 4 && groups < 4 && rows * 4 <= combine_ctas<4, kBf16Partials, false>(device))
      groups = 4;
  }
  if (groups == 16)
    launch_combine<16, kBf16Partials>(prm, grid(16), stream);
  else if (groups == 4)
    launch_combine<4, kBf16Partials>(prm, grid(4), stream);
  else
    launch_combine<1, kBf16Partials>(prm, grid(1), stream);
}

}  // namespace

void mla_verify_forward(const at::Tensor& q, const at::Tensor& kv_pool, const at::Tensor& qo_indptr,
                        const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                        const c10::optional<at::Tensor>& k_extend, const c10::optional<at::Tensor>& custom_mask,
                        const c10::optional<at::Tensor>& mask_indptr, at::Tensor& out, at::Tensor& lse,
                        at::Tensor& ws_o, at::Tensor& ws_lse, double sm_scale, int64_t max_q_len,
                        int64_t num_splits, int64_t tile_keys, int64_t cta_rows) {
  using namespace sm120_mla;
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(2) == kDimQK &&
                  q.is_contiguous(), "q must be a contiguous CUDA bf16 tensor [T, H, 576]");
  // [P, 1, 576] is SGLang's MLA pool buffer; any other middle size would put rows 576 x it apart
  TORCH_CHECK(kv_pool.scalar_type() == at::kBFloat16 && kv_pool.is_contiguous() && kv_pool.size(-1) == kDimQK &&
                  (kv_pool.dim() == 2 || (kv_pool.dim() == 3 && kv_pool.size(1) == 1)),
              "kv_pool must be contiguous bf16 [P, 576] or [P, 1, 576]");
  // Host metadata only (no sync): mla_verify_attention checks all of this with named errors
  // first; these keep a direct call to the extension from faulting the device.
  const auto dev = q.device();
  auto on_dev = [&](const at::Tensor& t) { return t.device() == dev; };
  TORCH_CHECK(on_dev(kv_pool) && on_dev(qo_indptr) && on_dev(kv_indptr) && on_dev(kv_indices) && on_dev(out) &&
                  on_dev(lse) && on_dev(ws_o) && on_dev(ws_lse), "every tensor must be on q's device");
  TORCH_CHECK(q.size(1) >= 1 && q.size(1) <= 128, "heads must be in 1..128");
  auto aligned16 = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  // both kernels read q in 16-byte pieces (the 64-row kernel's WIDE_Q_LDG, the split kernel's SPLIT_Q_SMEM)
  TORCH_CHECK(aligned16(q), "q must start on a 16-byte boundary");
  TORCH_CHECK(qo_indptr.scalar_type() == at::kInt && kv_indptr.scalar_type() == at::kInt &&
                  qo_indptr.dim() == 1 && qo_indptr.numel() >= 2 && kv_indptr.numel() == qo_indptr.numel() &&
                  qo_indptr.is_contiguous() && kv_indptr.is_contiguous(),
              "qo_indptr and kv_indptr must be contiguous int32 [B+1], B >= 1");
  TORCH_CHECK((kv_indices.scalar_type() == at::kInt || kv_indices.scalar_type() == at::kLong) &&
                  kv_indices.is_contiguous(), "kv_indices must be contiguous int32 or int64");
  TORCH_CHECK(ws_o.is_contiguous() && ws_lse.is_contiguous(), "workspace tensors must be contiguous");
  // the attention kernels store their partial rows (fp32 or bf16) in 16-byte pieces
  TORCH_CHECK(aligned16(ws_o), "the workspace's partial rows must start on a 16-byte boundary");
  // 16-byte pieces: the gathers read kv_pool and k_extend rows, the combine step writes out rows
  TORCH_CHECK(aligned16(kv_pool) && aligned16(out) && (!k_extend.has_value() || aligned16(*k_extend)),
              "kv_pool, out and k_extend must start on a 16-byte boundary");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() == q.size(0) * q.size(1) * kDimV,
              "out must be contiguous bf16 [T, H, 512]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == q.size(0) * q.size(1),
              "lse must be contiguous float32 [T, H]");
  TORCH_CHECK(ws_o.scalar_type() == at::kFloat && ws_lse.scalar_type() == at::kFloat, "workspace must be float32");
  TORCH_CHECK(!k_extend.has_value() || (on_dev(*k_extend) && k_extend->scalar_type() == at::kBFloat16 &&
                                        k_extend->is_contiguous() && k_extend->numel() == q.size(0) * kDimQK),
              "k_extend must be contiguous bf16 [T, 576] on q's device");
  TORCH_CHECK(custom_mask.has_value() == mask_indptr.has_value(), "custom_mask and mask_indptr go together");
  // an empty mask's null data pointer would read as no mask: a causal chain, silently
  TORCH_CHECK(!custom_mask.has_value() || custom_mask->numel() > 0, "custom_mask is empty");
  TORCH_CHECK(!custom_mask.has_value() ||
                  (on_dev(*custom_mask) && on_dev(*mask_indptr) && custom_mask->element_size() == 1 &&
                   (mask_indptr->scalar_type() == at::kInt || mask_indptr->scalar_type() == at::kLong) &&
                   mask_indptr->numel() == qo_indptr.numel() && custom_mask->is_contiguous() &&
                   mask_indptr->is_contiguous()),
              "custom_mask must be 1-byte and mask_indptr int32/int64 [B+1], on q's device");
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "num_splits out of range");
  TORCH_CHECK(max_q_len >= 1 && max_q_len <= 16, "max_q_len must be in 1..16");
  TORCH_CHECK(tile_keys == 16 || tile_keys == 32, "tile_keys must be 16 or 32");
  TORCH_CHECK(cta_rows == kRowsPerCta || (cta_rows == wide::kRows && tile_keys == wide::kKeys),
              "cta_rows must be 32, or 64 with 16-key tiles");
  const int64_t T = q.size(0), H = q.size(1), B = qo_indptr.size(0) - 1;
  // partial_slot: max_q_len * H rows of slots for each of the B * num_splits CTAs of a row tile
  const int64_t slots = B * num_splits * max_q_len * H;
  // the partials' element: bf16 where the kernel the launch picks stores them so (float32 storage)
  const int64_t partial_bytes = (cta_rows == wide::kRows ? wide::kBf16Partials : kSplitBf16Partials) ? 2 : 4;
  TORCH_CHECK(ws_o.numel() * 4 >= slots * kDimV * partial_bytes && ws_lse.numel() >= slots, "workspace too small");
  TORCH_CHECK(B <= 65535, "batch must be <= 65535 (grid z)");
  // partial_slot's rows without a pool: (q_start * H + row) * num_splits, inside the workspace
  TORCH_CHECK(T <= B * max_q_len, "q has more tokens than batch * max_q_len");
  if (T == 0 || B == 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  const int device = q.get_device();

  Params prm{};
  prm.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  prm.kv_pool = reinterpret_cast<const __nv_bfloat16*>(kv_pool.data_ptr());
  prm.k_extend = k_extend.has_value() ? reinterpret_cast<const __nv_bfloat16*>(k_extend->data_ptr()) : nullptr;
  prm.qo_indptr = qo_indptr.data_ptr<int32_t>();
  prm.kv_indptr = kv_indptr.data_ptr<int32_t>();
  prm.kv_indices = kv_indices.data_ptr();
  prm.kv_indices_64 = kv_indices.scalar_type() == at::kLong;
  prm.custom_mask = custom_mask.has_value() ? reinterpret_cast<const uint8_t*>(custom_mask->data_ptr()) : nullptr;
  prm.mask_indptr = mask_indptr.has_value() ? mask_indptr->data_ptr() : nullptr;
  prm.mask_indptr_64 = mask_indptr.has_value() && mask_indptr->scalar_type() == at::kLong;
  prm.ws_o = ws_o.data_ptr<float>();
  prm.ws_lse = ws_lse.data_ptr<float>();
  prm.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  prm.lse = lse.data_ptr<float>();
  prm.heads = static_cast<int>(H);
  prm.batch = static_cast<int>(B);
  prm.max_q_len = static_cast<int>(max_q_len);
  prm.num_splits = static_cast<int>(num_splits);
  // the 64-row kernel pools only in its batched build (mla_verify_wide_kernel<true>), and only
  // from sm_90 on (kWidePool); 0 where it does not, so the combine step's launch reads it as is
  const bool wide_pool = B > 1 && compute_major() >= 9;
  const int pool_mode = !BALANCED_SPLITS ? 0 : cta_rows != wide::kRows ? 1 : wide_pool ? 2 : 0;
  // T in the spare bits (Params): the attention kernels read no row of q or k_extend past it.
  // T <= B * max_q_len <= 65535 * 16 (checked above), so T << 2 fits.
  static_assert(int64_t(65535) * 16 < (int64_t(1) << 29), "T << 2 must fit an int");
  prm.balanced_splits = pool_mode | static_cast<int>(T << 2);
  prm.scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);

  // the index tensors' lengths: a request whose indptrs pass them reads nothing there
  // (request_reads_fit); kv_indptr entries past 2^30 count as past kv_indices, which keeps the
  // kernels' 32-bit key counts from wrapping (a batch's keys are far fewer)
  const Bounds bounds{std::min<int64_t>(kv_indices.numel(), int64_t(1) << 30),
                      custom_mask.has_value() ? custom_mask->numel() : 0};

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>((max_q_len * H + cta_rows - 1) / cta_rows),
                  static_cast<unsigned>(num_splits), static_cast<unsigned>(B));
  if (cta_rows == wide::kRows && B > 1)
    launch_wide<true>(prm, bounds, grid, stream, device);
  else if (cta_rows == wide::kRows)
    launch_wide<false>(prm, bounds, grid, stream, device);
  else if (tile_keys == 32)
    launch_split<32>(prm, bounds, grid, stream, device);
  else if (DECODE_ONE_MTILE && DECODE_ROWS_AS_N && max_q_len * H <= 8)   // rows as the mma's N
    launch_split<16, 1, true>(prm, bounds, grid, stream, device);
  else if (DECODE_ONE_MTILE && max_q_len * H <= 16)   // every CTA's rows 16-31 are padding
    launch_split<16, 1>(prm, bounds, grid, stream, device);
  else
    launch_split<16>(prm, bounds, grid, stream, device);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t rows = T * H;
  Params combine_prm = prm;
  combine_prm.balanced_splits = pool_mode;   // the pool mode alone (pool_mode<true>: kModeOnly)
  if (cta_rows == wide::kRows ? wide::kBf16Partials : kSplitBf16Partials)   // the partials are bf16
    launch_combine_for<true>(combine_prm, rows, device, stream);
  else
    launch_combine_for<false>(combine_prm, rows, device, stream);
}

// The wide kernel's phase stamps from the last call of a WIDE_TRACE build (mla_verify_wide.cuh):
// int64 [warps, rounds, events] of clock64() values, on the CPU.
at::Tensor wide_phase_trace() {
#ifdef WIDE_TRACE
  namespace wide = sm120_mla::wide;
  at::Tensor out = torch::empty({wide::kWarps, wide::kTraceRounds, wide::kTraceEvents}, torch::kLong);
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(out.data_ptr(), wide::wide_trace_clocks, out.numel() * sizeof(long long)));
  return out;
#else
  TORCH_CHECK(false, "wide_phase_trace: this build records no trace; build it with defines=(\"WIDE_TRACE\",)");
#endif
}

// The CTA milestones of the last call of a CTA_TIMELINE build (mla_verify.cuh): int64
// [kernel (0 the wide kernel, 1 the combine step), CTA, event] of %globaltimer ns, on the CPU;
// the stamps are cleared for the next call.
at::Tensor cta_timeline() {
#ifdef CTA_TIMELINE
  using namespace sm120_mla;
  at::Tensor out = torch::empty({2, kTimelineCtas, kTimelineEvents}, torch::kLong);
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(out.data_ptr(), cta_timeline_ns, out.numel() * sizeof(long long)));
  void* stamps = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&stamps, cta_timeline_ns));
  C10_CUDA_CHECK(cudaMemset(stamps, 0, out.numel() * sizeof(long long)));
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  return out;
#else
  TORCH_CHECK(false, "cta_timeline: this build records no timeline; build it with defines=(\"CTA_TIMELINE\",)");
#endif
}

// The pool as the last call of a POOL_TRACE build computed it (mla_verify.cuh): int32
// [slots, 3] of (request, split, count) a pool CTA, and [slots, 2] of (first split, splits) a
// combine row, on the CPU; the device copies are reset to -1 for the next call.
std::vector<at::Tensor> pool_trace() {
#ifdef POOL_TRACE
  using namespace sm120_mla;
  at::Tensor ctas = torch::empty({kPoolTraceSlots, 3}, torch::kInt);
  at::Tensor rows = torch::empty({kPoolTraceSlots, 2}, torch::kInt);
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(ctas.data_ptr(), pool_trace_ctas, ctas.numel() * sizeof(int)));
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(rows.data_ptr(), pool_trace_rows, rows.numel() * sizeof(int)));
  void* at = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&at, pool_trace_ctas));
  C10_CUDA_CHECK(cudaMemset(at, 0xff, sizeof(pool_trace_ctas)));
  C10_CUDA_CHECK(cudaGetSymbolAddress(&at, pool_trace_rows));
  C10_CUDA_CHECK(cudaMemset(at, 0xff, sizeof(pool_trace_rows)));
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  return {ctas, rows};
#else
  TORCH_CHECK(false, "pool_trace: this build records no pool; build it with defines=(\"POOL_TRACE\",)");
#endif
}

// One launch of the mma.sync ceiling kernel: out.numel() / threads_per_block blocks, each
// warp doing iters x kPeakChains mma.sync m16n8k16 (2 * 16 * 8 * 16 flops each).
void mma_sync_peak(at::Tensor& out, int64_t iters, int64_t threads_per_block) {
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out must be a contiguous CUDA float32 tensor");
  TORCH_CHECK(threads_per_block >= 32 && threads_per_block <= 1024 && threads_per_block % 32 == 0,
              "threads_per_block must be a multiple of 32 in 32..1024");
  TORCH_CHECK(out.numel() % threads_per_block == 0, "out.numel() must be a multiple of threads_per_block");
  TORCH_CHECK(iters >= 1 && iters <= (1 << 24), "iters must be in 1..2^24");
  const c10::cuda::CUDAGuard guard(out.device());
  sm120_mla::mma_sync_peak_kernel<<<static_cast<unsigned>(out.numel() / threads_per_block),
                                    static_cast<unsigned>(threads_per_block), 0,
                                    c10::cuda::getCurrentCUDAStream()>>>(out.data_ptr<float>(),
                                                                        static_cast<int>(iters));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
