"""The float64 oracle against its explicit loop, against hand cases, and against SGLang's own
Triton `extend_attention_fwd` (run on CPU by the Triton interpreter, in a subprocess)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from sm120_workbook.masks import (causal_chain_mask, draft_block, mask_indptr_for, random_tree_mask,
                                  random_tree_parents, tree_draft_block)
from sm120_workbook.reference import (SM_SCALES, case_lengths, make_verify_case,
                                      mla_verify_loop, mla_verify_reference)


def _random_shape(rng: random.Random, max_batch=3, max_ctx=24, q_len=None):
    batch = rng.randint(1, max_batch)
    q_lens = [q_len or rng.randint(1, 16) for _ in range(batch)]
    ctx = [rng.randint(0, max_ctx) for _ in range(batch)]
    return batch, q_lens, ctx


def _assert_matches_loop(case, atol=1e-10):
    out, lse = mla_verify_reference(**case, return_lse=True)
    out_loop, lse_loop = mla_verify_loop(**case, return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert not torch.isnan(out).any(), "NaN in the reference output: a poisoned pool row leaked in"
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(out, out_loop, atol=atol, rtol=0)
    torch.testing.assert_close(lse, lse_loop, atol=atol, rtol=0)
    return out, lse


# -- the reference against the loop --------------------------------------------------------

@pytest.mark.parametrize("with_k_extend", [True, False], ids=["k_extend", "pool_only"])
@pytest.mark.parametrize("mask", ["causal", "tree", None], ids=["causal_mask", "tree_mask", "no_mask"])
@pytest.mark.parametrize("heads", [1, 3, 8, 128])
def test_reference_matches_loop(seed, heads, mask, with_k_extend):
    rng = random.Random(seed)
    batch, q_lens, ctx = _random_shape(rng, max_batch=3, max_ctx=40)
    case = make_verify_case(batch, heads, q_lens, ctx, mask=mask, seed=seed,
                            pool_extra=rng.randint(0, 40), dtype=torch.bfloat16, with_k_extend=with_k_extend)
    assert case_lengths(case) == (ctx, q_lens)
    _assert_matches_loop(case)


@pytest.mark.parametrize("q_len", [1, 2, 15, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_matches_loop_q_len_edges(seed, q_len, dtype):
    rng = random.Random(seed)
    batch, q_lens, ctx = _random_shape(rng, max_batch=2, max_ctx=20, q_len=q_len)
    case = make_verify_case(batch, 2, q_lens, ctx, mask=rng.choice(["causal", "tree", None]),
                            seed=seed, dtype=dtype)
    _assert_matches_loop(case)


def test_pool_shapes_and_mask_dtypes_agree(seed):
    case = make_verify_case(3, 4, [3, 5, 2], [7, 0, 11], mask="tree", seed=seed)
    base = mla_verify_reference(**case)
    flat = dict(case, kv_pool=case["kv_pool"][:, 0], k_extend=case["k_extend"][:, 0])
    torch.testing.assert_close(mla_verify_reference(**flat), base, atol=0, rtol=0)
    as_u8 = dict(case, custom_mask=case["custom_mask"].to(torch.uint8))
    torch.testing.assert_close(mla_verify_reference(**as_u8), base, atol=0, rtol=0)
    wide = dict(case, qo_indptr=case["qo_indptr"].long(), kv_indptr=case["kv_indptr"].long(),
                kv_indices=case["kv_indices"].int(), mask_indptr=case["mask_indptr"].int())
    torch.testing.assert_close(mla_verify_reference(**wide), base, atol=0, rtol=0)


def test_causal_custom_mask_equals_no_mask(seed):
    case = make_verify_case(2, 3, [4, 6], [5, 9], mask="causal", seed=seed)
    no_mask = dict(case, custom_mask=None, mask_indptr=None)
    torch.testing.assert_close(mla_verify_reference(**case), mla_verify_reference(**no_mask), atol=0, rtol=0)


def test_prefix_columns_of_the_mask_are_not_read(seed):
    """SGLang may leave them unwritten (fill_prefix_mask=False; skip_prefix_custom_mask=True)."""
    case = make_verify_case(2, 3, [4, 3], [6, 10], mask="tree", seed=seed)
    ctx, q_lens = case_lengths(case)
    scrambled = case["custom_mask"].clone()
    for b, (p, t) in enumerate(zip(ctx, q_lens)):
        start = int(case["mask_indptr"][b])
        rows = scrambled[start:start + t * (p + t)].view(t, p + t)
        rows[:, :p] = torch.rand(t, p) < 0.5
    torch.testing.assert_close(mla_verify_reference(**dict(case, custom_mask=scrambled)),
                               mla_verify_reference(**case), atol=0, rtol=0)


def test_kv_indices_tail_beyond_kv_indptr_is_ignored(seed):
    """SGLang over-allocates kv_indices; entries past kv_indptr[-1] are garbage."""
    case = make_verify_case(2, 2, 3, [4, 5], mask=None, seed=seed)
    padded = torch.cat([case["kv_indices"], torch.tensor([-1, 10**9])])
    torch.testing.assert_close(mla_verify_reference(**dict(case, kv_indices=padded)),
                               mla_verify_reference(**case), atol=0, rtol=0)


def test_nan_poison_in_unused_slots_and_visible_output(seed):
    case = make_verify_case(2, 4, 4, [9, 3], mask="tree", pool_extra=50, seed=seed)
    pool = case["kv_pool"][:, 0]
    used = set(case["kv_indices"].tolist())
    unused = [i for i in range(pool.shape[0]) if i not in used]
    assert len(unused) == 50 and torch.isnan(pool[unused]).all()
    assert not torch.isnan(pool[sorted(used)]).any()
    assert not torch.isnan(mla_verify_reference(**case)).any()
    # and a poisoned row that *is* referenced does show up: the check above can fail
    idx = case["kv_indices"].clone()
    idx[0] = unused[0]
    assert torch.isnan(mla_verify_reference(**dict(case, kv_indices=idx))).any()


def test_hand_case_single_visible_key():
    """With no prefix and a mask where each draft sees only itself, out = its own V row."""
    t, heads = 3, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, heads, 576, generator=g, dtype=torch.float64)
    k_ext = torch.randn(t, 576, generator=g, dtype=torch.float64)
    custom_mask = torch.eye(t, dtype=torch.bool).reshape(-1)
    out, lse = mla_verify_reference(
        q, torch.zeros(1, 576, dtype=torch.float64), torch.tensor([0, t]), torch.tensor([0, 0]),
        torch.zeros(0, dtype=torch.int64), 0.5, k_extend=k_ext, custom_mask=custom_mask,
        mask_indptr=torch.tensor([0, t * t]), return_lse=True)
    torch.testing.assert_close(out, k_ext[:, None, :512].expand(t, heads, 512), atol=0, rtol=0)
    torch.testing.assert_close(lse, 0.5 * torch.einsum("thd,td->th", q, k_ext), atol=1e-12, rtol=0)


def test_hand_case_two_equal_keys_average():
    """Two keys with equal scores: the output is the mean of their V rows, lse = s + log 2."""
    kv = torch.zeros(4, 576, dtype=torch.float32)
    kv[1, :512] = 2.0
    kv[3, :512] = 4.0
    q = torch.zeros(1, 1, 576, dtype=torch.float32)   # all scores 0
    out, lse = mla_verify_reference(q, kv, torch.tensor([0, 1]), torch.tensor([0, 2]),
                                    torch.tensor([1, 3]), 1.0, return_lse=True)
    assert torch.all(out == 3.0)
    assert abs(float(lse) - torch.log(torch.tensor(2.0, dtype=torch.float64)).item()) < 1e-15


def test_make_verify_case_layout(seed):
    case = make_verify_case(3, 5, [2, 16, 1], [0, 13, 40], mask="tree", seed=seed, pool_extra=7)
    assert case["q"].shape == (19, 5, 576) and case["q"].dtype == torch.bfloat16
    assert case["kv_pool"].shape == (53 + 7, 1, 576)
    assert case["k_extend"].shape == (19, 1, 576)
    assert case["qo_indptr"].dtype == torch.int32 and case["qo_indptr"].tolist() == [0, 2, 18, 19]
    assert case["kv_indptr"].dtype == torch.int32 and case["kv_indptr"].tolist() == [0, 0, 13, 53]
    assert case["kv_indices"].dtype == torch.int64
    assert len(set(case["kv_indices"].tolist())) == 53          # unique slots
    assert case["kv_indices"].tolist() != list(range(53))       # scattered
    assert case["mask_indptr"].dtype == torch.int64
    assert case["sm_scale"] in SM_SCALES
    scales = {make_verify_case(1, 1, 1, 3, seed=s)["sm_scale"] for s in range(40)}
    assert scales == set(SM_SCALES)   # each case draws one: the bare scale and the real models'
    assert make_verify_case(1, 1, 1, 3, seed=seed, sm_scale=0.25)["sm_scale"] == 0.25
    again = make_verify_case(3, 5, [2, 16, 1], [0, 13, 40], mask="tree", seed=seed, pool_extra=7)
    for k in ("q", "kv_pool", "kv_indices", "custom_mask"):
        torch.testing.assert_close(again[k], case[k], atol=0, rtol=0, equal_nan=True)
    decode = make_verify_case(2, 2, 3, [4, 6], mask=None, seed=seed, with_k_extend=False)
    assert decode["k_extend"] is None and decode["kv_indptr"].tolist() == [0, 7, 16]
    assert case_lengths(decode) == ([4, 6], [3, 3])


# -- masks ---------------------------------------------------------------------------------

def test_mask_indptr_is_sglangs_formula():
    prefix, q = [5, 0, 12], [4, 4, 4]
    expect = [0]
    for p, t in zip(prefix, q):
        expect.append(expect[-1] + t * (p + t))
    ind = mask_indptr_for(prefix, q)
    assert ind.dtype == torch.int64 and ind.tolist() == expect
    mask, ind2 = causal_chain_mask(prefix, 4)
    assert ind2.tolist() == expect and mask.numel() == expect[-1] and mask.dtype == torch.bool


def test_causal_chain_mask_blocks():
    prefix, q = [3, 0], [5, 2]
    mask, ind = causal_chain_mask(prefix, q)
    for b, (p, t) in enumerate(zip(prefix, q)):
        rows = mask[int(ind[b]):int(ind[b]) + t * (p + t)].view(t, p + t)
        assert rows[:, :p].all()
        assert torch.equal(draft_block(mask, ind, b, p, t), torch.ones(t, t, dtype=torch.bool).tril())


def test_random_tree_mask_is_a_tree(seed):
    rng = random.Random(seed)
    prefix = [rng.randint(0, 9) for _ in range(3)]
    q = [rng.randint(1, 16) for _ in range(3)]
    mask, ind = random_tree_mask(prefix, q, torch.Generator().manual_seed(seed))
    assert mask.numel() == int(ind[-1])
    for b, (p, t) in enumerate(zip(prefix, q)):
        rows = mask[int(ind[b]):int(ind[b]) + t * (p + t)].view(t, p + t)
        assert rows[:, :p].all()
        blk = rows[:, p:]
        assert blk.diagonal().all() and blk[:, 0].all()           # itself and the root
        assert not blk.triu(1).any()                              # ancestors precede descendants
        for i in range(1, t):
            # exactly one parent: the deepest visible earlier node; it sees a subset of i's view
            parent = max(j for j in range(i) if blk[i, j])
            assert torch.equal(blk[i, :i], blk[parent, :i] | (torch.arange(i) == parent))
    again, _ = random_tree_mask(prefix, q, torch.Generator().manual_seed(seed))
    assert torch.equal(again, mask)


def test_random_trees_branch():
    """The trees are trees, not chains in disguise: over a few seeds some draft has a parent
    other than the draft before it, and some node has two children."""
    from sm120_workbook.masks import random_tree_parents

    trees = [random_tree_parents(8, torch.Generator().manual_seed(s)) for s in range(10)]
    assert any(p != i - 1 for t in trees for i, p in enumerate(t) if i > 0)
    assert any(max(t.count(j) for j in range(8)) >= 2 for t in trees)


def test_the_reference_by_head_chunks_is_the_reference_whole(monkeypatch):
    """At 256k keys the reference takes the heads a few at a time (float64 scores would not fit
    at once): chunks of 3 of 7 heads give what all 7 at once give, to float64 rounding."""
    import sm120_workbook.reference as reference

    c = make_verify_case(2, 7, [3, 5], [40, 90], mask="tree", seed=5)
    whole, whole_lse = mla_verify_reference(**c, return_lse=True)
    monkeypatch.setattr(reference, "_SCORE_ELEMS_PER_CHUNK", 3 * 5 * 95)   # 3 heads of the longer request
    chunked, chunked_lse = mla_verify_reference(**c, return_lse=True)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked_lse, whole_lse, rtol=1e-12, atol=1e-12)


def test_tree_draft_block_from_parents():
    blk = tree_draft_block([-1, 0, 0, 1, 3])
    assert blk.int().tolist() == [[1, 0, 0, 0, 0],
                                  [1, 1, 0, 0, 0],
                                  [1, 0, 1, 0, 0],
                                  [1, 1, 0, 1, 0],
                                  [1, 1, 0, 1, 1]]
    assert random_tree_parents(1) == [-1]
    with pytest.raises(ValueError, match="parents"):
        tree_draft_block([-1, 1])


@pytest.mark.parametrize("call, name", [
    (lambda: causal_chain_mask([1, 2], [1, 2, 3]), "q_lens"),
    (lambda: causal_chain_mask([-1], [2]), "prefix_lens"),
    (lambda: causal_chain_mask([1.5], [2]), "prefix_lens"),
    (lambda: random_tree_mask([], 2), "prefix_lens"),
    (lambda: draft_block(torch.ones(4, dtype=torch.bool), torch.tensor([0, 8]), 0, 2, 2), "custom_mask"),
    # a prefix or draft length that does not match the request's mask, or no such request
    (lambda: draft_block(*causal_chain_mask([4], [2]), 0, 3, 2), "prefix_len, q_len"),
    (lambda: draft_block(*causal_chain_mask([4], [2]), 0, 4, 1), "prefix_len, q_len"),
    (lambda: draft_block(*causal_chain_mask([4], [2]), 1, 4, 2), "b: a request index in 0..0"),
    (lambda: draft_block(*causal_chain_mask([4], [2]), -1, 4, 2), "b: a request index"),
])
def test_mask_bad_inputs(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# -- bad inputs name the argument ------------------------------------------------------------

def _bad_cases():
    def edit(**kw):
        return kw

    c = make_verify_case(2, 2, 3, [4, 5], mask="tree", seed=0)
    return [
        (edit(q=c["q"][..., :512]), "q"),
        (edit(q=c["q"].to(torch.int32)), "q"),
        (edit(q=c["q"][:, :, None]), "q"),
        (edit(kv_pool=c["kv_pool"].float()), "kv_pool"),
        (edit(kv_pool=c["kv_pool"].expand(-1, 2, -1)), "kv_pool"),
        (edit(k_extend=c["k_extend"][:-1]), "k_extend"),
        (edit(k_extend=c["k_extend"].half()), "k_extend"),
        (edit(qo_indptr=c["qo_indptr"].float()), "qo_indptr"),
        (edit(qo_indptr=torch.tensor([0, 3, 5], dtype=torch.int32)), "qo_indptr"),
        (edit(qo_indptr=torch.tensor([0, 4, 3], dtype=torch.int32)), "qo_indptr"),
        (edit(qo_indptr=torch.tensor([1, 3, 6], dtype=torch.int32)), "qo_indptr"),
        (edit(kv_indptr=torch.tensor([0, 9], dtype=torch.int32)), "kv_indptr"),
        (edit(kv_indptr=torch.tensor([0, 4, 90], dtype=torch.int32)), "kv_indices"),
        (edit(kv_indices=c["kv_indices"].float()), "kv_indices"),
        (edit(kv_indices=torch.full_like(c["kv_indices"], 10**6)), "kv_indices"),
        (edit(kv_indices=-c["kv_indices"] - 1), "kv_indices"),
        (edit(custom_mask=c["custom_mask"].float()), "custom_mask"),
        (edit(custom_mask=c["custom_mask"][:-1]), "custom_mask"),
        (edit(custom_mask=c["custom_mask"].view(1, -1)), "custom_mask"),
        (edit(custom_mask=None), "custom_mask|mask_indptr"),
        (edit(mask_indptr=None), "mask_indptr"),
        (edit(mask_indptr=c["mask_indptr"][:-1]), "mask_indptr"),
        (edit(mask_indptr=c["mask_indptr"].float()), "mask_indptr"),
        (edit(sm_scale=-1.0), "sm_scale"),
        (edit(sm_scale=float("nan")), "sm_scale"),
        (edit(sm_scale=torch.tensor(0.1)), "sm_scale"),
        (edit(k_extend=None, kv_indptr=torch.tensor([0, 2, 9], dtype=torch.int32)), "kv_indptr"),
    ], c


_BAD, _BASE = _bad_cases()


@pytest.mark.parametrize("fn", [mla_verify_reference, mla_verify_loop], ids=["reference", "loop"])
@pytest.mark.parametrize("i", range(len(_BAD)), ids=[f"{n}-{i}" for i, (_, n) in enumerate(_BAD)])
def test_bad_inputs_raise_value_error_naming_the_argument(fn, i):
    edits, name = _BAD[i]
    with pytest.raises(ValueError, match=name):
        fn(**dict(_BASE, **edits))


def test_device_mismatch_is_named():
    c = make_verify_case(1, 1, 2, 3, mask="causal", seed=0)
    meta = dict(c, kv_pool=c["kv_pool"].to("meta"))
    with pytest.raises(ValueError, match="kv_pool"):
        mla_verify_reference(**meta)


@pytest.mark.parametrize("kw, name", [
    (dict(mask="chain"), "mask"), (dict(batch=0), "batch"), (dict(heads=0), "heads"),
    (dict(q_len=[1, 2, 3]), "q_len"), (dict(ctx_lens=-1), "prefix_lens"),
    (dict(dtype=torch.int8), "dtype"), (dict(pool_extra=-1), "pool_extra"),
])
def test_make_verify_case_bad_inputs(kw, name):
    with pytest.raises(ValueError, match=name):
        make_verify_case(**{"batch": 2, **kw})


@pytest.mark.gpu
def test_reference_on_cuda_matches_loop(seed):
    case = make_verify_case(2, 16, [4, 7], [50, 9], mask="tree", seed=seed, device="cuda")
    out, lse = mla_verify_reference(**case, return_lse=True)
    assert out.device.type == "cuda"
    out_loop, lse_loop = mla_verify_loop(**case, return_lse=True)
    torch.testing.assert_close(out, out_loop, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, lse_loop, atol=1e-10, rtol=0)


# -- against SGLang's own Triton kernel, on CPU under the Triton interpreter ---------------------

_SGLANG_TRITON_SCRIPT = textwrap.dedent("""
    import json, os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    from sm120_workbook.reference import make_verify_case, mla_verify_reference  # ours: must import
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except ImportError as e:  # SGLang's Triton ops can't load here: the test skips with this
        print(json.dumps({"skip": f"cannot import SGLang's Triton extend attention: {e!r}"}))
        sys.exit(0)
    seed = int(sys.argv[1])
    results = []
    for mask, q_lens, ctx in (("tree", [5, 7], [37, 70]), (None, [4, 6], [0, 41])):
        c = make_verify_case(2, 3, q_lens, ctx, mask=mask, seed=seed, dtype=torch.float32)
        T, H, _ = c["q"].shape
        o = torch.zeros(T, H, 512)
        lse = torch.zeros(T, H)
        k_ext = c["k_extend"]
        try:
            # SGLang's MLA call: V is the first 512 dims of the same KV rows
            extend_attention_fwd(
                c["q"], k_ext, k_ext[..., :512].contiguous(), o, c["kv_pool"], c["kv_pool"][..., :512],
                c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["custom_mask"], mask is None,
                c["mask_indptr"], max(q_lens), 1.0, 1.0, sm_scale=c["sm_scale"], lse_extend=lse)
        except TypeError:
            raise   # most likely SGLang's signature moved: fail rather than skip (it may be the interpreter's)
        except Exception as e:
            print(json.dumps({"skip": f"the Triton interpreter could not run extend_attention_fwd: {e!r}"}))
            sys.exit(0)
        ref, ref_lse = mla_verify_reference(**c, return_lse=True)
        results.append({"mask": str(mask), "max_abs_out": float((o - ref).abs().max()),
                        "max_abs_lse": float((lse - ref_lse).abs().max()),
                        "nan": bool(torch.isnan(o).any())})
    print(json.dumps({"results": results}))
""")


def test_reference_matches_sglang_triton_extend_attention(seed, tmp_path):
    """Tree mask with k_extend (target verify) and the implicit causal chain, float32."""
    script = tmp_path / "sglang_triton_check.py"
    script.write_text(_SGLANG_TRITON_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run([sys.executable, str(script), str(seed)], capture_output=True,
                              text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.skip("the Triton interpreter took over 120 s for extend_attention_fwd here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    print(report)
    for r in report["results"]:
        assert not r["nan"], r
        assert r["max_abs_out"] < 2e-5, r
        assert r["max_abs_lse"] < 2e-5, r


@pytest.mark.parametrize("kw, name", [(dict(batch=True), "batch"), (dict(heads=True), "heads"),
                                      (dict(q_len=2.5), "q_len"), (dict(ctx_lens="32"), "ctx_lens"),
                                      (dict(q_len=0), "q_len")])   # no query row in the whole case
def test_make_verify_case_names_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        make_verify_case(**kw)


def test_random_tree_mask_names_a_bad_generator():
    with pytest.raises(ValueError, match="^generator: a torch.Generator, an int seed or None, got 'x'"):
        random_tree_mask([4], [8], generator="x")


def test_make_verify_case_seed_none_is_fresh():
    a, b = make_verify_case(seed=None), make_verify_case(seed=None)
    assert not torch.equal(a["kv_indices"], b["kv_indices"]) or not torch.equal(a["q"], b["q"])
    assert torch.equal(make_verify_case(seed=3)["q"], make_verify_case(seed=3)["q"])


def test_the_real_models_scales_are_sglangs():
    """DeepSeek-V3 (YaRN factor 40) and Kimi K2 (factor 32): SGLang multiplies 1/sqrt(192) by
    mscale^2 (compute_mla_mscale_scaling); the checks draw these beside the bare scale."""
    pytest.importorskip("sglang")
    from sglang.srt.configs.model_config import compute_mla_mscale_scaling

    from sm120_workbook.mla import DEEPSEEK_V3_SM_SCALE, KIMI_K2_SM_SCALE, SM_SCALE

    for factor, ours in ((40, DEEPSEEK_V3_SM_SCALE), (32, KIMI_K2_SM_SCALE)):
        rope = {"type": "yarn", "factor": factor, "mscale": 1.0, "mscale_all_dim": 1.0}
        assert ours == pytest.approx(compute_mla_mscale_scaling(rope, SM_SCALE), rel=1e-12)
    assert (round(KIMI_K2_SM_SCALE, 4), round(DEEPSEEK_V3_SM_SCALE, 4)) == (0.1309, 0.1352)
