// The 64-row verify kernel (v17): the same attention as mla_verify_split_kernel, with every
// warp alike instead of score and value warps.
//
// Why: a key row that one CTA gathers serves that CTA's rows only, so at q16 h8 (128 rows) the
// 32-row kernel reads every key four times, and its gather is bound per SM (NOTES.md, session
// 6). Halving the re-read needs 64 rows a CTA, and sm_120 has 64K registers an SM: O for 64
// rows x 512 (fp32) is 128 KB and Q for 64 rows x 576 (bf16) is 72 KB. The split kernel keeps
// Q in its score warps and O in its value warps, and every thread gets the larger of the two
// register counts, so 64 rows would need ~400 KB. Here each warp holds a share of both:
//   warp w: rows (w / 4) * 32 .. +32 (two m16 tiles), quarter dq = w % 4 of the QK dims
//   (144 of 576, Q in 72 registers) and of the O columns (128 of 512, O in 128 registers).
// 200 of the 255 registers a thread may have at 256 threads an SM.
//
// A round (16 keys, one stage of the cp.async ring), per warp:
//   QK(t): partial S over my 144 dims -> s_part
//   SM(t): sum the four partials of my 32 rows (every warp of a row pair sums them in the same
//          order, so all four hold the same S and P) -> online softmax -> P stays in registers
//          as the A operand (the accumulator layout of S is the A layout of P)
//   PV(t): O += P . V over my 128 columns
// The four warps of a row pair exchange S partials, so they meet between QK(t) and SM(t).
// WIDE_PINGPONG picks the schedule (both: one barrier of all 256 threads a round, "A(t)", once
// tile t has landed):
//   0, lockstep: every warp runs A(t) QK(t) B(t) SM(t) PV(t), B a barrier of all threads.
//   1 (default), ping-pong: row pair 0 runs A(t) QK(t) B0(t) SM(t) PV(t), B0 its own 128-thread
//      barrier; row pair 1 runs A(t) SM(t-1) PV(t-1) QK(t), a phase later, and needs no barrier
//      of its own (A orders its partials; they alternate between two buffers). Each SMSP holds
//      one warp of each pair (warps w and w+4), so one warp's softmax runs beside the other's
//      mma.sync. Pair 1 still reads tile t-1 in round t, so the ring refills tile t-2's stage.
// The split, workspace and combine step are the split kernel's (mla_verify.cuh).
//
// Measured on the H200 (NOTES.md, session 7): the gather halves as intended, but a round moves
// ~200 KB of shared memory for 64 rows (V reloaded per m16 tile, every warp reading all four
// partials of its rows) against ~150 KB for the split kernel's two 32-row rounds, so this kernel
// is 1.26-1.36x slower at every shape, in either schedule (ping-pong gains 1%). It is an option
// (cta_rows=64), not the default.
#pragma once

#include "mla_verify.cuh"

namespace sm120_mla {
namespace wide {

constexpr int kRows = 64;                // (token, head) rows per CTA: four m16 tiles
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kQuarters = 4;             // QK dims and O columns, split four ways
constexpr int kQkSteps = kDimQK / 16 / kQuarters;   // 9 k-steps of 16 dims
constexpr int kVCols = kDimV / kQuarters;           // 128 output columns per warp
constexpr int kKeys = 16;
#ifndef WIDE_PINGPONG
#define WIDE_PINGPONG 1
#endif
constexpr bool kPingPong = WIDE_PINGPONG;
// WIDE_STAGES: the ring. Lockstep reads only tile t in round t, so 4 stages keep 3 tiles in
// flight; ping-pong also reads tile t-1, which leaves 2.
#ifndef WIDE_STAGES
#define WIDE_STAGES 4
#endif
constexpr int kStages = WIDE_STAGES;
static_assert(kStages >= 2 + kPingPong && kStages <= 4, "WIDE_STAGES: 2..4 (3..4 ping-pong; 5 x 18.7 KB exceeds sm_120's 99 KB)");
constexpr int kStageElems = kKeys * kKvRowStride;
constexpr int kLoadThreadsPerKey = kThreads / kKeys;                                     // 16
constexpr int kLoadSteps = (kChunksPerKey + kLoadThreadsPerKey - 1) / kLoadThreadsPerKey;  // 5
// Round r refills the stage of tile r-1-kLag with tile r + kAhead (kAhead = stages-1-kLag),
// from an index staged in the cp.async group of an earlier round. Round r waits for groups <= r
// (group k holds tile k), so the index of tile X must be in a group <= X - kAhead, i.e. staged
// at round <= X - 2 kAhead.
constexpr int kLag = kPingPong ? 1 : 0;
constexpr int kAhead = kStages - 1 - kLag;
constexpr int kIndexAhead = 2 * kAhead + 1;
constexpr int kWideIndexRing = 8;
static_assert(kIndexAhead + 1 <= kWideIndexRing, "index ring too small");

struct Shared {
  __nv_bfloat16 kv[kStages][kStageElems];
  // QK partial sums of each dim quarter, in the mma accumulator order: float4 t4 of a row holds
  // keys 2*t4, 2*t4+1, 8+2*t4, 9+2*t4, what lane (g, t4) of a warp holds for that row.
  float4 s_part[kQuarters][kRows][kKeys / 4];
  // Ping-pong: row pair 1 reads tile t-1's partials while it writes tile t's, so its odd tiles
  // go here (only its rows: a second buffer for all 64 would not fit beside 4 stages).
  float4 s_part_odd[kPingPong ? kQuarters : 1][32][kKeys / 4];
  int64_t index[kWideIndexRing][kKeys];   // kv_indices of tiles ahead (int32: low half)
};
constexpr int kSmemBytes = sizeof(Shared);
static_assert(kSmemBytes <= 101376, "sm_120 allows at most 99 KB of shared memory per block");

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// grid: (64-row tiles of max_q_len*heads, num_splits, batch); block: kThreads.
__global__ void __launch_bounds__(kThreads, 1) mla_verify_wide_kernel(const Params prm) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Shared& sm = *reinterpret_cast<Shared*>(smem_raw);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragment coordinates
  const int dq = warp % kQuarters;          // my quarter of the dims and of the O columns
  const int b = blockIdx.z, split = blockIdx.y;
  const int H = prm.heads;

  const int q_start = prm.qo_indptr[b];
  const int q_len = prm.qo_indptr[b + 1] - q_start;
  const int row0 = blockIdx.x * kRows;
  const int rows = q_len * H;
  if (row0 >= rows) return;                        // request shorter than max_q_len
  const int pair = warp / kQuarters;                  // row pair: warps 0-3 and 4-7
  const int wrow0 = row0 + pair * 32;                 // my warp's first row

  const int64_t kv_start = prm.kv_indptr[b];
  const int prefix_len = prm.kv_indptr[b + 1] - static_cast<int>(kv_start);
  const int num_keys = prefix_len + (prm.k_extend ? q_len : 0);
  const int draft0 = num_keys - q_len;

  int chunk = (num_keys + prm.num_splits - 1) / prm.num_splits;
  chunk = max(kMinKeysPerSplit, (chunk + kKeys - 1) / kKeys * kKeys);
  const int key_begin = split * chunk;
  const int key_end = min(num_keys, key_begin + chunk);
  const int num_tiles = key_begin < key_end ? (key_end - key_begin + kKeys - 1) / kKeys : 0;

  auto partial_index = [&](int gr) {  // workspace slot of row gr, or -1 for padding
    if (gr >= rows) return int64_t(-1);
    const int tok = q_start + gr / H, head = gr % H;
    return (static_cast<int64_t>(tok) * H + head) * prm.num_splits + split;
  };
  if (num_tiles == 0) {  // empty split: the combine step gives it zero weight
    if (tid < kRows) {
      const int64_t pi = partial_index(row0 + tid);
      if (pi >= 0) prm.ws_lse[pi] = -INFINITY;
    }
    return;
  }

  {  // the split's slice of kv_indices to L2 up front (see the split kernel)
    const int prefix_keys = max(0, min(key_end, prefix_len) - key_begin);
    const int elem = prm.kv_indices_64 ? 8 : 4;
    const char* first = static_cast<const char*>(prm.kv_indices) + (kv_start + key_begin) * elem;
    for (int64_t off = int64_t(tid) * 128; off < int64_t(prefix_keys) * elem; off += int64_t(kThreads) * 128)
      prefetch_l2(first + off);
  }

  // Gather: 16 threads per key row, 16 B each per step; the row's index comes from sm.index.
  const int ld_key = tid / kLoadThreadsPerKey, ld_part = tid % kLoadThreadsPerKey;
  const int prefix_end = min(key_end, prefix_len);
  auto row_of = [&](int tile) -> const __nv_bfloat16* {
    const int key = key_begin + tile * kKeys + ld_key;
    if (tile >= num_tiles || key >= key_end) return nullptr;
    if (key >= prefix_len) return prm.k_extend + static_cast<int64_t>(q_start + key - prefix_len) * kDimQK;
    const int64_t v = sm.index[tile % kWideIndexRing][ld_key];
    const int64_t row = prm.kv_indices_64 ? v : static_cast<int64_t>(static_cast<int32_t>(v & 0xffffffff));
    return prm.kv_pool + row * kDimQK;
  };
  auto stage_index = [&](int tile, bool async) {  // one thread per key row
    const int key = key_begin + tile * kKeys + ld_key;
    if (ld_part != 0 || tile >= num_tiles || key >= prefix_end) return;
    int64_t* dst = &sm.index[tile % kWideIndexRing][ld_key];
    const char* src = static_cast<const char*>(prm.kv_indices) + (kv_start + key) * (prm.kv_indices_64 ? 8 : 4);
    if (!async)
      *dst = load_index(prm.kv_indices, kv_start + key, prm.kv_indices_64);
    else if (prm.kv_indices_64)
      cp_async_small<8>(dst, src);
    else
      cp_async_small<4>(dst, src);
  };
  auto load_tile = [&](int tile) {  // into stage tile % kStages; a missing row zero-fills
    const __nv_bfloat16* row = row_of(tile);
    const bool valid = row != nullptr;
    const __nv_bfloat16* src = (valid ? row : prm.kv_pool) + ld_part * 8;
    __nv_bfloat16* dst = &sm.kv[tile % kStages][ld_key * kKvRowStride + ld_part * 8];
#ifdef ABLATE_NO_LOADS
    return;
#endif
#pragma unroll
    for (int j = 0; j < kLoadSteps; ++j) {
      const int step = kLoadThreadsPerKey * 8 * j;
      if (ld_part + kLoadThreadsPerKey * j < kChunksPerKey) cp_async_16(dst + step, src + step, valid);
    }
  };

  // Prologue: the indices of the first kIndexAhead tiles (plain loads), then tiles
  // 0 .. kAhead-1, one cp.async group each. Round r commits group r + kAhead (tile r + kAhead).
  for (int i = 0; i < kIndexAhead; ++i) stage_index(i, false);
  __syncthreads();
  for (int s = 0; s < kAhead; ++s) {
    if (s < num_tiles) load_tile(s);
    cp_async_commit();
  }

  // Q fragments of my 32 rows x 144 dims, in registers for the whole split.
  uint32_t qf[2][kQkSteps][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int gr = wrow0 + mt * 16 + g + hi * 8;
      const uint32_t* qrow = nullptr;
      if (gr < rows)
        qrow = reinterpret_cast<const uint32_t*>(
            prm.q + (static_cast<int64_t>(q_start + gr / H) * H + gr % H) * kDimQK + dq * (kQkSteps * 16));
#pragma unroll
      for (int ks = 0; ks < kQkSteps; ++ks) {
        qf[mt][ks][hi] = qrow ? qrow[ks * 8 + t4] : 0u;          // dims 2*t4, +1
        qf[mt][ks][hi + 2] = qrow ? qrow[ks * 8 + 4 + t4] : 0u;  // dims 8 + 2*t4, +1
      }
    }
  }

  float o[2][kVCols / 8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < kVCols / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
  // Running max (log2 domain) and this lane's share of the running sum, per row [mt][hi]:
  // identical in the 4 lanes of a row and in the 4 warps of a row pair.
  float m_run[2][2], l_run[2][2];
#pragma unroll
  for (int i = 0; i < 4; ++i) { (&m_run[0][0])[i] = -INFINITY; (&l_run[0][0])[i] = 0.f; }

  const __nv_bfloat16* klane = &sm.kv[0][0] + (lane & 7) * kKvRowStride + ((lane >> 4) & 1) * 8 * kKvRowStride +
                               dq * (kQkSteps * 16) + ((lane >> 3) & 1) * 8;
  const __nv_bfloat16* vlane = &sm.kv[0][0] + ((lane & 7) + ((lane >> 3) & 1) * 8) * kKvRowStride + dq * kVCols +
                               ((lane >> 4) & 1) * 8;
  const int my_rows = wrow0 - row0;   // my rows' first index within the CTA's 64
  // Quarter d's partial S of my 32 rows for `tile`, indexed [row - my_rows][t4].
  auto my_part = [&](int tile, int d) -> float4 (*)[kKeys / 4] {
    if (kPingPong && pair == 1 && (tile & 1)) return sm.s_part_odd[d];
    return sm.s_part[d] + my_rows;
  };

  // QK(t): partial S = Q[my 32 rows, my 144 dims] . K[16 keys, my 144 dims]^T -> s_part
  auto qk = [&](int tile) {
    float sacc[2][2][4] = {};
#ifndef ABLATE_NO_QK
    const __nv_bfloat16* kbase = klane + (tile % kStages) * kStageElems;
#pragma unroll
    for (int ks = 0; ks < kQkSteps; ++ks) {
      uint32_t kb[4];   // keys 0-7 in kb[0..1], keys 8-15 in kb[2..3]
      ldmatrix_x4(kb, kbase + ks * 16);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma_16816(sacc[mt][0], qf[mt][ks], kb[0], kb[1]);
        mma_16816(sacc[mt][1], qf[mt][ks], kb[2], kb[3]);
      }
    }
#endif
    float4 (*part)[kKeys / 4] = my_part(tile, dq);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int r = mt * 16 + g;
      part[r][t4] = make_float4(sacc[mt][0][0], sacc[mt][0][1], sacc[mt][1][0], sacc[mt][1][1]);
      part[r + 8][t4] = make_float4(sacc[mt][0][2], sacc[mt][0][3], sacc[mt][1][2], sacc[mt][1][3]);
    }
  };

  // SM(t) and PV(t): the online softmax of my rows in the log2 domain, then O += P . V.
  auto softmax_pv = [&](int tile) {
    const int tile_key0 = key_begin + tile * kKeys;
    const bool full_prefix_tile = tile_key0 + kKeys <= min(key_end, draft0);   // no mask to apply
    const __nv_bfloat16* vbase = vlane + (tile % kStages) * kStageElems;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint32_t pa[4];   // P of this m16 tile and 16 keys, as the mma's A operand
#ifndef ABLATE_NO_SOFTMAX
      float alpha[2];
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int r = mt * 16 + g + hi * 8;
        float4 acc = my_part(tile, 0)[r][t4];
#pragma unroll
        for (int d = 1; d < kQuarters; ++d) {
          const float4 v = my_part(tile, d)[r][t4];
          acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        float sc[4] = {acc.x, acc.y, acc.z, acc.w};   // keys 2t4, 2t4+1, 8+2t4, 9+2t4
        const int gr = wrow0 + r;
        const bool row_valid = gr < rows;
        if (full_prefix_tile) {
#pragma unroll
          for (int j = 0; j < 4; ++j) sc[j] = row_valid ? sc[j] * prm.scale_log2 : -INFINITY;
        } else {
          const int tok = row_valid ? gr / H : 0;
          const int64_t mask_row =
              prm.custom_mask ? load_index(prm.mask_indptr, b, prm.mask_indptr_64) + int64_t(tok) * num_keys : 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int key = tile_key0 + (j >> 1) * 8 + 2 * t4 + (j & 1);
            bool visible = row_valid && key < key_end;
            if (visible && key >= draft0)
              visible = prm.custom_mask ? prm.custom_mask[mask_row + key] != 0 : key - draft0 <= tok;
            sc[j] = visible ? sc[j] * prm.scale_log2 : -INFINITY;
          }
        }
        float tile_max = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        // Lazy rescaling, as in the split kernel: keep the running max unless this tile
        // exceeds it by more than 2^8 (p <= 256), so most tiles skip the O rescale.
        const float m_old = m_run[mt][hi];
        const float m_new = tile_max > m_old + kRescaleThreshold ? tile_max : m_old;
        const float base = m_new == -INFINITY ? 0.f : m_new;   // nothing visible yet: exp2 gives 0
        float p[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) p[j] = exp2f(sc[j] - base);
        // 1 when the max stays (also for a row with nothing visible yet, or a padding row)
        alpha[hi] = m_new == m_old ? 1.f : exp2f(m_old - base);
        l_run[mt][hi] = l_run[mt][hi] * alpha[hi] + ((p[0] + p[1]) + (p[2] + p[3]));
        m_run[mt][hi] = m_new;
        pa[hi] = pack_bf16(p[0], p[1]);        // rows g / g+8, keys 2t4, 2t4+1
        pa[hi + 2] = pack_bf16(p[2], p[3]);    // keys 8+2t4, 9+2t4
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // warp-uniform: usually skipped
#pragma unroll
        for (int nt = 0; nt < kVCols / 8; ++nt) {
          o[mt][nt][0] *= alpha[0]; o[mt][nt][1] *= alpha[0];
          o[mt][nt][2] *= alpha[1]; o[mt][nt][3] *= alpha[1];
        }
      }
#else
      pa[0] = pa[1] = pa[2] = pa[3] = pack_bf16(1.f, 1.f);
#endif
#ifndef ABLATE_NO_PV
#pragma unroll
      for (int np = 0; np < kVCols / 16; ++np) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, vbase + np * 16);
        mma_16816(o[mt][2 * np], pa, vb[0], vb[1]);
        mma_16816(o[mt][2 * np + 1], pa, vb[2], vb[3]);
      }
#endif
    }
  };

  // Ping-pong runs one round more: row pair 1's SM(n-1) and PV(n-1) after A(n).
  const bool lagging = kPingPong && pair == 1;
  for (int tile = 0; tile < num_tiles + kLag; ++tile) {
    if (tile + 1 < num_tiles) cp_async_wait<kAhead - 1>();   // my copies of tile `tile` (group `tile`) have landed
    else cp_async_wait<0>();
    __syncthreads();                // A(tile): everyone's have; the stage refilled below is free
    if (tile + kAhead < num_tiles) load_tile(tile + kAhead);
    stage_index(tile + kIndexAhead, true);
    cp_async_commit();
    if (lagging) {
      if (tile > 0) softmax_pv(tile - 1);   // its partials were written before A(tile)
      if (tile < num_tiles) qk(tile);
    } else if (tile < num_tiles) {
      qk(tile);
      if (kPingPong) barrier_sync(1, 128);   // B0(tile): row pair 0's partials are written
      else __syncthreads();                  // B(tile): every quarter's partial S is written
      softmax_pv(tile);
    }
  }
  cp_async_wait<0>();

  // Normalised partial output of my rows and my 128 columns; quarter 0 writes the LSE.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float l = l_run[mt][hi];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int64_t pi = partial_index(wrow0 + mt * 16 + g + hi * 8);
      if (pi < 0) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      float* dst = prm.ws_o + pi * kDimV + dq * kVCols + 2 * t4;
#pragma unroll
      for (int nt = 0; nt < kVCols / 8; ++nt)
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[mt][nt][2 * hi] * inv, o[mt][nt][2 * hi + 1] * inv);
      if (dq == 0 && t4 == 0) prm.ws_lse[pi] = l > 0.f ? m_run[mt][hi] + log2f(l) : -INFINITY;
    }
  }
}

}  // namespace wide
}  // namespace sm120_mla
