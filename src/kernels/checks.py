"""Checking the kernel against the float64 reference: one case, or a grid of odd sizes.

Tolerances: ||out - ref|| / ||ref|| < 1e-2 and max |out - ref| < 5e-2 (outputs are O(1)):
bf16 output rounding alone gives ~2e-3 relative, the probabilities enter PV as bf16, and the
split partials (both kernels' since v23) are rounded to bf16 once (<= 2^-9 relative) before the fp32 merge.
The LSE comes from fp32 scores of the same bf16 inputs the reference sees: < 1e-3.
The relative norm is over the whole batch, and at long context 16 random draft keys hold next
to nothing of a row's softmax: hiding every draft of a 65,553-key request moves it 1.7e-3,
inside the tolerance. So the draft mask is checked at long context by a case whose prefix is
damped, where a wrong mask moves the output by O(1) (test_kernel_gpu.py,
test_the_draft_mask_at_long_context); the random cases check it at short contexts.
"""
from __future__ import annotations

import random

import torch

from ..reference import make_verify_case, mla_verify_reference
from .verify_attention import DEFAULT_TILE_KEYS, DIM_V, MlaVerifyWorkspace, mla_verify_attention

REL_TOL, ABS_TOL, LSE_TOL = 1e-2, 5e-2, 1e-3

# (batch, heads, q_len, ctx_lens, mask, with_k_extend): odd sizes, mixed lengths, both layouts.
FIXED_CASES = [
    (1, 8, 16, 4096, None, True),          # DFlash block, implicit causal chain
    (1, 16, 16, 1, "causal", True),        # ctx 1
    (1, 3, 7, 127, "tree", True),
    (1, 5, 16, 129, "tree", True),
    (1, 1, 1, 127, None, False),           # decode, one head
    (2, 128, 1, [129, 1000], None, False), # decode, 128 heads, mixed lengths
    (3, 8, 16, [1, 700, 65537], "tree", True),
    (4, 16, 4, [5000, 17, 129, 3000], "causal", True),
    (2, 64, 16, [2048, 333], "tree", True),
    (5, 8, 1, [1, 2, 3, 64, 65], None, False),
    (2, 2, 8, [300, 4097], "tree", True),  # 16 rows: the split kernel's one-m16-tile build
    (3, 4, 2, [70000, 1, 513], "tree", True),  # 8 rows: that build with the rows as the mma's N
    (1, 8, 4, 300, "causal", False),       # decode layout with 4 queries: their keys end the prefix
    (1, 8, 16, 262144, "tree", True),      # the longest context the kernel serves
    (2, 128, 1, [262144, 4097], None, False),  # decode at 256k, 128 heads
]


# (defines, cta_rows): the schedules still in the source beside the shipped one, each a build that
# must compute the same attention (tests/test_kernel_gpu.py; gpu_check builds them in parallel
# before the tests, which would otherwise build them one after another).
SCHEDULE_VARIANTS = [
    (("GROUP_BARRIERS=1",), 32), (("PV_LAG=1",), 32), (("PV_LAG=1", "STAGES_16=3"), 32), (("STAGES_16=3",), 32),
    (("TILE_STAGGER=3",), 32), (("SPLIT_LOADS=1",), 32), (("SPLIT_LOADS=1", "STAGES_16=3"), 32),
    (("WIDE_STAGES=3",), 64), (("WIDE_REFILL_IN_QK=0",), 64), (("WIDE_PINGPONG=0",), 64),
    (("WIDE_PINGPONG=0", "WIDE_STAGES=2"), 64), (("WIDE_PINGPONG=0", "WIDE_REFILL_IN_QK=0"), 64),
    (("WIDE_FUSED=1",), 64), (("WIDE_FUSED=1", "WIDE_PINGPONG=0"), 64), (("WIDE_FUSED=1", "WIDE_STAGES=3"), 64),
    (("COMBINE_PDL=0",), 32), (("COMBINE_PDL=0",), 64), (("CTA_TIMELINE",), 64),
    (("WIDE_Q_SMEM=0",), 64), (("WIDE_BF16_PARTIALS=0",), 64), (("WIDE_PREFETCH_FIRST_TILES=0",), 64),
    (("COMBINE_PRELOAD=0",), 32), (("COMBINE_PRELOAD=0",), 64), (("WIDE_Q_STAGGER=0",), 64),
    (("WIDE_Q_LDG=0",), 64), (("MIN_KEYS_PER_SPLIT=64",), 32), (("MIN_KEYS_PER_SPLIT=64",), 64),
    (("STAGED_PROLOGUE=0",), 32), (("PROLOGUE_EARLY_STAGES=1",), 32), (("PROLOGUE_EARLY_STAGES=0",), 32),
    (("DECODE_ONE_MTILE=0",), 32), (("DECODE_ROWS_AS_N=0",), 32), (("EARLY_REFILL=1",), 32), (("EARLY_REFILL=1", "DECODE_ONE_MTILE=0"), 32),
    (("SPLIT_BF16_PARTIALS=0",), 32), (("SPLIT_Q_SMEM=0",), 32),
    (("BALANCED_SPLITS=0",), 32), (("BALANCED_SPLITS=0",), 64), (("POOL_MIN_MAX=0",), 32), (("POOL_MIN_MAX=0",), 64),
]


def run_kernel(case: dict, max_q_len: int, num_splits: int | None = None,
               tile_keys: int = DEFAULT_TILE_KEYS, kernel_defines: tuple[str, ...] = (),
               cta_rows: int | None = None):
    """The kernel on a `make_verify_case` dict, with NaN-poisoned out, lse and workspace, its
    index values checked first (`kernel_defines`:
    a diagnostic build of mla_verify.cuh, e.g. ("GROUP_BARRIERS=1",); `cta_rows`: 32, the split
    kernel, or 64, the wide kernel; None picks by shape)."""
    q = case["q"]
    T, H, _ = q.shape
    out = torch.full((T, H, DIM_V), float("nan"), device=q.device, dtype=torch.bfloat16)
    lse = torch.full((T, H), float("nan"), device=q.device, dtype=torch.float32)
    batch = case["qo_indptr"].numel() - 1
    ws = MlaVerifyWorkspace(batch * max_q_len, H, q.device, num_splits=num_splits, tile_keys=tile_keys,
                              kernel_defines=kernel_defines, cta_rows=cta_rows)
    # A fresh workspace may reuse an earlier one's memory: NaN makes a partial slot that the
    # combine step reads without this call having written it show in the output.
    ws.partial_o.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    mla_verify_attention(q, case["kv_pool"], case["qo_indptr"], case["kv_indptr"], case["kv_indices"],
                         out=out, lse=lse, workspace=ws, sm_scale=case["sm_scale"], max_q_len=max_q_len,
                         k_extend=case["k_extend"], custom_mask=case["custom_mask"],
                         mask_indptr=case["mask_indptr"], check_values=True)
    return out, lse


def compare(case: dict, out, lse) -> dict:
    """Errors of (out, lse) against the float64 reference, and whether all were written."""
    ref, ref_lse = mla_verify_reference(case["q"], case["kv_pool"], case["qo_indptr"], case["kv_indptr"],
                                        case["kv_indices"], case["sm_scale"], k_extend=case["k_extend"],
                                        custom_mask=case["custom_mask"], mask_indptr=case["mask_indptr"],
                                        return_lse=True)
    written = not (torch.isnan(out).any() or torch.isnan(lse).any())
    o = out.double()
    rel = ((o - ref).norm() / ref.norm()).item()
    mx = (o - ref).abs().max().item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    passed = written and rel < REL_TOL and mx < ABS_TOL and lse_err < LSE_TOL
    return {"written": written, "rel_err": rel, "max_abs_err": mx, "lse_err": lse_err, "passed": passed}


def random_shapes(rng: random.Random, n: int) -> list[tuple]:
    """n random verify shapes in FIXED_CASES' layout: batch 1..4, heads 1..128, q_len 1..16,
    per-request contexts of 1, up to 300 or up to 20k, any mask, drafts in k_extend."""
    shapes = []
    for _ in range(n):
        b = rng.randint(1, 4)
        shapes.append((b, rng.choice([1, 2, 3, 5, 8, 16, 24, 64, 128]), rng.randint(1, 16),
                       [rng.choice([1, rng.randint(1, 300), rng.randint(1, 20000)]) for _ in range(b)],
                       rng.choice([None, "causal", "tree"]), True))
    return shapes


# The compiled kernels as (cta_rows, tile_keys): the 32-row split kernel with 16- and 32-key
# tiles, and the 64-row wide kernel.
LAYOUTS = ((32, 16), (32, 32), (64, 16))


def correctness_grid(seed: int, random_cases: int = 6, layouts=LAYOUTS, device="cuda"):
    """The fixed odd-size cases plus random shapes, for each kernel layout, as a DataFrame."""
    import pandas as pd

    rng = random.Random(seed)
    shapes = list(FIXED_CASES) + random_shapes(rng, random_cases)
    rows = []
    for batch, heads, q_len, ctx, mask, ext in shapes:
        for cta_rows, tk in layouts:
            case = make_verify_case(batch=batch, heads=heads, q_len=q_len, ctx_lens=ctx, mask=mask,
                                    with_k_extend=ext, seed=rng.randrange(2**31), device=device, pool_extra=257)
            out, lse = run_kernel(case, max_q_len=q_len, tile_keys=tk, cta_rows=cta_rows)
            rows.append({"batch": batch, "heads": heads, "q_len": q_len, "ctx": str(ctx), "mask": mask or "chain",
                         "k_extend": ext, "cta_rows": cta_rows, "tile_keys": tk, **compare(case, out, lse)})
    return pd.DataFrame(rows)
