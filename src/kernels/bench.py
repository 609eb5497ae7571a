"""Benchmark the sm120_mla kernel against the attention paths SGLang users have, in one run.

Every implementation is timed the way a serving step runs it: the call is captured in a
CUDA graph, each replay is timed with CUDA events after an L2 flush, and the median is
kept. The copy bandwidth and bf16 matmul rate are measured in the same run, so achieved
GB/s and the roofline use this GPU's own ceilings. So is the mma.sync rate (the only tensor
instruction the kernel may use, native on sm_120 but the legacy path on the H200): the
second roofline, `roofline_mma_us`, is the floor for sm_120 code timed on this GPU.

    python -m sm120_workbook.kernels.bench [--quick] [--out data/results/kernel_bench.jsonl]

Impls: sm120_mla (this kernel), triton_decode (SGLang's Triton decode, q_len 1),
triton_verify (SGLang's Triton extend kernel with a custom mask: the target-verify path),
flashmla (sgl_kernel's FlashMLA, page 64, causal) and flashinfer_mla (FlashInfer's choice for
the GPU: its Hopper kernel on the H200), where they run; flashinfer_mla_fa2 is FlashInfer's
mma.sync MLA kernel, the one it runs on sm_120.
An implementation that cannot run here is reported with its reason, never timed as zero.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import statistics
import sys
import traceback
from dataclasses import dataclass

import torch

from ..mla import DIM_QK, DIM_V, SM_SCALE
from ..results import add_record_args
from ..roofline import verify_cost
from .verify_attention import (CTA_ROWS, MAX_SPLITS, MlaVerifyWorkspace, kernel_available, mla_verify_attention,
                               tile_keys_of)

L2_FLUSH_BYTES = 256 << 20
# How L2 is emptied before each timing: by reading a buffer larger than any L2 (the H200's 50 MB, an
# RTX PRO 6000's 128 MB), which leaves clean lines behind. Writing it (zero_, until session 51) left
# dirty lines, whose write-back then landed inside the timed replay of any kernel that reads more
# than L2 holds: +6.6 us (21%) on the decode step at 64k keys on the H200, +6.7 us on a bare 75.5 MB
# read, nothing on the compute-bound q16 step (NOTES.md, session 51). Records carry it as `l2_flush`;
# those without the field were timed after a write. `--l2-flush write` (bench, targets) times after the
# old flush again, to set the two side by side (bench_report.targets_by_flush). "layer" is the read
# flush followed by the kernels a served MLA layer runs just before its attention (LayerPrelude):
# FlashMLA's time depends on the kernels before it, not only on L2 (session 52).
L2_FLUSHES = ("read", "write", "layer")   # the first is the default
L2_FLUSH = L2_FLUSHES[0]


class LayerPrelude:
    """What a served MLA layer runs between its input and its attention call, as one TP8 rank of
    Kimi K2 runs it for a 16-token verify step (8 heads), in bf16: the fused q/kv down-projection
    GEMM (7168 -> 1536 + 576, 30 MB of weights), the two RMSNorms, the q up-projection (1536 -> 8 x
    192), the absorb bmm (q_nope x w_kc, 8 x 128 x 512), RoPE-like elementwise products, and the KV
    write of the step's latent rows. Fixed at that size whatever shape is timed: it stands for the
    kinds of kernel that precede attention (GEMMs, a reduction, elementwise), not their exact cost,
    which lies outside the timed replay. K2's own weights are fp8 (other GEMM kernels): a proxy."""

    HIDDEN, Q_RANK, KV_RANK, ROPE, NOPE, HEADS, TOKENS = 7168, 1536, 512, 64, 128, 8, 16

    def __init__(self, device="cuda"):
        g = torch.Generator(device=device).manual_seed(0)
        bf16 = functools.partial(torch.randn, device=device, generator=g, dtype=torch.bfloat16)
        T, H = self.TOKENS, self.HEADS
        self.x = bf16(T, self.HIDDEN)
        self.w_qkv_a = bf16(self.HIDDEN, self.Q_RANK + self.KV_RANK + self.ROPE) * 0.01
        self.w_q_b = bf16(self.Q_RANK, H * (self.NOPE + self.ROPE)) * 0.03
        self.w_kc = bf16(H, self.NOPE, self.KV_RANK) * 0.1
        self.q_norm = torch.ones(self.Q_RANK, device=device, dtype=torch.bfloat16)
        self.kv_norm = torch.ones(self.KV_RANK, device=device, dtype=torch.bfloat16)
        self.cos, self.sin = bf16(T, 1, self.ROPE), bf16(T, 1, self.ROPE)
        self.kv_pool = torch.zeros(4 * T, DIM_QK, device=device, dtype=torch.bfloat16)
        self.slots = torch.arange(T, 2 * T, device=device)
        self.q_out = torch.empty(H, T, self.KV_RANK, device=device, dtype=torch.bfloat16)

    def __call__(self) -> None:
        T, H = self.TOKENS, self.HEADS
        qkv = self.x @ self.w_qkv_a
        q_a, kv_a, k_pe = qkv.split([self.Q_RANK, self.KV_RANK, self.ROPE], dim=-1)
        q_a = torch.nn.functional.rms_norm(q_a, (self.Q_RANK,), self.q_norm)
        kv_a = torch.nn.functional.rms_norm(kv_a, (self.KV_RANK,), self.kv_norm)
        q = (q_a @ self.w_q_b).view(T, H, self.NOPE + self.ROPE)
        q_nope, q_pe = q.split([self.NOPE, self.ROPE], dim=-1)
        torch.bmm(q_nope.transpose(0, 1), self.w_kc, out=self.q_out)
        q_pe = q_pe * self.cos + q_pe.flip(-1) * self.sin
        k_pe = k_pe.unsqueeze(1) * self.cos + k_pe.unsqueeze(1).flip(-1) * self.sin
        self.kv_pool.index_copy_(0, self.slots, torch.cat([kv_a, k_pe.squeeze(1)], dim=-1))


class L2Flush:
    """Empties L2 before a timing as `kind` says (default: L2_FLUSH when made). "read" reads
    L2_FLUSH_BYTES (a reduction into one value, so it also runs in a stream's order like the timed
    replay); "write" zeroes them, leaving dirty lines; "layer" reads them, then runs LayerPrelude.
    FlashMLA's batch-1 times depend on which: 8-24% higher after the read than after the write, and
    not through L2's lines (NOTES.md, session 52; data/results/probes/l2_flush_baselines.jsonl); as
    high after the layer flush as after the read (session 53)."""

    def __init__(self, kind: str | None = None, device="cuda"):
        self.kind = L2_FLUSH if kind is None else _l2_flush_kind(kind)
        self.buf = torch.zeros(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=device)
        self.sink = torch.empty((), dtype=torch.int64, device=device)
        self.prelude = LayerPrelude(device) if self.kind == "layer" else None
        # The layer flush is one graph launch: launched one by one, the prelude's dozen kernels took the
        # CPU longer than the GPU, so the timed replay's launch was no longer hidden behind the flush and
        # the events counted it (6-33 us more than after the read flush in session 53's first layer run).
        self.graph = (captured_graph(self._read)
                      if self.prelude is not None and torch.device(device).type == "cuda" else None)

    def _read(self) -> None:
        torch.sum(self.buf, dim=0, out=self.sink)
        if self.prelude is not None:
            self.prelude()

    def __call__(self) -> None:
        if self.kind == "write":
            self.buf.zero_()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self._read()


def _l2_flush_kind(kind: str) -> str:
    if kind not in L2_FLUSHES:
        raise ValueError(f"kind: {kind!r} is no L2 flush; one of {L2_FLUSHES}")
    return kind


def add_l2_flush_arg(ap) -> None:
    ap.add_argument("--l2-flush", choices=L2_FLUSHES, default=L2_FLUSHES[0],
                    help="how L2 is emptied before each timing (recorded as l2_flush): read (the default since "
                         "session 51), write (the flush before it, for a side-by-side) or layer (the read, then "
                         "the kernels a served MLA layer runs before attention: bench.LayerPrelude)")


def use_l2_flush(kind: str) -> None:
    """The flush every later timing of this process uses and records (L2_FLUSH)."""
    global L2_FLUSH
    L2_FLUSH = _l2_flush_kind(kind)


REF_TOLERANCE = 1e-2   # relative, as the kernel's own tests (checks.py): bf16 output and probabilities


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    q_len: int
    ctx: int       # committed context per request (prefix keys); the draft adds q_len keys
    # > 0: a skewed batch, request 0 at ctx and every other request at short_ctx (the split
    # kernel's balanced pool, BALANCED_SPLITS, is for such a batch)
    short_ctx: int = 0

    @property
    def contexts(self) -> list[int]:
        """Each request's committed context."""
        return [self.ctx] + [self.short_ctx or self.ctx] * (self.batch - 1)

    @property
    def keys(self) -> list[int]:
        """Each request's keys: its context and the step's own q_len tokens."""
        return [c + self.q_len for c in self.contexts]

    @property
    def label(self) -> str:
        """"b32 h16 q1 16k", and "+2k" for a skewed batch's other requests: the tables' shape column."""
        from ..service_charts import ctx_label

        skew = f"+{ctx_label(self.short_ctx)}" if self.short_ctx else ""
        return f"b{self.batch} h{self.heads} q{self.q_len} {ctx_label(self.ctx)}{skew}"


def int_in(least: int, most: int | None = None):
    """An argparse type: an int from `least` to `most` (None: no bound), refused when the flags
    are read, before any GPU check or build."""
    import argparse

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer, got {text!r}") from None
        if n < least or (most is not None and n > most):
            raise argparse.ArgumentTypeError(f"must be {least}..{most}, got {n}" if most is not None
                                             else f"must be at least {least}, got {n}")
        return n
    return parse


def add_shape_args(ap) -> None:
    """--batch, --heads, --q-len and --ctx for a one-shape tool (profile, phase_trace); the
    default is the workbook's headline shape, b1 h8 q16 at 64k. The bounds are the kernel's."""
    ap.add_argument("--batch", type=int_in(1), default=1)
    ap.add_argument("--heads", type=int_in(1, 128), default=8)
    ap.add_argument("--q-len", type=int_in(1, 16), default=16)
    ap.add_argument("--ctx", type=int_in(1), default=65536)


def shape_from_args(a) -> Shape:
    return Shape(a.batch, a.heads, a.q_len, a.ctx)


def parse_shape(text: str) -> Shape:
    """A `--shape` value, "batch,heads,q_len,ctx", as a Shape (every request at ctx): ab.py and
    splits.py take it."""
    try:
        batch, heads, q_len, ctx = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--shape: {text!r}; give batch,heads,q_len,ctx as four integers, e.g. 256,8,1,4096") from None
    if min(batch, heads, q_len, ctx) < 1 or q_len > 16 or heads > 128:
        raise ValueError(f"--shape: {text!r}; needs batch, heads, ctx >= 1, q_len 1-16 and heads <= 128")
    return Shape(batch, heads, q_len, ctx)


class Inputs:
    """One verify step's tensors, shared by every implementation (random, never zeros)."""

    def __init__(self, s: Shape, device="cuda", seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.shape = s
        T = s.batch * s.q_len
        ctxs = s.contexts
        self.keys = s.keys                          # per request, draft included
        self.q = torch.randn(T, s.heads, DIM_QK, device=device, generator=g).to(torch.bfloat16)
        # The pool holds every request's context and draft rows back to back (a sorted,
        # defragmented allocator); notebook 04 measures what scattering costs.
        self.pool = torch.randn(sum(self.keys), 1, DIM_QK, device=device, generator=g).to(torch.bfloat16)
        self.starts = [0, *itertools.accumulate(self.keys)][:-1]   # each request's first pool row
        ar = functools.partial(torch.arange, device=device, dtype=torch.int64)
        self.kv_indices_full = ar(sum(self.keys))
        self.prefix_indices = torch.cat([ar(st, st + c) for st, c in zip(self.starts, ctxs)])
        draft_rows = torch.cat([ar(st + c, st + c + s.q_len) for st, c in zip(self.starts, ctxs)])
        self.k_extend = self.pool[draft_rows].contiguous()             # the drafts' own KV

        def indptr(lens, dtype=torch.int32):
            return torch.tensor([0, *itertools.accumulate(lens)], device=device, dtype=dtype)

        self.qo_indptr = indptr([s.q_len] * s.batch)
        self.kv_indptr = indptr(ctxs)
        self.kv_indptr_full = indptr(self.keys)
        tri = torch.ones(s.q_len, s.q_len, dtype=torch.bool, device=device).tril()
        blocks = [torch.cat([torch.ones(s.q_len, c, dtype=torch.bool, device=device), tri], dim=1) for c in ctxs]
        self.custom_mask = torch.cat([b.reshape(-1) for b in blocks])
        self.mask_indptr = indptr([b.numel() for b in blocks], torch.int64)

    @property
    def kv_bytes(self) -> int:
        return sum(self.keys) * DIM_QK * 2


# Each builder returns a zero-argument callable that runs one step on preallocated buffers and
# returns its output [T, heads, 512] (check_against_reference reads it).

def build_sm120_mla(x: Inputs, num_splits: int | None = None, tile_keys: int | None = None,
                    kernel_defines: tuple[str, ...] = (), cta_rows: int | None = None, kernel_source=None,
                    custom_mask: bool = False):
    """custom_mask: pass SGLang's mask (the causal chain written out, as a tree verify passes its
    tree) instead of the implicit chain; verify shapes only."""
    s = x.shape
    if custom_mask and s.q_len == 1:
        raise ValueError("custom_mask: decode (q_len 1) takes no mask")
    T = s.batch * s.q_len
    out = torch.empty(T, s.heads, DIM_V, device=x.q.device, dtype=torch.bfloat16)
    lse = torch.empty(T, s.heads, device=x.q.device, dtype=torch.float32)
    ws = MlaVerifyWorkspace(T, s.heads, x.q.device, num_splits=num_splits, kernel_defines=kernel_defines,
                            cta_rows=cta_rows, kernel_source=kernel_source,
                            **({"tile_keys": tile_keys} if tile_keys else {}))
    if s.q_len == 1:   # decode: the token is already in the pool, no k_extend
        args = (x.q, x.pool, x.qo_indptr, x.kv_indptr_full, x.kv_indices_full)
        kw = {}
    else:
        args = (x.q, x.pool, x.qo_indptr, x.kv_indptr, x.prefix_indices)
        kw = {"k_extend": x.k_extend}
        if custom_mask:
            kw.update(custom_mask=x.custom_mask, mask_indptr=x.mask_indptr)
    fn = lambda: mla_verify_attention(*args, out=out, lse=lse, workspace=ws, sm_scale=SM_SCALE,
                                      max_q_len=s.q_len, **kw)
    fn.num_splits = ws.num_splits_for(s.batch, s.q_len)
    fn.tile_keys = ws.tile_keys
    fn.cta_rows = ws.cta_rows_for(s.batch, s.q_len)
    return fn


def build_triton_verify(x: Inputs):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    s = x.shape
    out = torch.empty(s.batch * s.q_len, s.heads, DIM_V, device=x.q.device, dtype=torch.bfloat16)
    ke = x.k_extend

    def fn():
        extend_attention_fwd(x.q, ke, ke[..., :DIM_V], out, x.pool, x.pool[..., :DIM_V], x.qo_indptr, x.kv_indptr,
                             x.prefix_indices, x.custom_mask, True, x.mask_indptr, s.q_len, 1.0, 1.0, SM_SCALE)
        return out
    return fn


TRITON_NUM_KV_SPLITS = 8   # SGLang's --triton-attention-num-kv-splits default


def triton_decode_cap(keys: list[int], sm_count: int) -> int:
    """max_kv_splits as SGLang 0.5.17's Triton backend sets it for an MLA model: the server
    default of 8 raised by `_mla_decode_kv_splits_cap` to the SM count's and the context's power
    of two (TritonAttnBackend.__init__; a server whose context length is this step's longest
    request). That is Triton's best case: a server launched with K2's 131,072-token context
    caps at 256 everywhere, 1.36-1.40x slower at 1k and 1.15-1.18x at 2k, the same from 4k
    (probes/triton_decode_cap.jsonl, session 56). Until session 22 the benchmark ran 8 splits without the MLA path, 1.7-18x slower
    than a server's decode at batch 1 (12x at 64k); those records load as
    `triton_decode_8splits` (bench_report)."""
    from sglang.srt.layers.attention.triton_backend import _mla_decode_kv_splits_cap

    return _mla_decode_kv_splits_cap(TRITON_NUM_KV_SPLITS, sm_count, max(keys))


def triton_decode_splits(heads: int, keys: list[int], sm_count: int, cap: int) -> list[int]:
    """Each request's split count, from SGLang's own `get_num_kv_splits_triton`, as its backend
    runs it before each decode step (one KV head: MLA)."""
    import triton
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    n = len(keys)
    splits = torch.empty(n, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(keys, dtype=torch.int32, device="cuda")
    get_num_kv_splits_triton[(1,)](splits, seq_lens, n, 1, heads, 1, cap, sm_count,
                                   MAX_NUM_SEQ=256 if n < 256 else triton.next_power_of_2(n))
    return splits.tolist()


def build_triton_decode(x: Inputs):
    from sglang.kernels.jit.utils.arch import is_arch_support_pdl
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    s = x.shape
    if s.q_len != 1:
        raise ValueError("triton_decode is the q_len 1 path")
    dev = x.q.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cap = triton_decode_cap(x.keys, sms)
    per_request = triton_decode_splits(s.heads, x.keys, sms, cap)
    out = torch.empty(s.batch, s.heads, DIM_V, device=dev, dtype=torch.bfloat16)
    logits = torch.empty(s.batch, s.heads, cap, DIM_V, device=dev, dtype=torch.float32)
    lse = torch.empty(s.batch, s.heads, cap, device=dev, dtype=torch.float32)
    splits = torch.tensor(per_request, device=dev, dtype=torch.int32)   # set before each step, outside its graph
    pdl = is_arch_support_pdl()

    def fn():
        decode_attention_fwd(x.q, x.pool, x.pool[..., :DIM_V], out, x.kv_indptr_full, x.kv_indices_full, logits,
                             lse, splits, cap, SM_SCALE, 1.0, 1.0, has_mla=True, use_pdl=pdl)
        return out
    fn.num_splits, fn.max_kv_splits = max(per_request), cap
    return fn


def build_flashmla(x: Inputs, page: int = 64):
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    s = x.shape
    dev = x.q.device
    blocks = -(-max(x.keys) // page)
    cache = torch.zeros(s.batch * blocks * page, 1, DIM_QK, device=dev, dtype=torch.bfloat16)
    for b, (start, keys) in enumerate(zip(x.starts, x.keys)):   # the pool's rows in 64-token pages
        cache[b * blocks * page:b * blocks * page + keys] = x.pool[start:start + keys]
    cache = cache.view(s.batch * blocks, page, 1, DIM_QK)
    table = torch.arange(s.batch * blocks, device=dev, dtype=torch.int32).view(s.batch, blocks)
    seqlens = torch.tensor(x.keys, device=dev, dtype=torch.int32)
    meta, splits = get_mla_metadata(seqlens, s.q_len * s.heads, 1)
    q = x.q.view(s.batch, s.q_len, s.heads, DIM_QK)
    return lambda: flash_mla_with_kvcache(q, cache, table, seqlens, DIM_V, meta, splits,
                                          softmax_scale=SM_SCALE, causal=True)[0].view(-1, s.heads, DIM_V)


def build_flashinfer_mla(x: Inputs, backend: str = "auto"):
    """FlashInfer's paged MLA. `auto` picks its Hopper kernel (fa3: wgmma, TMA) on the H200; on
    sm_120 (and sm_80-sm_89) it picks fa2, the mma.sync kernel an RTX PRO 6000 user gets, which
    `flashinfer_mla_fa2` times here (its first call JIT-compiles it)."""
    import flashinfer

    s = x.shape
    dev = x.q.device
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
    kv_lens = torch.tensor(x.keys, device=dev, dtype=torch.int32)
    # causal as SGLang's flashinfer_mla backend plans: False for decode, True for the drafts of a verify
    causal = s.q_len > 1
    wrapper.plan(x.qo_indptr, x.kv_indptr_full, x.kv_indices_full.to(torch.int32), kv_lens, s.heads,
                 DIM_V, DIM_QK - DIM_V, 1, causal, SM_SCALE, torch.bfloat16, torch.bfloat16)
    q_nope, q_pe = x.q[..., :DIM_V].contiguous(), x.q[..., DIM_V:].contiguous()
    ckv, kpe = x.pool[:, :, :DIM_V], x.pool[:, :, DIM_V:]
    out = torch.empty(s.batch * s.q_len, s.heads, DIM_V, device=dev, dtype=torch.bfloat16)

    def fn():
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
        return out
    return fn


def check_against_reference(impl: str, shape: Shape, **kw) -> float:
    """One step of `impl` at `shape` against the float64 reference (relative error of its
    output): a baseline called with wrong arguments would otherwise change only its speed.
    Every impl here sees the drafts as a causal chain after each request's prefix."""
    from ..reference import mla_verify_reference

    x = Inputs(shape, seed=1)
    out = BUILDERS[impl](x, **kw)().float()
    ref = mla_verify_reference(x.q, x.pool, x.qo_indptr, x.kv_indptr_full, x.kv_indices_full, SM_SCALE)
    return float((out.double() - ref).norm() / ref.norm())


BUILDERS = {
    "sm120_mla": build_sm120_mla,
    "triton_decode": build_triton_decode,
    "triton_verify": build_triton_verify,
    "flashmla": build_flashmla,
    "flashinfer_mla": build_flashinfer_mla,
    "flashinfer_mla_fa2": functools.partial(build_flashinfer_mla, backend="fa2"),
}


def replays(text: str) -> int:
    """The argparse type of every timing tool's --reps: graph replays a timing, at least 2 (each
    timing keeps their median and spread)."""
    import argparse

    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"at least 2 replays (a median and a spread), got {n}")
    return n


def captured_graph(fn, warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of fn, captured after `warmup` eager calls on a side stream (compiles, autotuning
    and library workspaces happen outside the capture), and replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_times_us(graph, before, reps: int) -> list[float]:
    """µs of `reps` replays of graph, each timed with CUDA events after `before()` (an L2 flush)
    runs outside the timed span."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        before()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def interleaved_medians_us(graph, befores: dict, rounds: int = 5, reps: int = 50) -> dict:
    """For each named `before` (a way of flushing L2, or of running other kernels first), the median
    over `rounds` of the median µs of `reps` replays of graph after it; the names' order alternates
    from round to round, so that drift within the process falls on each alike (the L2 probes in
    data/results/probes)."""
    per = {name: [] for name in befores}
    for r in range(rounds):
        for name in (list(befores) if r % 2 == 0 else list(befores)[::-1]):
            per[name].append(statistics.median(replay_times_us(graph, befores[name], reps)))
    return {name: statistics.median(v) for name, v in per.items()}


def time_graph_us(fn, reps: int = 50, warmup: int = 3) -> dict:
    """Median µs of CUDA-graph replays of fn, each after an L2 flush (L2Flush), timed with CUDA events."""
    if reps < 2:
        raise ValueError(f"reps: the median and spread of the replays need at least 2, got {reps}")
    flush = L2Flush()
    kind = flush.kind
    graph = captured_graph(fn, warmup)
    times = replay_times_us(graph, flush, reps)
    del graph, flush
    return {"time_us": statistics.median(times), "time_us_min": min(times),
            "time_us_iqr": statistics.quantiles(times, n=4)[2] - statistics.quantiles(times, n=4)[0],
            "reps": reps, "l2_flush": kind}


def nsplit_retime(x: Inputs, splits: int, cta_rows: int, tile_keys: int, auto_us: float, reps: int = 50) -> str:
    """One line of the NSPLIT explorer: the call at batch `x` with the split count, kernel and
    tile forced, timed as a serving step is (time_graph_us), against `auto_us`, the workspace's
    own choice; a schedule the workspace refuses is said in its words (its ValueError)."""
    try:
        fn = build_sm120_mla(x, num_splits=splits, tile_keys=tile_keys, cta_rows=cta_rows)
    except ValueError as e:
        return f"not a schedule the kernel has: {e}"
    t = time_graph_us(fn, reps=reps)["time_us"]
    return (f"splits {splits:3d}, {fn.cta_rows}-row kernel, {tile_keys}-key tiles: {t:.1f} µs "
            f"({t / auto_us:.2f}x the workspace's choice)")


def nsplit_explorer(heads: int = 8, ctx: int = 65536, reps: int = 50):
    """Notebook 03's NSPLIT explorer (needs a GPU): the workspace's choice at batch 1, q_len 16,
    `heads` and `ctx` timed once, then a slider for the split count and dropdowns for the kernel
    (32 or 64 rows) and the tile; each setting a user lets go of is timed live by nsplit_retime.
    Returns the widget."""
    import ipywidgets as W

    ok, why = kernel_available()
    if not ok:
        raise RuntimeError(f"nsplit_explorer: needs a GPU that runs the kernel ({why})")
    x = Inputs(Shape(1, heads, 16, ctx))
    auto = build_sm120_mla(x)
    auto_us = time_graph_us(auto, reps=reps)["time_us"]

    # continuous_update off: a drag would otherwise queue a capture and 50 replays per value passed
    splits = W.IntSlider(value=auto.num_splits, min=1, max=MAX_SPLITS, description="splits",
                         continuous_update=False)
    cta_rows = W.Dropdown(options=list(CTA_ROWS), value=auto.cta_rows, description="cta_rows")
    tile_keys = W.Dropdown(options=tile_keys_of(auto.cta_rows), value=auto.tile_keys, description="tile_keys")
    out = W.Output()
    timed = [(auto.num_splits, auto.cta_rows, auto.tile_keys)]
    with out:
        print(f"splits {auto.num_splits:3d}, {auto.cta_rows}-row kernel, {auto.tile_keys}-key tiles: "
              f"{auto_us:.1f} µs (the workspace's choice)")

    def retime(_change=None):
        setting = (splits.value, cta_rows.value, tile_keys.value)
        if setting == timed[0]:   # a kernel change that also reset the tile fires twice
            return
        timed[0] = setting
        with out:
            out.clear_output()
            try:
                print(nsplit_retime(x, *setting, auto_us=auto_us, reps=reps))
            except Exception:
                timed[0] = None   # picked again, it is timed again
                raise

    # first, so that a 64-row pick resets the tile before the setting is timed
    cta_rows.observe(lambda change: setattr(tile_keys, "options", tile_keys_of(change["new"])), "value")
    for control in (splits, cta_rows, tile_keys):
        control.observe(retime, "value")
    chosen = W.HTML(f"the workspace's choice: {auto.num_splits} splits, {auto.cta_rows}-row kernel, "
                    f"{auto.tile_keys}-key tiles: {auto_us:.1f} µs")
    return W.VBox([chosen, W.HBox([splits, cta_rows, tile_keys]), out])


def diagnostic_and_shipped(x: "Inputs", defines=(), diagnostic: str = "", cta_rows: int = 64):
    """The call of a diagnostic build (`defines` plus the `diagnostic` define, e.g. WIDE_TRACE)
    and the time of both it and the same build without it, since the stamps cost a little:
    (diagnostic call, its median µs, the undiagnosed build's median µs)."""
    stamped = build_sm120_mla(x, kernel_defines=tuple(defines) + (diagnostic,), cta_rows=cta_rows)
    shipped = build_sm120_mla(x, kernel_defines=tuple(defines), cta_rows=cta_rows)
    return stamped, time_graph_us(stamped)["time_us"], time_graph_us(shipped)["time_us"]


# The MLA libraries timed beside sm120_mla at verify shapes, and sm120_mla's builds there: the
# default (the kernel by shape), then each kernel fixed (32 rows with 16- and 32-key tiles, 64 rows).
VERIFY_LIBRARIES = ("flashmla", "flashinfer_mla", "flashinfer_mla_fa2")
# The decode kernels timed beside sm120_mla at q_len 1, at batch 1 and batched.
DECODE_LIBRARIES = ("triton_decode", "flashmla", "flashinfer_mla_fa2")
# Beside sm120_mla on a skewed verify batch: FlashMLA (its metadata splits work by length) and
# fa2, the FlashInfer kernel an RTX PRO 6000 user runs.
SKEWED_VERIFY = ("flashmla", "flashinfer_mla_fa2")
# skewed batches: one 64k request beside short ones, as a server's batch is (BALANCED_SPLITS)
SKEWED_BATCHES = (Shape(8, 8, 1, 65536, 1024), Shape(32, 8, 1, 65536, 2048), Shape(8, 8, 16, 65536, 1024))
SM120_KERNELS = ({}, {"cta_rows": 32}, {"tile_keys": 32}, {"cta_rows": 64})


def step_cost(x: Inputs) -> dict:
    """verify_cost of one step, summed over its requests' lengths (a skewed batch's differ)."""
    s = x.shape
    costs = [verify_cost(s.heads, s.q_len, k) for k in x.keys]
    total = {key: sum(c[key] for c in costs) for key in costs[0] if key != "intensity"}
    return {**total, "intensity": total["flops"] / total["total_bytes"]}


def default_grid(quick: bool = False, num_sms: int | None = None) -> list[tuple[str, Shape, dict]]:
    """(impl, shape, builder kwargs) for one run. Contexts span 1k (a short chat turn) to 128k.
    num_sms (default: this GPU's, else the H200's 132) places the NSPLIT sweep's one-wave counts."""
    ctxs = [4096, 16384, 65536] if quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    grid = []
    for heads in (8, 16):
        for ctx in ctxs:
            v = Shape(1, heads, 16, ctx)
            grid += [("sm120_mla", v, kw) for kw in SM120_KERNELS]
            grid += [(impl, v, {}) for impl in VERIFY_LIBRARIES]
            if ctx <= 65536:
                grid.append(("triton_verify", v, {}))
            if heads == 8:   # NGRAM's verify in the live service: 8 draft tokens, 64 rows, 2 row CTAs a split
                n = Shape(1, heads, 8, ctx)
                grid += [("sm120_mla", n, {}), ("sm120_mla", n, {"cta_rows": 32}), ("sm120_mla", n, {"cta_rows": 64})]
                grid += [(impl, n, {}) for impl in VERIFY_LIBRARIES]
            d = Shape(1, heads, 1, ctx)
            grid += [("sm120_mla", d, {}), ("sm120_mla", d, {"tile_keys": 32})]
            grid += [(impl, d, {}) for impl in DECODE_LIBRARIES]
        b32 = Shape(32, heads, 16, 16384)
        grid += [("sm120_mla", b32, kw) for kw in SM120_KERNELS]
        grid += [(impl, b32, {}) for impl in VERIFY_LIBRARIES]
    # batched decode: a busy server's step, every SM at work; 8 heads (Kimi K2 under TP8) and 16
    # (the DeepSeek-V3 family under TP8), which run different builds (DECODE_ROWS_AS_N)
    for heads in (8, 16):
        for b, ctx in ((8, 65536), (32, 16384)):
            d = Shape(b, heads, 1, ctx)
            grid += [("sm120_mla", d, {})] + [(impl, d, {}) for impl in DECODE_LIBRARIES]
    for b, q in ((2, 16), (4, 8)):   # small batches: where the kernel choice switches (choose_cta_rows)
        m = Shape(b, 8, q, 65536)
        grid += [("sm120_mla", m, kw) for kw in ({}, {"cta_rows": 32}, {"cta_rows": 64})]
        grid += [(impl, m, {}) for impl in ("flashmla", "flashinfer_mla_fa2")]
    for k in SKEWED_BATCHES:
        grid += [("sm120_mla", k, {})] + [(impl, k, {}) for impl in (DECODE_LIBRARIES if k.q_len == 1 else SKEWED_VERIFY)]
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    # NSPLIT sweep at the headline shape: one wave of the 32-row kernel (4 row CTAs a split) and of
    # the 64-row one (2), beside fixed counts (33 and 66 on the H200, 47 and 94 on an RTX PRO 6000)
    for splits in sorted({8, 16, min(MAX_SPLITS, num_sms // 4), min(MAX_SPLITS, num_sms // 2), MAX_SPLITS}):
        grid += [("sm120_mla", Shape(1, 8, 16, 65536), {"num_splits": splits, "tile_keys": k}) for k in (16, 32)]
    return grid


MMA_PEAK_CHAINS = 8            # mma_peak.cuh: kPeakChains
MMA_FLOPS = 2 * 16 * 8 * 16    # one mma.sync m16n8k16


def measure_mma_sync_tflops(threads_per_block: int = 256, blocks_per_sm: int = 4, iters: int = 4096,
                            repeats: int = 10) -> float:
    """TFLOP/s of register-only mma.sync m16n8k16 (bf16, fp32 accumulate) over every SM:
    the median of `repeats` launches, timed with CUDA events. blocks_per_sm=1 with 256
    threads is the kernel's own 8 warps per SM."""
    from ..hardware import _time_ms
    from .build import load_kernel_module

    mod = load_kernel_module()
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out = torch.empty(sms * blocks_per_sm * threads_per_block, device="cuda")
    times = _time_ms(torch, lambda: mod.mma_sync_peak(out, iters, threads_per_block), repeats, 2)
    flops = out.numel() // 32 * iters * MMA_PEAK_CHAINS * MMA_FLOPS
    return flops / (statistics.median(times) * 1e9)


def run(grid, reps: int = 50, progress: bool = True) -> tuple[list[dict], dict]:
    """Time every (impl, shape) of the grid; returns (records, ceilings). Each record carries
    its provenance (GPU, driver, versions, commit, date) from the start, so that a live run,
    before or without being recorded, says what it was measured on."""
    from tqdm.auto import tqdm

    from ..hardware import measure_bf16_matmul_tflops, measure_copy_bandwidth, unsupported_reason
    from ..provenance import provenance
    from ..roofline import roofline_time_us

    copy = measure_copy_bandwidth(1 << 30)
    mm = measure_bf16_matmul_tflops(8192)
    ceilings = {"copy_gbps": copy["copy_gbps"], "matmul_tflops": mm["bf16_tflops"],
                "mma_sync_tflops": measure_mma_sync_tflops(),
                "mma_sync_tflops_8warps": measure_mma_sync_tflops(blocks_per_sm=1)}
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    measured_on = {k: v for k, v in provenance().items() if k != "command"}   # the writer names the command
    records, cache, checked = [], {}, {}
    capability = torch.cuda.get_device_capability()   # where a library has no kernel, it is not called
    for impl, shape, kw in tqdm(grid, disable=not progress, desc="kernel bench"):
        rec = {**measured_on, "impl": impl, **shape.__dict__, **ceilings, "num_splits": kw.get("num_splits"),
               "run_id": run_id,
               "num_splits_forced": "num_splits" in kw, "kernel_forced": "cta_rows" in kw or "tile_keys" in kw}
        why = unsupported_reason(impl, capability)
        if why:
            records.append({**rec, "status": "unsupported", "error": why})
            continue
        try:
            if shape not in cache:
                cache.clear()
                torch.cuda.empty_cache()
                cache[shape] = Inputs(shape)
            x = cache[shape]
            if impl != "sm120_mla":   # a baseline's answer, once a run per impl and layout (the tests check ours)
                key = (impl, shape.q_len == 1)
                if key not in checked:
                    checked[key] = check_against_reference(impl, Shape(1, 8, shape.q_len, 1000))
                rec["ref_rel_err"] = checked[key]
                if not checked[key] < REF_TOLERANCE:
                    raise RuntimeError(f"{impl} differs from the float64 reference by {checked[key]:.2e} "
                                       f"(relative): not timed")
            fn = BUILDERS[impl](x, **kw)
            for attr in ("num_splits", "tile_keys", "cta_rows", "max_kv_splits"):   # what the impl chose
                if hasattr(fn, attr):
                    rec[attr] = getattr(fn, attr)
            t = time_graph_us(fn, reps=reps if impl != "triton_verify" else max(5, reps // 5))
            rec.update(t)
            rec["gbps"] = x.kv_bytes / (t["time_us"] * 1e3)
            cost = step_cost(x)
            rec["roofline_us"] = roofline_time_us(cost, ceilings["copy_gbps"], ceilings["matmul_tflops"])
            rec["roofline_mma_us"] = roofline_time_us(cost, ceilings["copy_gbps"], ceilings["mma_sync_tflops"])
            rec["status"] = "ok"
        except Exception as e:  # record why an alternative can't run here; never a fake number
            rec["status"] = "error"
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc(limit=2, file=sys.stderr)
        records.append(rec)
    return records, ceilings


def summary_table(records) -> str:
    rows = ["impl           rows tk  b   h  q          ctx splits   time_us    GB/s  roof_us  mma_us  status"]
    for r in records:
        ctx = f"{r['ctx']}" + (f"+{r['short_ctx']}s" if r.get("short_ctx") else "")   # skewed: + the others'
        rows.append(f"{r['impl']:14s} {str(r.get('cta_rows') or ''):>4s} {str(r.get('tile_keys') or ''):>2s} {r['batch']:2d} {r['heads']:3d} {r['q_len']:2d} {ctx:>12s} "
                    f"{str(r.get('num_splits') or ''):>6s} {r.get('time_us', float('nan')):9.1f} "
                    f"{r.get('gbps', float('nan')):7.0f} {r.get('roofline_us', float('nan')):8.1f} "
                    f"{r.get('roofline_mma_us', float('nan')):7.1f}  "
                    f"{r['status'] if r['status'] == 'ok' else r.get('error', '')[:120]}")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Benchmark sm120_mla against SGLang's attention paths")
    ap.add_argument("--quick", action="store_true", help="fewer contexts")
    ap.add_argument("--reps", type=replays, default=50)
    ap.add_argument("--impls", default=",".join(BUILDERS), help="comma-separated subset of " + ",".join(BUILDERS))
    add_l2_flush_arg(ap)
    add_record_args(ap, "kernel_bench")
    args = ap.parse_args(argv)
    impls = set(args.impls.split(","))
    unknown = impls - set(BUILDERS)
    if unknown:
        ap.error(f"--impls: unknown {sorted(unknown)}; choose from {list(BUILDERS)}")
    if not torch.cuda.is_available():
        sys.exit("kernel bench needs a CUDA GPU; none is visible to torch")
    use_l2_flush(args.l2_flush)
    records, ceil = run([g for g in default_grid(args.quick) if g[0] in impls], reps=args.reps)
    print(f"copy {ceil['copy_gbps']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s, "
          f"mma.sync {ceil['mma_sync_tflops']:.0f} TFLOP/s ({ceil['mma_sync_tflops_8warps']:.0f} with 8 warps/SM)")
    print(summary_table(records))
    if not args.no_record:
        from pathlib import Path

        from ..results import append_cli_records, append_records, cli_command

        ok = [dict(r, kernel_version=args.tag) for r in records if r["status"] == "ok"]
        path = append_cli_records("kernel_bench", ok, "sm120_workbook.kernels.bench", argv, args.out)
        append_records("ceilings", [{"copy_gbps": ceil["copy_gbps"], "bf16_tflops": ceil["matmul_tflops"],
                                     "mma_sync_tflops": ceil["mma_sync_tflops"],
                                     "mma_sync_tflops_8warps": ceil["mma_sync_tflops_8warps"],
                                     "matmul_n": 8192, "copy_nbytes": 1 << 30,
                                     "run_id": records[0]["run_id"] if records else None}],   # the run they served
                       command=cli_command("sm120_workbook.kernels.bench", argv),
                       path=Path(args.out).with_name("ceilings.jsonl") if args.out else None)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
