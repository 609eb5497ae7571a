"""The Python face of the sm120_mla kernel: argument checks, the workspace, the split policy.

`mla_verify_attention` takes SGLang's Triton-backend metadata as it is (qo_indptr,
kv_indptr, kv_indices into a page-size-1 pool, custom_mask and mask_indptr), so the SGLang
backend passes its buffers straight through. All checks read shapes, dtypes and devices
only, never tensor values, so a call costs no host sync and can be captured in a graph.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..mla import DIM_QK, DIM_V
from .build import load_kernel_module, source_dir_of

MAX_SPLITS = 128   # the kernels' kMaxSplits (mla_verify.cuh), the combine step's bound
MAX_Q_LEN = 16
TILE_KEYS = (16, 32)      # keys per softmax round of the 32-row kernel: the two compiled variants
# 16 keys: as fast or faster at every shape timed since v18k (32 had been ~0.7 us faster at 4k decode)
DEFAULT_TILE_KEYS = 16
# (token, head) rows per CTA: 32 is the split kernel (score and value warps, mla_verify.cuh),
# 64 the wide kernel (every warp alike, 16-key tiles only, mla_verify_wide.cuh), which reads
# each key half as often when a request has more than 32 rows.
CTA_ROWS = (32, 64)


def tile_keys_of(cta_rows: int) -> tuple[int, ...]:
    """The key tiles a kernel is compiled with: both in the 32-row kernel, 16 in the 64-row one."""
    return TILE_KEYS if cta_rows == 32 else (16,)


ROWS_PER_CTA = 32           # the split kernel's, the default of choose_num_splits
# (Where max_q_len * heads <= 16, decode at up to 16 heads, the launcher runs the split kernel on
# one m16 tile of its 32 rows, since the other is padding: DECODE_ONE_MTILE, v18m. Where it is
# <= 8, with the rows as the mma's N: DECODE_ROWS_AS_N, v21.)


def choose_cta_rows(batch: int, heads: int, max_q_len: int) -> int:
    """The kernel for a call's static shape (NOTES.md, sessions 7-10, H200): the 64-row kernel once
    a request fills its 64 rows, else the 32-row split kernel. Since v18b the 64-row kernel is
    faster at q16 h8 at every context (0.97x the split kernel's time at 4k, 0.80x at 64k, 0.79x
    at 128k), and at q8 h8 from 16k (0.87x at 64k; 1.11x at 4k, 2 us). At q16 h16 it ties at 4k
    and is 0.78x at 64k. A couple of us lost at one short shape for tens gained at long contexts,
    which is where the Triton path this kernel replaces hurts. Decode (8 rows a request at h8)
    stays on the split kernel."""
    return 64 if heads * max_q_len >= 64 else 32


def _fail(arg: str, msg: str):
    raise ValueError(f"{arg}: {msg}")


def _check_int(arg: str, v, lo: int = 1, hi: int | None = None) -> None:
    """An int (not a bool) in lo..hi (hi None: no upper bound), else an error naming `arg`."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        _fail(arg, f"must be a positive int, got {v!r}" if (lo, hi) == (1, None)
              else f"must be an int in {lo}..{hi}, got {v!r}")


def _check(arg: str, t, *, dtypes, dim=None, device=None, contiguous=True, align=0):
    if not isinstance(t, torch.Tensor):
        _fail(arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(arg, f"dtype {t.dtype} not in {[str(d) for d in dtypes]}")
    if dim is not None and t.dim() not in (dim if isinstance(dim, tuple) else (dim,)):
        _fail(arg, f"expected {dim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(arg, f"on {t.device}, expected {device} (same device as q)")
    if contiguous and not t.is_contiguous():
        _fail(arg, "must be contiguous")
    if align and t.data_ptr() % align:
        # the kernel moves rows with 16-byte cp.async and vector stores: a view at an odd
        # offset would fault the launch (and poison the CUDA context) instead
        _fail(arg, f"data must start on a {align}-byte boundary (a view at offset {t.storage_offset()})")


def _overlaps(a, b) -> bool:
    """Whether two (contiguous) tensors share bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


# sm_scale reaches the kernel as a float32 in the log2 domain (Params::scale_log2)
_LOG2_E = math.log2(math.e)
_F32 = torch.finfo(torch.float32)


def kernel_available() -> tuple[bool, str]:
    """Whether the kernel can build and run here, and if not, why."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible to torch"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return False, f"GPU is sm_{cap[0]}{cap[1]}; the kernel needs sm_80 or newer"
    try:
        load_kernel_module()
    except Exception as e:  # a failed nvcc build: say so, with the compiler's own words
        return False, f"kernel build failed: {e}"
    return True, f"sm_{cap[0]}{cap[1]}"


def choose_num_splits(batch: int, heads: int, max_q_len: int, num_sms: int, cta_rows: int = ROWS_PER_CTA) -> int:
    """KV splits per request: as many as fit one wave of CTAs (one CTA per SM), from static
    shapes only.

    Rounding down matters: one CTA past a full wave starts a second wave that costs as much
    as the first. The grid must not depend on sequence lengths (a captured graph replays for
    any), so short contexts are handled inside the kernel, which gives each split at least
    16 keys (MIN_KEYS_PER_SPLIT) and leaves the rest empty.
    """
    for name, v in (("batch", batch), ("heads", heads), ("max_q_len", max_q_len), ("num_sms", num_sms)):
        _check_int(name, v)
    if cta_rows not in CTA_ROWS:
        _fail("cta_rows", f"must be one of {CTA_ROWS}, got {cta_rows!r}")
    row_ctas = batch * math.ceil(max_q_len * heads / cta_rows)
    return max(1, min(MAX_SPLITS, num_sms // row_ctas))


POOL_KEY_CAP = 1 << 24   # mla_verify.cuh kPoolKeyCap


def pool_first_ctas(keys, num_splits: int, min_max: bool = True) -> list[int]:
    """Where each request's CTAs start in its row tile's pool of batch x num_splits CTAs, and
    the pool's size last: the kernels' schedule for a batch (BALANCED_SPLITS and POOL_MIN_MAX
    in mla_verify.cuh, step for step), for CPU tests and for reading a batch's balance. `keys`
    are the requests' key counts (prefix plus draft tokens).

    Each request gets max(1, ceil(keys / L)) CTAs for the smallest load L (within 1/64) whose
    CTAs fit the pool, and the last request the leftover; equal lengths get num_splits each.
    Batches over 128 requests keep v19's rule, one CTA each and the spare ones by keys, which
    min_max=False gives at any batch (the `POOL_MIN_MAX=0` build). The search counts at most
    POOL_KEY_CAP keys a request (kPoolKeyCap: no sum over the batch wraps a 32-bit register).
    """
    batch = len(keys)
    if batch == 0 or num_splits < 1 or min(keys) < 0:
        raise ValueError(f"keys: needs at least one request, none negative, and num_splits >= 1; "
                         f"got {batch} requests and num_splits={num_splits}")
    pool, total = batch * num_splits, sum(keys)
    spare = pool - batch
    if batch > 128 or (not min_max and batch > 1):
        before = [0, *itertools.accumulate(keys)]   # each request's keys before it, and the total last
        return [r + spare * before[r] // total if total else r * num_splits for r in range(batch + 1)]
    keys = [min(k, POOL_KEY_CAP) for k in keys]
    total = sum(keys)
    if batch == 1 or spare == 0 or len(set(keys)) == 1:
        ctas = [num_splits] * batch
    else:
        def needs(load):
            return [max(1, -(-k // load)) for k in keys]

        lo, hi = max(1, -(-total // pool)) - 1, max(1, -(-total // spare))
        while hi - lo > max(1, hi >> 6):
            mid = (lo + hi) // 2
            if sum(needs(mid)) <= pool:
                hi = mid
            else:
                lo = mid
        ctas = needs(hi)
        ctas[-1] += pool - sum(ctas)
    return [0, *itertools.accumulate(ctas)]


def most_keys_a_cta(keys, first_ctas) -> float:
    """The most keys one CTA walks when `keys` are split as `first_ctas` says (pool_first_ctas).
    A request works on at most MAX_SPLITS of its CTAs (the kernels' kMaxSplits; the rest exit):
    on 188 SMs the pool can hand one long request more than that."""
    return max(k / min(b - a, MAX_SPLITS) for k, a, b in zip(keys, first_ctas, first_ctas[1:]))


# The defines that decide whether a build's partial outputs are bf16 (mla_verify.cuh, _wide.cuh)
PARTIAL_DTYPE_DEFINES = ("SPLIT_BF16_PARTIALS", "WIDE_BF16_PARTIALS", "WIDE_STAGES")


def partial_bytes(kernel_defines=(), kernel_source=None) -> int:
    """Bytes of a partial output element as the build stores it: 2 for the default build (both
    kernels store bf16 partials, SPLIT_BF16_PARTIALS and WIDE_BF16_PARTIALS with a 4-stage ring),
    4 where a define could change that or another revision's sources build (before v23 they
    stored fp32): sized for fp32, those stay safe."""
    named = {str(d).split("=", 1)[0].strip() for d in kernel_defines}
    return 4 if kernel_source is not None or named & set(PARTIAL_DTYPE_DEFINES) else 2


class MlaVerifyWorkspace:
    """Per-split partial outputs (bf16 or fp32, by build) and LSEs, allocated once and reused by
    every call.

    Each call needs batch x max_q_len x heads x num_splits rows of partials (each of the
    grid's CTAs has max_q_len x heads of them, whichever request it works on), so max_tokens
    bounds batch x max_q_len, which is the token count where every request has max_q_len
    queries. With num_splits=None the split count follows `choose_num_splits` for each call's
    batch; the buffer is sized so that any batch up to max_tokens fits. With cta_rows=None
    the kernel follows `choose_cta_rows` for each call's batch and max_q_len (32-key tiles
    exist only in the 32-row kernel); 32 or 64 fixes it. `kernel_defines` and `kernel_source`
    (a folder with another revision's kernel sources) pick another build, for ablations and
    A/B runs.
    """

    def __init__(self, max_tokens: int, heads: int, device=None, num_splits: int | None = None,
                 tile_keys: int = DEFAULT_TILE_KEYS, kernel_defines: tuple[str, ...] = (),
                 cta_rows: int | None = None, kernel_source=None):
        _check_int("max_tokens", max_tokens)
        _check_int("heads", heads, 1, 128)
        if num_splits is not None:
            _check_int("num_splits", num_splits, 1, MAX_SPLITS)
        # exact ints: 16.0 would pass `in`, then fail in pybind with no argument named
        if isinstance(tile_keys, bool) or not isinstance(tile_keys, int) or tile_keys not in TILE_KEYS:
            _fail("tile_keys", f"must be one of {TILE_KEYS}, got {tile_keys!r}")
        if cta_rows is not None and (isinstance(cta_rows, bool) or not isinstance(cta_rows, int)
                                     or cta_rows not in CTA_ROWS):
            _fail("cta_rows", f"must be one of {CTA_ROWS} or None (by shape), got {cta_rows!r}")
        if cta_rows is not None and tile_keys not in tile_keys_of(cta_rows):
            _fail("tile_keys", f"the 64-row kernel has 16-key tiles only, got {tile_keys!r}")
        self.tile_keys, self.fixed_cta_rows = tile_keys, cta_rows
        if isinstance(kernel_defines, (str, bytes)):   # a str would become one define a character
            _fail("kernel_defines", f"expected a tuple of 'NAME=VALUE' strings, got the string {kernel_defines!r}")
        self.kernel_defines = tuple(kernel_defines)   # a build variant, for ablations only
        # another revision's kernel sources (build.source_dir_of), for A/B runs (ab.py) only
        self.kernel_source = None if kernel_source is None else str(source_dir_of(kernel_source, "kernel_source"))
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.heads, self.max_tokens, self.fixed_splits = heads, max_tokens, num_splits
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 1)
        if num_splits is None:
            # B*max_q_len*H*S <= 64*num_sms when S > 1 (one wave of B*S CTAs per row tile, each
            # tile <= 64 rows), else B*max_q_len*H.
            rows = max(CTA_ROWS) * self.num_sms + max_tokens * heads
        else:
            rows = max_tokens * heads * num_splits
        self.capacity_rows = rows
        # float32 storage either way; a bf16-partials build uses (and the extension checks) half
        self.partial_bytes = partial_bytes(self.kernel_defines, self.kernel_source)
        self.partial_o = torch.empty(rows * DIM_V * self.partial_bytes // 4, dtype=torch.float32,
                                     device=self.device)
        self.partial_lse = torch.empty(rows, dtype=torch.float32, device=self.device)

    def cta_rows_for(self, batch: int, max_q_len: int) -> int:
        if self.fixed_cta_rows is not None:
            return self.fixed_cta_rows
        return 32 if self.tile_keys != 16 else choose_cta_rows(batch, self.heads, max_q_len)

    def num_splits_for(self, batch: int, max_q_len: int) -> int:
        if self.fixed_splits is not None:
            return self.fixed_splits
        return choose_num_splits(batch, self.heads, max_q_len, self.num_sms, self.cta_rows_for(batch, max_q_len))

    @property
    def nbytes(self) -> int:
        return self.partial_o.numel() * 4 + self.partial_lse.numel() * 4


def _as_rows(arg: str, t, device):
    """[N, 576] or [N, 1, 576] bf16 -> [N, 576] view (SGLang's MLA pool is [P, 1, 576])."""
    _check(arg, t, dtypes=(torch.bfloat16,), dim=(2, 3), device=device, align=16)
    if t.dim() == 3:
        if t.shape[1] != 1:
            _fail(arg, f"expected [N, 576] or [N, 1, 576], got {tuple(t.shape)}")
        t = t.view(t.shape[0], t.shape[2])
    if t.shape[1] != DIM_QK:
        _fail(arg, f"last dim must be {DIM_QK} (512 latent + 64 rope), got {t.shape[1]}")
    return t


def check_index_values(q, kv_pool, qo_indptr, kv_indptr, kv_indices, *, sm_scale: float, max_q_len: int,
                       k_extend=None, custom_mask=None, mask_indptr=None) -> None:
    """The preconditions that live in the index tensors' values, which the launch cannot check
    without a host sync: qo_indptr and kv_indptr start at 0 and never decrease, qo_indptr ends
    at or before T, no request has more than max_q_len queries, kv_indptr ends within
    kv_indices, every used kv_indices entry is a pool row, without k_extend each request's
    prefix holds its own query tokens, and the mask holds every request's rows. Raises
    ValueError naming the argument. Reads the tensors back to the host, so it cannot run while
    a CUDA graph is being captured."""
    from ..reference import _check_indptr, validate_verify_args

    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        _fail("check_values", "reads the index tensors back to the host, which a CUDA graph capture forbids")
    qo = qo_indptr.tolist()
    _check_indptr("qo_indptr", qo)   # before its end slices q below
    if qo[-1] > q.shape[0]:
        _fail("qo_indptr", f"ends at {qo[-1]}, past q's {q.shape[0]} tokens")
    long = next(((b, t1 - t0) for b, (t0, t1) in enumerate(zip(qo, qo[1:])) if t1 - t0 > max_q_len), None)
    if long is not None:
        _fail("qo_indptr", f"request {long[0]} has {long[1]} queries, more than max_q_len {max_q_len}")
    n = qo[-1]   # tokens past it are graph padding, which the reference does not take
    validate_verify_args(q[:n], kv_pool, qo_indptr, kv_indptr, kv_indices, sm_scale,
                         None if k_extend is None else k_extend[:n], custom_mask, mask_indptr)


def mla_verify_attention(q, kv_pool, qo_indptr, kv_indptr, kv_indices, *, out, lse, workspace,
                         sm_scale: float, max_q_len: int, k_extend=None, custom_mask=None,
                         mask_indptr=None, check_values: bool = False):
    """Absorbed MLA attention for speculative verify (q_len 1..16) and decode (q_len 1).

    Args:
        q: [T, H, 576] bf16, the queries of all requests back to back (T = qo_indptr[-1]).
        kv_pool: [P, 576] or [P, 1, 576] bf16, one KV row per token (page size 1); V is
            each row's first 512 columns.
        qo_indptr: [B+1] int32, request b's queries are q[qo_indptr[b]:qo_indptr[b+1]].
        kv_indptr: [B+1] int32, and kv_indices: int32|int64, request b's prefix rows are
            kv_pool[kv_indices[kv_indptr[b]:kv_indptr[b+1]]].
        k_extend: [T, 576] or [T, 1, 576] bf16, the draft tokens' own KV, appended after the
            prefix (SGLang's target verify). None for decode, where each query's own token
            is already the last entry of its prefix.
        custom_mask: flat bool/uint8 and mask_indptr [B+1] int32|int64, SGLang's verify
            format: request b's [q_len, L_b] mask starts at mask_indptr[b], L_b = its key
            count. Only the draft columns are read; the prefix is always visible. Without a
            mask the draft tokens form a causal chain (DFlash).
        out: [T, H, 512] bf16 and lse: [T, H] float32, sharing no memory with each other or an
            input, written in full (lse is the natural log of sum exp(sm_scale * q.k)). Tokens
            past qo_indptr[-1] (graph padding) get 0 and -inf. Broken index values (see below)
            give NaN rows where the kernels can see them: tokens past max_q_len within a
            request, tokens before qo_indptr[0], every token of a request that runs past q's T
            rows (none of whose rows is read), whose kv_indptr range is negative, or whose
            kv_indptr range or mask rows pass len(kv_indices) or len(custom_mask) (v31; the
            kernels then read neither tensor, nor a kv_indptr range with an entry below 0;
            kv_indptr entries past 2^30 count as past kv_indices). The
            other requests are computed over their ranges as given (a raised kv_indptr entry
            gives the request before it more keys), except past 128 requests in the pooled
            layouts (below). A decreasing qo_indptr gives NaN for every token before
            qo_indptr[-1] (those past it count as padding), in every layout. So does a
            decreasing kv_indptr, or a negative qo_indptr[0] or kv_indptr[0], past 128 requests
            in the pooled layouts (v19's pool rule, and the POOL_MIN_MAX=0 build at any batch),
            which would place the requests' CTAs out of order: the 32-row kernel on every arch,
            the 64-row kernel's batches from sm_90 on. No workspace slot past the call's own
            batch x max_q_len x H x splits rows is written, whatever the indptrs hold.
        workspace: an MlaVerifyWorkspace for this device and head count.
        max_q_len: an upper bound on every request's q_len (1..16); it sizes the grid.
        check_values: also check the index tensors' values first (`check_index_values`):
            one host sync, so for eager calls and debugging, never under graph capture.

    Returns out. Launches on the current stream, with no allocation and no host sync.
    Preconditions that only check_values checks (the host cannot read index values without
    a sync, so a graph replay trusts them): every q_len <= max_q_len (contained: NaN rows);
    qo_indptr[0] >= 0 and monotone indptrs (contained: NaN rows, as above); qo_indptr[-1] <= T
    (contained since v30: NaN rows, and no row of q or k_extend past T is read);
    kv_indptr[-1] <= len(kv_indices) and the mask's length (contained since v31: NaN rows, and
    neither tensor is read past its end); and, not contained, kv_indices inside the pool: an
    index outside it is read out of bounds (a check a key would cost the gather).
    """
    if isinstance(q, torch.Tensor) and not q.is_cuda and any(
            isinstance(t, torch.Tensor) and t.is_cuda for t in (kv_pool, qo_indptr, kv_indptr, kv_indices, out, lse)):
        _fail("q", f"on {q.device}, but the other tensors are on CUDA")
    _check("q", q, dtypes=(torch.bfloat16,), dim=3, align=16)
    dev = q.device
    T, H, D = q.shape
    if D != DIM_QK:
        _fail("q", f"last dim must be {DIM_QK} (512 latent + 64 rope), got {D}")
    if not 1 <= H <= 128:
        _fail("q", f"heads must be in 1..128, got {H}")
    kv_rows = _as_rows("kv_pool", kv_pool, dev)
    _check("qo_indptr", qo_indptr, dtypes=(torch.int32,), dim=1, device=dev)
    _check("kv_indptr", kv_indptr, dtypes=(torch.int32,), dim=1, device=dev)
    _check("kv_indices", kv_indices, dtypes=(torch.int32, torch.int64), dim=1, device=dev)
    if qo_indptr.numel() < 2:
        _fail("qo_indptr", f"must be [B+1] with B >= 1, got {qo_indptr.numel()} entries")
    if kv_indptr.numel() != qo_indptr.numel():
        _fail("kv_indptr", f"must be [B+1] like qo_indptr ({qo_indptr.numel()}), got {kv_indptr.numel()}")
    batch = qo_indptr.numel() - 1
    if batch > 65535:
        _fail("qo_indptr", f"batch {batch} exceeds 65535 requests per call")
    _check_int("max_q_len", max_q_len, 1, MAX_Q_LEN)
    if T > batch * max_q_len:
        _fail("q", f"{T} tokens exceed batch {batch} x max_q_len {max_q_len}")
    ke_rows = None
    if k_extend is not None:
        ke_rows = _as_rows("k_extend", k_extend, dev)
        if ke_rows.shape[0] != T:
            _fail("k_extend", f"needs one row per query token ({T}), got {ke_rows.shape[0]}")
    if custom_mask is not None and mask_indptr is None:
        _fail("mask_indptr", "custom_mask needs mask_indptr")
    if mask_indptr is not None and custom_mask is None:
        _fail("custom_mask", "mask_indptr was given without custom_mask")
    if custom_mask is not None:
        _check("custom_mask", custom_mask, dtypes=(torch.bool, torch.uint8), dim=1, device=dev)
        _check("mask_indptr", mask_indptr, dtypes=(torch.int32, torch.int64), dim=1, device=dev)
        if mask_indptr.numel() != batch + 1:
            _fail("mask_indptr", f"must be [B+1] = [{batch + 1}], got {mask_indptr.numel()}")
        if custom_mask.numel() == 0:   # its null pointer would read as "no mask": a causal chain
            _fail("custom_mask", "is empty; pass None for a causal chain without a mask")
        custom_mask = custom_mask.view(torch.uint8)
    _check("out", out, dtypes=(torch.bfloat16,), dim=3, device=dev, align=16)
    if tuple(out.shape) != (T, H, DIM_V):
        _fail("out", f"expected shape {(T, H, DIM_V)}, got {tuple(out.shape)}")
    _check("lse", lse, dtypes=(torch.float32,), dim=2, device=dev)
    if tuple(lse.shape) != (T, H):
        _fail("lse", f"expected shape {(T, H)}, got {tuple(lse.shape)}")
    # the kernels write out, lse and the workspace while they read the rest: no byte may be shared
    written = {"out": out, "lse": lse}
    if isinstance(workspace, MlaVerifyWorkspace):
        written.update({"workspace.partial_o": workspace.partial_o, "workspace.partial_lse": workspace.partial_lse})
    read = {"q": q, "kv_pool": kv_rows, "k_extend": ke_rows, "custom_mask": custom_mask, "qo_indptr": qo_indptr,
            "kv_indptr": kv_indptr, "kv_indices": kv_indices, "mask_indptr": mask_indptr}
    for name, w in written.items():
        for other, t in {**written, **read}.items():
            if t is not None and t is not w and _overlaps(w, t):
                _fail(name, f"overlaps {other}'s memory")
    if not isinstance(workspace, MlaVerifyWorkspace):
        _fail("workspace", f"expected an MlaVerifyWorkspace, got {type(workspace).__name__}")
    if workspace.device != dev:
        _fail("workspace", f"allocated on {workspace.device}, q is on {dev}")
    if workspace.heads != H:
        _fail("workspace", f"allocated for {workspace.heads} heads, q has {H}")
    splits = workspace.num_splits_for(batch, max_q_len)
    if batch * max_q_len * H * splits > workspace.capacity_rows:
        _fail("workspace", f"too small: {batch} requests x max_q_len {max_q_len} x {H} heads x {splits} "
              f"splits > {workspace.capacity_rows} rows (allocated for max_tokens={workspace.max_tokens})")
    # a tensor sm_scale would cost a sync here and break graph capture; a bool is no scale
    if isinstance(sm_scale, (bool, torch.Tensor)) or not isinstance(sm_scale, (int, float)):
        _fail("sm_scale", f"must be a Python float, got {type(sm_scale).__name__}")
    try:
        scale_log2 = float(sm_scale) * _LOG2_E
    except OverflowError:
        _fail("sm_scale", f"must be a positive finite float, got an int of {len(str(sm_scale))} digits")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        _fail("sm_scale", f"must be a positive finite float, got {sm_scale!r}")
    if not _F32.tiny <= scale_log2 <= _F32.max:
        _fail("sm_scale", f"{sm_scale!r} x log2(e) is no normal float32, the kernel's scale")
    if check_values:
        check_index_values(q, kv_pool, qo_indptr, kv_indptr, kv_indices, sm_scale=sm_scale, max_q_len=max_q_len,
                           k_extend=k_extend, custom_mask=custom_mask, mask_indptr=mask_indptr)
    if dev.type != "cuda":
        _fail("q", f"must be a CUDA tensor, got {dev}")

    mod = load_kernel_module(torch.cuda.get_device_capability(dev), defines=workspace.kernel_defines,
                             source_dir=workspace.kernel_source)
    mod.mla_verify_forward(q, kv_rows, qo_indptr, kv_indptr, kv_indices, ke_rows, custom_mask,
                           mask_indptr, out, lse, workspace.partial_o, workspace.partial_lse,
                           float(sm_scale), max_q_len, splits, workspace.tile_keys,
                           workspace.cta_rows_for(batch, max_q_len))
    return out
