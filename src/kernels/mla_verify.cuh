// MLA verify attention for sm_120 (RTX PRO 6000 Blackwell), written only with instructions
// that sm_80 .. sm_120 share: mma.sync m16n8k16 (bf16), ldmatrix and cp.async. No wgmma,
// TMA or tcgen05, and at most 99 KB of shared memory per block, so the code timed on an
// H200 (sm_90) is the code that runs on sm_120.
//
// Absorbed MLA: every token has one 576-wide bf16 KV row (512 latent + 64 rope) shared by
// all heads; V is the row's first 512 columns. A request's queries (q_len tokens x heads)
// attend to its prefix (gathered through kv_indices, page size 1) and to the draft tokens'
// own KV (k_extend), under a causal chain (DFlash) or a tree mask (SGLang custom_mask).
//
// Work split: one CTA owns 32 (token, head) rows of one request and one KV split. The KV of
// a split streams through a cp.async ring (TileConfig: 16 keys x 4 stages, or 32 keys x 2);
// each key row is read once from memory and used for both QK (576 dims) and PV (512 dims).
// The CTA's warps specialise: four score warps compute S = QK^T and the online softmax of
// tile t+1 while four value warps issue the loads and accumulate P.V of tile t, handing
// tiles over through named barriers. Where no CTA has more than 16 rows (decode at up to 16
// heads) the launcher runs a build that computes one m16 tile instead of two (DECODE_ONE_MTILE),
// and where none has more than 8 (decode at up to 8 heads) one with the rows as the mma's N
// (DECODE_ROWS_AS_N).
// Partial results per split go to a workspace, and a second kernel merges the splits by their
// LSE and writes every row of `out` and `lse`.
//
// This file holds no torch code, so nvcc can compile it alone for resource reports.
// ABLATE_NO_LOADS / _NO_QK / _NO_SOFTMAX / _NO_PV each remove one part of the per-tile
// work (the output is then wrong): `python -m sm120_workbook.kernels.ablation` times
// them to show where a tile's time goes. The default build defines none.
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <stdint.h>

namespace sm120_mla {

constexpr int kDimQK = 576;              // 512 latent + 64 rope
constexpr int kDimV = 512;
constexpr int kRowsPerCta = 32;          // (token, head) rows: two m16 tiles
constexpr int kScoreWarps = 4;           // QK^T and softmax; the 576 dims split four ways
constexpr int kValueWarps = 4;           // loads and P.V; 128 output columns each
constexpr int kGroupThreads = 128;       // threads in each of the two warp groups
constexpr int kWarps = kScoreWarps + kValueWarps;
constexpr int kThreads = kWarps * 32;
constexpr int kQkSteps = kDimQK / 16 / kScoreWarps;   // 9 k-steps of 16 dims per score warp
constexpr int kVColsPerWarp = kDimV / kValueWarps;    // 128 output columns per value warp
constexpr int kSoftmaxThreadsPerRow = kGroupThreads / kRowsPerCta;  // 4
// MIN_KEYS_PER_SPLIT (v18k): a split never gets fewer keys. The grid's split count is fixed by
// static shapes, so at short contexts this floor decides how many splits run and how many tiles
// each walks, and a call there is mostly its fixed part. v1's 64 left decode (128 splits) 17 to 65
// splits of 4 tiles at 1k-4k; 16 runs 65-86 splits of 1-3 tiles. Measured (NOTES.md, session 13):
// decode h8 3.6 / 2.5 / 1.2 us shorter at 1k / 2k / 4k (15.0 -> 11.4 at 1k), the 64-row kernel
// 3.6 / 2.5 us at q16 h8 1k / 2k and 2.5 at q16 h16 1k; from 8k the split count is the same.
#ifndef MIN_KEYS_PER_SPLIT
#define MIN_KEYS_PER_SPLIT 16
#endif
constexpr int kMinKeysPerSplit = MIN_KEYS_PER_SPLIT;
static_assert(kMinKeysPerSplit >= 16 && kMinKeysPerSplit % 16 == 0, "MIN_KEYS_PER_SPLIT: whole 16-key tiles");
constexpr int kMaxSplits = 128;
constexpr float kRescaleThreshold = 8.f;  // log2 units: see the softmax step
constexpr int kChunksPerKey = kDimQK * 2 / 16;        // 72 cp.async of 16 B per key row
// Shared-memory rows are padded by 16 bytes so that the 8 row addresses of one ldmatrix
// fall in different banks (1168 B stride = 292 words, 4 banks apart).
constexpr int kKvRowStride = kDimQK + 8;              // bf16 elements

// Barriers. Both groups meet once per tile at the hand-over (cta_sync: barrier 0, every
// thread of the CTA): the score warps bring P(t) and the O rescale of tile t, the value
// warps bring tile t+1 landed in shared memory; then the score warps compute tile t+1
// while the value warps multiply tile t. Every barrier is a sync on both sides, so each one
// orders all the shared-memory accesses before it against all those after it
// (handover_model.py checks the schedule). cta_sync also ends the split (final row sums in
// shared memory). A second barrier-0 round in mid-tile lets each group's warps wait for
// each other (GROUP_BARRIERS below); the GROUP_BARRIERS=1 build uses two named barriers
// instead, one per group:
constexpr int kBarScore = 1;             // score warps only: S partials written
constexpr int kBarValue = 2;             // value warps only: every P.V of tile t is done
// (__syncthreads must not be reached from the two groups' different code paths: CUDA leaves
// that undefined, and compute-sanitizer's synccheck rejects it.)
// LATE_REFILL: refill the stage of tile t-1 right after hand-over t (every warp is done
// with it by then) instead of after a value-only barrier at the end of tile t: one barrier
// fewer per tile, one tile fewer in flight. Needs 3+ stages (16-key tiles) and GROUP_BARRIERS=1.
#ifndef LATE_REFILL
#define LATE_REFILL 0
#endif
// GROUP_BARRIERS: how the four warps of a group wait for each other inside a tile.
// 0 (default, v16): they do not use barriers of their own. Each tile has two barrier-0 rounds
//   of all 256 threads, so both groups meet the same sequence of rounds: the mid-tile round
//   (score: between QK and the softmax, when the S partials are written; value: before
//   refilling the previous tile's stage, when every value warp is done with it) and the
//   hand-over.
// 1 (v14): two 128-thread named barriers, kBarScore and kBarValue, serve one group each.
//   That lets the groups' mid-tile work overlap, and it is 1.5% faster at q16 h8 64k (107.7 vs
//   109.3 us). compute-sanitizer's racecheck then reports the P / row_scale hand-over, although
//   barrier 0 orders every access pair (handover_model.py). It is clean on 0. The issue requires a
//   racecheck-clean kernel, so 0 ships (NOTES.md, sessions 4 and 5).
#ifndef GROUP_BARRIERS
#define GROUP_BARRIERS 0
#endif
// HANDOVER_SYNCWARP: a __syncwarp() before each hand-over cta_sync. The aligned barrier of
// v12 needed it (converged warps); the non-.aligned barrier 0 does not. 0 times the same
// (ablation no_syncwarp, NOTES.md session 4), so it stays at 1, the build all tests ran on.
#ifndef HANDOVER_SYNCWARP
#define HANDOVER_SYNCWARP 1
#endif
// PV_LAG: when the value warps multiply. 0 (v16): P.V(t) right after hand-over t, beside the
// score warps' QK(t+1), so both groups' mma.sync share each SMSP's tensor pipe in the first
// half of a round and leave it idle in the second (softmax, refill). 1: P.V(t) one half-round
// later, after the mid-tile round of tile t+1, beside the softmax(t+1), which uses other pipes;
// the stage of tile t is refilled at the start of round t+2. One fewer tile stays in flight
// for part of a round (16-key tiles only; 32-key tiles keep the v16 schedule).
#ifndef PV_LAG
#define PV_LAG 0
#endif
static_assert(!PV_LAG || (!GROUP_BARRIERS && !LATE_REFILL), "PV_LAG: a schedule of the GROUP_BARRIERS=0 build");
// TILE_STAGGER: the row CTAs of one split walk its tiles from different starting points,
// row CTA r from tile r * TILE_STAGGER on (wrapping round), so that the four CTAs that read
// the same keys do not ask L2 for the same lines at the same moment. The online softmax does
// not depend on the order of the tiles. 0 (default): every CTA walks them in order.
#ifndef TILE_STAGGER
#define TILE_STAGGER 0
#endif
// SPLIT_LOADS: who issues a refill's cp.async copies. 0 (v16): the value warps, 9 copies a
// thread a round, on their own critical path (ncu: they stall on the load units accepting
// them while the score warps wait at the barriers). 1: the score warps issue 4 of the 9 (the
// upper chunks of each key row) right after the mid-tile round, from the same staged index,
// and wait for their own copies before the hand-over. 16-key tiles, GROUP_BARRIERS=0 only.
#ifndef SPLIT_LOADS
#define SPLIT_LOADS 0
#endif
static_assert(!SPLIT_LOADS || (!GROUP_BARRIERS && !PV_LAG && !LATE_REFILL), "SPLIT_LOADS: the v16 schedule only");
constexpr int kIndexRing = 16;           // tiles of kv_indices staged in shared memory
// How many tiles ahead of its cp.async a tile's rows are pulled into L2 (prefetch.global.L2
// costs no shared memory, so it could deepen the pipeline past the ring's kStages tiles).
// Measured (NOTES.md, v11): 1, 4, 8 and 12 tiles ahead all time the same, so the default
// is 0, no prefetch, which saves the value warps ~50 instructions a tile. A build define,
// so that the ablation can sweep it.
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 0
#endif
constexpr int kPrefetchAhead = PREFETCH_AHEAD;
// EARLY_REFILL: when a stage is refilled. 0: after the next mid-tile round, the first point at
// which all four value warps are done with it, so each refill waits about half a round after
// the stage's last P.V. 1: each value warp refills the part of the stage only it reads, its own
// 128 V columns (8 chunks of 16 B a lane), plus one chunk a thread of the rope columns
// (512-575), which no value warp reads, right after its own P.V of the tile. Nine copies a
// thread either way. The score warps last read the stage in QK, before the hand-over that
// precedes this P.V. 16-key tiles, the v16 schedule, no L2 prefetch.
// Session 14's candidate, refuted in session 15 and kept off as the record: 1.4-1.6x slower at
// batched decode (b8 64k 178 -> 254-289 us) with either lane mapping below, since copies issued
// in the P.V stream cost more than an earlier refill gains (NOTES.md, session 15).
#ifndef EARLY_REFILL
#define EARLY_REFILL 0
#endif
static_assert(!EARLY_REFILL || (!GROUP_BARRIERS && !PV_LAG && !LATE_REFILL && !SPLIT_LOADS && PREFETCH_AHEAD == 0),
              "EARLY_REFILL: the v16 schedule only, without PREFETCH_AHEAD");
// STAGED_PROLOGUE (v18l): how the split kernel's value warps find the first tiles' key rows.
// 0 (up to v18k): each of the kStages first tiles loads its kv_indices entry with a plain load
// and copies the row as soon as it arrives, a load -> copies block per tile, so ptxas waits out
// one index trip per tile in turn (the CTA timeline, session 13: decode's "indices staged" at
// 1.8 / 3.8 / 5.8 us with 1 / 3 / 8 tiles a split). 1: the indices of the first kStages +
// kIndexAhead tiles are loaded together (predicated loads, all in flight) into the index ring,
// as the 64-row kernel's prologue does, and the first tiles' copies read them from there: one
// index trip a CTA.
#ifndef STAGED_PROLOGUE
#define STAGED_PROLOGUE 1
#endif
// PROLOGUE_EARLY_STAGES (v18n): how many of the ring's first tiles the value warps copy before
// they hand tile 0 over; the rest are copied right after the hand-over, while the score warps
// start. 0 (up to v18m): all kStages of them. Since v18l the first tile landed 1.3-1.5 us after
// its index, against 0.2-0.4 before: the warps issued the four tiles' copies (74 KB) in order, at
// the rate the load units accept cp.async, before they reached tile 0's wait. Measured (NOTES.md,
// sessions 13 and 14): with 2, tile 0 lands 0.6-0.8 us earlier. On two m16 tiles decode was
// 0.4-0.9 us shorter at 8k-16k in five rounds; the 0.2-0.3 us it seemed to lose at 1k there came
// from the order the ablation ran the builds in. On v18m's one tile, in three rounds: 0.1-0.5 us
// shorter up to 16k, and within +-0.4 us at 64k-128k.
#ifndef PROLOGUE_EARLY_STAGES
#define PROLOGUE_EARLY_STAGES 2   // 0: kStages
#endif
// DECODE_ONE_MTILE (v18m): where max_q_len * heads <= 16 (decode at up to 16 heads), the
// launcher runs the split kernel with one m16 row tile (MT = 1) instead of two, since every
// CTA's rows 16-31 are padding: half the score warps' QK mma.sync (in four accumulator chains
// instead of two), half the value warps' P.V, and the padding rows' softmax skipped. Decode's
// loop was bound by its compute (~1,480 cycles a round at 64k, ~1,200 with no loads, ~1,060 with
// loads only), half of it padding. Measured (NOTES.md, session 14): decode h8 -0.65 us at 1k,
// -1.2 at 4k, -1.65 at 16k, -3.5 at 64k and -9 at 128k (66.4 -> 57.5 us, 13%). On sm_120, where
// decode is memory-bound, it should gain little. 0 runs decode on two m16 tiles, as up to v18l.
#ifndef DECODE_ONE_MTILE
#define DECODE_ONE_MTILE 1
#endif
// DECODE_ROWS_AS_N (v21): where max_q_len * heads <= 8 (decode at up to 8 heads: Kimi K2 under
// TP8), the one-tile build still pads 8 rows to the mma's M of 16. This build swaps the operands:
// S^T = K . Q^T (the tile's 16 keys as M, the 8 rows as N) and O^T = V^T . P^T (16 output columns
// as M, the rows as N), so each QK k-step and each P.V column pair is one mma.sync, not two. The
// same ldmatrix reads serve, their lanes addressing the 8x8 matrices in the A operand's order (in
// B order, ptxas added 4 MOVs before every mma.sync); Q takes 18 registers, O 32. Measured
// (NOTES.md, session 17): decode h8 b8 64k 178.4 -> 169.5 us and b32 16k 178.1 -> 169.7 (-5%),
// b1 128k 58.4 -> 56.5, within 0.1 us at 1k. On sm_120, where decode is memory-bound, it should
// gain little. 0 runs such batches on the one-tile build, as up to v20.
#ifndef DECODE_ROWS_AS_N
#define DECODE_ROWS_AS_N 1
#endif
// SPLIT_BF16_PARTIALS (v23): the split kernel's normalised partial outputs. 0 (up to v22): fp32
// stored straight from the accumulators: 8-byte stores of 8 rows a warp (rows as M; 32 a thread
// at 16 rows), or 4-byte ones (rows as N: 32 a thread at 8 rows). The CTA timeline put decode
// h16's epilogue at ~1.0 us against h8's ~0.7 (NOTES.md, session 23). 1: bf16, as the wide
// kernel's (WIDE_BF16_PARTIALS: one more rounding, <= 2^-9 relative, before the fp32 merge),
// staged through the idle ring so that the value warps store whole rows in 16-byte pieces:
// 8 stores a thread at 16 rows, 4 at 8, and half the bytes for the combine step to read.
#ifndef SPLIT_BF16_PARTIALS
#define SPLIT_BF16_PARTIALS 1
#endif
constexpr bool kSplitBf16Partials = SPLIT_BF16_PARTIALS;
// SPLIT_Q_SMEM (v24): how the split kernel's score warps get their Q fragments. 0 (up to v23):
// straight from memory, one 4-byte load a fragment register: 36 a thread at 16 rows (18 at 8, 72
// at 32), each warp instruction touching 8 rows' lines. In decode h16's CTA timeline Q is
// requested ~0.35 us later than at h8 and tile 0 lands ~0.65 us later: the score warps' loads
// queue in the same load units as the value warps' index loads and first copies. 1: each score
// warp reads its rows' 144 dims in 16-byte pieces (9 loads a thread at 16 rows, lanes along each
// row's 288 bytes), puts them in a ring stage that the prologue leaves free (PROLOGUE_EARLY_STAGES:
// the value warps copy stages past it only after tile 0's hand-over, by when Q is in registers)
// and takes the fragments with ldmatrix. Where the free stages hold fewer keys than the CTA has
// rows (32-key tiles with both stages copied first; STAGED_PROLOGUE=0; PROLOGUE_EARLY_STAGES=0;
// 32 rows with 3 stages) the kernel keeps 0's register loads.
#ifndef SPLIT_Q_SMEM
#define SPLIT_Q_SMEM 1
#endif
// Staged bf16 partial rows in shared memory: 260 words apart, so that a warp's 4-byte stores
// (8 rows x 4 lanes, or with the rows as N 4 row pairs x 8 lanes) hit the 32 banks once.
constexpr int kOutRowStride = kDimV + 8;

// STAGES_16: the cp.async ring of 16-key tiles. Two stages are always being read (the score
// warps on tile t+1, the value warps on tile t), so 4 stages keep 2 tiles in flight and 3
// keep 1. A build define for the ablation (`stages3`): if the gather is bound by the latency
// of the copies in flight rather than by a throughput, 3 stages double the loads-only time.
#ifndef STAGES_16
#define STAGES_16 4
#endif
static_assert(STAGES_16 == 3 || STAGES_16 == 4, "STAGES_16: 3 or 4 (5 x 18.7 KB exceeds sm_120's 99 KB)");

// Tile shape: KEYS keys per softmax round. 16 keys x 4 stages and 32 keys x 2 stages fill
// the same 74,752 B ring; 16 keeps two tiles in flight while the groups work on the other
// two, 32 halves the hand-overs per key but leaves no tile in flight. 16 is faster at every
// shape measured (NOTES.md) and the default. Both stay under sm_120's 99 KB.
template <int KEYS>
struct TileConfig {
  static constexpr int kKeys = KEYS;
  static constexpr int kStages = KEYS == 16 ? STAGES_16 : 2;
  // the ring stages the value warps copy before tile 0's hand-over (PROLOGUE_EARLY_STAGES)
  static constexpr int kEarlyStages =
      STAGED_PROLOGUE && PROLOGUE_EARLY_STAGES > 0 && PROLOGUE_EARLY_STAGES < kStages ? PROLOGUE_EARLY_STAGES : kStages;
  static constexpr int kStageElems = KEYS * kKvRowStride;
  static constexpr int kPRowStride = KEYS + 8;        // bf16 elements: conflict-free ldmatrix rows
  static constexpr int kLoadThreadsPerKey = kGroupThreads / KEYS;
  static constexpr int kLoadSteps = (kChunksPerKey + kLoadThreadsPerKey - 1) / kLoadThreadsPerKey;
  static constexpr int kQkNTiles = KEYS / 8;                  // n8 tiles of keys per score warp
  static constexpr int kSoftmaxKeys = KEYS / kSoftmaxThreadsPerRow;
  static constexpr int kPvKSteps = KEYS / 16;
  struct Shared {
    __nv_bfloat16 kv[kStages][kStageElems];
    float s_part[kScoreWarps][kRowsPerCta][KEYS];      // QK partial sums, one per dim quarter
    __nv_bfloat16 p[2][kRowsPerCta][kPRowStride];      // probabilities (bf16), by tile parity
    float row_scale[2][kRowsPerCta];                   // each tile's rescale of O, by parity
    float row_max[kRowsPerCta];                        // final running max (log2 domain)
    float row_sum[kRowsPerCta];                        // final running sum of exp2
    int64_t index[kIndexRing][KEYS];                   // kv_indices of tiles ahead (int32: low half)
  };
  static constexpr int kSmemBytes = sizeof(Shared);
  static_assert(kSmemBytes <= 101376, "sm_120 allows at most 99 KB of shared memory per block");
  static_assert(kGroupThreads % KEYS == 0 && KEYS % 16 == 0 && kSoftmaxKeys % 4 == 0, "tile shape");
};
static_assert(GROUP_BARRIERS || !LATE_REFILL, "LATE_REFILL replaces kBarValue: needs GROUP_BARRIERS=1");
static_assert(kRowsPerCta == 2 * 16 && kGroupThreads == kScoreWarps * 32 && kGroupThreads == kValueWarps * 32,
              "warp layout");

// CTA_TIMELINE (a diagnostic build, off by default): one thread of every CTA of the attention
// kernel (kernel 0: the wide kernel, or since session 13 the split kernel) and of the combine
// step (kernel 1) stamps %globaltimer, in ns on one clock for all SMs, at the CTA's milestones
// (kEv*), so that a call's fixed part (launch ramp, prologue, first tiles, epilogue, the
// combine's own chain) can be told apart CTA by CTA. cta_timeline() (the launcher) copies the
// stamps out and clears them; cta_timeline.py tabulates them. Thread 0 stamps unless `by` names
// another (the split kernel's value warps stamp their own milestones).
// A CTA past kTimelineCtas is not stamped; a milestone a CTA never reached stays 0.
constexpr int kTimelineCtas = 4096;
constexpr int kTimelineEvents = 8;
// kEvIndptr and kEvQRequested (session 12) split the 64-row kernel's prologue: its request's
// indptr entries are in, and its Q copies are issued.
enum TimelineEvent {
  kEvEntry = 0, kEvStaged = 1, kEvTile0 = 2, kEvTile1 = 3, kEvLoopEnd = 4, kEvExit = 5, kEvIndptr = 6, kEvQRequested = 7
};
#ifdef CTA_TIMELINE
__device__ unsigned long long cta_timeline_ns[2][kTimelineCtas][kTimelineEvents];
#endif
#ifdef CTA_TIMELINE
// This CTA's row of cta_timeline_ns; rows past kTimelineCtas are not stamped.
__device__ __forceinline__ unsigned timeline_cta() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
__device__ __forceinline__ void timeline_store(int kernel, unsigned cta, int event, unsigned long long t) {
  if (cta < kTimelineCtas) cta_timeline_ns[kernel][cta][event] = t;
}
#endif
__device__ __forceinline__ void timeline_stamp(int kernel, int event, int by = 0) {
#ifdef CTA_TIMELINE
  if (threadIdx.x == by) {
    const unsigned cta = timeline_cta();
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    timeline_store(kernel, cta, event, t);
  }
#endif
}
// The same, once `value` (a loaded value) has arrived: the stamp waits for it.
__device__ __forceinline__ void timeline_stamp_after(int kernel, int event, int value) {
#ifdef CTA_TIMELINE
  if (threadIdx.x == 0) {
    const unsigned cta = timeline_cta();
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(value));
    timeline_store(kernel, cta, event, t);
  }
#endif
}

struct Params {
  const __nv_bfloat16* q;          // [T, H, 576]
  const __nv_bfloat16* kv_pool;    // [P, 576]
  const __nv_bfloat16* k_extend;   // [T, 576] or nullptr (decode: queries' keys are in the pool)
  const int32_t* qo_indptr;        // [B+1]
  const int32_t* kv_indptr;        // [B+1]
  const void* kv_indices;          // int32 or int64
  const uint8_t* custom_mask;      // flat bool, or nullptr for a causal chain
  const void* mask_indptr;         // int32 or int64, [B+1]
  float* ws_o;                     // [B*num_splits*max_q_len*H, 512] (partial_slot): each split's
                                   // normalised output, fp32, or
                                   // bf16 in a buffer of half that size (WIDE_BF16_PARTIALS,
                                   // SPLIT_BF16_PARTIALS; the combine step's kBf16Partials)
  float* ws_lse;                   // [B*num_splits*max_q_len*H]: each split's LSE (log2 domain)
  __nv_bfloat16* out;              // [T, H, 512]
  float* lse;                      // [T, H] natural-log LSE of sm_scale * q.k
  int heads;
  int batch;
  int max_q_len;
  int num_splits;
  int kv_indices_64;
  int mask_indptr_64;
  float scale_log2;                // sm_scale * log2(e)
  // Bits 0-1, the pool (pool_mode): BALANCED_SPLITS (requests share each row tile's CTAs by
  // keys) 0 off, 1 on with the split kernel, 2 on with the 64-row kernel (batches, from sm_90 on).
  // Bits 2 and up (v30): T, the rows of q and k_extend (q_tokens; T <= 65535 x 16 < 2^20). One
  // field, last, in what was padding: at 255 registers, a Params that grew or moved its fields
  // changed what ptxas spilled in the 64-row kernel on sm_86/sm_89 (4 -> 12 bytes).
  int balanced_splits;
  // No field more: a Params of 128 bytes instead of 120 moved ptxas's schedule of both attention
  // kernels' loops on sm_90 and made a combine step spill on sm_120a (session 26). Hence T in the
  // spare bits above; the combine step finds T from its grid.
};
static_assert(sizeof(Params) == 128, "Params: no field more (see above); spare bits are the way in");
// The lengths of the index tensors that the attention kernels read through indptrs (v31): a
// second kernel argument, since Params has no room. A second argument left the loops' SASS alone
// where a larger Params did not (NOTES.md, v19). The combine step reads neither tensor.
struct Bounds {
  int64_t kv_indices_len;          // len(kv_indices)
  int64_t mask_len;                // len(custom_mask); 0 without a mask
};
// kModeOnly: the combine step's Params, whose balanced_splits the launcher gives the pool mode
// alone (the combine step finds T from its grid). Read as v29 read it there, the combine step's
// SASS stays v29's; read through `& 3`, every combine build was rescheduled and b32 h16 q16 ran
// 1.1% slower (ab.py, session 46).
template <bool kModeOnly = false>
__device__ __forceinline__ int pool_mode(const Params& prm) { return kModeOnly ? prm.balanced_splits : prm.balanced_splits & 3; }
__device__ __forceinline__ int q_tokens(const Params& prm) { return prm.balanced_splits >> 2; }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  // src-size 0 zero-fills: keys past the split's end become 0, never stale or NaN data.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
// The same 16-byte copy, issued only where `issue` holds: a predicate on the instruction instead
// of a branch, so a copy that only some lanes make does not split the warp.
__device__ __forceinline__ void cp_async_16_if(void* smem, const void* gmem, bool valid, bool issue) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16, %2;\n}\n"
               ::"r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0), "r"(static_cast<int>(issue)));
}
// a ? x : y without a branch: ptxas turns a C++ select whose one side needs a load into a
// branch around that load, which splits the refill from the code it should overlap.
__device__ __forceinline__ uint64_t select_u64(bool a, uint64_t x, uint64_t y) {
  uint64_t r;
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n selp.b64 %0, %2, %3, p;\n}\n"
      : "=l"(r) : "r"(static_cast<int>(a)), "l"(x), "l"(y));
  return r;
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ T* select_ptr(bool a, T* x, T* y) {
  return reinterpret_cast<T*>(select_u64(a, reinterpret_cast<uint64_t>(x), reinterpret_cast<uint64_t>(y)));
}
// A refill's key row, branch-free (both kernels): the k_extend row of a draft key (key >=
// prefix_len), else the pool row of `staged`, the key's kv_indices entry as staged in shared
// memory (an int32 entry fills its low half). `staged` is stale unless the key is a live prefix
// key, and used only then. Not `live` (past the split's end): kv_pool itself, so the copies
// that zero-fill still name a valid address.
__device__ __forceinline__ const __nv_bfloat16* staged_key_row(const Params& prm, int64_t staged, int key,
                                                               int prefix_len, int q_start, bool live) {
  const int64_t pool_row = prm.kv_indices_64 ? staged : static_cast<int64_t>(static_cast<int32_t>(staged & 0xffffffff));
  const bool extend = key >= prefix_len;
  const int64_t row = static_cast<int64_t>(select_u64(extend, static_cast<uint64_t>(q_start + key - prefix_len),
                                                      static_cast<uint64_t>(pool_row)));
  const __nv_bfloat16* base = select_ptr(extend, prm.k_extend, prm.kv_pool);
  return select_ptr(live, base + row * kDimQK, prm.kv_pool);
}
// 4- or 8-byte asynchronous copy (kv_indices entries).
template <int BYTES>
__device__ __forceinline__ void cp_async_small(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "n"(BYTES));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int BYTES>
__device__ __forceinline__ void cp_async_small_if(void* smem, const void* gmem, bool issue) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.ca.shared.global [%0], [%1], %3;\n}\n"
               ::"r"(smem_addr(smem)), "l"(gmem), "r"(static_cast<int>(issue)), "n"(BYTES));
}
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// D = A(16x16, row) * B(16x8, col) + D, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Barriers wait until every participating thread has arrived, ordering the shared-memory
// accesses before against those after. `bar.sync` (barrier.sync.aligned) requires every
// participating thread to execute the same instruction; it serves the barriers internal to
// one group (kBarScore, kBarValue: `count` threads). The barriers of all warps are reached
// from the two groups' different code, which only the non-.aligned form allows (synccheck
// rejects the aligned one there). Its SASS adds a WARPSYNC and a divergent fallback;
// measured, that costs nothing here, while a never-inlined function holding one aligned
// `bar.sync 0` for every thread cost 5% (NOTES.md, v14 and v15).
__device__ __forceinline__ void barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void cta_sync() {
  asm volatile("barrier.sync 0;\n" ::: "memory");
}

// COMBINE_PDL: the combine step is launched as a programmatic dependent of the attention
// kernel (sm_90 and newer, sm_120 included; the launcher leaves the attribute off below sm_90,
// where these two compile to nothing). The attention kernel lets it launch at once; the
// combine step's CTAs then take each SM that an attention CTA leaves, run their prologue
// (the padding-row test), and wait in griddepcontrol.wait until the attention grid has
// finished and its writes are visible. What that saves is the launch gap between the two
// kernels and the combine step's ramp, not its work: 0.3-1.3 us a call on the H200 (q16 h8 4k
// 26.7 -> 25.6, decode h8 4k 16.5 -> 15.9; NOTES.md, session 10), so it is on by default.
#ifndef COMBINE_PDL
#define COMBINE_PDL 1
#endif
__device__ __forceinline__ void launch_dependents() {
#if COMBINE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if COMBINE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Pull a line into L2 without waiting for it (no register result, so nothing stalls).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, int is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Stage the kv_indices entry of `key` in shared memory (one thread per key row), where `copy`:
// a plain load (a prologue) or a predicated 4- or 8-byte cp.async (an int32 entry fills the
// low half; the reader masks the rest).
__device__ __forceinline__ void stage_key_index(const Params& prm, int64_t* dst, int64_t kv_start, int key, bool copy,
                                                bool async) {
  if (!async) {
    if (copy) *dst = load_index(prm.kv_indices, kv_start + key, prm.kv_indices_64);
    return;
  }
  const char* src = static_cast<const char*>(prm.kv_indices) + (kv_start + key) * (prm.kv_indices_64 ? 8 : 4);
  cp_async_small_if<8>(dst, src, copy && prm.kv_indices_64);
  cp_async_small_if<4>(dst, src, copy && !prm.kv_indices_64);
}

// Helpers shared by the split kernel and the wide kernel (mla_verify_wide.cuh).

// Which request, and which of its splits, a CTA works on (v19, BALANCED_SPLITS). The CTAs of
// one row tile, gridDim.y x gridDim.z = num_splits x batch of them, are a pool. Request r takes
// the pool's CTAs first_cta(r) .. first_cta(r + 1) - 1: one of its own, and the rest shared out
// in proportion to its keys. So a batch of mixed lengths finishes together, where a fixed
// num_splits a request left its longest request's CTAs working long after the others had
// finished. Equal lengths give every request num_splits, exactly as before. The grid still
// depends on static shapes only, so a captured graph replays for any lengths.
// BALANCED_SPLITS=0: num_splits CTAs a request whatever its length (up to v18n).
#ifndef BALANCED_SPLITS
#define BALANCED_SPLITS 1
#endif
// The 64-row kernel takes the pool from sm_90 on. It keeps num_splits a request where its main
// loop spilled with the pool: on sm_80-sm_89 (24-64 bytes, reloaded every round), and in its
// WIDE_TRACE build (phase_trace.py, batch 1, where the pool changes nothing; 4 bytes on sm_90).
// Device code only: the combine step is compiled for the same arch with the same defines, in
// the same module, so it agrees.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || defined(WIDE_TRACE))
constexpr bool kWidePool = false;
#else
constexpr bool kWidePool = true;
#endif
template <bool kModeOnly = false>
__device__ __forceinline__ bool pooled(const Params& prm) {
  return pool_mode<kModeOnly>(prm) == 1 || (kWidePool && pool_mode<kModeOnly>(prm) == 2);
}
struct SplitPool {
  int spare;            // CTAs beyond one a request: shared out by keys
  int64_t total_keys;   // keys of the whole batch
};
// Keys of requests 0 .. r-1: their prefixes and, with k_extend, their draft tokens. (The 32-bit
// differences can wrap for a negative indptr[0]: request_of_cta counts that batch broken.)
__device__ __forceinline__ int64_t keys_before(const Params& prm, int r) {
  int64_t k = prm.kv_indptr[r] - prm.kv_indptr[0];
  if (prm.k_extend) k += prm.qo_indptr[r] - prm.qo_indptr[0];
  return k;
}
// total_keys 0: every request num_splits CTAs. So at batch 1, where that is the whole pool
// anyway, nothing is loaded: the indptr round trip and the division cost v19b 1.5-3 us there.
template <bool kModeOnly = false>
__device__ __forceinline__ SplitPool split_pool(const Params& prm) {
  return {prm.batch * (prm.num_splits - 1), pooled<kModeOnly>(prm) && prm.batch > 1 ? keys_before(prm, prm.batch) : 0};
}
// The pool's first CTA for request r (r = batch: the pool's size).
__device__ __forceinline__ int first_cta(const Params& prm, const SplitPool& pool, int r) {
  if (pool.total_keys == 0) return r * prm.num_splits;   // also: not balanced
  return r + static_cast<int>(pool.spare * keys_before(prm, r) / pool.total_keys);
}
// The request of pool CTA c: how many of requests 1 .. batch-1 start at or before c, counted by
// the whole block (every thread must call it, with the same c). The count goes through a warp
// reduction so that it lands in a uniform register: ptxas cannot tell that a barrier's count is
// the same in every lane, and with the request index in a regular register the request's
// indptr values took regular registers too, which spilled in the 64-row kernel's loop.
// -1 for a broken batch: an indptr that decreases anywhere, or starts below 0 (v29; from a
// negative start keys_before's 32-bit differences can wrap). first_cta is then not monotone,
// so a request's span may hold CTAs that work on another request, or none, and its combine
// rows would read their partials or stale slots: a silent wrong answer. The same walk
// reads the pairs (a few loads more, from the lines it reads anyway), and the kernels give every
// slot of a broken batch an LSE of +inf (poison_broken_batch), so every token comes out NaN.
// A pooled batch with no keys at all (total_keys 0: num_splits CTAs a request) walks too.
__device__ __forceinline__ int request_of_cta(const Params& prm, const SplitPool& pool, int c) {
  if (prm.batch == 1) return 0;
  if (!pooled(prm)) return c / prm.num_splits;
  int before = 0, broken = 0;
  for (int r0 = 1; r0 <= prm.batch; r0 += blockDim.x) {
    const int r = r0 + static_cast<int>(threadIdx.x);
    before += __syncthreads_count(r < prm.batch && first_cta(prm, pool, r) <= c);
    broken |= __syncthreads_or(r <= prm.batch && (prm.kv_indptr[r] < prm.kv_indptr[r - 1] ||
                                                  prm.qo_indptr[r] < prm.qo_indptr[r - 1] ||
                                                  (r == 1 && min(prm.kv_indptr[0], prm.qo_indptr[0]) < 0)));
  }
  return __reduce_max_sync(0xffffffffu, broken ? -1 : before);
}
// This CTA's place in its row tile's pool, read afresh from the special registers wherever it is
// used: volatile, so that ptxas does not keep one copy live (spilled) through the main loop.
__device__ __forceinline__ int pool_cta() {
  unsigned y, z, ny;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
  asm volatile("mov.u32 %0, %%nctaid.y;" : "=r"(ny));
  return static_cast<int>(y + ny * z);
}
// POOL_MIN_MAX (v20): each request's CTA count minimises the most keys any CTA of the pool
// walks, by a binary search over that load L: request r needs max(1, ceil(keys_r / L)) CTAs, and
// the smallest L whose needs fit the pool wins (the leftover CTAs go to the last request). v19's
// rule, one CTA each plus the spare ones by keys, over-serves the short requests whenever the
// pool has few CTAs a request: with 64k + 31 x 2k at b32 decode (a pool of 128) the long request
// got 49 CTAs of ~1,340 keys; the search gives it 64 of ~1,020. Over random batches (log-uniform 0.5k-128k,
// NOTES.md session 16) v19's slowest CTA walks 1-3% more keys than needed at 2-8 requests, 10%
// at 32 and 25% at 64 (num_splits 4 and 2); the search's 1/64 tolerance stays within 1%.
// A decreasing qo_indptr (a broken contract that no request sees alone: two requests' tokens may
// overlap) gives every request an empty span: no CTA computes, and the combine step writes NaN.
// Equal lengths skip the search: num_splits CTAs each, exactly as before. Warp 0 runs it, one
// request a lane (up to four), so it serves up to kPoolScanMax requests; larger batches have no
// spare CTAs at the workspace's split counts, and keep v19's rule.
#ifndef POOL_MIN_MAX
#define POOL_MIN_MAX 1
#endif
constexpr int kPoolScanMax = 128;
// A request's place in its row tile's pool: its first CTA, and the next request's.
struct PoolSpan {
  int request, first, next;
};
template <bool kModeOnly = false>
__device__ __forceinline__ bool pool_min_max(const Params& prm) {
  return POOL_MIN_MAX && pooled<kModeOnly>(prm) && prm.batch > 1 && prm.batch <= kPoolScanMax;
}
__device__ __forceinline__ unsigned ceil_div(unsigned a, unsigned b) { return (a + b - 1) / b; }
// A request's keys for the pool's balance: b - a, 0 where an indptr decreases (a broken contract:
// that request comes out NaN, and the others' spans stay apart), and at most kPoolKeyCap, so that
// no sum over 128 requests wraps. The cap only shapes the balance (16M keys, 64x the largest
// context): a split's keys come from the indptrs themselves.
constexpr unsigned kPoolKeyCap = 1u << 24;
__device__ __forceinline__ unsigned key_gap(int a, int b) {
  return b > a ? min(static_cast<unsigned>(b) - static_cast<unsigned>(a), kPoolKeyCap) : 0u;
}
// Block-wide (every thread calls it). kFindCta: the span of the request that holds pool CTA
// `at`; otherwise that of request `at`.
template <bool kFindCta>
__device__ __forceinline__ PoolSpan pool_span_min_max(const Params& prm, int at) {
  __shared__ int span[3];
  if (threadIdx.x < 32) {
    constexpr int kPerLane = kPoolScanMax / 32;
    const int B = prm.batch, lane = threadIdx.x;
    const unsigned ns = prm.num_splits, P = B * ns, spare = P - B;
    // request lane + 32 j, for the j that hold any (a uniform test: no work past the batch)
    auto has = [&](int j) { return 32 * j < B; };
    unsigned keys[kPerLane], total = 0;
    bool broken = false;   // a decreasing qo_indptr: its requests' tokens may overlap
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int r = lane + 32 * j;
      keys[j] = 0;
      if (has(j) && r < B) {
        const int q0 = prm.qo_indptr[r], q1 = prm.qo_indptr[r + 1];
        broken |= q1 < q0;
        keys[j] = min(key_gap(prm.kv_indptr[r], prm.kv_indptr[r + 1]) + (prm.k_extend ? key_gap(q0, q1) : 0u),
                      kPoolKeyCap);
      }
      total += keys[j];
    }
    total = __reduce_add_sync(0xffffffffu, total);
    const unsigned keys0 = __shfl_sync(0xffffffffu, keys[0], 0);
    bool equal = true;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) equal &= lane + 32 * j >= B || keys[j] == keys0;
    if (__any_sync(0xffffffffu, broken)) {   // no CTAs for any request: none computes, the combine gives NaN
      if (lane == 0) span[0] = span[1] = span[2] = 0;
    } else if (__all_sync(0xffffffffu, equal) || spare == 0) {   // num_splits CTAs each
      if (lane == 0) {
        const int r = kFindCta ? at / prm.num_splits : at;
        span[0] = r;
        span[1] = r * prm.num_splits;
        span[2] = (r + 1) * prm.num_splits;
      }
    } else {
      // the CTAs of request lane + 32 j at load L, and their sum over the batch
      unsigned ctas[kPerLane];
      auto needs = [&](unsigned L) {
        unsigned sum = 0;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          ctas[j] = has(j) && lane + 32 * j < B ? max(1u, ceil_div(keys[j], L)) : 0u;
          sum += ctas[j];
        }
        return __reduce_add_sync(0xffffffffu, sum);
      };
      // hi: a load that fits (sum of max(1, ceil(k / hi)) <= T / hi + B <= P); lo: one that may not
      unsigned lo = max(1u, ceil_div(total, P)) - 1, hi = max(1u, ceil_div(total, spare));
      while (hi - lo > max(1u, hi >> 6)) {
        const unsigned mid = (lo + hi) / 2;
        if (needs(mid) <= P) hi = mid; else lo = mid;
      }
      const unsigned used = needs(hi);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j)   // the leftover: to the last request (no dynamic index: no stack)
        if (lane + 32 * j == B - 1) ctas[j] += P - used;
      // first CTA of each request: an exclusive prefix sum in request order (j, then lane)
      unsigned carry = 0;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (!has(j)) break;
        unsigned incl = ctas[j];
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const unsigned v = __shfl_up_sync(0xffffffffu, incl, off);
          if (lane >= off) incl += v;
        }
        const int r = lane + 32 * j;
        const int first = static_cast<int>(carry + incl - ctas[j]), next = static_cast<int>(carry + incl);
        if (r < B && (kFindCta ? first <= at && at < next : r == at)) {
          span[0] = r;
          span[1] = first;
          span[2] = next;
        }
        carry += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
  }
  __syncthreads();
  return {span[0], span[1], span[2]};
}
// The span of request r (the combine step; block-wide).
template <bool kModeOnly = false>
__device__ __forceinline__ PoolSpan pool_span_of_request(const Params& prm, int r) {
  if (pool_min_max<kModeOnly>(prm)) return pool_span_min_max<false>(prm, r);
  const SplitPool pool = split_pool<kModeOnly>(prm);
  return {r, first_cta(prm, pool, r), first_cta(prm, pool, r + 1)};
}

// A CTA's work: request `request`, split `split` of its `count` (at most kMaxSplits, the
// combine step's bound; a CTA past that bound has none: split >= count). count kBrokenBatch:
// the batch is broken (request_of_cta), and the CTA only poisons its slots (poison_broken_batch).
struct SplitOf {
  int request, split, count;
};
constexpr int kBrokenBatch = -1;
// POOL_TRACE (a diagnostic build: tests/test_kernel_gpu.py checks it against
// verify_attention.pool_first_ctas, the Python mirror): the pool as the kernels computed it.
// pool_trace_ctas[c] = (request, split, count) of pool CTA c in the first row tile;
// pool_trace_rows[row] = (first split, splits) as the combine step found them. Slots past
// kPoolTraceSlots are not written.
#ifdef POOL_TRACE
constexpr int kPoolTraceSlots = 4096;
__device__ int pool_trace_ctas[kPoolTraceSlots][3];
__device__ int pool_trace_rows[kPoolTraceSlots][2];
#endif
__device__ __forceinline__ void pool_trace_cta(const SplitOf& w) {
#ifdef POOL_TRACE
  const int c = pool_cta();   // only here: pool_cta's volatile reads would stay in every build
  if (threadIdx.x == 0 && blockIdx.x == 0 && c < kPoolTraceSlots) {
    pool_trace_ctas[c][0] = w.request;
    pool_trace_ctas[c][1] = w.split;
    pool_trace_ctas[c][2] = w.count;
  }
#endif
}
// The combine step's side: where combine row `row` found its splits. Every thread of every
// column slice writes the same two values: a test on threadIdx / blockIdx here kept that
// predicate live to the lse store and spilled it on sm_120a.
__device__ __forceinline__ void pool_trace_row(int64_t row, int first_split, int splits) {
#ifdef POOL_TRACE
  if (row < kPoolTraceSlots) {
    pool_trace_rows[row][0] = first_split;
    pool_trace_rows[row][1] = splits;
  }
#endif
}
__device__ __forceinline__ SplitOf split_of_cta(const Params& prm, int c) {
  if (pool_min_max(prm)) {
    const PoolSpan span = pool_span_min_max<true>(prm, c);
    // uniform registers, as request_of_cta's: the same in every lane
    return {__reduce_max_sync(0xffffffffu, span.request), __reduce_max_sync(0xffffffffu, c - span.first),
            __reduce_max_sync(0xffffffffu, min(span.next - span.first, kMaxSplits))};
  }
  const SplitPool pool = split_pool(prm);
  const int r = request_of_cta(prm, pool, c);
  if (r < 0) return {0, 0, kBrokenBatch};
  const int first = first_cta(prm, pool, r);
  // uniform registers, as the request (request_of_cta): the same in every lane
  // monotone indptrs give first <= c; the guard is kept (one select): a CTA before its
  // request's first would read keys before the request's kv_indices, so it gets no work
  const int split = c >= first ? c - first : kMaxSplits;
  return {r, __reduce_max_sync(0xffffffffu, split),
          __reduce_max_sync(0xffffffffu, min(first_cta(prm, pool, r + 1) - first, kMaxSplits))};
}

// The (token, head) rows of a request that the attention kernels compute: q_len * H, or fewer
// where the caller broke the contract, which only check_values can see before a graph replay.
// Tokens past max_q_len have no workspace slots (their rows would overwrite the next pool CTA's
// slots, or run past the workspace), and a request starting before q is not read at all, nor
// (q_rows_fit) one running past q's T rows; the combine step writes NaN for all three, so it shows.
__device__ __forceinline__ int request_rows(const Params& prm, int q_start, int q_len) {
  // at least 0: a negative q_len (a decreasing qo_indptr) times H could wrap to a large count
  return q_start >= 0 ? max(min(q_len, prm.max_q_len), 0) * prm.heads : 0;
}
// Request b's q_len: the indptrs' difference as it wraps (unsigned), not undefined, so that a
// garbage pair (2147483640, -100) cannot let the compiler fold q_rows_fit's test to
// qo_indptr[b + 1] <= T, as nvcc did for sm_120a (see there).
__device__ __forceinline__ int request_q_len(const Params& prm, int b, int q_start) {
  return static_cast<int>(static_cast<unsigned>(prm.qo_indptr[b + 1]) - static_cast<unsigned>(q_start));
}
// Whether a request's tokens lie within q's T rows, the rows of q and k_extend that its CTAs
// read (v30; before, a qo_indptr past T was read out of bounds). The attention kernels take it as
// one more factor of their row count, beside unpooled_slots_fit; the combine step has its own
// test (q1 <= T, T from its grid). T - q_start cannot wrap for q_start >= 0 (elsewhere
// request_rows is 0), and q_len is the indptrs' difference as it wraps (request_q_len): with
// a signed, undefined overflow nvcc folded this test to
// qo_indptr[b + 1] <= T on sm_120a, which let the pair (2147483640, -100) through, q_len
// wrapped positive and q read ~2^31 rows out (found by a review in session 46, in the PTX; the
// SASS of every loop is the same either way). A q_len that wrapped positive exceeds T - q_start,
// since T < 2^20. The 64-row kernel spells it q_start <= T - q_len (which can wrap only for a
// negative q_len, where request_rows is 0): with this spelling its
// loop is rescheduled (sm_90 and sm_120a), with that one it stays v29's on both; the split
// kernels' loops stay v29's on sm_120a with this one (NOTES.md, v30).
__device__ __forceinline__ bool q_rows_fit(const Params& prm, int q_start, int q_len) {
  return q_len <= q_tokens(prm) - q_start;
}

// Workspace slot of (token, head) row `gr` of a request (q_start: its first token) for its split
// `split`, or -1 for a padding row past `rows`.
// kBalanced (BALANCED_SPLITS): each pool CTA has max_q_len * H rows of slots, so a request may
// have any number of splits; the combine step finds them from the same pool (pool_span_of_request). Otherwise:
// num_splits slots a row, row by row.
template <bool kBalanced>
__device__ __forceinline__ int64_t partial_slot(const Params& prm, int q_start, int rows, int gr, int split) {
  if (gr >= rows) return -1;
  if (kBalanced) return static_cast<int64_t>(pool_cta()) * prm.max_q_len * prm.heads + gr;
  // row (q_start + gr / H) * H + gr % H of the [T * H] rows, i.e. q_start * H + gr: no division
  return (static_cast<int64_t>(q_start) * prm.heads + gr) * prm.num_splits + split;
}
// Without a pool (partial_slot<false>) a request's slots go row by row from q_start x H, and the
// workspace holds batch x max_q_len x H rows of them (>= T x H). A request that would pass them
// (a qo_indptr past T, a broken contract: the combine step writes NaN for its tokens) computes
// nothing: its kernel takes rows x this. Written so that nothing wraps for q_len >= 0 (a sum
// q_start + q_len would, for garbage values); for q_len < 0 request_rows is 0 and this does not
// matter. (v26 first bounded each slot in partial_slot: 1.4% slower at q16 h8 16k on the H200,
// in one process against this form; this form keeps the sm_120a loop v25's. NOTES.md session 27.)
__device__ __forceinline__ bool unpooled_slots_fit(const Params& prm, int q_start, int q_len) {
  return q_start <= prm.batch * prm.max_q_len - min(q_len, prm.max_q_len);
}

// Loads that ptxas keeps apart from the kernel's own loads of the same words (asm volatile):
// request_reads_fit's. With plain loads ptxas kept the indptrs it had read for the check live
// into the main loop, and the batched 64-row kernel spilled 52 bytes on sm_90 (v31).
__device__ __forceinline__ int load_apart(const int32_t* p) {
  int v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int64_t load_apart(const int64_t* p) {
  int64_t v;
  asm volatile("ld.global.s64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}
// index[i] of an int32 or int64 index tensor, loaded apart as above, and only where `issue`
// holds (0 elsewhere): predicated, not branched around, so that it is in flight beside the loads
// before it.
__device__ __forceinline__ int64_t load_index_apart_if(const void* index, int64_t i, int is64, bool issue) {
  int64_t v64 = 0;
  int v32 = 0;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.b32 p, %4, 0;\n setp.ne.and.b32 q, %5, 0, p;\n"
               " @q ld.global.s64 %0, [%2];\n setp.eq.and.b32 q, %5, 0, p;\n @q ld.global.s32 %1, [%3];\n}\n"
               : "+l"(v64), "+r"(v32)
               : "l"(static_cast<const int64_t*>(index) + i), "l"(static_cast<const int32_t*>(index) + i),
                 "r"(static_cast<int>(issue)), "r"(is64));
  return is64 ? v64 : v32;
}
// Whether request b's reads stay inside kv_indices and custom_mask (v31; before, a kv_indptr past
// len(kv_indices), a negative kv_indptr in the unpooled layouts, or a mask_indptr past the mask
// was read out of bounds). Its prefix indices are kv_indices[kv_indptr[b], kv_indptr[b + 1]); its
// mask, SGLang's layout, q_rows rows of num_keys bytes from mask_indptr[b], of which the kernels
// read the draft keys' bytes. From the indptrs alone: q_len wraps as request_q_len's does, and the
// mask's test is in 64 bits, where nothing wraps (q_rows * num_keys stays below 2^37 in
// magnitude). Both kv_indptr entries must be >= 0: then the kernels' 32-bit prefix_len cannot
// wrap (kv_indptr [1, INT_MIN] passed kv0 >= 0 and kv1 <= len, and wrapped it to INT_MAX: found
// by a review in session 47), and wherever the kernels read the mask, their num_keys is this
// one; the launcher caps kv_indices_len at 2^30, so that num_keys + a split count cannot wrap.
// kMaskBeside: mask_indptr[b] loaded predicated, in flight beside the kv_indptr loads; else under
// the mask's branch, after compares that wait on them, one L2 round trip later (+0.33 us at q16
// h8 4k with a mask). The batched 64-row kernel takes the branch: with the predicated load its
// loop ran 1.0-1.1% slower at b32 q16 16k (ab.py, session 47), and there a round trip is 0.05%.
template <bool kMaskBeside = true>
__device__ __forceinline__ bool request_reads_fit(const Params& prm, const Bounds& bounds, int b, int q_len) {
  const int kv0 = load_apart(prm.kv_indptr + b), kv1 = load_apart(prm.kv_indptr + b + 1);
  int64_t mask_start = 0;
  if (kMaskBeside)
    mask_start = load_index_apart_if(prm.mask_indptr, b, prm.mask_indptr_64, prm.custom_mask != nullptr);
  else if (prm.custom_mask)
    mask_start = prm.mask_indptr_64 ? load_apart(static_cast<const int64_t*>(prm.mask_indptr) + b)
                                    : load_apart(static_cast<const int32_t*>(prm.mask_indptr) + b);
  const int64_t num_keys = int64_t(kv1) - kv0 + (prm.k_extend ? q_len : 0);
  const int q_rows = max(min(q_len, prm.max_q_len), 0);
  return (kv0 | kv1) >= 0 && kv1 <= bounds.kv_indices_len &&
         (!prm.custom_mask || (mask_start >= 0 && mask_start <= bounds.mask_len - q_rows * num_keys));
}
// A broken batch that the layout cannot keep apart (v29): every CTA gives the LSE slots of its
// rows +inf and computes nothing, so every combine row that reads them weighs its splits by
// exp2(inf - inf): NaN, in its output and its lse. Pooled: past kPoolScanMax requests (and in
// the POOL_MIN_MAX=0 build at any batch), an indptr that decreases (request_of_cta); the pool
// CTA's max_q_len x H slots, all of them, since its request's span may be any. Unpooled: a
// decreasing qo_indptr in a batch (qo_indptr_decreases), where two requests' tokens share
// slots; the request's own rows, as it would write them (the others' CTAs write the rest, with
// the same +inf). The CTA's rows are row0 .. row0 + cta_rows - 1, one thread each.
template <bool kPooled>
__device__ __forceinline__ void poison_broken_batch(const Params& prm, int q_start, int rows, int row0, int split,
                                                    int cta_rows) {
  if (static_cast<int>(threadIdx.x) < cta_rows) {
    const int64_t pi = partial_slot<kPooled>(prm, q_start, kPooled ? prm.max_q_len * prm.heads : rows,
                                             row0 + static_cast<int>(threadIdx.x), split);
    if (pi >= 0) prm.ws_lse[pi] = INFINITY;
  }
}
// Whether qo_indptr decreases anywhere in the batch: the unpooled layouts' check (the 64-row
// kernel's batches on sm_80-89, BALANCED_SPLITS=0). Their slots go row by row from each
// request's first token, so two requests whose tokens overlap write the same slots, which no
// request sees alone. The pools see it in their own searches. Each warp walks the batch on its
// own: a block-wide walk (__syncthreads_or) made ptxas spill 72 bytes in sm_86's batched
// 64-row kernel, reloaded in its main loop (NOTES.md session 28).
__device__ __forceinline__ bool qo_indptr_decreases(const Params& prm) {
  const int lane = threadIdx.x & 31;
  bool decreases = false;
  for (int r0 = 1; r0 <= prm.batch; r0 += 32) {
    const int r = r0 + lane;
    decreases |= __any_sync(0xffffffffu, r <= prm.batch && prm.qo_indptr[r] < prm.qo_indptr[r - 1]);
  }
  return decreases;
}

// The split's slice of kv_indices (a few KB) to L2 up front: each index load of the gather then
// waits on an L2 hit rather than an HBM miss. `threads` threads of the CTA share the lines.
__device__ __forceinline__ void prefetch_index_slice(const Params& prm, int64_t kv_start, int key_begin,
                                                     int prefix_keys, int tid, int threads) {
  const int elem = prm.kv_indices_64 ? 8 : 4;
  const char* first = static_cast<const char*>(prm.kv_indices) + (kv_start + key_begin) * elem;
  for (int64_t off = int64_t(tid) * 128; off < int64_t(prefix_keys) * elem; off += int64_t(threads) * 128)
    prefetch_l2(first + off);
}

// One warp's O (fp32, 128 columns of MT m16 tiles: 32 rows, or 16 in the decode build): rows g
// and g+8 of m16 tile `mt` times a0 and a1, skipped when every factor in the warp is 1
// (warp-uniform; the lazy rescale makes that the usual case).
template <int MT>
__device__ __forceinline__ void rescale_o(float (&o)[MT][kVColsPerWarp / 8][4], int mt, float a0, float a1) {
  if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
    for (int nt = 0; nt < kVColsPerWarp / 8; ++nt) {
      o[mt][nt][0] *= a0; o[mt][nt][1] *= a0;
      o[mt][nt][2] *= a1; o[mt][nt][3] *= a1;
    }
  }
}

// O += P . V over 16 keys and one warp's 128 columns: pa holds P of the MT m16 tiles (A operand),
// vbase is this lane's ldmatrix.trans address of the 16 key rows at the warp's first column.
// Each V fragment serves every m16 tile (MT: 2, or 1 in the split kernel's decode build).
// One column pair `np` of that (16 columns): one V fragment, 2 * MT mma.sync.
template <int MT>
__device__ __forceinline__ void pv_column_pair(float (&o)[MT][kVColsPerWarp / 8][4], const uint32_t (&pa)[MT][4],
                                               const __nv_bfloat16* vbase, int np) {
  uint32_t vb[4];
  ldmatrix_x4_trans(vb, vbase + np * 16);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mma_16816(o[mt][2 * np], pa[mt], vb[0], vb[1]);
    mma_16816(o[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
  }
}
template <int MT>
__device__ __forceinline__ void pv_16_keys(float (&o)[MT][kVColsPerWarp / 8][4], const uint32_t (&pa)[MT][4],
                                           const __nv_bfloat16* vbase) {
#pragma unroll
  for (int np = 0; np < kVColsPerWarp / 16; ++np) pv_column_pair(o, pa, vbase, np);
}

// DECODE_ROWS_AS_N: one warp's O^T (fp32, its 128 columns x 8 rows). o[cp] is the m16n8 tile of
// columns 16 cp .. +16: columns g and g+8, rows 2 t4 and 2 t4+1. A row's rescale is a column of
// that tile: a0 scales row 2 t4, a1 row 2 t4+1 (skipped as in rescale_o).
__device__ __forceinline__ void rescale_o_rows_as_n(float (&o)[kVColsPerWarp / 16][4], float a0, float a1) {
  if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
    for (int cp = 0; cp < kVColsPerWarp / 16; ++cp) {
      o[cp][0] *= a0; o[cp][1] *= a1;
      o[cp][2] *= a0; o[cp][3] *= a1;
    }
  }
}
// O^T += V^T . P^T over 16 keys: pb0, pb1 are P^T (the B operand: row g's keys 2 t4, +1 and 8 more
// on). vbase is this lane's ldmatrix.trans address in A order (columns as M, keys as K): lanes
// 0-7 keys 0-7 / columns 0-7, lanes 8-15 the same keys / columns 8-15, lanes 16-31 keys 8-15
// (pv_16_keys has the middle two the other way round, its B order). One mma.sync a column pair,
// where pv_column_pair runs two with half of each m16 tile padding.
__device__ __forceinline__ void pv_16_keys_rows_as_n(float (&o)[kVColsPerWarp / 16][4], uint32_t pb0, uint32_t pb1,
                                                     const __nv_bfloat16* vbase) {
#pragma unroll
  for (int cp = 0; cp < kVColsPerWarp / 16; ++cp) {
    uint32_t va[4];
    ldmatrix_x4_trans(va, vbase + cp * 16);
    mma_16816(o[cp], va, pb0, pb1);
  }
}

// Q fragments (the mma A operand) of MT * 16 rows from `first_row`, over the 144 dims of quarter
// `dim_part`; rows past `rows` are 0. They stay in registers for the whole split.
template <int MT>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[MT][kQkSteps][4], const Params& prm, int q_start,
                                                 int rows, int first_row, int dim_part, int g, int t4) {
  const int H = prm.heads;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int gr = first_row + mt * 16 + g + hi * 8;
      const uint32_t* qrow = nullptr;
      if (gr < rows)
        qrow = reinterpret_cast<const uint32_t*>(
            prm.q + (static_cast<int64_t>(q_start + gr / H) * H + gr % H) * kDimQK + dim_part * (kQkSteps * 16));
#pragma unroll
      for (int ks = 0; ks < kQkSteps; ++ks) {
        qf[mt][ks][hi] = qrow ? qrow[ks * 8 + t4] : 0u;          // dims 2*t4, +1
        qf[mt][ks][hi + 2] = qrow ? qrow[ks * 8 + 4 + t4] : 0u;  // dims 8 + 2*t4, +1
      }
    }
  }
}

// The same fragments through shared memory (SPLIT_Q_SMEM): this warp's kRows rows x 144 dims in
// 16-byte loads, all in flight at once, stored at `staged` (rows kKvRowStride apart), then read
// with ldmatrix. Rows past `rows` are 0. With ROWS_AS_N only qf[0][ks][0] and [2] are operands
// (row g's dims): the other two stay 0. A token's heads are consecutive rows of q, so row gr of
// the request is q row q_start * H + gr.
template <int MT, int kRows, bool ROWS_AS_N>
__device__ __forceinline__ void load_q_fragments_staged(uint32_t (&qf)[MT][kQkSteps][4], const Params& prm,
                                                        int q_start, int rows, int first_row, int dim_part, int lane,
                                                        __nv_bfloat16* staged) {
  constexpr int kPieces = kQkSteps * 2;                 // 16-byte pieces of a row's 144 dims: 18
  constexpr int kSteps = (kRows * kPieces + 31) / 32;   // 9 at 16 rows
  const __nv_bfloat16* q0 = prm.q + (static_cast<int64_t>(q_start) * prm.heads + first_row) * kDimQK +
                            dim_part * (kQkSteps * 16);
  __nv_bfloat16* s0 = staged + dim_part * (kQkSteps * 16);
  uint4 v[kSteps];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int p = lane + 32 * i, r = p / kPieces, c = p % kPieces;
    v[i] = make_uint4(0u, 0u, 0u, 0u);
    if (r < kRows && first_row + r < rows) v[i] = *reinterpret_cast<const uint4*>(q0 + r * kDimQK + c * 8);
  }
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int p = lane + 32 * i, r = p / kPieces, c = p % kPieces;
    if (r < kRows) *reinterpret_cast<uint4*>(s0 + r * kKvRowStride + c * 8) = v[i];
  }
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int ks = 0; ks < kQkSteps; ++ks) {
      if constexpr (ROWS_AS_N) {   // lanes 0-7 rows 0-7 at dims 0-7, lanes 8-15 the same rows at dims 8-15
        ldmatrix_x2(qf[mt][ks][0], qf[mt][ks][2], s0 + (lane & 7) * kKvRowStride + ks * 16 + ((lane >> 3) & 1) * 8);
        qf[mt][ks][1] = qf[mt][ks][3] = 0u;
      } else {   // the A operand: rows 0-7 / 8-15 at dims 0-7, then the same at dims 8-15
        ldmatrix_x4(qf[mt][ks], s0 + (mt * 16 + (lane & 15)) * kKvRowStride + ks * 16 + (lane >> 4) * 8);
      }
    }
}

// grid: (row tiles of max_q_len*heads, num_splits, batch); block: kThreads.
//
// handover_model.py states this schedule step by step and checks it for races and
// deadlocks on a CPU (tests/test_handover_model.py): keep the two in step.
// Pipeline for tile t (hand-over(t): the (t+1)-th cta_sync, after one for tile 0):
//   score warps: S = Q.K(t) -> softmax -> P(t) -> hand-over(t)
//   value warps: tile t+1 landed -> hand-over(t) -> O += P.V(t)
//                -> (all value warps done) refill that stage with tile t+stages
// so the score warps work on tile t+1 while the value warps multiply tile t.
// MT: the m16 row tiles a CTA computes. 2 (its 32 rows), or 1 where the launcher knows that no
// CTA has more than 16 rows (max_q_len * heads <= 16: decode at up to 16 heads), so the other
// tile is all padding (DECODE_ONE_MTILE; see there).
// ROWS_AS_N: the rows are the mma's N and the keys (QK) or output columns (P.V) its M, where no
// CTA has more than 8 rows (DECODE_ROWS_AS_N; see there). One m16 tile's registers and buffers.
template <int KEYS, int MT = 2, bool ROWS_AS_N = false>
__global__ void __launch_bounds__(kThreads, 1) mla_verify_split_kernel(const Params prm, const Bounds bounds) {
  static_assert(MT == 1 || MT == 2, "MT: one or two m16 row tiles");
  static_assert(!ROWS_AS_N || MT == 1, "ROWS_AS_N: at most 8 rows, within one m16 tile's buffers");
  constexpr int kComputedRows = ROWS_AS_N ? 8 : MT * 16;   // rows past it are padding
  using Cfg = TileConfig<KEYS>;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  typename Cfg::Shared& sm = *reinterpret_cast<typename Cfg::Shared*>(smem_raw);
  timeline_stamp(0, kEvEntry);
  launch_dependents();

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragment coordinates
  const SplitOf work = split_of_cta(prm, pool_cta());
  pool_trace_cta(work);
  const int b = work.request, split = work.split;
  const int H = prm.heads;

  const int q_start = prm.qo_indptr[b];
  const int q_len = request_q_len(prm, b, q_start);
  const int row0 = blockIdx.x * kRowsPerCta;       // first (token*H + head) row of this CTA
  const bool reads_fit = request_reads_fit(prm, bounds, b, q_len);   // tested with the broken batches, below
  const int rows = request_rows(prm, q_start, q_len) *
                   ((BALANCED_SPLITS || unpooled_slots_fit(prm, q_start, q_len)) && q_rows_fit(prm, q_start, q_len));
  // a broken batch (poison_broken_batch): the pool's count says so; the unpooled batches look;
  // and a request whose reads would leave kv_indices or the mask (v31) poisons its slots alike
  if (!reads_fit || (BALANCED_SPLITS ? work.count == kBrokenBatch : rows > row0 && qo_indptr_decreases(prm))) {
    poison_broken_batch<BALANCED_SPLITS>(prm, q_start, rows, row0, split, kRowsPerCta);
    timeline_stamp(0, kEvExit);
    return;
  }
  if (row0 >= rows || split >= work.count) {       // request shorter than max_q_len; a spare CTA
    timeline_stamp(0, kEvExit);
    return;
  }

  const int64_t kv_start = prm.kv_indptr[b];
  const int prefix_len = prm.kv_indptr[b + 1] - static_cast<int>(kv_start);
  timeline_stamp_after(0, kEvIndptr, prefix_len);
  const int num_keys = prefix_len + (prm.k_extend ? q_len : 0);
  const int draft0 = num_keys - q_len;             // first draft key; before it all is visible

  // This split's key range: equal chunks, whole tiles, never below kMinKeysPerSplit.
  int chunk = (num_keys + work.count - 1) / work.count;
  chunk = max(kMinKeysPerSplit, (chunk + KEYS - 1) / KEYS * KEYS);
  const int key_begin = split * chunk;
  const int key_end = min(num_keys, key_begin + chunk);
  const int num_tiles = key_begin < key_end ? (key_end - key_begin + KEYS - 1) / KEYS : 0;

  // The key tile that loop step t works on (TILE_STAGGER); the ring slot stays t's.
  const int tile_rot = TILE_STAGGER > 0 && num_tiles > 0 ? int(blockIdx.x) * TILE_STAGGER % num_tiles : 0;
  auto key_tile = [&](int t) {
    const int kt = t + tile_rot;
    return kt >= num_tiles && t < num_tiles ? kt - num_tiles : kt;
  };

  auto partial_index = [&](int r) {  // workspace slot of local row r, or -1 for padding
    return partial_slot<BALANCED_SPLITS>(prm, q_start, rows, row0 + r, split);
  };

  if (num_tiles == 0) {  // empty split: the combine step gives it zero weight
    if (tid < kRowsPerCta) {
      const int64_t pi = partial_index(tid);
      if (pi >= 0) prm.ws_lse[pi] = -INFINITY;
    }
    timeline_stamp(0, kEvExit);
    return;
  }

  prefetch_index_slice(prm, kv_start, key_begin, max(0, min(key_end, prefix_len) - key_begin), tid, kThreads);

  // Gather: kLoadThreadsPerKey threads per key row, 16 B each per step. A row reference is
  // a pool row (>= 0), a k_extend row (-2 - r), or nothing (-1: zero-fill past key_end).
  // The kv_indices a tile needs are copied to shared memory (cp.async, in the same groups
  // as the rows) kIndexAhead tiles before the tile's own copy, and each tile's rows are
  // pulled into L2 kPrefetchAhead tiles before it: no load result is ever waited on in a
  // register.
  // A tile's index is staged in the cp.async group of iteration (tile - kIndexAhead), and
  // iteration i has waited for groups <= i + 1. The L2 prefetch of tile X reads its index at
  // iteration X - kStages - kPrefetchAhead, hence kIndexAhead >= kStages + kPrefetchAhead - 1;
  // a slot is rewritten only after its last reader (the tile's own copy): ring > ahead.
  constexpr int kIndexAhead = kStages + kPrefetchAhead - 1 > kStages ? kStages + kPrefetchAhead - 1 : kStages;
  constexpr int kRefillLag = LATE_REFILL && kStages >= 3 ? 1 : 0;   // see LATE_REFILL (16-key tiles only)
  static_assert(kPrefetchAhead >= 0 && kIndexAhead + 1 <= kIndexRing, "index ring too small for PREFETCH_AHEAD");
  const int gtid = tid % kGroupThreads;   // thread index within its warp group
  const int ld_key = gtid / Cfg::kLoadThreadsPerKey, ld_part = gtid % Cfg::kLoadThreadsPerKey;
  const int prefix_end = min(key_end, prefix_len);   // keys below it come through kv_indices
  auto tile_key = [&](int tile) { return key_begin + key_tile(tile) * KEYS + ld_key; };
  // This thread's key row of a tile: a pool row, a k_extend row, or nullptr past key_end.
  auto row_of = [&](int tile, bool staged) -> const __nv_bfloat16* {  // staged: index in sm.index
    const int key = tile_key(tile);
    if (tile >= num_tiles || key >= key_end) return nullptr;
    if (key >= prefix_len) return prm.k_extend + static_cast<int64_t>(q_start + key - prefix_len) * kDimQK;
    int64_t row;
    if (!staged) {
      row = load_index(prm.kv_indices, kv_start + key, prm.kv_indices_64);
    } else {
      const int64_t v = sm.index[tile % kIndexRing][ld_key];
      row = prm.kv_indices_64 ? v : static_cast<int64_t>(static_cast<int32_t>(v & 0xffffffff));
    }
    return prm.kv_pool + row * kDimQK;
  };
  // The refill's copies are predicated rather than branched around, as in the wide kernel
  // (v17e): one straight-line block. Here that times within 1.5% of the branchy version (v16e,
  // NOTES.md session 8): the value warps' refill waits on the load units taking the copies
  // (ncu: a long-scoreboard stall right after them), not on the address arithmetic.
  auto stage_index = [&](int tile, bool async) {  // one thread per key row
    const int key = tile_key(tile);
    const bool copy = ld_part == 0 && tile < num_tiles && key < prefix_end;
#ifdef ABLATE_NO_INDEX   // with ABLATE_NO_LOADS: what is left is the barriers and the loop itself
    if (async) return;
#endif
    stage_key_index(prm, &sm.index[tile % kIndexRing][ld_key], kv_start, key, copy, async);
  };
  // A refill's key row from its staged index (`live` false past key_end: the copies zero-fill).
  struct RowRef {
    const __nv_bfloat16* row;
    bool live;
  };
  auto staged_row = [&](int tile) {
    const int key = tile_key(tile);
    const bool live = tile < num_tiles && key < key_end;
    return RowRef{staged_key_row(prm, sm.index[tile % kIndexRing][ld_key], key, prefix_len, q_start, live), live};
  };
  // One base address and constant offsets per thread, so each cp.async is one instruction.
  // A missing row copies 0 bytes (zero-fill) from a valid address.
  // Steps [first, end) of the row's kLoadSteps copies (SPLIT_LOADS gives the score warps the upper ones).
  auto copy_row = [&](RowRef r, int stage, int first, int end) {
    const __nv_bfloat16* src = r.row + ld_part * 8;
    __nv_bfloat16* dst = &sm.kv[stage][ld_key * kKvRowStride + ld_part * 8];
#ifdef ABLATE_NO_LOADS
    return;
#endif
#pragma unroll
    for (int j = 0; j < Cfg::kLoadSteps; ++j) {
      const int step = Cfg::kLoadThreadsPerKey * 8 * j;
      if (j >= first && j < end)
        cp_async_16_if(dst + step, src + step, r.live, ld_part + Cfg::kLoadThreadsPerKey * j < kChunksPerKey);
    }
  };
  auto load_tile = [&](const __nv_bfloat16* row, int stage, int first, int end) {   // the prologue's rows
    copy_row(RowRef{row != nullptr ? row : prm.kv_pool, row != nullptr}, stage, first, end);
  };
  auto prefetch_rows = [&](const __nv_bfloat16* row) {   // the key row's 9 lines of 128 B
    if (row == nullptr) return;
#pragma unroll
    for (int j = 0; j * Cfg::kLoadThreadsPerKey < kDimQK * 2 / 128; ++j)
      if (ld_part + j * Cfg::kLoadThreadsPerKey < kDimQK * 2 / 128) prefetch_l2(row + (ld_part + j * Cfg::kLoadThreadsPerKey) * 64);
  };

  // The stage of tile `done` is free (no warp reads it again): refill it with the tile
  // `stages` beyond, stage the index of the tile kIndexAhead beyond that, and pull the rows
  // of the tile kPrefetchAhead beyond it into L2.
  constexpr bool kSplitLoads = SPLIT_LOADS && KEYS == 16;
  constexpr int kScoreFirstStep = kSplitLoads ? Cfg::kLoadSteps - Cfg::kLoadSteps * 4 / 9 : Cfg::kLoadSteps;
  auto refill = [&](int done) {
    const int next = done + kStages;
    copy_row(staged_row(next), done % kStages, 0, kScoreFirstStep);   // past the end: zero-fills a free stage
    stage_index(next + kIndexAhead, true);
    cp_async_commit();
    if (kPrefetchAhead > 0) prefetch_rows(row_of(next + kPrefetchAhead, true));
  };

  // EARLY_REFILL: this value warp's part of the refill of the stage of tile `done`, right after
  // its own P.V of it: its 128 V columns of the 16 key rows (lane: key lane/2, chunks 16*vwarp +
  // 2j + (lane&1) for j < 8, so that each copy instruction fills whole 32-byte sectors: a lane
  // pair's 32 contiguous bytes of each row) and one chunk of rope (thread: key gtid/8, chunk 64 +
  // gtid%8). The first build gave each lane 8 contiguous chunks instead, so every instruction
  // fetched half sectors, and decode was 1.6x slower (NOTES.md, session 15).
  constexpr bool kEarlyRefill = EARLY_REFILL && KEYS == 16;
  auto refill_own = [&](int done, int vwarp) {
    const int next = done + kStages;
    const int tile_key0 = key_begin + key_tile(next) * KEYS;
    __nv_bfloat16* stage = sm.kv[done % kStages];
    // key row k of the tile: `count` chunks from `chunk`, `step` chunks apart
    auto copy_chunks = [&](int k, int chunk, int count, int step) {
      const int key = tile_key0 + k;
      const bool live = next < num_tiles && key < key_end;
      const __nv_bfloat16* src = staged_key_row(prm, sm.index[next % kIndexRing][k], key, prefix_len, q_start, live);
#pragma unroll
      for (int j = 0; j < count; ++j)
        cp_async_16(stage + k * kKvRowStride + (chunk + j * step) * 8, src + (chunk + j * step) * 8, live);
    };
    __syncwarp();   // this warp's ldmatrix reads of its columns come before its lanes overwrite them
    copy_chunks(lane >> 1, (kVColsPerWarp / 8) * vwarp + (lane & 1), 8, 2);
    copy_chunks(gtid >> 3, kDimV / 8 + (gtid & 7), 1, 1);
    stage_index(next + kIndexAhead, true);
    cp_async_commit();
  };
  static_assert(!kEarlyRefill || (KEYS * 2 == 32 && (kDimQK - kDimV) / 8 * KEYS == kGroupThreads),
                "EARLY_REFILL: a lane pair a key row, a thread a rope chunk");

  // The score warps' share of the refill (SPLIT_LOADS): the same tile, the upper copies.
  auto score_refill = [&](int done) {
    const int next = done + kStages;
    copy_row(staged_row(next), done % kStages, kScoreFirstStep, Cfg::kLoadSteps);
    cp_async_commit();
  };

  if (warp < kScoreWarps) {
    // ---------------- score warps: S = Q.K^T over this warp's 144 dims, then softmax ----------------
    const int dim_part = warp;
    uint32_t qf[MT][kQkSteps][4];   // MT * 16 rows x 144 dims, for the whole split
    // SPLIT_Q_SMEM: through the first ring stage the prologue leaves free (see there)
    constexpr bool kQSmem = SPLIT_Q_SMEM && (kStages - Cfg::kEarlyStages) * KEYS >= kComputedRows;
    if constexpr (kQSmem)
      load_q_fragments_staged<MT, kComputedRows, ROWS_AS_N>(qf, prm, q_start, rows, row0, dim_part, lane,
                                                            sm.kv[Cfg::kEarlyStages]);
    else
      load_q_fragments(qf, prm, q_start, rows, row0, dim_part, g, t4);
    timeline_stamp(0, kEvQRequested);

    // Softmax layout: 4 threads per row, KEYS/4 keys each. The row's running max and sum
    // live in registers, identical in the row's 4 threads.
    constexpr int NK = Cfg::kSoftmaxKeys;
    const int sm_row = tid / kSoftmaxThreadsPerRow, sm_key = (tid % kSoftmaxThreadsPerRow) * NK;
    const int sm_gr = row0 + sm_row;
    const bool sm_row_valid = sm_gr < rows;
    const int sm_tok = sm_row_valid ? sm_gr / H : 0;  // query token within the request
    int64_t mask_row = 0;
    if (prm.custom_mask) mask_row = load_index(prm.mask_indptr, b, prm.mask_indptr_64) + int64_t(sm_tok) * num_keys;
    float m_run = -INFINITY, l_run = 0.f;

    // ldmatrix.x4 lane addresses of a 16-key x 16-dim block: the four 8x8 matrices in B order
    // (keys 0-7 / dims 0-7, 8-15, then keys 8-15), or with ROWS_AS_N in A order (keys 0-7 / dims
    // 0-7, keys 8-15 / dims 0-7, then dims 8-15), so that the fragment is the mma's operand as loaded.
    const int k_keys8 = ROWS_AS_N ? (lane >> 3) & 1 : (lane >> 4) & 1;
    const int k_dims8 = ROWS_AS_N ? (lane >> 4) & 1 : (lane >> 3) & 1;
    const __nv_bfloat16* klane = &sm.kv[0][0] + (lane & 7) * kKvRowStride + k_keys8 * 8 * kKvRowStride +
                                 dim_part * (kQkSteps * 16) + k_dims8 * 8;
#ifdef ABLATE_NO_SOFTMAX
    // No softmax writes row_scale: 1 keeps the value warps' O rescale skipped, as the lazy
    // rescale does in most rounds of the full kernel (uninitialised, it ran every round).
    if (tid < 2 * kRowsPerCta) (&sm.row_scale[0][0])[tid] = 1.f;
#endif
    cta_sync();   // tile 0 is in shared memory
    timeline_stamp(0, kEvTile0);
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int par = tile & 1;   // P and row_scale alternate buffers: P(t-1) is still being read

      // S partial = Q[MT * 16 rows, 144 dims] . K[KEYS keys, 144 dims]^T
      {
        // Two accumulator sets (even and odd k-steps) double the independent mma chains; with
        // one m16 tile, four sets keep as many chains (and registers) as two tiles do.
        constexpr int kQkSets = 4 / MT;
        float sacc[kQkSets][MT][Cfg::kQkNTiles][4] = {};
        const __nv_bfloat16* kbase = klane + (tile % kStages) * Cfg::kStageElems;
#ifndef ABLATE_NO_QK
#pragma unroll
        for (int ks = 0; ks < kQkSteps; ++ks) {
#pragma unroll
          for (int kg = 0; kg < KEYS / 16; ++kg) {
            uint32_t kb[4];   // lanes 16-31 address keys 8-15 of the group: n-tile 2kg+1 in kb[2], kb[3]
            ldmatrix_x4(kb, kbase + kg * 16 * kKvRowStride + ks * 16);   // (ROWS_AS_N: the A operand)
            if constexpr (ROWS_AS_N) {
              // S^T (keys g, g+8 x rows 2 t4, +1) = K (A) . Q^T (B: row g's dims, qf's first 8 rows)
              mma_16816(sacc[ks % kQkSets][0][kg], kb, qf[0][ks][0], qf[0][ks][2]);
            } else {
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                mma_16816(sacc[ks % kQkSets][mt][2 * kg], qf[mt][ks], kb[0], kb[1]);
                mma_16816(sacc[ks % kQkSets][mt][2 * kg + 1], qf[mt][ks], kb[2], kb[3]);
              }
            }
          }
        }
#endif
        if constexpr (ROWS_AS_N) {
#pragma unroll
          for (int kg = 0; kg < KEYS / 16; ++kg) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              v[i] = sacc[0][0][kg][i];
#pragma unroll
              for (int set = 1; set < kQkSets; ++set) v[i] += sacc[set][0][kg][i];
            }
            float* dst = &sm.s_part[dim_part][2 * t4][kg * 16 + g];
            dst[0] = v[0]; dst[KEYS] = v[1]; dst[8] = v[2]; dst[KEYS + 8] = v[3];
          }
        } else {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < Cfg::kQkNTiles; ++nt) {
              float* dst = &sm.s_part[dim_part][mt * 16 + g][nt * 8 + 2 * t4];
              float v[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                v[i] = sacc[0][mt][nt][i];
#pragma unroll
                for (int set = 1; set < kQkSets; ++set) v[i] += sacc[set][mt][nt][i];
              }
              *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
              *reinterpret_cast<float2*>(dst + 8 * KEYS) = make_float2(v[2], v[3]);
            }
        }
      }
#if GROUP_BARRIERS
      barrier_sync(kBarScore, kGroupThreads);
#else
      cta_sync();   // the mid-tile round: S partials written (value warps: before refill(tile - 1))
      if (kSplitLoads && tile > 0) score_refill(tile - 1);
#endif

      // Online softmax over this tile, in the log2 domain. With one m16 tile (MT == 1) the rows
      // from 16 on (from 8 on, ROWS_AS_N) are padding that no value warp reads: they skip it.
#ifndef ABLATE_NO_SOFTMAX
      if (sm_row < kComputedRows) {
        float sc[NK];
#pragma unroll
        for (int j = 0; j < NK; j += 4) {
          float4 acc = *reinterpret_cast<const float4*>(&sm.s_part[0][sm_row][sm_key + j]);
#pragma unroll
          for (int d = 1; d < kScoreWarps; ++d) {
            const float4 v = *reinterpret_cast<const float4*>(&sm.s_part[d][sm_row][sm_key + j]);
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
          }
          sc[j] = acc.x; sc[j + 1] = acc.y; sc[j + 2] = acc.z; sc[j + 3] = acc.w;
        }
        const int tile_key0 = key_begin + key_tile(tile) * KEYS;
        if (tile_key0 + KEYS <= min(key_end, draft0)) {   // uniform: a full tile of prefix keys
#pragma unroll
          for (int j = 0; j < NK; ++j) sc[j] = sm_row_valid ? sc[j] * prm.scale_log2 : -INFINITY;
        } else {
#pragma unroll
          for (int j = 0; j < NK; ++j) {
            const int key = tile_key0 + sm_key + j;
            bool visible = sm_row_valid && key < key_end;
            if (visible && key >= draft0)
              visible = prm.custom_mask ? prm.custom_mask[mask_row + key] != 0 : key - draft0 <= sm_tok;
            sc[j] = visible ? sc[j] * prm.scale_log2 : -INFINITY;
          }
        }
        float tile_max = sc[0];
#pragma unroll
        for (int j = 1; j < NK; ++j) tile_max = fmaxf(tile_max, sc[j]);
#pragma unroll
        for (int off = 1; off < kSoftmaxThreadsPerRow; off <<= 1)
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
        // Lazy rescaling: keep the running max unless this tile exceeds it by more than 2^8.
        // p then stays <= 256 (exact in bf16's range, fp32 sums stay far from overflow), the
        // result is unchanged, and most tiles skip the O rescale entirely.
        const float m_new = tile_max > m_run + kRescaleThreshold ? tile_max : m_run;
        // A row with nothing visible yet keeps max -inf: use 0 as the base so exp2 gives 0, not NaN.
        const float base = m_new == -INFINITY ? 0.f : m_new;
        float p[NK], psum = 0.f;
#pragma unroll
        for (int j = 0; j < NK; ++j) {
          p[j] = exp2f(sc[j] - base);
          psum += p[j];
        }
        __nv_bfloat16* prow = &sm.p[par][sm_row][sm_key];
#pragma unroll
        for (int j = 0; j < NK; j += 4) {
          const __nv_bfloat162 lo = __floats2bfloat162_rn(p[j], p[j + 1]);
          const __nv_bfloat162 hi = __floats2bfloat162_rn(p[j + 2], p[j + 3]);
          *reinterpret_cast<uint2*>(prow + j) =
              make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
        }
        const float alpha = exp2f(m_run - base);  // 0 when m_run is -inf, 1 when the max stays
        // Each thread sums its own keys; alpha is the same in the row's threads, so the row
        // sum is the sum of the threads' sums, reduced once after the last tile.
        l_run = l_run * alpha + psum;
        m_run = m_new;
        if (tid % kSoftmaxThreadsPerRow == 0) sm.row_scale[par][sm_row] = alpha;
      }
#endif
      // This thread's share of tile+1 (SPLIT_LOADS; its group g holds tile g + stages).
      if (kSplitLoads && tile + 1 < num_tiles) cp_async_wait<kStages - 2>();
      if (HANDOVER_SYNCWARP) __syncwarp();
      cta_sync();   // P(tile) ready; tile+1 in shared memory
      if (tile == 0) timeline_stamp(0, kEvTile1);
    }
    timeline_stamp(0, kEvLoopEnd);
    if (kSplitLoads) cp_async_wait<0>();
#pragma unroll
    for (int off = 1; off < kSoftmaxThreadsPerRow; off <<= 1) l_run += __shfl_xor_sync(0xffffffffu, l_run, off);
    if (tid % kSoftmaxThreadsPerRow == 0) {
      sm.row_max[sm_row] = m_run;
      sm.row_sum[sm_row] = l_run;
    }
    cta_sync();   // also: warp 0 reads every row's sums below
    if (tid < kRowsPerCta) {
      const int64_t pi = partial_index(tid);
      if (pi >= 0) {
        const float l = sm.row_sum[tid];
        prm.ws_lse[pi] = l > 0.f ? sm.row_max[tid] + log2f(l) : -INFINITY;
      }
    }
    return;
  }

  // ---------------- value warps: the gather into the ring, and O += P.V ----------------
  const int vwarp = warp - kScoreWarps;
  // Fill the ring and stage the indices of the next kIndexAhead tiles (STAGED_PROLOGUE: the
  // first tiles' indices too, all loaded at once), then hand tile 0 over once this thread's
  // copies of it have landed. Group k of this thread's cp.async groups holds tile k (and, from
  // the refills on, the index of tile k + kIndexAhead).
  // Stages [first, end) of the ring from their staged indices, one cp.async group each.
  auto copy_first_tiles = [&](int first, int end) {
    for (int s = first; s < end; ++s) {
      if (s < num_tiles) copy_row(staged_row(s), s, 0, Cfg::kLoadSteps);
      cp_async_commit();
    }
  };
  constexpr int kEarlyStages = Cfg::kEarlyStages;   // kStages with STAGED_PROLOGUE=0
#if STAGED_PROLOGUE
  static_assert(kStages + kIndexAhead <= kIndexRing, "STAGED_PROLOGUE: the first tiles' indices fill the ring");
#pragma unroll
  for (int i = 0; i < kStages + kIndexAhead; ++i) stage_index(i, false);
  __syncwarp();   // a key row's index is read by the 8 lanes of its warp that copy the row
  copy_first_tiles(0, kEarlyStages);
#else
  for (int s = 0; s < kStages; ++s) {
    if (s < num_tiles) load_tile(row_of(s, false), s, 0, Cfg::kLoadSteps);
    cp_async_commit();
  }
#pragma unroll
  for (int i = 0; i < kIndexAhead; ++i) stage_index(kStages + i, false);
  __syncwarp();   // a key row's index is read by the 8 lanes of its warp that copy the row
#endif
  timeline_stamp(0, kEvStaged, kGroupThreads);   // the first tiles' copies are issued, the next indices staged
  for (int i = 0; i < kPrefetchAhead; ++i) prefetch_rows(row_of(kStages + i, true));
  cp_async_wait<kEarlyStages - 1>();
  __syncwarp();
  cta_sync();   // tile 0 is in shared memory
  copy_first_tiles(kEarlyStages, kStages);   // the rest of the ring (PROLOGUE_EARLY_STAGES)

  float o[MT][kVColsPerWarp / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kVColsPerWarp / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
  float ot[kVColsPerWarp / 16][4];   // ROWS_AS_N: O^T (rescale_o_rows_as_n); o is then unused
#pragma unroll
  for (int cp = 0; cp < kVColsPerWarp / 16; ++cp)
#pragma unroll
    for (int i = 0; i < 4; ++i) ot[cp][i] = 0.f;

  const int pv_col0 = vwarp * kVColsPerWarp;
  // O = O * row_scale(tile) + P(tile) . V(tile), from the stage and the P buffer of `tile`.
  auto multiply = [&](int tile) {
    const int par = tile & 1;
    const __nv_bfloat16* kv = sm.kv[tile % kStages];
    if constexpr (ROWS_AS_N) {
      rescale_o_rows_as_n(ot, sm.row_scale[par][2 * t4], sm.row_scale[par][2 * t4 + 1]);
#ifndef ABLATE_NO_PV
#pragma unroll
      for (int kk = 0; kk < Cfg::kPvKSteps; ++kk) {
        uint32_t pb0, pb1;   // P^T: lanes 0-7 address rows 0-7 at keys 0-7, lanes 8-15 at keys 8-15
        ldmatrix_x2(pb0, pb1, &sm.p[par][lane & 7][kk * 16 + ((lane >> 3) & 1) * 8]);
        pv_16_keys_rows_as_n(ot, pb0, pb1, kv + (kk * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * kKvRowStride +
                                               pv_col0 + ((lane >> 3) & 1) * 8);
      }
#endif
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        rescale_o(o, mt, sm.row_scale[par][mt * 16 + g], sm.row_scale[par][mt * 16 + g + 8]);
      }
#ifndef ABLATE_NO_PV
#pragma unroll
      for (int kk = 0; kk < Cfg::kPvKSteps; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldmatrix_x4(pa[mt], &sm.p[par][mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][kk * 16 + ((lane >> 4) & 1) * 8]);
        pv_16_keys(o, pa, kv + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kKvRowStride + pv_col0 +
                              ((lane >> 4) & 1) * 8);
      }
#endif
    }
  };

  if constexpr (PV_LAG && kStages >= 3) {
    // Round t: [refill the stage of tile t-2] mid(t) [P.V(t-1), beside softmax(t)] hand-over(t).
    // Tile t-2's last reader was P.V(t-2), before hand-over(t-1). Committed groups after the
    // refill hold tiles up to t-2+stages, and hand-over t needs tile t+1: stages-3 may pend.
    for (int tile = 0; tile < num_tiles; ++tile) {
      if (tile >= 2) refill(tile - 2);
      cta_sync();   // the mid-tile round: S partials of tile written
      if (tile >= 1) multiply(tile - 1);
      if (tile + 1 < num_tiles) cp_async_wait<(kStages >= 3 ? kStages - 3 : 0)>();
      if (HANDOVER_SYNCWARP) __syncwarp();
      cta_sync();   // P(tile) is ready; tile+1 is in shared memory; P.V(tile-1) is done
    }
    multiply(num_tiles - 1);
  } else {
    for (int tile = 0; tile < num_tiles; ++tile) {
#if !GROUP_BARRIERS
      cta_sync();   // the mid-tile round: every value warp is done with tile - 1
      if (!kEarlyRefill && tile > 0) refill(tile - 1);
#endif
      // Hand tile+1 over and take P(tile): the score warps start on tile+1 while this group
      // multiplies tile. Cp.async group g holds tile g; committed so far: every group up to
      // stages+tile-1 (stages+tile-2 with the late refill, after tile 0).
      if (tile + 1 < num_tiles) cp_async_wait<kStages - 2 - kRefillLag>();
      // The cta_sync below also orders the staged indices (written by one lane's cp.async,
      // read by the 8 lanes of its key row) for the refill: the __syncwarp is not needed.
      if (HANDOVER_SYNCWARP) __syncwarp();
      cta_sync();  // P(tile) is ready; the score warps have tile+1
      if (kRefillLag && tile > 0) refill(tile - 1);
      multiply(tile);
      if (kEarlyRefill && tile + 1 < num_tiles) refill_own(tile, vwarp);   // as refill(tile) would, next round
      if (!kRefillLag && GROUP_BARRIERS) {
        barrier_sync(kBarValue, kGroupThreads);   // every value warp is done with this stage
        refill(tile);
      }
    }
  }
  cp_async_wait<0>();
  cta_sync();   // the score warps' final row sums are in smem

  // Normalised partial output of each row of this split.
  auto inv_sum = [&](int r) {
    const float l = sm.row_sum[r];
    return l > 0.f ? 1.f / l : 0.f;
  };
  if constexpr (kSplitBf16Partials) {
    // bf16 rows through the ring (every warp is done with it: the cta_sync above), then whole
    // rows (1 KB, 64 pieces of 16 B) stored by the value warps' 128 threads.
    static_assert(kComputedRows * kOutRowStride <= kStages * Cfg::kStageElems, "staged partial rows fit the ring");
    __nv_bfloat16* staged = &sm.kv[0][0];
    if constexpr (ROWS_AS_N) {
      // ot[cp] holds columns g and g+8 of rows 2 t4, +1. Lanes g and g^1 (lane ^ 4) swap one value,
      // so that each packs two adjacent columns: an even g columns g, g+1; an odd g columns g+7, g+8.
      const bool even = (g & 1) == 0;
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int r = 2 * t4 + hi;
        const float inv = inv_sum(r);
        __nv_bfloat16* dst = staged + r * kOutRowStride + pv_col0 + (even ? g : g + 7);
#pragma unroll
        for (int cp = 0; cp < kVColsPerWarp / 16; ++cp) {
          const float lo = ot[cp][hi] * inv, up = ot[cp][2 + hi] * inv;
          const float theirs = __shfl_xor_sync(0xffffffffu, even ? up : lo, 4);
          *reinterpret_cast<uint32_t*>(dst + cp * 16) = even ? pack_bf16(lo, theirs) : pack_bf16(theirs, up);
        }
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int r = mt * 16 + g + hi * 8;
          const float inv = inv_sum(r);
          __nv_bfloat16* dst = staged + r * kOutRowStride + pv_col0 + 2 * t4;
#pragma unroll
          for (int nt = 0; nt < kVColsPerWarp / 8; ++nt)
            *reinterpret_cast<uint32_t*>(dst + nt * 8) = pack_bf16(o[mt][nt][2 * hi] * inv, o[mt][nt][2 * hi + 1] * inv);
        }
      }
    }
    barrier_sync(kBarValue, kGroupThreads);   // the staged rows are in (the score warps have left)
    constexpr int kPiecesPerRow = kDimV * 2 / 16;                 // 64
    constexpr int kRowsPerStep = kGroupThreads / kPiecesPerRow;   // 2
    const int piece = gtid % kPiecesPerRow;
#pragma unroll
    for (int r = gtid / kPiecesPerRow; r < kComputedRows; r += kRowsPerStep) {
      const int64_t pi = partial_index(r);
      if (pi >= 0)
        reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(prm.ws_o) + pi * kDimV)[piece] =
            *reinterpret_cast<const uint4*>(staged + r * kOutRowStride + piece * 8);
    }
  } else if constexpr (ROWS_AS_N) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {   // rows 2 t4 and 2 t4+1; a warp's store fills 32-byte sectors
      const int r = 2 * t4 + hi;
      const int64_t pi = partial_index(r);
      if (pi < 0) continue;
      const float inv = inv_sum(r);
      float* dst = prm.ws_o + pi * kDimV + pv_col0 + g;
#pragma unroll
      for (int cp = 0; cp < kVColsPerWarp / 16; ++cp) {
        dst[cp * 16] = ot[cp][hi] * inv;
        dst[cp * 16 + 8] = ot[cp][2 + hi] * inv;
      }
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int r = mt * 16 + g + hi * 8;
        const int64_t pi = partial_index(r);
        if (pi < 0) continue;
        const float inv = inv_sum(r);
        float* dst = prm.ws_o + pi * kDimV + pv_col0 + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < kVColsPerWarp / 8; ++nt)
          *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[mt][nt][2 * hi] * inv, o[mt][nt][2 * hi + 1] * inv);
      }
    }
  }
  timeline_stamp(0, kEvExit, kGroupThreads);   // the first value warp's partials are stored
}

// The combine step. A CTA merges one row's splits for a slice of its 512 columns: kGroups
// groups of threads each sum every kGroups-th split, then the groups' sums are added in shared
// memory. With kGroups == 1 a CTA holds a whole row (4 columns a thread) and walks its splits in
// order, which is all a row with few splits needs. With many splits that one walk is the
// bottleneck: at q16 h8 64k (128 rows x 66 splits, 17 MB of fp32 partials) it took 18 us under
// ncu, 4 warps an SM with one 16-byte load in flight per thread. kGroups == 16 spreads a row over
// 16 CTAs with every split's load in flight at once. The launcher picks kGroups from num_splits
// (combine_groups), a static shape, so a captured graph keeps its grid.
// kPreload (COMBINE_PRELOAD, v18f): each thread's partials (at most kMaxSplitsPerGroup) are loaded
// right after griddepcontrol.wait, beside the LSE pass, and held raw until the weights are in, so
// that the two round trips to L2 overlap (v18b: ~1.9 us for the LSE pass, then ~1.6 for the
// merge, in series). The held loads take registers: 64 (bf16) or 72 (fp32) a thread on sm_90 and
// 64-80 on sm_120a (kernel_resources.json), against 32-40 without. With v18c's 2,048 CTAs at q16 h8 that meant two waves
// (NOTES.md session 10), so the launcher uses it only where the grid stays within one wave, with
// fewer, wider CTAs where needed (kGroups == 8: 64 columns a CTA; v18f, session 11).
// kMaxSplitsPerGroup = 12 rather than 16 (v18h): at 16 the kernel took 96 registers on sm_120a,
// 5 CTAs an SM, and q16 h8's 1,024 CTAs (94 splits on 188 SMs, 12 a group) missed one wave there.
constexpr int kCombineThreads = 128;
#ifndef COMBINE_PRELOAD
#define COMBINE_PRELOAD 1
#endif
// COMBINE_POOL_GROUPS (v20, host side only: mla_verify.cu's launch_combine_for): without the
// preload, split groups for the most splits a pooled batch may give one row, not num_splits.
#ifndef COMBINE_POOL_GROUPS
#define COMBINE_POOL_GROUPS 1
#endif
constexpr int kMaxSplitsPerGroup = 12;   // kPreload: a group's splits held in registers, at most

// A full warp's max and sum, every lane getting the result (the combine step's LSE passes).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <int kGroups, bool kBf16Partials = false, bool kPreload = false>
__global__ void __launch_bounds__(kCombineThreads) mla_verify_combine_kernel(const Params prm) {
  constexpr int kVecs = kCombineThreads / kGroups;   // float4 columns per CTA: 128, 32, 16 or 8
  constexpr int kCols = kVecs * 4;                   // 512, 128, 64 or 32 (grid.y = kDimV / kCols)
  static_assert(kCols * kGroups == kDimV, "a row's columns are covered by kGroups slices");
  static_assert(!kPreload || kMaxSplits <= 32 * 4, "kPreload: the LSE pass holds 4 LSEs a lane");
  __shared__ float weight[kMaxSplits];
  __shared__ float4 group_sum[kGroups > 1 ? kGroups : 1][kVecs];
  __shared__ float total[2];
  timeline_stamp(1, kEvEntry);
  const int64_t row = blockIdx.x;
  const int col0 = blockIdx.y * kCols;
  const int tid = threadIdx.x, lane = tid & 31;
  const int vec = tid % kVecs, group = tid / kVecs;
  __nv_bfloat16* dst = prm.out + row * kDimV + col0 + vec * 4;
  auto store = [&](float4 v) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(v.z, v.w);
  };
  // Rows the attention kernel never wrote: tokens past the last request (CUDA-graph padding)
  // get 0 and lse -inf. Tokens of a broken contract get NaN, so it shows: past max_q_len within
  // their request, before the first request, in a request that request_rows did not compute
  // (its tokens leave [0, T)) or whose prefix is negative, or whose pool span left the workspace
  // or is empty (a decreasing qo_indptr: see pool_span_min_max). The test is uniform across the CTA.
  // A broken batch that the layout cannot keep apart gives NaN further down: its LSE slots hold
  // +inf (poison_broken_batch), as do a request's whose reads would leave kv_indices or the mask
  // (request_reads_fit, v31).
  const int64_t token = row / prm.heads;
  int request = 0;   // the request holding token: last b with qo_indptr[b] <= token
  int unwritten = token >= prm.qo_indptr[prm.batch] ? 1 : 0;
  if (!unwritten) {
    int hi = prm.batch - 1;
    while (request < hi) {
      const int mid = (request + hi + 1) >> 1;
      if (prm.qo_indptr[mid] <= token) request = mid; else hi = mid - 1;
    }
    const int q0 = prm.qo_indptr[request], q1 = prm.qo_indptr[request + 1];
    const int num_tokens = gridDim.x / prm.heads;   // the grid's rows are q's T x H
    const bool computed = q0 <= token && token < q1 && token - q0 < prm.max_q_len &&
                          request_rows(prm, q0, q1 - q0) > 0 && q1 <= num_tokens &&
                          prm.kv_indptr[request] <= prm.kv_indptr[request + 1];
    unwritten = computed ? 0 : 2;
  }
  // This row's splits: S pool CTAs from span.first, each with max_q_len * H rows of slots, or
  // num_splits slots of the row itself (partial_slot). The indptrs are inputs, so they are read
  // before the wait. Block-wide, in a branch the whole CTA takes or skips.
  PoolSpan span{0, 0, 0};
  if (!unwritten) {
    span = pool_span_of_request<true>(prm, request);
    if (pooled<true>(prm) && (span.first < 0 || span.next <= span.first || span.next > prm.batch * prm.num_splits))
      unwritten = 2;
  }
  if (unwritten) {
    const float fill = unwritten == 1 ? 0.f : NAN;
    if (group == 0) store(make_float4(fill, fill, fill, fill));
    if (tid == 0 && blockIdx.y == 0) prm.lse[row] = unwritten == 1 ? -INFINITY : NAN;
    // These rows read nothing the attention kernel writes, but the grid must not end before it
    // does: attention CTAs may still write the workspace, which the next call reuses. Some row
    // waits in every call: row 0 (a request's, which waits below, unless the call is all
    // padding or broken), and the NaN rows of a broken call. Padding rows past row 0 do not.
    if (unwritten == 2 || blockIdx.x == 0) wait_for_prerequisite_grid();
    timeline_stamp(1, kEvExit);
    return;
  }
  const int first_split = span.first;
  const int S = min(span.next - first_split, kMaxSplits);
  pool_trace_row(row, first_split, S);
  const int64_t split_stride = pooled<true>(prm) ? static_cast<int64_t>(prm.max_q_len) * prm.heads : 1;
  const int64_t slot0 = pooled<true>(prm)
                            ? first_split * split_stride + (row - static_cast<int64_t>(prm.qo_indptr[request]) * prm.heads)
                            : row * prm.num_splits;
  wait_for_prerequisite_grid();   // the partials below are the attention kernel's
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t first = (slot0 * kDimV + col0) / 4 + vec;   // in 4-column vectors
  const int64_t stride = split_stride * (kDimV / 4);          // from one split's partial to the next
  // The launcher sized kGroups for num_splits; a request with more splits than the preload
  // holds (a long one beside short ones) takes the walk below.
  if (kPreload && S <= kGroups * kMaxSplitsPerGroup) {
    using Raw = typename std::conditional<kBf16Partials, uint2, float4>::type;   // 4 bf16 or 4 fp32
    const Raw* parts = reinterpret_cast<const Raw*>(prm.ws_o);
    // The LSE warp's own loads go first (v18d: loads queued ahead of them delayed the LSE pass),
    // then every thread's partials, none of them waited for until the weights are in.
    float lv[4];
    if (tid < 32) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        lv[j] = lane + 32 * j < S ? prm.ws_lse[slot0 + (lane + 32 * j) * split_stride] : -INFINITY;
    }
    Raw raw[kMaxSplitsPerGroup];
#pragma unroll
    for (int k = 0; k < kMaxSplitsPerGroup; ++k) {
      const int s = group + k * kGroups;
      if (s < S) raw[k] = parts[first + s * stride];
    }
    if (tid < 32) {
      float m = fmaxf(fmaxf(lv[0], lv[1]), fmaxf(lv[2], lv[3]));
      m = warp_max(m);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float w = m == -INFINITY ? 0.f : exp2f(lv[j] - m);   // 0 for splits with no keys
        if (lane + 32 * j < S) weight[lane + 32 * j] = w;
        sum += w;
      }
      sum = warp_sum(sum);
      if (lane == 0) { total[0] = m; total[1] = sum; }
    }
    __syncthreads();
    timeline_stamp(1, kEvStaged);   // the split weights are in shared memory
#pragma unroll
    for (int k = 0; k < kMaxSplitsPerGroup; ++k) {
      const int s = group + k * kGroups;
      if (s >= S) break;
      // a split with no keys never wrote its partial (it may hold NaN), so it is never multiplied
      const float w = weight[s];
      if (w != 0.f) {
        float4 v;
        if constexpr (kBf16Partials) {
          const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[k].x));
          const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[k].y));
          v = make_float4(lo.x, lo.y, hi.x, hi.y);
        } else {
          v = raw[k];
        }
        acc.x = fmaf(w, v.x, acc.x); acc.y = fmaf(w, v.y, acc.y);
        acc.z = fmaf(w, v.z, acc.z); acc.w = fmaf(w, v.w, acc.w);
      }
    }
  } else {
    if (tid < 32) {
      const float* lse = prm.ws_lse + slot0;
      float m = -INFINITY;
      for (int s = lane; s < S; s += 32) m = fmaxf(m, lse[s * split_stride]);
      m = warp_max(m);
      float sum = 0.f;
      for (int s = lane; s < S; s += 32) {
        const float w = m == -INFINITY ? 0.f : exp2f(lse[s * split_stride] - m);  // 0 for splits with no keys
        weight[s] = w;
        sum += w;
      }
      sum = warp_sum(sum);
      if (lane == 0) { total[0] = m; total[1] = sum; }
    }
    __syncthreads();
    timeline_stamp(1, kEvStaged);   // the split weights are in shared memory
#pragma unroll 4
    for (int s = group; s < S; s += kGroups) {
      // Loaded whatever the weight, so the loads of a thread's splits are in flight together;
      // a split with no keys never wrote its partial (it may hold NaN), so it is never multiplied.
      const int64_t at = first + s * stride;
      float4 v;
      if constexpr (kBf16Partials) {
        const uint2 raw = reinterpret_cast<const uint2*>(prm.ws_o)[at];   // 4 bf16
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        v = make_float4(lo.x, lo.y, hi.x, hi.y);
      } else {
        v = reinterpret_cast<const float4*>(prm.ws_o)[at];
      }
      const float w = weight[s];
      if (w != 0.f) {
        acc.x = fmaf(w, v.x, acc.x); acc.y = fmaf(w, v.y, acc.y);
        acc.z = fmaf(w, v.z, acc.z); acc.w = fmaf(w, v.w, acc.w);
      }
    }
  }
  if constexpr (kGroups > 1) {
    group_sum[group][vec] = acc;
    __syncthreads();
    if (group != 0) return;
#pragma unroll
    for (int k = 1; k < kGroups; ++k) {   // in group order: the same sum on every run
      const float4 v = group_sum[k][vec];
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
  }
  const float wsum = total[1];
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;   // NaN weights (a broken batch) leave acc NaN
  store(make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
  // -inf for no keys; NaN where a split's LSE was +inf (poison_broken_batch), as its output
  if (tid == 0 && blockIdx.y == 0) prm.lse[row] = wsum != 0.f ? (total[0] + log2f(wsum)) * 0.6931471805599453f : -INFINITY;
  timeline_stamp(1, kEvExit);
}

// Split groups of the combine step for num_splits splits: enough that each thread has a few
// splits' loads in flight, no more (with few splits, a row in one CTA wastes fewer threads).
__host__ __device__ constexpr int combine_groups(int num_splits) {
  return num_splits >= 32 ? 16 : num_splits >= 8 ? 4 : 1;
}
// With kPreload (COMBINE_PRELOAD): whether `groups` split groups suit num_splits splits, each
// group at least 2 of them and at most kMaxSplitsPerGroup.
__host__ __device__ constexpr bool preload_groups_fit(int groups, int num_splits) {
  return num_splits >= 2 * groups && (num_splits + groups - 1) / groups <= kMaxSplitsPerGroup;
}

}  // namespace sm120_mla
