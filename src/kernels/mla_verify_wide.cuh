// The 64-row verify kernel (v17): the same attention as mla_verify_split_kernel, with every
// warp alike instead of score and value warps.
//
// Why: a key row that one CTA gathers serves that CTA's rows only, so at q16 h8 (128 rows) the
// 32-row kernel reads every key four times, and its gather is bound per SM (NOTES.md, session
// 6). Halving the re-read needs 64 rows a CTA, and sm_120 has 64K registers an SM: O for 64
// rows x 512 (fp32) is 128 KB and Q for 64 rows x 576 (bf16) is 72 KB. The split kernel keeps
// Q in its score warps and O in its value warps, and every thread gets the larger of the two
// register counts, so 64 rows would need ~400 KB. Here each warp holds a share of both:
//   warp w: rows (w / 4) * 32 .. +32 (a row pair, two m16 tiles), quarter dq = w % 4 of the QK
//   dims (144 of 576, Q in 72 registers) and of the O columns (128 of 512, O in 128 registers).
// 200 of the 255 registers a thread may have at 256 threads an SM.
//
// A round (16 keys, one stage of the cp.async ring), for row pair 0:
//   A(t)    all 256 threads: tile t has landed, and a stage no warp reads any more is free
//   QK(t)   partial S of my 32 rows over my 144 dims -> s_part; between its k-steps, the
//           copies that refill the free stage (branch-free, v17e)
//   B(t)    my row pair's 128 threads: every quarter's partials are written
//   SM(t)   reduce-scatter: warp dq sums the four partials of 8 of the pair's 32 rows and runs
//           their online softmax (one row per 4 lanes, the row's max and sum in registers),
//           then writes P (bf16) and the O rescale of those rows to shared memory
//   C(t)    my row pair: P of all 32 rows is written
//   PV(t)   P of my 32 rows through ldmatrix, O += P . V over my 128 columns, each V fragment
//           used for both m16 tiles
// Row pair 1 runs a phase behind (WIDE_PINGPONG): A(t) SM(t-1) C PV(t-1) QK(t), A ordering its
// partials, so each SMSP (warps w and w+4) has one pair's softmax beside the other's mma.sync.
// In v17d that timed the same as running the pairs in step (WIDE_PINGPONG=0); with v17e's
// refill between QK's k-steps it is 3% faster (NOTES.md, session 8).
// Per 64 rows a round moves ~130 KB of shared memory (K 37, V 32, partials 16 + 16, P 10,
// cp.async 18). v17b, where every warp summed all four partials of its 32 rows and ran their
// softmax itself (P stayed in registers), moved ~200 KB and was 1.26-1.36x slower than the
// split kernel on the H200 (NOTES.md, session 7).
// Around the loop (v18, v18e, v18g): Q comes through the still-empty ring (WIDE_Q_SMEM, each
// split from its own starting row, WIDE_Q_STAGGER) while the first tiles' key rows are pulled
// into L2 (WIDE_PREFETCH_FIRST_TILES), and the partial outputs leave in bf16 through the idle
// ring as whole rows (WIDE_BF16_PARTIALS); cta_timeline.py shows where those microseconds went.
// The split, workspace and combine step are the split kernel's (mla_verify.cuh); the combine
// step reads this kernel's partials as bf16.
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
constexpr int kPRowStride = kKeys + 8;   // bf16: 48-byte rows, conflict-free ldmatrix
// WIDE_PINGPONG: 1 runs row pair 1 a phase behind row pair 0 (A(t) SM(t-1) C PV(t-1) QK(t)),
// so that on each SMSP (warps w and w+4) one pair's softmax and barriers run beside the other's
// mma.sync; 0 runs both pairs in step.
#ifndef WIDE_PINGPONG
#define WIDE_PINGPONG 1
#endif
// WIDE_FUSED: 1 runs each warp's QK(t) and PV(t-1) as one instruction stream, a QK k-step and
// a P.V column pair in turn. QK alone is four accumulator chains of 9 mma.sync each, and an
// mma.sync's result is ~64 cycles away on the H200 (one warp with 8 chains issues one every
// ~8.2 cycles), so QK waits on its own chains (~600 cycles for 36 mma.sync, phase trace);
// P.V's 32 independent accumulators fill those gaps without registers of their own beyond P
// and one V fragment. Both tiles t-1 and t are read in round t, as under ping-pong.
// Measured 7% slower (v17f, NOTES.md session 9): with S and P both live, one fragment buffer
// is left, so every ldmatrix waits in line before its mma.sync. Off; kept as the record.
#ifndef WIDE_FUSED
#define WIDE_FUSED 0
#endif
constexpr bool kFused = WIDE_FUSED;
constexpr int kLag = (WIDE_PINGPONG || WIDE_FUSED) ? 1 : 0;
// WIDE_REFILL_IN_QK: 1 issues a round's refill copies one by one between QK's k-steps, so the
// load units take them while the tensor pipe works; 0 issues all of them before QK.
#ifndef WIDE_REFILL_IN_QK
#define WIDE_REFILL_IN_QK 1
#endif
constexpr bool kRefillInQk = WIDE_REFILL_IN_QK;
constexpr bool kPingPong = kLag == 1;
// WIDE_STAGES: the ring. In step, only tile t is read in round t, so 4 stages keep 3 tiles in
// flight; ping-pong also reads tile t-1, which leaves 2.
#ifndef WIDE_STAGES
#define WIDE_STAGES 4
#endif
constexpr int kStages = WIDE_STAGES;
// WIDE_Q_SMEM: how Q reaches the registers. 1: the CTA's 64 Q rows, one contiguous 72 KB block
// of q, are copied into the (still empty) ring with 16-byte cp.async beside the index loads of
// the prologue, then taken into registers with ldmatrix; the ring is free again before the
// first tile's copies. 0 (v17e): each thread loads its fragments from global memory, 72
// 4-byte loads, each warp instruction touching 8 rows: ~4,600 L1 line-requests a CTA, which
// the CTA timeline (cta_timeline.py) showed holding the first tile back by ~2 us and round 0
// by ~1 us more. The 64 rows fill a 4-stage ring exactly, so smaller rings keep 0.
#ifndef WIDE_Q_SMEM
#define WIDE_Q_SMEM (WIDE_STAGES == 4)
#endif
// WIDE_Q_STAGGER: the order in which a CTA copies its Q rows. Every split of a row group copies
// the same 72 KB of q, all at once at the start (66 CTAs at q16 h8 on the H200), so in the same
// order they ask L2 for the same few lines at the same moment; 1 starts split s at row s % 64 so
// that they ask for different rows. Measured (v18g, NOTES.md session 11): the prologue ~0.1 us
// shorter and a call 0.3-0.7 us shorter at q16 (1.3 at h16 64k): Q's arrival is mostly the
// 9.5 MB stream itself, a little of it that contention.
#ifndef WIDE_Q_STAGGER
#define WIDE_Q_STAGGER 1
#endif
// WIDE_Q_LDG (v18j): how Q's 72 KB reach the ring. 1: 18 plain 16-byte loads a thread, all in
// flight before any is used, stored into the ring after the indices are asked for. 0 (up to
// v18h): the same pieces as 18 cp.async a thread, at the rate one SM's load units accept cp.async
// (~19-36 B a cycle measured for the key gathers, NOTES.md session 6). Measured: Q and the
// indices arrive in 1.31 us instead of 2.24 (q16 h8 4k), so cp.async's acceptance bound them,
// and a call is 0.5-1.3 us shorter at 8 heads up to 64k (NOTES.md, session 13). On sm_90 ptxas
// reschedules the loop: 8 heads lose 0.4 us at 128k, 16 heads 0.6-1% from 64k. On sm_120a the
// loop's SASS is v18h's, so an RTX PRO 6000 gets the prologue's gain alone.
#ifndef WIDE_Q_LDG
#define WIDE_Q_LDG 1
#endif
// WIDE_BF16_PARTIALS: the normalised partial outputs. 0 (v17e): fp32, 8-byte stores straight
// from the accumulators, 128 KB a CTA; the epilogue took ~4 us at every context in the CTA
// timeline, 17 MB from 132 CTAs at once, bound by what L2 takes in, not by any one SM. 1: bf16,
// as FlashInfer keeps its split partials (one more rounding, <= 2^-9 relative, before the fp32
// merge), staged through the idle ring so that each warp stores whole rows in 16-byte pieces:
// full 32-byte sectors, half the bytes. (v17h's bf16 partials, 4-byte stores from the
// accumulators, wrote half-sectors, as many as fp32 wrote whole, and were no faster.) The
// combine step reads them as kBf16Partials. The staging needs a 4-stage ring; smaller keep 0.
#ifndef WIDE_BF16_PARTIALS
#define WIDE_BF16_PARTIALS (WIDE_STAGES == 4)
#endif
constexpr bool kBf16Partials = WIDE_BF16_PARTIALS;
// WIDE_PREFETCH_FIRST_TILES: 1 pulls the first tiles' key rows into L2 while Q is on its way
// (see the prologue). A test of whether the first tile, 1.2-1.3 us after Q in the CTA timeline,
// waits on HBM latency (then this hides it) or on the L2 -> SM stream (then it does not).
#ifndef WIDE_PREFETCH_FIRST_TILES
#define WIDE_PREFETCH_FIRST_TILES 1
#endif
static_assert(kStages >= 2 + kLag && kStages <= 4, "WIDE_STAGES: 2..4, 3..4 with ping-pong (5 x 18.7 KB exceeds 99 KB)");
constexpr int kStageElems = kKeys * kKvRowStride;
static_assert(!WIDE_Q_SMEM || kRows * kKvRowStride <= kStages * kStageElems, "WIDE_Q_SMEM: Q fills a 4-stage ring");
static_assert(!WIDE_BF16_PARTIALS || kRows * kOutRowStride <= kStages * kStageElems,
              "WIDE_BF16_PARTIALS: 64 staged rows need a 4-stage ring");
constexpr int kLoadThreadsPerKey = kThreads / kKeys;                                     // 16
constexpr int kLoadSteps = (kChunksPerKey + kLoadThreadsPerKey - 1) / kLoadThreadsPerKey;  // 5
// Round r refills the stage of tile r-1-kLag with tile r + kAhead, from an index staged in the
// cp.async group of an earlier round. Round r waits for groups <= r (group k holds tile k), so
// the index of tile X must be in a group <= X - kAhead, i.e. staged at round <= X - 2 kAhead.
constexpr int kAhead = kStages - 1 - kLag;
constexpr int kIndexAhead = 2 * kAhead + 1;
constexpr int kWideIndexRing = 8;
static_assert(kIndexAhead + 1 <= kWideIndexRing, "index ring too small");

// WIDE_TRACE (a diagnostic build, off by default): lane 0 of every warp of CTA (0, 0, 0) stamps
// clock64() at each phase boundary of its first kTraceRounds rounds; wide_phase_trace() (the
// launcher) copies the stamps out and phase_trace.py turns them into phase lengths. Events of
// round t, in program order: arrive at A, leave A, then the ends of the round's phases: QK, B,
// SM, C, PV for row pair 0 (and both pairs in step); SM(t-1), C, PV(t-1), QK(t) for row pair 1
// under ping-pong (its last slot unused).
constexpr int kTraceRounds = 64;
constexpr int kTraceEvents = 7;
#ifdef WIDE_TRACE
__device__ long long wide_trace_clocks[kWarps][kTraceRounds][kTraceEvents];
#endif

struct Shared {
  __nv_bfloat16 kv[kStages][kStageElems];
  // QK partial sums of each dim quarter, in the mma accumulator order: float4 t4 of a row holds
  // keys 2*t4, 2*t4+1, 8+2*t4, 9+2*t4, what lane (g, t4) of a warp holds for that row.
  float4 s_part[kQuarters][kRows][kKeys / 4];
  __nv_bfloat16 p[kRows][kPRowStride];    // P of the current tile (bf16), keys in order
  float row_scale[kRows];                 // the O rescale of the current tile
  float row_sum[kRows];                   // after the last tile: each row's running sum
  int64_t index[kWideIndexRing][kKeys];   // kv_indices of tiles ahead (int32: low half)
};
constexpr int kSmemBytes = sizeof(Shared);
static_assert(kSmemBytes <= 101376, "sm_120 allows at most 99 KB of shared memory per block");

// The softmax row of thread `tid` (reduce-scatter: warp dq of a row pair owns 8 of its 32 rows,
// one row per 4 lanes).
__device__ __forceinline__ int softmax_row_of(int tid) {
  const int warp = tid >> 5;
  return (warp / kQuarters) * 32 + (warp % kQuarters) * 8 + ((tid & 31) >> 2);
}

// threadIdx.x, read again where it is used (volatile, so not merged with the first read).
__device__ __forceinline__ int fresh_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// grid: (64-row tiles of max_q_len*heads, num_splits, batch); block: kThreads.
// kBatched: the launcher's choice for calls of more than one request, which share each row
// tile's CTAs out by keys (BALANCED_SPLITS). A batch-1 call runs the build without that code:
// in one kernel for both, batch 1 took 0.7-1.7 us longer (v19c, NOTES.md session 15), since the
// pool's prologue and its uniform registers changed how ptxas laid out the main loop.
template <bool kBatched>
__global__ void __launch_bounds__(kThreads, 1) mla_verify_wide_kernel(const Params prm, const Bounds bounds) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Shared& sm = *reinterpret_cast<Shared*>(smem_raw);
  timeline_stamp(0, kEvEntry);
  launch_dependents();

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragment coordinates
  const int dq = warp % kQuarters;          // my quarter of the dims and of the O columns
  constexpr bool kPool = kBatched && BALANCED_SPLITS && kWidePool;
  const SplitOf work = kPool ? split_of_cta(prm, pool_cta())
                             : SplitOf{static_cast<int>(blockIdx.z), static_cast<int>(blockIdx.y), prm.num_splits};
  if (kPool) pool_trace_cta(work);   // the unpooled layout (batch 1, sm_80-89) has no pool to trace
  const int b = work.request, split = work.split;
  const int H = prm.heads;

  const int q_start = prm.qo_indptr[b];
  const int q_len = request_q_len(prm, b, q_start);
  const int row0 = blockIdx.x * kRows;
  const bool reads_fit = request_reads_fit<!kBatched>(prm, bounds, b, q_len);   // tested with the broken batches, below
  // q_rows_fit, spelled so that the loop's SASS stays v29's (see there)
  const int rows = request_rows(prm, q_start, q_len) * (kPool || unpooled_slots_fit(prm, q_start, q_len)) *
                   (q_start <= q_tokens(prm) - q_len);
  // a broken batch (poison_broken_batch): the pool's count says so; the unpooled batches look;
  // and a request whose reads would leave kv_indices or the mask (v31) poisons its slots alike
  if (!reads_fit || (kPool ? work.count == kBrokenBatch : kBatched && rows > row0 && qo_indptr_decreases(prm))) {
    poison_broken_batch<kPool>(prm, q_start, rows, row0, split, kRows);
    timeline_stamp(0, kEvExit);
    return;
  }
  // request shorter than max_q_len; a spare CTA (tested in the pooled build only: the unused
  // test alone made ptxas spill 4 bytes in the batch-1 build's loop on sm_90)
  if (row0 >= rows || (kPool && split >= work.count)) {
    timeline_stamp(0, kEvExit);
    return;
  }
  const int pair = warp / kQuarters;                  // row pair: warps 0-3 and 4-7
  const int my_rows = pair * 32;                      // my warp's first row within the CTA's 64
#if !WIDE_Q_SMEM
  const int wrow0 = row0 + my_rows;
#endif
  auto stamp = [&](int tile, int event) {
#ifdef WIDE_TRACE
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && lane == 0 && tile >= 0 && tile < kTraceRounds)
      wide_trace_clocks[warp][tile][event] = clock64();
#endif
  };

  const int64_t kv_start = prm.kv_indptr[b];
  const int prefix_len = prm.kv_indptr[b + 1] - static_cast<int>(kv_start);
  timeline_stamp_after(0, kEvIndptr, prefix_len);
  const int num_keys = prefix_len + (prm.k_extend ? q_len : 0);
  const int draft0 = num_keys - q_len;

  int chunk = (num_keys + work.count - 1) / work.count;
  chunk = max(kMinKeysPerSplit, (chunk + kKeys - 1) / kKeys * kKeys);
  const int key_begin = split * chunk;
  const int key_end = min(num_keys, key_begin + chunk);
  const int num_tiles = key_begin < key_end ? (key_end - key_begin + kKeys - 1) / kKeys : 0;

  auto partial_index = [&](int gr) { return partial_slot<kPool>(prm, q_start, rows, gr, split); };
  if (num_tiles == 0) {  // empty split: the combine step gives it zero weight
    if (tid < kRows) {
      const int64_t pi = partial_index(row0 + tid);
      if (pi >= 0) prm.ws_lse[pi] = -INFINITY;
    }
    timeline_stamp(0, kEvExit);
    return;
  }

#if WIDE_Q_SMEM
  // The row of Q's 16-byte piece c (72 a row): split s starts at row s % 64 (WIDE_Q_STAGGER).
  auto q_piece_row = [&](int c) { return WIDE_Q_STAGGER ? (c / kChunksPerKey + split) % kRows : c / kChunksPerKey; };
#endif
#if WIDE_Q_SMEM && WIDE_Q_LDG
  // Q of the CTA's rows into registers now, into the ring below (once the indices are asked for)
  constexpr int kQPieces = kRows * kChunksPerKey / kThreads;   // 18 pieces of 16 B a thread
  static_assert(kRows * kChunksPerKey % kThreads == 0, "Q's pieces split evenly over the threads");
  uint4 q_pieces[kQPieces];
  {
    const __nv_bfloat16* qsrc = prm.q + (static_cast<int64_t>(q_start) * H + row0) * kDimQK;
#pragma unroll
    for (int i = 0; i < kQPieces; ++i) {
      const int c = tid + i * kThreads, r = q_piece_row(c), ch = c % kChunksPerKey;
      q_pieces[i] = row0 + r < rows ? *reinterpret_cast<const uint4*>(qsrc + r * kDimQK + ch * 8) : make_uint4(0, 0, 0, 0);
    }
    timeline_stamp(0, kEvQRequested);
  }
#elif WIDE_Q_SMEM
  {   // Q of the CTA's rows (contiguous in q, 72 copies of 16 B a row; zeros past `rows`) -> the ring
    const __nv_bfloat16* qsrc = prm.q + (static_cast<int64_t>(q_start) * H + row0) * kDimQK;
    for (int c = tid; c < kRows * kChunksPerKey; c += kThreads) {
      const int r = q_piece_row(c), ch = c % kChunksPerKey;
      const bool live = row0 + r < rows;
      cp_async_16(&sm.kv[0][0] + r * kKvRowStride + ch * 8, qsrc + (live ? r : 0) * kDimQK + ch * 8, live);
    }
    cp_async_commit();
    timeline_stamp(0, kEvQRequested);
  }
#endif
  prefetch_index_slice(prm, kv_start, key_begin, max(0, min(key_end, prefix_len) - key_begin), tid, kThreads);

  // Gather: 16 threads per key row, 16 B each per step; the row's index comes from sm.index.
  // The refill is branch-free (selects and predicated copies), so ptxas can schedule it into
  // the QK that follows it. In v17d it was a branchy block of its own after barrier A, and its
  // dependent address arithmetic, at 2 warps an SMSP, held a third of the round's stall samples
  // (ncu, NOTES.md session 8).
  const int ld_key = tid / kLoadThreadsPerKey, ld_part = tid % kLoadThreadsPerKey;
  const int prefix_end = min(key_end, prefix_len);
  auto stage_index = [&](int tile, bool async) {  // one thread per key row
    const int key = key_begin + tile * kKeys + ld_key;
    const bool copy = ld_part == 0 && tile < num_tiles && key < prefix_end;
    stage_key_index(prm, &sm.index[tile % kWideIndexRing][ld_key], kv_start, key, copy, async);
  };
  // A refill's copies: the key row this thread gathers (16 B a step) into stage tile % kStages;
  // a missing row (past the split's end) zero-fills from a valid address.
  struct Refill {
    const __nv_bfloat16* src;
    __nv_bfloat16* dst;
    bool live;
  };
  auto plan_refill = [&](int tile) {
    const int key = key_begin + tile * kKeys + ld_key;
    const bool live = tile < num_tiles && key < key_end;
    return Refill{staged_key_row(prm, sm.index[tile % kWideIndexRing][ld_key], key, prefix_len, q_start, live) + ld_part * 8,
                  &sm.kv[tile % kStages][ld_key * kKvRowStride + ld_part * 8], live};
  };
  auto copy_step = [&](const Refill& r, int j) {   // step j of kLoadSteps
#ifndef ABLATE_NO_LOADS
    const int step = kLoadThreadsPerKey * 8 * j;
    cp_async_16_if(r.dst + step, r.src + step, r.live, ld_part + kLoadThreadsPerKey * j < kChunksPerKey);
#endif
  };
  auto load_tile = [&](int tile) {
    const Refill r = plan_refill(tile);
#pragma unroll
    for (int j = 0; j < kLoadSteps; ++j) copy_step(r, j);
  };

  // Prologue: the indices of the first kIndexAhead tiles (plain loads), then tiles
  // 0 .. kAhead-1, one cp.async group each. Round r commits group r + kAhead (tile r + kAhead).
  for (int i = 0; i < kIndexAhead; ++i) stage_index(i, false);
#if WIDE_PREFETCH_FIRST_TILES
  // The first kAhead tiles' key rows towards L2 as soon as their indices are known: their copies
  // wait for Q to be in registers (the ring holds Q until then), and then find them in L2.
  if (ld_part == 0) {
    for (int i = 0; i < kAhead; ++i) {
      const int key = key_begin + i * kKeys + ld_key;
      if (i < num_tiles && key < key_end) {
        const int64_t idx = key < prefix_end ? sm.index[i % kWideIndexRing][ld_key] : 0;   // this thread staged it
        const char* row = reinterpret_cast<const char*>(staged_key_row(prm, idx, key, prefix_len, q_start, true));
#pragma unroll
        for (int l = 0; l < kDimQK * 2 / 128; ++l) prefetch_l2(row + l * 128);
      }
    }
  }
#endif
#ifdef ABLATE_NO_SOFTMAX
  // No softmax writes row_scale: 1 keeps the O rescale skipped, as in most rounds of the full kernel.
  if (tid < kRows) sm.row_scale[tid] = 1.f;
#endif
  uint32_t qf[2][kQkSteps][4];   // my 32 rows x 144 dims, for the whole split
#if WIDE_Q_SMEM
#if WIDE_Q_LDG
#pragma unroll
  for (int i = 0; i < kQPieces; ++i) {
    const int c = tid + i * kThreads;
    *reinterpret_cast<uint4*>(&sm.kv[0][0] + q_piece_row(c) * kKvRowStride + c % kChunksPerKey * 8) = q_pieces[i];
  }
#endif
  cp_async_wait<0>();
  __syncthreads();                // Q and the indices are in shared memory
  {
    const __nv_bfloat16* qlane = &sm.kv[0][0] + (my_rows + (lane & 15)) * kKvRowStride + dq * (kQkSteps * 16) +
                                 (lane >> 4) * 8;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int ks = 0; ks < kQkSteps; ++ks) ldmatrix_x4(qf[mt][ks], qlane + mt * 16 * kKvRowStride + ks * 16);
  }
  __syncthreads();                // every warp holds its Q: the ring is free for the tiles
#else
  __syncthreads();
#endif
  timeline_stamp(0, kEvStaged);   // the first tiles' indices are in shared memory (and Q in registers)
  for (int s = 0; s < kAhead; ++s) {
    if (s < num_tiles) load_tile(s);
    cp_async_commit();
  }
#if !WIDE_Q_SMEM
  load_q_fragments(qf, prm, q_start, rows, wrow0, dq, g, t4);
#endif

  float o[2][kVCols / 8][4] = {};

  // The softmax row this lane shares with 3 others (reduce-scatter: warp dq owns rows
  // my_rows + dq*8 .. +8), its running max (log2 domain) and this lane's share of its sum.
  const int sm_row = softmax_row_of(tid);
  const int sm_gr = row0 + sm_row;
  const bool sm_row_valid = sm_gr < rows;
  const int sm_tok = sm_row_valid ? sm_gr / H : 0;
  const int64_t mask_row = prm.custom_mask && sm_row_valid
                               ? load_index(prm.mask_indptr, b, prm.mask_indptr_64) + int64_t(sm_tok) * num_keys
                               : 0;
  float m_run = -INFINITY, l_run = 0.f;

  const __nv_bfloat16* klane = &sm.kv[0][0] + (lane & 7) * kKvRowStride + ((lane >> 4) & 1) * 8 * kKvRowStride +
                               dq * (kQkSteps * 16) + ((lane >> 3) & 1) * 8;
  const __nv_bfloat16* vlane = &sm.kv[0][0] + ((lane & 7) + ((lane >> 3) & 1) * 8) * kKvRowStride + dq * kVCols +
                               ((lane >> 4) & 1) * 8;
  const __nv_bfloat16* plane = &sm.p[my_rows + (lane & 7) + ((lane >> 3) & 1) * 8][((lane >> 4) & 1) * 8];

  // One QK k-step (16 of my dims): one K fragment, four mma.sync.
  auto qk_step = [&](float (&sacc)[2][2][4], const __nv_bfloat16* kbase, int ks) {
    uint32_t kb[4];   // keys 0-7 in kb[0..1], keys 8-15 in kb[2..3]
    ldmatrix_x4(kb, kbase + ks * 16);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      mma_16816(sacc[mt][0], qf[mt][ks], kb[0], kb[1]);
      mma_16816(sacc[mt][1], qf[mt][ks], kb[2], kb[3]);
    }
  };
  // My quarter's partial S of my 32 rows -> s_part, in the mma accumulator order.
  auto write_partials = [&](const float (&sacc)[2][2][4]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int r = my_rows + mt * 16 + g;
      sm.s_part[dq][r][t4] = make_float4(sacc[mt][0][0], sacc[mt][0][1], sacc[mt][1][0], sacc[mt][1][1]);
      sm.s_part[dq][r + 8][t4] = make_float4(sacc[mt][0][2], sacc[mt][0][3], sacc[mt][1][2], sacc[mt][1][3]);
    }
  };

  // QK(t): partial S = Q[my 32 rows, my 144 dims] . K[16 keys, my 144 dims]^T -> s_part
  auto qk = [&](int tile, const Refill& rf) {
    const int stage = tile % kStages;
    {   // (scope of the accumulators)
      float sacc[2][2][4] = {};
#ifndef ABLATE_NO_QK
      const __nv_bfloat16* kbase = klane + stage * kStageElems;
#pragma unroll
      for (int ks = 0; ks < kQkSteps; ++ks) {
        qk_step(sacc, kbase, ks);
        // copies at k-steps 1, 3, 5, 7, 8: the first waits for the address arithmetic, which
        // the first k-step's ldmatrix and mma.sync can run beside
        if (kRefillInQk && (ks % 2 == 1 || ks == kQkSteps - 1)) copy_step(rf, (ks + 1) / 2 - 1 + (ks == kQkSteps - 1));
      }
#else
      if (kRefillInQk)
        for (int j = 0; j < kLoadSteps; ++j) copy_step(rf, j);
#endif
      write_partials(sacc);
    }
  };

  // SM(t): my row's 4 keys (2t4, 2t4+1, 8+2t4, 9+2t4), summed over the quarters in order.
  auto softmax_rows = [&](int tile) {
#ifndef ABLATE_NO_SOFTMAX
    {
      float4 acc = sm.s_part[0][sm_row][t4];
#pragma unroll
      for (int d = 1; d < kQuarters; ++d) {
        const float4 v = sm.s_part[d][sm_row][t4];
        acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
      }
      float sc[4] = {acc.x, acc.y, acc.z, acc.w};
      const int tile_key0 = key_begin + tile * kKeys;
      if (tile_key0 + kKeys <= min(key_end, draft0)) {   // a full tile of prefix keys: no mask
#pragma unroll
        for (int j = 0; j < 4; ++j) sc[j] = sm_row_valid ? sc[j] * prm.scale_log2 : -INFINITY;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = tile_key0 + (j >> 1) * 8 + 2 * t4 + (j & 1);
          bool visible = sm_row_valid && key < key_end;
          if (visible && key >= draft0)
            visible = prm.custom_mask ? prm.custom_mask[mask_row + key] != 0 : key - draft0 <= sm_tok;
          sc[j] = visible ? sc[j] * prm.scale_log2 : -INFINITY;
        }
      }
      float tile_max = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      // Lazy rescaling, as in the split kernel: keep the running max unless this tile exceeds
      // it by more than 2^8 (p <= 256), so most tiles skip the O rescale.
      const float m_new = tile_max > m_run + kRescaleThreshold ? tile_max : m_run;
      const float base = m_new == -INFINITY ? 0.f : m_new;   // nothing visible yet: exp2 gives 0
      float pr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) pr[j] = exp2f(sc[j] - base);
      const float alpha = m_new == m_run ? 1.f : exp2f(m_run - base);   // 1 when the max stays
      l_run = l_run * alpha + ((pr[0] + pr[1]) + (pr[2] + pr[3]));
      m_run = m_new;
      // The fused round (WIDE_FUSED) takes the row's P and rescale addresses from a fresh read
      // of the thread index: kept live over the round, they are the one value it spills.
      const int prow = kFused ? softmax_row_of(fresh_thread_index()) : sm_row;
      *reinterpret_cast<uint32_t*>(&sm.p[prow][2 * t4]) = pack_bf16(pr[0], pr[1]);
      *reinterpret_cast<uint32_t*>(&sm.p[prow][8 + 2 * t4]) = pack_bf16(pr[2], pr[3]);
      if (t4 == 0) sm.row_scale[prow] = alpha;
    }
#endif
  };

  // PV(t): O = O * row_scale + P . V over my 128 columns.
  auto pv = [&](int tile) {
    const int stage = tile % kStages;
    {
      uint32_t pa[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        ldmatrix_x4(pa[mt], plane + mt * 16 * kPRowStride);
        rescale_o(o, mt, sm.row_scale[my_rows + mt * 16 + g], sm.row_scale[my_rows + mt * 16 + g + 8]);
      }
#ifndef ABLATE_NO_PV
      pv_16_keys(o, pa, vlane + stage * kStageElems);
#endif
    }
  };

  // QK(tile) and PV(tile - 1) in one stream (WIDE_FUSED): k-step ks of QK, then column pair
  // ks of P.V, so each QK accumulator's next mma.sync has four independent ones before it.
  auto qk_pv = [&](int tile, const Refill& rf) {
    const __nv_bfloat16* kbase = klane + (tile % kStages) * kStageElems;
    const __nv_bfloat16* vbase = vlane + ((tile - 1) % kStages) * kStageElems;
    uint32_t pa[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      ldmatrix_x4(pa[mt], plane + mt * 16 * kPRowStride);
      rescale_o(o, mt, sm.row_scale[my_rows + mt * 16 + g], sm.row_scale[my_rows + mt * 16 + g + 8]);
    }
    float sacc[2][2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kQkSteps; ++ks) {
#ifndef ABLATE_NO_QK
      qk_step(sacc, kbase, ks);
#endif
      if (ks % 2 == 1 || ks == kQkSteps - 1) copy_step(rf, (ks + 1) / 2 - 1 + (ks == kQkSteps - 1));
#ifndef ABLATE_NO_PV
      if (ks < kVCols / 16) pv_column_pair(o, pa, vbase, ks);
#endif
    }
    write_partials(sacc);
  };
  // The MMA phase of round `tile`: QK(tile) and PV(tile - 1), each where it exists.
  auto mma_phase = [&](int tile, const Refill& rf) {
    if (tile > 0 && tile < num_tiles) qk_pv(tile, rf);
    else if (tile < num_tiles) qk(tile, rf);
    else pv(tile - 1);
  };

  // Ping-pong runs one round more: row pair 1's SM, PV of the last tile after A(n).
  const bool lagging = kPingPong && pair == 1;
  if constexpr (kFused) {
    // Round t: A(t), then row pair 0: QK(t)+PV(t-1), B, SM(t), C; row pair 1 (ping-pong): SM(t-1),
    // C, QK(t)+PV(t-1). A(t) frees the stage of tile t-2 (both pairs multiplied it in round t-1).
    for (int tile = 0; tile <= num_tiles; ++tile) {
      cp_async_wait<kAhead - 1>();
      stamp(tile, 0);
      __syncthreads();
      stamp(tile, 1);
      if (tile < 2) timeline_stamp(0, kEvTile0 + tile);
      const Refill rf = plan_refill(tile + kAhead);
      if (lagging) {
        if (tile > 0) {
          softmax_rows(tile - 1);
          stamp(tile, 2);
          barrier_sync(1 + pair, 128);   // C(tile-1)
          stamp(tile, 3);
        }
        mma_phase(tile, rf);
        stamp(tile, 4);
      } else {
        mma_phase(tile, rf);
        stamp(tile, 2);
        if (tile < num_tiles) {
          barrier_sync(1 + pair, 128);   // B(tile)
          stamp(tile, 3);
          softmax_rows(tile);
          stamp(tile, 4);
          barrier_sync(1 + pair, 128);   // C(tile)
          stamp(tile, 5);
        }
      }
      stage_index(tile + kIndexAhead, true);
      cp_async_commit();
    }
  } else
  for (int tile = 0; tile < num_tiles + kLag; ++tile) {
    cp_async_wait<kAhead - 1>();    // my copies of tile `tile` (group `tile`) have landed
    stamp(tile, 0);
    __syncthreads();                // A(tile): everyone's have; the stage refilled below is free
    stamp(tile, 1);
    if (tile < 2) timeline_stamp(0, kEvTile0 + tile);
    // Refill the stage of tile `tile - 1 - kLag` with tile `tile + kAhead` (past the split's end
    // it zero-fills a stage no round reads), during QK or before it.
    const Refill rf = plan_refill(tile + kAhead);
    if (!kRefillInQk)
      for (int j = 0; j < kLoadSteps; ++j) copy_step(rf, j);
    if (lagging) {                  // SM(t-1), C, PV(t-1), QK(t): A(t) ordered the partials of t-1
      if (tile > 0) {
        softmax_rows(tile - 1);
        stamp(tile, 2);
        barrier_sync(1 + pair, 128);   // C(tile-1)
        stamp(tile, 3);
        pv(tile - 1);
        stamp(tile, 4);
      }
      if (tile < num_tiles) qk(tile, rf);  // after C: the pair is done reading the partials of t-1
      stamp(tile, 5);
    } else if (tile < num_tiles) {
      qk(tile, rf);
      stamp(tile, 2);
      barrier_sync(1 + pair, 128);     // B(tile): the pair's partials are written
      stamp(tile, 3);
      softmax_rows(tile);
      stamp(tile, 4);
      barrier_sync(1 + pair, 128);     // C(tile): P and the rescale of the pair's 32 rows are written
      stamp(tile, 5);
      pv(tile);
      stamp(tile, 6);
    }
    stage_index(tile + kIndexAhead, true);
    cp_async_commit();              // group `tile + kAhead`: this round's copies
  }
  cp_async_wait<0>();
  timeline_stamp(0, kEvLoopEnd);

  // Each row's sum, from the warp that ran its softmax, to every warp that holds its O; the
  // LSE comes from that warp alone.
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  if (t4 == 0) {
    sm.row_sum[sm_row] = l_run;
    const int64_t pi = partial_index(sm_gr);
    if (pi >= 0) prm.ws_lse[pi] = l_run > 0.f ? m_run + log2f(l_run) : -INFINITY;
  }
#if WIDE_BF16_PARTIALS
  // Normalised partial outputs (bf16) through the ring: my pair's 32 rows, then whole rows of
  // them (1 KB each, 64 16-byte pieces) stored by the pair's 128 threads.
  __syncthreads();                // every warp is done with the ring (row pair 1 multiplies last)
  __nv_bfloat16* stage_out = &sm.kv[0][0];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = my_rows + mt * 16 + g + hi * 8;
      const float l = sm.row_sum[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      __nv_bfloat16* dst = stage_out + r * kOutRowStride + dq * kVCols + 2 * t4;
#pragma unroll
      for (int nt = 0; nt < kVCols / 8; ++nt)
        *reinterpret_cast<uint32_t*>(dst + nt * 8) = pack_bf16(o[mt][nt][2 * hi] * inv, o[mt][nt][2 * hi + 1] * inv);
    }
  }
  barrier_sync(1 + pair, 128);    // my pair's rows are staged
  {
    constexpr int kPiecesPerRow = kDimV * 2 / 16;             // 64
    constexpr int kRowsPerStep = 128 / kPiecesPerRow;         // 2
    const int ptid = tid % 128, piece = ptid % kPiecesPerRow;
#pragma unroll 4
    for (int r = my_rows + ptid / kPiecesPerRow; r < my_rows + 32; r += kRowsPerStep) {
      const int64_t pi = partial_index(row0 + r);
      if (pi >= 0)
        reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(prm.ws_o) + pi * kDimV)[piece] =
            *reinterpret_cast<const uint4*>(stage_out + r * kOutRowStride + piece * 8);
    }
  }
#else
  barrier_sync(1 + pair, 128);

  // Normalised partial output of my rows and my 128 columns.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = my_rows + mt * 16 + g + hi * 8;
      const int64_t pi = partial_index(row0 + r);
      if (pi < 0) continue;
      const float l = sm.row_sum[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      float* dst = prm.ws_o + pi * kDimV + dq * kVCols + 2 * t4;
#pragma unroll
      for (int nt = 0; nt < kVCols / 8; ++nt)
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[mt][nt][2 * hi] * inv, o[mt][nt][2 * hi + 1] * inv);
    }
  }
#endif
  timeline_stamp(0, kEvExit);
}

}  // namespace wide
}  // namespace sm120_mla
