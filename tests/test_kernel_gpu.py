"""The sm120_mla kernel against the float64 reference, on a GPU (skips visibly elsewhere).

Tolerances and their reasons: sm120_workbook/kernels/checks.py. Every check draws fresh
random inputs, NaN-poisons unused pool rows, the output and the LSE, and checks that every
element was written.
"""
from __future__ import annotations

import math
import random
import shutil

import pytest
import torch

from sm120_workbook.kernels.checks import FIXED_CASES, LAYOUTS, SCHEDULE_VARIANTS, compare, random_shapes, run_kernel
from sm120_workbook.reference import make_verify_case

pytestmark = pytest.mark.gpu


def assert_matches_reference(case, out, lse, label=""):
    r = compare(case, out, lse)
    assert r["written"], f"{label}: output or lse has unwritten (NaN) elements"
    assert r["passed"], f"{label}: rel {r['rel_err']:.2e}, max abs {r['max_abs_err']:.2e}, lse {r['lse_err']:.2e}"
    return r["rel_err"]


CASES = FIXED_CASES
layouts = pytest.mark.parametrize("cta_rows,tile_keys", LAYOUTS, ids=[f"r{r}tk{k}" for r, k in LAYOUTS])


@layouts
@pytest.mark.parametrize("batch,heads,q_len,ctx,mask,with_ext", CASES)
def test_kernel_matches_reference(batch, heads, q_len, ctx, mask, with_ext, cta_rows, tile_keys, seed):
    case = make_verify_case(batch=batch, heads=heads, q_len=q_len, ctx_lens=ctx, mask=mask,
                            with_k_extend=with_ext, seed=seed, device="cuda", pool_extra=257)
    out, lse = run_kernel(case, max_q_len=q_len, tile_keys=tile_keys, cta_rows=cta_rows)
    assert_matches_reference(case, out, lse, f"b{batch} h{heads} q{q_len} ctx{ctx} {mask} r{cta_rows} tk{tile_keys}")


def test_random_shapes(seed):
    """Twenty random shapes: heads 1..128, q_len 1..16, per-request contexts up to 20k."""
    rng = random.Random(seed)
    for i, (batch, heads, q_len, ctx, mask, _) in enumerate(random_shapes(rng, 20)):
        case = make_verify_case(batch=batch, heads=heads, q_len=q_len, ctx_lens=ctx, mask=mask,
                                seed=rng.randrange(2**31), device="cuda")
        cta_rows, tk = LAYOUTS[i % len(LAYOUTS)]
        out, lse = run_kernel(case, max_q_len=q_len, tile_keys=tk, cta_rows=cta_rows)
        assert_matches_reference(case, out, lse, f"#{i} b{batch} h{heads} q{q_len} ctx{ctx} {mask} r{cta_rows} tk{tk}")


@pytest.mark.parametrize("batch, heads, q_len, cta_rows, num_splits",
                         [(16, 8, 1, 32, None), (16, 8, 4, 32, None), (16, 8, 16, 64, None), (32, 8, 1, 32, None),
                          (20, 1, 1, 32, None), (48, 1, 1, 32, None), (130, 1, 1, 32, 2)])
def test_skewed_batch(batch, heads, q_len, cta_rows, num_splits, seed):
    """One long request beside short ones: the kernel gives the long one most of the grid
    (BALANCED_SPLITS, POOL_MIN_MAX), and every row still merges its own splits. At b16 the long
    request has more splits than the combine step preloads (decode: 8 a request on average, ~100
    for the long one). At b32 h8 and b20 h1 decode (4 and 6 splits on average) no preload fits,
    and the combine step walks in 4 and 16 split groups (COMBINE_POOL_GROUPS, on a 132-SM H200).
    At b48 a lane of the pool's search holds two requests; at b130 (2 splits each, forced) the
    pool keeps v19's rule, past the search's 128 requests."""
    rng = random.Random(seed)
    ctx = [rng.randrange(20000, 30000)] + [rng.randrange(1, 200) for _ in range(batch - 1)]
    rng.shuffle(ctx)
    case = make_verify_case(batch=batch, heads=heads, q_len=q_len, ctx_lens=ctx, mask="tree" if q_len > 1 else None,
                            with_k_extend=q_len > 1, seed=seed, device="cuda")
    out, lse = run_kernel(case, max_q_len=q_len, cta_rows=cta_rows, num_splits=num_splits)
    assert_matches_reference(case, out, lse, f"skewed b{batch} h{heads} q{q_len} ctx={ctx}")


@pytest.mark.parametrize("batch, heads, q_len, cta_rows, num_splits",
                         [(2, 8, 16, 64, None), (5, 8, 1, 32, None), (3, 8, 4, 32, None), (40, 1, 1, 32, None),
                          (64, 8, 1, 32, None), (130, 1, 1, 32, 2)])
def test_pool_matches_its_python_mirror(batch, heads, q_len, cta_rows, num_splits, seed):
    """The pool as the kernels computed it (a POOL_TRACE build) is `pool_first_ctas`' schedule:
    every pool CTA of the first row tile has its request, split and split count from it, and the
    combine step finds each row's first split and split count from it (mixed random lengths; b40
    and b64 put two requests on a lane of the search; b130 is past it, on v19's rule)."""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention
    from sm120_workbook.kernels.build import load_kernel_module
    from sm120_workbook.kernels.verify_attention import MAX_SPLITS, pool_first_ctas

    if cta_rows == 64 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the 64-row kernel shares its CTAs by length from sm_90 on (kWidePool); this GPU is older")
    rng = random.Random(seed)
    ctx = [int(math.exp(rng.uniform(0, math.log(30000)))) for _ in range(batch)]
    case = make_verify_case(batch=batch, heads=heads, q_len=q_len, ctx_lens=ctx, mask="tree" if q_len > 1 else None,
                            with_k_extend=q_len > 1, seed=seed, device="cuda")
    defines = ("POOL_TRACE",)
    module = load_kernel_module(defines=defines)
    module.pool_trace()   # clear what earlier calls left
    T, H = batch * q_len, heads
    ws = MlaVerifyWorkspace(T, H, "cuda", num_splits=num_splits, kernel_defines=defines, cta_rows=cta_rows)
    out = torch.empty(T, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(T, H, device="cuda")
    mla_verify_attention(case["q"], case["kv_pool"], case["qo_indptr"], case["kv_indptr"], case["kv_indices"],
                         out=out, lse=lse, workspace=ws, sm_scale=case["sm_scale"], max_q_len=q_len,
                         k_extend=case["k_extend"], custom_mask=case["custom_mask"], mask_indptr=case["mask_indptr"])
    ctas, rows = (t.numpy() for t in module.pool_trace())
    splits = ws.num_splits_for(batch, q_len)
    # every request attends over ctx + q_len keys: the drafts' KV in k_extend (verify) or as the
    # last q_len entries of its kv_indices (decode), and the kernels count both
    keys = [k + q_len for k in ctx]
    first = pool_first_ctas(keys, splits)
    assert first[-1] == batch * splits
    for r in range(batch):
        count = min(first[r + 1] - first[r], MAX_SPLITS)   # the kernels' kMaxSplits
        for c in range(first[r], first[r + 1]):
            assert ctas[c].tolist() == [r, c - first[r], count], (c, r, ctx)
        for row in range(r * q_len * H, (r + 1) * q_len * H):
            assert rows[row].tolist() == [first[r], count], (row, r, ctx)
    assert (ctas[first[-1]:] == -1).all() and (rows[T * H:] == -1).all()
    assert_matches_reference(case, out, lse, f"pool trace b{batch} ctx={ctx}")


@pytest.mark.parametrize("mask", ["causal", "tree", None])
def test_the_draft_mask_at_long_context(mask, seed):
    """At 65k keys, 16 random draft keys hold next to nothing of a row's softmax, so a draft
    mask read wrongly there would pass the tolerances (checks.py). Here the prefix rows are damped
    (x 0.02): the drafts' keys, as drawn, then make most of every row's output, and a draft seen or
    hidden wrongly moves it far past the tolerance, which the test first shows on the reference
    itself (every draft visible against the case's mask)."""
    from sm120_workbook.kernels.checks import REL_TOL
    from sm120_workbook.masks import causal_chain_mask
    from sm120_workbook.reference import mla_verify_reference

    ctx, q_len = 65537, 16
    case = make_verify_case(batch=1, heads=8, q_len=q_len, ctx_lens=ctx, mask=mask, seed=seed, device="cuda",
                            pool_extra=257)
    case["kv_pool"][case["kv_indices"]] *= 0.02   # the used rows only: the rest stay NaN
    causal, indptr = causal_chain_mask([ctx], [q_len])
    every_draft = dict(case, custom_mask=torch.ones_like(causal).cuda(), mask_indptr=indptr.cuda())
    ref, alt = mla_verify_reference(**case), mla_verify_reference(**every_draft)
    moved = ((alt - ref).norm() / ref.norm()).item()
    assert moved > 10 * REL_TOL, f"this case cannot tell the masks apart (every draft visible moves it {moved:.1e})"
    out, lse = run_kernel(case, max_q_len=q_len)
    err = assert_matches_reference(case, out, lse, f"ctx {ctx} {mask}, prefix damped")
    print(f"{mask}: a wrong mask moves the output {moved:.2f}; the kernel is {err:.1e} off")


@pytest.mark.parametrize("num_splits", [1, 2, 7, 8, 31, 33, 128])   # every combine layout (1, 4, 16 groups)
@layouts
def test_any_split_count(num_splits, cta_rows, tile_keys, seed):
    case = make_verify_case(batch=2, heads=8, q_len=16, ctx_lens=[9000, 300], mask="tree", seed=seed,
                            device="cuda")
    out, lse = run_kernel(case, max_q_len=16, num_splits=num_splits, tile_keys=tile_keys, cta_rows=cta_rows)
    assert_matches_reference(case, out, lse, f"splits={num_splits}")


@pytest.mark.parametrize("heads,q_len", [(8, 16), (16, 16), (8, 8), (8, 1), (1, 1), (128, 1)])
def test_combine_layouts(heads, q_len, seed):
    """The combine step's layouts at batch 1, where it loads the partials beside its LSE pass
    (COMBINE_PRELOAD), on the H200 in 8 split groups (q16 h8: 1,024 CTAs), 4 (q16 h16, decode
    h128), or 16 (q8 h8, decode h8 and h1, fp32 partials). Grids that fit no such wave (a fixed 128
    splits at b2, test_any_split_count) run without the preload."""
    case = make_verify_case(batch=1, heads=heads, q_len=q_len, ctx_lens=20000, mask="tree" if q_len > 1 else None,
                            with_k_extend=q_len > 1, seed=seed, device="cuda")
    out, lse = run_kernel(case, max_q_len=q_len)
    assert_matches_reference(case, out, lse, f"h{heads} q{q_len}")


def test_max_q_len_above_actual(seed):
    """A grid sized for 16 draft tokens serves requests with fewer (padding CTAs exit)."""
    case = make_verify_case(batch=3, heads=8, q_len=[16, 3, 9], ctx_lens=[100, 2000, 5], mask="tree",
                            seed=seed, device="cuda")
    out, lse = run_kernel(case, max_q_len=16)
    assert_matches_reference(case, out, lse, "mixed q_len")


@pytest.mark.parametrize("defines", [(), ("COMBINE_PDL=0",)], ids=["default", "no_pdl"])
@pytest.mark.parametrize("cta_rows", [32, 64])
@pytest.mark.parametrize("H,Q", [(16, 16), (8, 1)], ids=["verify", "decode"])
def test_cuda_graph_replay_with_changed_lengths(H, Q, cta_rows, defines, seed):
    """One graph captured at the largest lengths replays correctly for shorter ones (the combine
    step a programmatic dependent, which capture records as its own edge, or launched in order),
    for a verify shape and for decode (the split kernel's one-m16-tile build at 32 rows)."""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    B, MAX_CTX = 3, 6000
    dev = "cuda"
    big = make_verify_case(batch=B, heads=H, q_len=Q, ctx_lens=MAX_CTX, mask="tree", seed=seed, device=dev)
    # Static buffers, as SGLang's graph runner keeps them.
    st = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in big.items()}
    mask_buf = torch.zeros(B * Q * (MAX_CTX + Q), dtype=torch.bool, device=dev)
    mask_buf[:st["custom_mask"].numel()] = st["custom_mask"]
    # kv_indices' tail (SGLang over-allocates it) points at a NaN row of the pool, so a read
    # past kv_indptr[-1] shows in the output instead of landing on a valid row.
    def poisoned_row():
        return int(torch.isnan(st["kv_pool"][:, 0, 0]).nonzero()[0])

    idx_buf = torch.full((B * MAX_CTX,), poisoned_row(), dtype=torch.int64, device=dev)
    idx_buf[:st["kv_indices"].numel()] = st["kv_indices"]
    out = torch.empty(B * Q, H, 512, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(B * Q, H, device=dev, dtype=torch.float32)
    ws = MlaVerifyWorkspace(B * Q, H, dev, cta_rows=cta_rows, kernel_defines=defines)

    def step():
        mla_verify_attention(st["q"], st["kv_pool"], st["qo_indptr"], st["kv_indptr"], idx_buf, out=out,
                             lse=lse, workspace=ws, sm_scale=st["sm_scale"], max_q_len=Q,
                             k_extend=st["k_extend"], custom_mask=mask_buf, mask_indptr=st["mask_indptr"])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()

    rng = random.Random(seed)
    for trial in range(4):
        ctx = [rng.randint(1, MAX_CTX) for _ in range(B)]
        # the captured softmax scale, as a server's graphs keep their layer's
        case = make_verify_case(batch=B, heads=H, q_len=Q, ctx_lens=ctx, mask="tree",
                                seed=rng.randrange(2**31), device=dev, sm_scale=st["sm_scale"],
                                pool_extra=st["kv_pool"].shape[0] - sum(ctx))
        # Same shapes as captured: copy the new step's values into the static buffers.
        st["q"].copy_(case["q"])
        st["k_extend"].copy_(case["k_extend"])
        st["kv_pool"].copy_(case["kv_pool"])
        st["kv_indptr"].copy_(case["kv_indptr"])
        st["mask_indptr"].copy_(case["mask_indptr"])
        idx_buf.fill_(poisoned_row())
        idx_buf[:case["kv_indices"].numel()] = case["kv_indices"]
        mask_buf.zero_()
        mask_buf[:case["custom_mask"].numel()] = case["custom_mask"]
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        graph_out, graph_lse = out.clone(), lse.clone()
        ref_case = dict(case, kv_pool=st["kv_pool"])
        assert_matches_reference(ref_case, graph_out, graph_lse, f"replay {trial} ctx={ctx}")
        eager_out, eager_lse = run_kernel(ref_case, max_q_len=Q, cta_rows=cta_rows, kernel_defines=defines)
        assert torch.equal(graph_out, eager_out), "graph replay differs from eager"


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")   # the refused call captured nothing, as it should
def test_bad_inputs_raise_before_launch():
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    case = make_verify_case(batch=1, heads=8, q_len=4, ctx_lens=64, mask=None, device="cuda")
    T, H = 4, 8
    ws = MlaVerifyWorkspace(T, H, "cuda")
    out = torch.empty(T, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(T, H, device="cuda", dtype=torch.float32)
    kw = dict(out=out, lse=lse, workspace=ws, sm_scale=case["sm_scale"], max_q_len=4, k_extend=case["k_extend"])
    args = [case["q"], case["kv_pool"], case["qo_indptr"], case["kv_indptr"], case["kv_indices"]]

    def expect(arg, *a, **k):
        with pytest.raises(ValueError, match=rf"^{arg}:"):
            mla_verify_attention(*a, **{**kw, **k})

    expect("q", case["q"].float(), *args[1:])
    expect("q", case["q"][:, :, :512].contiguous(), *args[1:])
    expect("q", case["q"].transpose(0, 1), *args[1:])
    expect("kv_pool", args[0], case["kv_pool"].cpu(), *args[2:])
    expect("qo_indptr", args[0], args[1], case["qo_indptr"].long(), *args[3:])
    expect("kv_indices", *args[:4], case["kv_indices"].float())
    expect("out", *args, out=out[:, :, :256])
    expect("lse", *args, lse=lse.double())
    expect("workspace", *args, workspace=MlaVerifyWorkspace(T, 16, "cuda"))
    expect("workspace", *args, workspace=MlaVerifyWorkspace(1, H, "cuda", num_splits=4))
    expect("max_q_len", *args, max_q_len=17)
    expect("k_extend", *args, k_extend=case["k_extend"][:2])
    expect("mask_indptr", *args, custom_mask=torch.ones(10, dtype=torch.bool, device="cuda"))
    expect("custom_mask", *args, mask_indptr=torch.zeros(2, dtype=torch.int64, device="cuda"))
    expect("qo_indptr", args[0], args[1], case["qo_indptr"][:1], *args[3:])
    flat = torch.empty(T * H * 576 + 1, device="cuda", dtype=torch.bfloat16)
    expect("q", flat[1:].view(T, H, 576), *args[1:])          # contiguous but misaligned
    expect("q", case["q"].cpu(), *args[1:])                   # on the CPU beside CUDA tensors
    # values, with check_values: an index past the pool, a mask too short for its rows
    pool_rows = case["kv_pool"].shape[0]
    expect("kv_indices", *args[:4], case["kv_indices"] + pool_rows, check_values=True)
    expect("custom_mask", *args, custom_mask=torch.ones(10, dtype=torch.bool, device="cuda"),
           mask_indptr=torch.zeros(2, dtype=torch.int64, device="cuda"), check_values=True)
    # check_values reads the indices back, which a capture forbids: refused, not a broken capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="^check_values:"):
        with torch.cuda.graph(g):
            mla_verify_attention(*args, **kw, check_values=True)
    # the extension's own checks, for a direct call that skips mla_verify_attention's
    from sm120_workbook.kernels.build import load_kernel_module

    mod = load_kernel_module()

    def direct(pool, ws_o):
        mod.mla_verify_forward(case["q"], pool, case["qo_indptr"], case["kv_indptr"], case["kv_indices"],
                               case["k_extend"], None, None, out, lse, ws_o, ws.partial_lse, case["sm_scale"],
                               4, 1, 16, 32)

    direct(case["kv_pool"], ws.partial_o)   # the same call with these two right runs
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=r"kv_pool must be contiguous bf16 \[P, 576\] or \[P, 1, 576\]"):
        direct(torch.zeros(case["kv_pool"].shape[0], 2, 576, device="cuda", dtype=torch.bfloat16), ws.partial_o)
    with pytest.raises(RuntimeError, match="partial rows must start on a 16-byte boundary"):
        direct(case["kv_pool"], ws.partial_o[1:])


def test_int32_indices(seed):
    """SGLang passes int64 kv_indices and mask_indptr; int32 ones take another load path."""
    case = make_verify_case(batch=3, heads=8, q_len=16, ctx_lens=[3000, 129, 1], mask="tree", seed=seed,
                            device="cuda")
    case["kv_indices"] = case["kv_indices"].to(torch.int32)
    case["mask_indptr"] = case["mask_indptr"].to(torch.int32)
    for cta_rows, tk in LAYOUTS:
        out, lse = run_kernel(case, max_q_len=16, tile_keys=tk, cta_rows=cta_rows)
        assert_matches_reference(case, out, lse, f"int32 indices r{cta_rows} tk{tk}")


@pytest.mark.parametrize("cta_rows", [32, 64])
def test_rows_outside_requests(cta_rows, seed):
    """Tokens past qo_indptr[-1] (graph padding) come out 0 / -inf; tokens past max_q_len
    within a request (a broken contract) come out NaN; every other row stays right."""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    case = make_verify_case(batch=2, heads=8, q_len=[4, 6], ctx_lens=[500, 70], mask="tree", seed=seed,
                            device="cuda")
    T, H = 10, 8
    pad = 3
    q = torch.cat([case["q"], torch.randn(pad, H, 576, device="cuda").bfloat16()])
    ke = torch.cat([case["k_extend"], torch.randn(pad, 1, 576, device="cuda").bfloat16()])
    out = torch.full((T + pad, H, 512), 7.0, device="cuda", dtype=torch.bfloat16)
    lse = torch.full((T + pad, H), 7.0, device="cuda")
    ws = MlaVerifyWorkspace(T + pad, H, "cuda", cta_rows=cta_rows)
    kw = dict(out=out, lse=lse, workspace=ws, sm_scale=case["sm_scale"], k_extend=ke,
              custom_mask=case["custom_mask"], mask_indptr=case["mask_indptr"])
    rest = (case["kv_pool"], case["qo_indptr"], case["kv_indptr"], case["kv_indices"])
    mla_verify_attention(q, *rest, max_q_len=8, **kw)
    assert_matches_reference(case, out[:T], lse[:T], "requests")
    assert (out[T:] == 0).all() and torch.isinf(lse[T:]).all() and (lse[T:] < 0).all()
    good_out, good_lse = out[:T].float().clone(), lse[:T].clone()
    # Request 1 has 6 tokens but the grid is sized for 5: its 6th token comes out NaN, and its
    # other tokens keep their values (the 6th's rows once landed in the next pool CTA's slots).
    kw.update(out=out[:T], lse=lse[:T], k_extend=case["k_extend"])
    mla_verify_attention(case["q"], *rest, max_q_len=5, **kw)
    assert torch.isnan(out[9].float()).all() and torch.isnan(lse[9]).all()
    assert_same_rows(out[:9], lse[:9], good_out[:9], good_lse[:9], "tokens within max_q_len")


def assert_same_rows(out, lse, good_out, good_lse, label):
    """Rows of a second call that must equal the first's: within bf16 rounding of the two calls'
    split plans (1e-2 of the largest output, as the reference tolerance), LSE within 1e-3."""
    out = out.float()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{label}: NaN where a value belongs"
    assert (out - good_out).abs().max() <= 1e-2 * good_out.abs().max(), f"{label}: output moved"
    assert (lse - good_lse).abs().max() <= 1e-3, f"{label}: lse moved"


def assert_nan_rows(out, lse, rows, label):
    """Rows of a call that a broken index contract must leave NaN, in the output and the LSE."""
    assert torch.isnan(out[rows].float()).all() and torch.isnan(lse[rows]).all(), f"{label}: not NaN"


@pytest.mark.parametrize("cta_rows", [32, 64])
def test_broken_index_values_give_nan_rows(cta_rows, seed):
    """Index values that a graph replay cannot check on the host (check_values does, eagerly): a
    request whose qo_indptr range runs past q's T rows, tokens before qo_indptr[0], a decreasing
    kv_indptr, a decreasing qo_indptr. The tokens they touch come out NaN, and a request whose
    ranges are intact keeps its values (a raised kv_indptr entry gives the request before it
    more keys, which it attends over as given). The request past T reads no row past it (v30:
    test_rows_past_t_are_not_read)."""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    H, T = 8, 13
    # no custom_mask (DFlash's implicit chain): a mask sized for the valid q_lens would be read
    # past its end by the broken ones
    case = make_verify_case(batch=3, heads=H, q_len=[4, 6, 3], ctx_lens=[500, 70, 900], mask=None, seed=seed,
                            device="cuda")
    ws = MlaVerifyWorkspace(T, H, "cuda", cta_rows=cta_rows)
    q, k_extend = case["q"], case["k_extend"]

    def call(qo_indptr, kv_indptr):
        out = torch.full((T, H, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((T, H), float("nan"), device="cuda")
        mla_verify_attention(q, case["kv_pool"], qo_indptr, kv_indptr, case["kv_indices"], out=out,
                             lse=lse, workspace=ws, sm_scale=case["sm_scale"], max_q_len=6,
                             k_extend=k_extend)
        torch.cuda.synchronize()
        return out, lse

    qo, kv = case["qo_indptr"], case["kv_indptr"]
    good_out, good_lse = call(qo, kv)
    assert_matches_reference(case, good_out, good_lse, "valid indices")
    good_out = good_out.float()
    def indptr(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    out, lse = call(indptr([0, 4, 10, 15]), kv)           # request 2 runs past q's 13 rows
    assert_nan_rows(out, lse, slice(10, 13), "request past T")
    assert_same_rows(out[:10], lse[:10], good_out[:10], good_lse[:10], "requests inside q")
    out, lse = call(indptr([1, 4, 10, 13]), kv)           # token 0 belongs to no request
    assert_nan_rows(out, lse, slice(0, 1), "token before qo_indptr[0]")
    assert_same_rows(out[4:], lse[4:], good_out[4:], good_lse[4:], "requests 1 and 2")
    k = kv.tolist()
    out, lse = call(qo, indptr([k[0], k[2] + 100, k[2], k[3]]))   # request 1's prefix is -100 keys
    assert_nan_rows(out, lse, slice(4, 10), "negative prefix")
    # request 0 now reads request 1's keys and 100 more; request 2 keeps its range, and its values:
    # the pool counts a negative prefix as no keys, so the CTAs' spans stay apart (v26)
    assert_same_rows(out[10:], lse[10:], good_out[10:], good_lse[10:], "request 2 beside a negative prefix")
    out, lse = call(indptr([0, 4, 2, 8]), kv)   # request 2's tokens 2..7 overlap request 0's 0..3
    assert_nan_rows(out, lse, slice(0, 8), "decreasing qo_indptr")
    assert (out[8:].float() == 0).all() and (lse[8:] == -math.inf).all(), "tokens past qo_indptr[-1]"


@pytest.mark.parametrize("cta_rows, heads, q_len", [(32, 2, 1), (32, 5, 1), (32, 8, 6), (64, 8, 1), (64, 8, 6)],
                         ids=["r32-decode-rows-as-n", "r32-decode-one-mtile", "r32-verify", "r64-decode", "r64-verify"])
def test_rows_past_t_are_not_read(cta_rows, heads, q_len, seed):
    """A request whose qo_indptr range runs past q's T rows computes nothing (v30: the kernels
    know T, in Params' spare bits), so none of its CTAs reads q or k_extend and none writes a
    workspace slot; the combine step gives its tokens NaN. Before v30 its CTAs read the rows past
    T, out of bounds for an unpadded q, and wrote their slots. At batch 1 every slot would be the
    request's, so the whole workspace must keep its fill. Every split build runs: at 2 heads the
    decode rows (max_q_len 3 x 2) are the mma's N, at 5 heads (15 rows) one m16 tile. (The
    sanitizer case runs the same with q and k_extend as allocations of their own, under memcheck.)"""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    H, T = heads, q_len
    case = make_verify_case(batch=1, heads=H, q_len=q_len, ctx_lens=300, mask=None, seed=seed,
                            with_k_extend=q_len > 1, device="cuda")
    ws = MlaVerifyWorkspace(T + 2, H, "cuda", cta_rows=cta_rows)
    ws.partial_lse.fill_(12345.0)
    out = torch.full((T, H, 512), 7.0, device="cuda", dtype=torch.bfloat16)
    lse = torch.full((T, H), 7.0, device="cuda")
    qo = torch.tensor([0, T + 2], dtype=torch.int32, device="cuda")   # two rows past q's T
    mla_verify_attention(case["q"], case["kv_pool"], qo, case["kv_indptr"], case["kv_indices"], out=out, lse=lse,
                         workspace=ws, sm_scale=case["sm_scale"], max_q_len=T + 2, k_extend=case["k_extend"])
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all(), "the request past T: not NaN"
    assert (ws.partial_lse == 12345.0).all(), "a CTA of the request past T computed (and read q past T)"


@pytest.mark.parametrize("cta_rows, batch, q_len, defines",
                         [(32, 3, 4, ()), (32, 1, 1, ()), (64, 3, 8, ()), (64, 1, 8, ()),
                          (32, 3, 4, ("BALANCED_SPLITS=0",)), (64, 3, 8, ("BALANCED_SPLITS=0",))],
                         ids=["r32-pooled", "r32-decode-rows-as-n", "r64-pooled", "r64-b1",
                              "r32-unpooled", "r64-unpooled"])
def test_reads_past_the_index_tensors_give_nan_rows(cta_rows, batch, q_len, defines, seed):
    """A request whose kv_indptr range passes len(kv_indices), whose mask rows (mask_indptr[b] +
    q_len x its keys) pass len(custom_mask) or start before it, or whose kv_indptr has an entry
    below 0, reads neither tensor (v31: the kernels take both lengths as a second argument), and
    its tokens come out NaN; every other request keeps its values. Before v31 its CTAs read past
    the tensors. Here the last request's reads pass kv_indices or the mask (each one entry short;
    the mask with an int32 mask_indptr too), its kv_indptr end is INT_MIN (its 32-bit key count
    would wrap to ~2^31), or its mask_indptr is -1 or 2^32 + 5; and the first request's range
    starts one key before kv_indices. Every layout runs: the pooled split kernel, its decode
    build (8 rows, the mma's N), the 64-row kernel's batches (pooled from sm_90 on) and batch 1,
    and both kernels unpooled (BALANCED_SPLITS=0). (The sanitizer case runs the short tensors as
    allocations of their own, under memcheck.)"""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    H = 8
    ctx = [300 + 41 * b for b in range(batch)]
    decode = q_len == 1
    case = make_verify_case(batch=batch, heads=H, q_len=q_len, ctx_lens=ctx, mask="causal" if decode else "tree",
                            seed=seed, with_k_extend=not decode, device="cuda")
    T = batch * q_len
    ws = MlaVerifyWorkspace(T, H, "cuda", cta_rows=cta_rows, kernel_defines=defines)

    def call(kv_indptr, kv_indices, custom_mask, mask_indptr=case["mask_indptr"]):
        out = torch.full((T, H, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((T, H), float("nan"), device="cuda")
        mla_verify_attention(case["q"], case["kv_pool"], case["qo_indptr"], kv_indptr, kv_indices, out=out, lse=lse,
                             workspace=ws, sm_scale=case["sm_scale"], max_q_len=q_len, k_extend=case["k_extend"],
                             custom_mask=custom_mask, mask_indptr=mask_indptr)
        torch.cuda.synchronize()
        return out, lse

    kv, kv_indices, mask, mask_indptr = case["kv_indptr"], case["kv_indices"], case["custom_mask"], case["mask_indptr"]
    assert int(kv[-1]) == kv_indices.numel() and int(mask_indptr[-1]) == mask.numel()   # no slack to pass
    good_out, good_lse = call(kv, kv_indices, mask)
    assert_matches_reference(case, good_out, good_lse, "valid indices")
    good_out = good_out.float()
    last, first = T - q_len, q_len   # the last request's first token; the first request's end
    kv_wraps, mask_before, mask_far = kv.clone(), mask_indptr.clone(), mask_indptr.clone()
    kv_wraps[-1] = -2**31      # the last request's prefix_len would wrap to ~2^31 in 32 bits (a review, session 47)
    mask_before[-2] = -1       # the last request's mask rows start one byte before the mask
    mask_far[-2] = 2**32 + 5   # past the mask, and past any int32 truncation of the value
    for label, args in (("kv_indices one short", (kv, kv_indices[:-1].clone(), mask)),
                        ("the mask one short", (kv, kv_indices, mask[:-1].clone())),
                        ("the mask one short, int32 mask_indptr",
                         (kv, kv_indices, mask[:-1].clone(), mask_indptr.to(torch.int32))),
                        ("a wrapping kv_indptr", (kv_wraps, kv_indices, mask)),
                        ("mask rows before the mask", (kv, kv_indices, mask, mask_before)),
                        ("mask rows 2^32 past the mask", (kv, kv_indices, mask, mask_far))):
        out, lse = call(*args)
        assert_nan_rows(out, lse, slice(last, None), label)
        if batch > 1:
            assert_same_rows(out[:last], lse[:last], good_out[:last], good_lse[:last], f"{label}: the other requests")
    kv_before = kv.clone()
    kv_before[0] = -1   # the first request's range starts one key before kv_indices
    out, lse = call(kv_before, kv_indices, mask)
    assert_nan_rows(out, lse, slice(None, first), "a range before 0")
    if batch > 1:
        assert_same_rows(out[first:], lse[first:], good_out[first:], good_lse[first:], "beside a range before 0")
    out, lse = call(kv, kv_indices, mask)   # the next valid call is whole again
    assert_same_rows(out, lse, good_out, good_lse, "a valid call after the broken ones")


BROKEN_BATCH = -1   # kBrokenBatch: the count POOL_TRACE records for a CTA of a broken batch


@pytest.mark.parametrize("batch, cta_rows, defines",
                         [(1, 64, ()), (1, 32, ()), (2, 64, ()), (2, 64, ("BALANCED_SPLITS=0",)),
                          (2, 32, ("BALANCED_SPLITS=0",)), (130, 32, ("POOL_TRACE",))],
                         ids=["b1-r64", "b1-r32", "b2-r64", "b2-r64-unpooled", "b2-r32-unpooled", "b130-trace"])
def test_broken_indptrs_stay_inside_the_workspace(batch, cta_rows, defines, seed):
    """Whatever the indptrs hold, no workspace slot past the call's batch x max_q_len x H x
    splits rows is written. Here the last request's qo_indptr range starts later than its place
    and runs past q's T rows: in the unpooled layouts (the 64-row kernel at batch 1, and with
    BALANCED_SPLITS=0 both kernels' batches, as the 64-row kernel's on sm_80-89) its slots go row
    by row from its first token, and v25 wrote them past the workspace. At 130 requests (v19's
    pool rule, two splits each) kv_indptr also decreases, far enough that the pool put a CTA
    before its request's first (v25 gave it a negative split, its keys before the request's
    kv_indices); since v29 the whole batch is broken, and the POOL_TRACE build shows that no
    CTA took work. The workspace is sized for 4x the tokens; its tail is checked after the call."""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention
    from sm120_workbook.kernels.build import load_kernel_module

    H, q_len = 8, 16 if batch < 130 else 1
    ctx = [300 + 37 * b for b in range(batch)]
    case = make_verify_case(batch=batch, heads=H, q_len=q_len, ctx_lens=ctx, mask=None, seed=seed,
                            with_k_extend=q_len > 1, device="cuda")
    T = batch * q_len
    ws = MlaVerifyWorkspace(4 * T, H, "cuda", cta_rows=cta_rows, num_splits=2 if batch >= 130 else None,
                            kernel_defines=defines)
    splits = ws.num_splits_for(batch, q_len)
    used = batch * q_len * H * splits
    ws.partial_lse.fill_(12345.0)
    o_tail = ws.partial_o.view(torch.uint8)[used * 512 * 2:]   # bf16 partials: 1 KB a slot
    o_tail.fill_(0x5A)
    qo = case["qo_indptr"].clone()
    qo[-2:] += q_len // 2 + 1 if q_len > 1 else 1   # the last request starts later and ends past T
    kv = case["kv_indptr"].clone()
    if batch >= 130:   # request batch/2 - 1 gains 5,000 keys, request batch/2 goes negative
        kv[batch // 2] = kv[batch // 2 + 1] + 5000
        assert int(kv[batch // 2]) < case["kv_indices"].numel()
    q, k_extend = case["q"], case["k_extend"]   # no row past T is read (test_rows_past_t_are_not_read)
    out = torch.full((T, H, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((T, H), float("nan"), device="cuda")
    module = load_kernel_module(defines=defines)
    if "POOL_TRACE" in defines:
        module.pool_trace()   # clear what earlier calls left
    mla_verify_attention(q, case["kv_pool"], qo, kv, case["kv_indices"], out=out, lse=lse, workspace=ws,
                         sm_scale=case["sm_scale"], max_q_len=q_len, k_extend=k_extend)
    torch.cuda.synchronize()
    assert (ws.partial_lse[used:] == 12345.0).all(), f"lse slots past {used} rows written"
    assert (o_tail == 0x5A).all(), f"partial slots past {used} rows written"
    assert torch.isnan(out[T - 1].float()).all() and torch.isnan(lse[T - 1]).all(), "the request past T: not NaN"
    if batch >= 130:
        assert torch.isnan(out.float()).all() and torch.isnan(lse).all(), "a broken batch: not NaN everywhere"
        count = module.pool_trace()[0][: batch * splits, 2]
        assert (count == BROKEN_BATCH).all(), "a CTA of a broken batch took work"


@pytest.mark.parametrize("batch, cta_rows, defines, broken",
                         [(130, 32, (), "kv"), (130, 32, (), "qo"), (130, 64, (), "kv"), (130, 64, (), "qo"),
                          (3, 64, ("BALANCED_SPLITS=0",), "qo"), (3, 32, ("BALANCED_SPLITS=0",), "qo")],
                         ids=["b130-r32-kv", "b130-r32-qo", "b130-r64-kv", "b130-r64-qo",
                              "b3-r64-unpooled-qo", "b3-r32-unpooled-qo"])
def test_broken_batches_give_nan_everywhere(batch, cta_rows, defines, broken, seed):
    """Where the layout cannot keep a broken batch's requests apart, every token before
    qo_indptr[-1] comes out NaN (v29; before, some came out wrong, silently). Past 128 requests
    (v19's pool rule, pooled layouts) a decreasing indptr, kv or qo, left the pool's spans overlapping or empty,
    so a request could read partials another request's CTAs wrote, or stale slots. In the
    unpooled layouts (BALANCED_SPLITS=0 here; the 64-row kernel's batches on sm_80-89) a
    decreasing qo_indptr made two requests write the same slots. Every CTA now gives its slots
    an LSE of +inf. The outputs are poisoned first, and the workspace holds a valid call's
    partials, so stale slots would show as values."""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    if broken == "kv" and cta_rows == 64 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the 64-row kernel's batches are unpooled before sm_90 (kWidePool): a decreasing "
                    "kv_indptr gives NaN to its own request only (test_broken_index_values_give_nan_rows)")
    H, q_len = 8, (16 if cta_rows == 64 else 6)   # r32: 48 rows, two row tiles of the split kernel's 32
    ctx = [200 + 13 * b for b in range(batch)]
    case = make_verify_case(batch=batch, heads=H, q_len=q_len, ctx_lens=ctx, mask=None, seed=seed, device="cuda")
    T = batch * q_len
    ws = MlaVerifyWorkspace(T, H, "cuda", cta_rows=cta_rows, num_splits=2, kernel_defines=defines)

    def call(qo, kv):
        out = torch.full((T, H, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((T, H), float("nan"), device="cuda")
        mla_verify_attention(case["q"], case["kv_pool"], qo, kv, case["kv_indices"], out=out, lse=lse, workspace=ws,
                             sm_scale=case["sm_scale"], max_q_len=q_len, k_extend=case["k_extend"])
        torch.cuda.synchronize()
        return out, lse

    good_out, good_lse = call(case["qo_indptr"], case["kv_indptr"])   # fills the workspace
    assert_matches_reference(case, good_out, good_lse, "valid indices")
    qo, kv = case["qo_indptr"].clone(), case["kv_indptr"].clone()
    mid = batch // 2
    if broken == "kv":   # request mid - 1 runs on through request mid's keys and 50 more; mid's range is -50
        kv[mid] = kv[mid + 1] + 50
    else:                # request mid's q_len is -1, and request mid + 1 starts on request mid - 1's last token
        qo[mid + 1] -= q_len + 1
    out, lse = call(qo, kv)
    end = int(qo[-1])
    assert torch.isnan(out[:end].float()).all() and torch.isnan(lse[:end]).all(), "a token of a broken batch: not NaN"
    assert (out[end:].float() == 0).all() and (lse[end:] == -math.inf).all(), "tokens past qo_indptr[-1]"
    out, lse = call(case["qo_indptr"], case["kv_indptr"])   # the next valid call is whole again
    assert_same_rows(out, lse, good_out.float(), good_lse, "a valid call after a broken one")


@pytest.mark.parametrize("cta_rows, heads, qo_values",
                         [(64, 8, [12, 12 - 268435457]), (64, 8, [2147483640, -100]), (32, 5, [12, 12 - 600000000]),
                          (32, 8, [2147483640, -100])],
                         ids=["r64-negative-q_len", "r64-wrapping-q_len", "r32-h5-negative-q_len", "r32-wrapping-q_len"])
def test_wrapping_indptrs_write_nothing(cta_rows, heads, qo_values, seed):
    """int32 index values whose arithmetic wraps (a review of v27 found both): a q_len of
    -268435457 made min(q_len, max_q_len) x 8 heads (and -600000000 x 5) wrap to a huge row count, so the kernels took
    rows they have no slots for (the unpooled layout's empty-split LSE past its rows, the pooled
    layout's padding rows past its pool); and q_start 2147483640 with qo_indptr[1] -100 wraps
    q_len positive, which v27's q_start + q_len test let through (q read ~2^31 rows out), and
    which the split kernel's T test (v30) let through on sm_120a as first compiled, where nvcc
    folded it to qo_indptr[1] <= T (the H200's sm_90 code kept the subtraction). Both
    qo_indptr pairs end below 0, so every token counts as padding (0 and -inf) and no kernel
    writes a workspace slot."""
    from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention

    T = 16
    case = make_verify_case(batch=1, heads=heads, q_len=T, ctx_lens=[300], mask=None, seed=seed, device="cuda")
    ws = MlaVerifyWorkspace(4 * T, heads, "cuda", cta_rows=cta_rows)
    ws.partial_lse.fill_(12345.0)
    ws.partial_o.view(torch.uint8).fill_(0x5A)
    out = torch.full((T, heads, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((T, heads), float("nan"), device="cuda")
    qo = torch.tensor(qo_values, dtype=torch.int32, device="cuda")
    mla_verify_attention(case["q"], case["kv_pool"], qo, case["kv_indptr"], case["kv_indices"], out=out, lse=lse,
                         workspace=ws, sm_scale=case["sm_scale"], max_q_len=T, k_extend=case["k_extend"])
    torch.cuda.synchronize()
    assert (ws.partial_lse == 12345.0).all() and (ws.partial_o.view(torch.uint8) == 0x5A).all(), "a slot written"
    assert (out.float() == 0).all() and (lse == -math.inf).all(), "tokens past qo_indptr[-1] are padding"


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_clean(tool):
    # checked here, not in a skipif mark: pytest would give that reason before the GPU one
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    from sm120_workbook.kernels import sanitize

    sanitize.build()
    r = sanitize.run_tool(tool)
    print(r["report_tail"])
    assert r["clean"], f"{tool}: {r['summary']}; first lines:\n" + "\n".join(r["first_lines"])


@pytest.mark.parametrize("defines,cta_rows", SCHEDULE_VARIANTS,
                         ids=lambda d: "+".join(d) if isinstance(d, tuple) else f"r{d}")
def test_schedule_variant_build_matches_reference(defines, cta_rows, seed):
    """Builds with another schedule (v14's per-group named barriers, P.V one half-round later,
    a 3-stage ring, row CTAs that walk the tiles from staggered starts, score warps that issue part
    of each refill; the wide kernel with a 2- or 3-stage ring, its refill before QK, its row pairs in step, or each warp's QK and
    P.V fused into one stream; the combine step launched in order, or without its preload; the
    timeline stamps; Q loaded from and fp32 partials stored straight to global memory, or Q
    copied in the same order by every split, or by cp.async as up to v18h; splits of at least
    64 keys, as up to v18j; the split kernel's first tiles each after its own index load, as up
    to v18k, only the first of them or all four before tile 0's hand-over; decode on two m16 tiles,
    as up to v18l, or with the rows as the mma's M, as up to v20; each value warp refilling its own
    columns right after its P.V; num_splits CTAs a request whatever its length, as up to v18n, or
    shared out by keys, as up to v19) compute the same attention."""

    # verify shapes, and three that fit one m16 tile (decode, 16 rows with a tree, 8 rows with a tree)
    for i, (batch, heads, q_len, ctx, mask, ext) in enumerate(FIXED_CASES[:4] + FIXED_CASES[6:7] + FIXED_CASES[9:12]):
        case = make_verify_case(batch=batch, heads=heads, q_len=q_len, ctx_lens=ctx, mask=mask,
                                with_k_extend=ext, seed=seed + i, device="cuda", pool_extra=257)   # printed: replayable
        out, lse = run_kernel(case, max_q_len=q_len, kernel_defines=defines, cta_rows=cta_rows)
        res = compare(case, out, lse)
        assert res["passed"], (batch, heads, q_len, ctx, mask, res)


def test_timings_flush_l2_by_reading_and_say_so():
    """Every timing's record says how L2 was emptied before it (bench.L2_FLUSH: read, since session
    51); the flush leaves its buffer as it was."""
    from sm120_workbook.kernels import bench

    x = torch.ones(1 << 20, device="cuda")
    t = bench.time_graph_us(lambda: x.mul_(1.0), reps=3)
    assert t["l2_flush"] == "read" and t["reps"] == 3 and t["time_us"] > 0
    flush = bench.L2Flush()
    flush.buf[::4096] = 7
    before = flush.buf.clone()
    flush()
    torch.cuda.synchronize()
    assert torch.equal(flush.buf, before) and flush.sink.item() == before.sum().item()


def test_the_layer_flush_replays_the_layer_as_one_graph(monkeypatch):
    """`--l2-flush layer`: one graph launch runs the read flush and a served MLA layer's kernels
    before attention (bench.LayerPrelude), and the replay computes what the prelude computes eagerly
    (launched one by one, its kernels once left the GPU idle before the timed replay: session 53)."""
    from sm120_workbook.kernels import bench

    monkeypatch.setattr(bench, "L2_FLUSH_BYTES", 1 << 24)   # a small buffer: the graph is the point here
    flush = bench.L2Flush("layer")
    assert flush.graph is not None and flush.prelude is not None
    p = flush.prelude
    p.kv_pool.fill_(float("nan"))
    p.q_out.fill_(float("nan"))
    flush.buf[::4096] = 5
    flush()
    torch.cuda.synchronize()
    assert flush.sink.item() == 5 * (flush.buf.numel() // 4096)
    replayed_q, replayed_kv = p.q_out.clone(), p.kv_pool[p.slots].clone()
    assert replayed_q.isfinite().all() and replayed_kv.isfinite().all()
    p.q_out.fill_(float("nan"))
    p.kv_pool.fill_(float("nan"))
    p()   # eagerly, on the same inputs
    torch.cuda.synchronize()
    # bf16 at torch's default tolerance for it: the same kernels, in a graph or not
    torch.testing.assert_close(p.q_out, replayed_q)
    torch.testing.assert_close(p.kv_pool[p.slots], replayed_kv)
