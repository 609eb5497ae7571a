"""The oracle: absorbed-MLA attention for a speculative-verify step, in float64 PyTorch.

Shapes (DeepSeek-V3 / Kimi K2 absorbed MLA, page_size 1, one KV head shared by all heads)::

    q          [T, H, 576]          512 latent (kv_lora_rank) + 64 rope dims per head
    kv_pool    [P, 576] | [P, 1, 576]   one row per cached token; V = row[:512]
    k_extend   [T, 576] | [T, 1, 576]   the draft tokens' own KV rows (target-verify)
    qo_indptr  [B+1] int32|int64    request b's queries are q[qo_indptr[b]:qo_indptr[b+1]]
    kv_indptr  [B+1] int32|int64    request b's pool rows are
    kv_indices [>= kv_indptr[-1]]   kv_pool[kv_indices[kv_indptr[b]:kv_indptr[b+1]]]
    custom_mask 1-D bool|uint8, mask_indptr [B+1]   SGLang's verify mask (see masks.py)
    out        [T, H, 512] float64, lse [T, H] float64 (natural log)

Request b attends over L_b keys: its prefix rows from the pool followed, when k_extend is
given, by k_extend[qo_indptr[b]:qo_indptr[b+1]] (SGLang's target-verify layout, where the
Triton backend's kv_indptr covers the committed context only). Without k_extend the last
q_len_b keys of the pool list are the queries' own tokens (decode, where SGLang has already
written them). The last q_len_b keys are the draft keys; every query sees all the others.
Draft key d is visible to query t iff ``custom_mask[mask_indptr[b] + t*L_b + (L_b-q_len_b) + d]``
(prefix columns of the mask are never read, as with ``skip_prefix_custom_mask=True``), or,
without custom_mask, iff d <= t (a causal chain: DFlash).

Scores are ``sm_scale * (q . k)`` over all 576 dims; ``lse = log(sum(exp(score)))`` over the
visible keys. A query that sees no key gets NaN output and lse = -inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masks import causal_chain_mask, check_lengths, random_tree_mask
from .mla import (DEEPSEEK_V3_SM_SCALE, DIM_QK, KV_LORA_RANK, QK_ROPE_DIM, SM_SCALE,  # noqa: F401 (re-exported)
                  SM_SCALES)

HEAD_DIM = DIM_QK  # 576

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MASK_DTYPES = (torch.bool, torch.uint8)
_SCORE_ELEMS_PER_CHUNK = 1 << 25  # float64 score elements per step (256 MiB)


@dataclass(frozen=True)
class VerifyLayout:
    """Validated host-side view of the index arguments (python ints)."""

    qo: list[int]            # qo_indptr
    kv: list[int]            # kv_indptr
    kv_indices: torch.Tensor  # the used entries, kv_indices[:kv_indptr[-1]] (q's device)
    q_lens: list[int]
    pool_lens: list[int]     # keys each request takes from the pool
    key_lens: list[int]      # L_b: pool keys + extend keys
    mask_starts: list[int] | None

    @property
    def batch(self) -> int:
        return len(self.q_lens)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[N, 576] view of a [N, 576] or [N, 1, 576] KV tensor."""
    if t.dim() == 3 and t.shape[1] == 1 and t.shape[2] == HEAD_DIM:
        return t[:, 0]
    if t.dim() == 2 and t.shape[1] == HEAD_DIM:
        return t
    raise ValueError(f"{name}: expected shape [N, {HEAD_DIM}] or [N, 1, {HEAD_DIM}], got {tuple(t.shape)}")


def _check_1d(name: str, t, dtypes, dtype_names: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected {dtype_names}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")


def _index_list(name: str, t, expect_len: int | None = None) -> list[int]:
    _check_1d(name, t, INDEX_DTYPES, "int32 or int64")
    if expect_len is not None and t.numel() != expect_len:
        raise ValueError(f"{name}: expected {expect_len} entries, got {t.numel()}")
    return t.tolist()


def _check_indptr(name: str, vals: list[int]) -> None:
    if len(vals) < 2:
        raise ValueError(f"{name}: needs B+1 >= 2 entries, got {len(vals)}")
    if vals[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name}: must be non-decreasing, got {vals}")


def validate_verify_args(q, kv_pool, qo_indptr, kv_indptr, kv_indices, sm_scale,
                         k_extend=None, custom_mask=None, mask_indptr=None) -> VerifyLayout:
    """Check every argument of `mla_verify_reference`; raise ValueError naming the culprit."""
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q: expected shape [T, H, {HEAD_DIM}], got {tuple(q.shape)}")
    if q.shape[1] < 1:
        raise ValueError("q: needs at least one head")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: expected bf16, fp16, fp32 (or fp64), got {q.dtype}")
    if not isinstance(kv_pool, torch.Tensor):
        raise ValueError(f"kv_pool: expected a torch.Tensor, got {type(kv_pool).__name__}")
    pool = _rows("kv_pool", kv_pool)
    if kv_pool.dtype != q.dtype:
        raise ValueError(f"kv_pool: dtype {kv_pool.dtype} differs from q's {q.dtype}")
    tensors = {"kv_pool": kv_pool, "qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices}
    if k_extend is not None:
        if not isinstance(k_extend, torch.Tensor):
            raise ValueError(f"k_extend: expected a torch.Tensor, got {type(k_extend).__name__}")
        ext = _rows("k_extend", k_extend)
        if ext.shape[0] != q.shape[0]:
            raise ValueError(f"k_extend: {ext.shape[0]} rows for {q.shape[0]} query tokens in q")
        if k_extend.dtype != q.dtype:
            raise ValueError(f"k_extend: dtype {k_extend.dtype} differs from q's {q.dtype}")
        tensors["k_extend"] = k_extend
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("custom_mask: custom_mask and mask_indptr must be given together"
                         if custom_mask is None else
                         "mask_indptr: custom_mask and mask_indptr must be given together")
    if custom_mask is not None:
        _check_1d("custom_mask", custom_mask, MASK_DTYPES, "bool or uint8")
        tensors["custom_mask"] = custom_mask
        tensors["mask_indptr"] = mask_indptr
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    if isinstance(sm_scale, torch.Tensor) or not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        raise ValueError(f"sm_scale: expected a Python float, got {type(sm_scale).__name__}")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale: expected a finite positive float, got {sm_scale}")

    qo = _index_list("qo_indptr", qo_indptr)
    _check_indptr("qo_indptr", qo)
    if qo[-1] != q.shape[0]:
        raise ValueError(f"qo_indptr: ends at {qo[-1]}, but q has T = {q.shape[0]} tokens")
    kv = _index_list("kv_indptr", kv_indptr, expect_len=len(qo))
    _check_indptr("kv_indptr", kv)
    if not isinstance(kv_indices, torch.Tensor):
        raise ValueError(f"kv_indices: expected a torch.Tensor, got {type(kv_indices).__name__}")
    if kv_indices.dtype not in INDEX_DTYPES or kv_indices.dim() != 1:
        raise ValueError(f"kv_indices: expected a 1-D int32/int64 tensor, got {kv_indices.dtype} {tuple(kv_indices.shape)}")
    if kv[-1] > kv_indices.numel():
        raise ValueError(f"kv_indices: kv_indptr ends at {kv[-1]} but kv_indices has {kv_indices.numel()} entries")
    used = kv_indices[: kv[-1]]  # SGLang over-allocates kv_indices; the tail is never read
    n_pool = pool.shape[0]
    out_of_pool = (used < 0) | (used >= n_pool)
    if bool(out_of_pool.any()):
        bad = used[out_of_pool][:5].tolist()
        raise ValueError(f"kv_indices: entries {bad} outside the pool of {n_pool} rows")

    q_lens = [b - a for a, b in zip(qo, qo[1:])]
    pool_lens = [b - a for a, b in zip(kv, kv[1:])]
    if k_extend is not None:
        key_lens = [p + t for p, t in zip(pool_lens, q_lens)]
    else:
        short = [b for b, (p, t) in enumerate(zip(pool_lens, q_lens)) if p < t]
        if short:
            raise ValueError(f"kv_indptr: without k_extend each request's pool keys must include its "
                             f"{q_lens[short[0]]} query tokens; request {short[0]} has {pool_lens[short[0]]}")
        key_lens = pool_lens

    mask_starts = None
    if custom_mask is not None:
        mask_starts = _index_list("mask_indptr", mask_indptr, expect_len=len(qo))
        for b, (start, t, L) in enumerate(zip(mask_starts, q_lens, key_lens)):
            if t and (start < 0 or start + t * L > custom_mask.numel()):
                raise ValueError(f"custom_mask: request {b} needs elements [{start}, {start + t * L}) "
                                 f"but the mask has {custom_mask.numel()} (check mask_indptr)")
    return VerifyLayout(qo, kv, used, q_lens, pool_lens, key_lens, mask_starts)


def _draft_visibility(layout: VerifyLayout, b: int, custom_mask) -> torch.Tensor:
    """[q_len, q_len] bool: query t sees draft key d (mask rows' last q_len columns)."""
    t, L = layout.q_lens[b], layout.key_lens[b]
    if custom_mask is None:
        return torch.ones(t, t, dtype=torch.bool, device="cpu").tril()
    start = layout.mask_starts[b]
    rows = custom_mask[start:start + t * L].view(t, L)
    return rows[:, L - t:].to(torch.bool)


def mla_verify_reference(q, kv_pool, qo_indptr, kv_indptr, kv_indices, sm_scale,
                         k_extend=None, custom_mask=None, mask_indptr=None, return_lse=False):
    """Absorbed-MLA verify attention in float64; see the module docstring for every shape.

    Returns out [T, H, 512] float64 on q's device (the caller casts), and with
    return_lse=True also lse [T, H] float64 (natural log of the softmax denominator).
    """
    layout = validate_verify_args(q, kv_pool, qo_indptr, kv_indptr, kv_indices, sm_scale,
                                  k_extend, custom_mask, mask_indptr)
    T, H, _ = q.shape
    dev = q.device
    pool = _rows("kv_pool", kv_pool)
    ext = _rows("k_extend", k_extend) if k_extend is not None else None
    idx = layout.kv_indices.to(torch.int64)
    out = torch.full((T, H, KV_LORA_RANK), float("nan"), dtype=torch.float64, device=dev)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64, device=dev)
    for b in range(layout.batch):
        q0, q1 = layout.qo[b], layout.qo[b + 1]
        t = q1 - q0
        if t == 0:
            continue
        keys = pool[idx[layout.kv[b]:layout.kv[b + 1]]].to(torch.float64)  # only indexed rows: poison stays out
        if ext is not None:
            keys = torch.cat([keys, ext[q0:q1].to(torch.float64)])
        L = keys.shape[0]
        visible = torch.ones(t, L, dtype=torch.bool, device=dev)
        visible[:, L - t:] = _draft_visibility(layout, b, custom_mask).to(dev)
        # heads in chunks: float64 scores at long context would not fit otherwise
        head_chunk = max(1, _SCORE_ELEMS_PER_CHUNK // max(1, t * L))
        for h0 in range(0, H, head_chunk):
            h1 = min(H, h0 + head_chunk)
            qb = q[q0:q1, h0:h1].to(torch.float64)                            # [t, h, 576]
            scores = torch.einsum("thd,ld->thl", qb, keys) * sm_scale        # [t, h, L]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            lse_b = torch.logsumexp(scores, dim=-1)                           # [t, h]
            probs = torch.exp(scores - lse_b[..., None])
            out[q0:q1, h0:h1] = torch.einsum("thl,lv->thv", probs, keys[:, :KV_LORA_RANK])
            lse[q0:q1, h0:h1] = lse_b
    return (out, lse) if return_lse else out


def mla_verify_loop(q, kv_pool, qo_indptr, kv_indptr, kv_indices, sm_scale,
                    k_extend=None, custom_mask=None, mask_indptr=None, return_lse=False):
    """The same function as `mla_verify_reference`, written as a slow explicit loop.

    One (request, query token, head) at a time; keys fetched row by row from python
    indices, visibility read element by element from the flat mask, softmax in python
    floats. It is the oracle's oracle: keep the sizes small.
    """
    layout = validate_verify_args(q, kv_pool, qo_indptr, kv_indptr, kv_indices, sm_scale,
                                  k_extend, custom_mask, mask_indptr)
    T, H, _ = q.shape
    pool = _rows("kv_pool", kv_pool).detach().to("cpu", torch.float64)
    ext = _rows("k_extend", k_extend).detach().to("cpu", torch.float64) if k_extend is not None else None
    qd = q.detach().to("cpu", torch.float64)
    mask = custom_mask.detach().cpu().tolist() if custom_mask is not None else None
    kv_indices_list = layout.kv_indices.tolist()
    out = torch.full((T, H, KV_LORA_RANK), float("nan"), dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for b in range(layout.batch):
        q_start, q_len = layout.qo[b], layout.q_lens[b]
        rows = [pool[kv_indices_list[j]] for j in range(layout.kv[b], layout.kv[b + 1])]
        if ext is not None:
            rows += [ext[q_start + d] for d in range(q_len)]
        L = len(rows)
        n_prefix = L - q_len
        for t in range(q_len):
            seen = list(range(n_prefix))
            for d in range(q_len):
                if mask is None:
                    ok = d <= t
                else:
                    ok = bool(mask[layout.mask_starts[b] + t * L + n_prefix + d])
                if ok:
                    seen.append(n_prefix + d)
            for h in range(H):
                qv = qd[q_start + t, h]
                scores = [float(torch.dot(qv, rows[j])) * sm_scale for j in seen]
                if not scores:
                    continue
                m = max(scores)
                weights = [math.exp(s - m) for s in scores]
                denom = sum(weights)
                acc = torch.zeros(KV_LORA_RANK, dtype=torch.float64)
                for w, j in zip(weights, seen):
                    acc += (w / denom) * rows[j][:KV_LORA_RANK]
                out[q_start + t, h] = acc
                lse[q_start + t, h] = m + math.log(denom)
    out, lse = out.to(q.device), lse.to(q.device)
    return (out, lse) if return_lse else out


def _per_request(name: str, value, batch: int) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        vals = [value] * batch
    elif isinstance(value, (list, tuple, range)):
        vals = list(value)
    else:
        raise ValueError(f"{name}: expected an int or one int per request, got {value!r}")
    if len(vals) != batch:
        raise ValueError(f"{name}: expected {batch} per-request values, got {len(vals)}")
    return vals


def make_verify_case(batch: int = 2, heads: int = 8, q_len=4, ctx_lens=32, mask: str | None = "causal",
                     pool_extra: int = 64, seed: int | None = 0, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.bfloat16, device="cpu", with_k_extend: bool = True,
                     sm_scale: float | None = None) -> dict:
    """Random inputs for one verify step in SGLang's layout, as kwargs of `mla_verify_reference`.

    - batch, heads: B requests, H query heads.
    - q_len: draft tokens per request (int, or one per request; SGLang uses one value).
    - ctx_lens: committed context tokens per request (int or one per request), i.e. the
      prefix keys; every request attends over ctx_len + q_len keys.
    - mask: "causal" (explicit causal-chain custom_mask), "tree" (random draft trees, as
      NGRAM/EAGLE), or None (no custom_mask: the kernel's implicit causal chain, DFlash).
    - with_k_extend: True gives SGLang's target-verify layout (pool rows for the context,
      the drafts' KV in k_extend); False puts the drafts' KV in the pool too, as the last
      q_len entries of each request's kv_indices (decode layout), and k_extend is None.
    - pool_extra: unused pool rows beyond those referenced. The pool is shuffled:
      kv_indices are unique and scattered, and every unused row is NaN, so a kernel that
      reads outside the index list shows it in its output.
    - seed / generator: the index structure (kv_indices, tree shapes) comes from a CPU
      generator (`generator`, else one seeded with `seed`; seed None draws a fresh one), so
      it is identical on every device; q, the pool and k_extend are drawn on `device` from a
      generator seeded from it, so values are reproducible per device type. Values are
      standard normal.
    - sm_scale: None draws one of SM_SCALES per case (from the same generator): the bare
      1/sqrt(192), and Kimi K2's and DeepSeek-V3's with YaRN's mscale (0.131, 0.135), whose
      softmax is sharper.

    Returns dict(q [T,H,576], kv_pool [P,1,576], k_extend [T,1,576] | None, qo_indptr int32,
    kv_indptr int32, kv_indices int64, custom_mask bool | None, mask_indptr int64 | None,
    sm_scale float), all on `device`. Use `case_lengths(case)` for the per-request
    (ctx_lens, q_lens).
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: expected a positive int, got {batch!r}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads: expected a positive int, got {heads!r}")
    if mask not in ("causal", "tree", None):
        raise ValueError(f"mask: expected 'causal', 'tree' or None, got {mask!r}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
    if not isinstance(pool_extra, int) or pool_extra < 0:
        raise ValueError(f"pool_extra: expected a non-negative int, got {pool_extra!r}")
    q_lens = _per_request("q_len", q_len, batch)
    ctx = _per_request("ctx_lens", ctx_lens, batch)
    ctx, q_lens = check_lengths(ctx, q_lens)
    if not any(q_lens):   # no query row at all: nothing for a reference or a kernel to compute
        raise ValueError(f"q_len: at least one request needs a query token, got {q_len!r}")
    gen = generator
    if gen is None:
        gen = torch.Generator()
        if seed is None:   # a fresh random case, as the checks draw them
            gen.seed()
        else:
            gen.manual_seed(seed)

    pool_lens = [c + (0 if with_k_extend else t) for c, t in zip(ctx, q_lens)]
    n_used = sum(pool_lens)
    n_pool = n_used + pool_extra
    slots = torch.randperm(n_pool, generator=gen)[:n_used]        # unique, scattered
    T = sum(q_lens)
    qo_indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(pool_lens).cumsum(0).tolist()), dtype=torch.int32)
    if mask == "causal":
        custom_mask, mask_indptr = causal_chain_mask(ctx, q_lens)
    elif mask == "tree":
        custom_mask, mask_indptr = random_tree_mask(ctx, q_lens, gen)
    else:
        custom_mask = mask_indptr = None
    value_seed = int(torch.randint(0, 2**62, (1,), generator=gen).item())
    if sm_scale is None:   # from the draw above, so the rest of a seeded case stays as it was
        sm_scale = SM_SCALES[value_seed % len(SM_SCALES)]

    dev = torch.device(device)
    vgen = torch.Generator(device=dev).manual_seed(value_seed)
    q = torch.randn(T, heads, HEAD_DIM, generator=vgen, device=dev, dtype=torch.float32).to(dtype)
    kv_pool = torch.full((n_pool, 1, HEAD_DIM), float("nan"), device=dev, dtype=dtype)
    slots_dev = slots.to(dev)
    kv_pool[slots_dev] = torch.randn(n_used, 1, HEAD_DIM, generator=vgen, device=dev,
                                     dtype=torch.float32).to(dtype)
    k_extend = (torch.randn(T, 1, HEAD_DIM, generator=vgen, device=dev, dtype=torch.float32).to(dtype)
                if with_k_extend else None)
    return {
        "q": q,
        "kv_pool": kv_pool,
        "qo_indptr": qo_indptr.to(dev),
        "kv_indptr": kv_indptr.to(dev),
        "kv_indices": slots_dev.to(torch.int64),
        "sm_scale": float(sm_scale),
        "k_extend": k_extend,
        "custom_mask": custom_mask.to(dev) if custom_mask is not None else None,
        "mask_indptr": mask_indptr.to(dev) if mask_indptr is not None else None,
    }


def case_lengths(case: dict) -> tuple[list[int], list[int]]:
    """(ctx_lens, q_lens) per request of a `make_verify_case` dict: prefix keys and drafts."""
    qo = case["qo_indptr"].tolist()
    kv = case["kv_indptr"].tolist()
    q_lens = [b - a for a, b in zip(qo, qo[1:])]
    pool_lens = [b - a for a, b in zip(kv, kv[1:])]
    if case.get("k_extend") is None:
        return [p - t for p, t in zip(pool_lens, q_lens)], q_lens
    return pool_lens, q_lens
