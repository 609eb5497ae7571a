"""patches/dflash_host_plan.py against SGLang 0.5.17's own code.

CPU: which draft backends it adapts and why not; that SGLang's `decide_needs_cpu_seq_lens` then lets
the overlap scheduler skip the lengths' copy; the check of host bounds; install and uninstall on the
real DFlashWorkerV2.
GPU: SGLang's `FlashInferIndicesUpdaterPrefill.call_begin_forward` plans a captured FlashInfer fa2
wrapper, adapted by `adapt`, from host lengths above the device's (exact, the reservation's two
blocks, and far above), and each graph replay matches the float64 reference of DFlash's draft
attention (non-causal over the prefix and the block, 32 query heads on 8 KV heads of 128), with NaN
in every KV slot outside the requests and in the output before each replay.
"""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from sm120_workbook.patches import dflash_host_plan

BLOCK, HEADS, KV_HEADS, DIM = 16, 32, 8, 128   # data/models/dflash_draft: a Qwen3 layer, 16-token blocks


@pytest.fixture
def fib():
    from sglang.srt.layers.attention import flashinfer_backend

    return flashinfer_backend


def planned_wrapper(**over):
    w = SimpleNamespace(is_cuda_graph_enabled=True, _backend="fa2", _cached_module=object(),
                        _custom_mask_buf=None, begin_forward="plan()")
    for k, v in over.items():
        setattr(w, k, v)
    return w


def draft_backend(fib, graphs=None, **over):
    """A FlashInferAttnBackend as a DFlash draft's is after its graphs are captured (no GPU)."""
    b = object.__new__(fib.FlashInferAttnBackend)
    b.prefill_backend, b.dispatch_reason = "fa2", None
    b.prefill_cuda_graph_metadata = graphs if graphs is not None else {1: [planned_wrapper()],
                                                                        4: [planned_wrapper()]}
    for k, v in over.items():
        setattr(b, k, v)
    return b


def test_mode_reads_the_environment():
    assert dflash_host_plan.mode({}) == "off"
    assert dflash_host_plan.mode({"SM120_DFLASH_HOST_PLAN": "1"}) == "on"
    assert dflash_host_plan.mode({"SM120_DFLASH_HOST_PLAN": " Yes "}) == "on"
    assert dflash_host_plan.mode({"SM120_DFLASH_HOST_PLAN": "check"}) == "check"
    assert dflash_host_plan.mode({"SM120_DFLASH_HOST_PLAN": "0"}) == "off"


def test_adapt_installs_sglangs_sync_free_plan_and_opts_out_of_host_lengths(fib):
    from sglang.srt.managers.overlap_utils import decide_needs_cpu_seq_lens

    target = SimpleNamespace(needs_cpu_seq_lens=False)   # the sm120_mla / Triton verify backend
    draft = draft_backend(fib)
    args = SimpleNamespace(enable_two_batch_overlap=False, speculative_algorithm="DFLASH")
    assert decide_needs_cpu_seq_lens(args, (target, draft)) is True   # as SGLang has it: a sync a step
    assert dflash_host_plan.adapt(draft) == [1, 4]
    for wrappers in draft.prefill_cuda_graph_metadata.values():
        w = wrappers[0]
        # call_begin_forward's sync-free branch keys on exactly this
        assert isinstance(w.begin_forward, functools.partial) and w.begin_forward.func is fib.fast_prefill_plan
        assert w.begin_forward.args == (w,)
    assert decide_needs_cpu_seq_lens(args, (target, draft)) is False
    assert fib.FlashInferAttnBackend.needs_cpu_seq_lens is True   # the class (the target's, other drafts) unchanged
    # NGRAM forces the copy whatever the backends say; the override does not pretend otherwise
    assert decide_needs_cpu_seq_lens(SimpleNamespace(enable_two_batch_overlap=False,
                                                     speculative_algorithm="NGRAM"), (target, draft)) is True


def test_adapt_with_check_keeps_the_sync_free_branch(fib):
    draft = draft_backend(fib)
    dflash_host_plan.adapt(draft, check=True)
    bf = draft.prefill_cuda_graph_metadata[1][0].begin_forward
    assert hasattr(bf, "func") and bf.func is fib.fast_prefill_plan
    assert draft.needs_cpu_seq_lens is False


@pytest.mark.parametrize("case,over,why", [
    ("prefill backend fa3", {"prefill_backend": "fa3"}, "not 'fa2'"),
    ("sliding window", {"dispatch_reason": "sliding_window"}, "several wrappers"),
    ("no graphs", {"prefill_cuda_graph_metadata": {}}, "no captured target-verify graphs"),
    ("unplanned wrapper", {"prefill_cuda_graph_metadata": {2: [planned_wrapper(_cached_module=None)]}},
     "bs=2 wrapper is not a planned fa2"),
    ("eager wrapper", {"prefill_cuda_graph_metadata": {2: [planned_wrapper(is_cuda_graph_enabled=False)]}},
     "bs=2 wrapper is not a planned fa2"),
    ("custom mask", {"prefill_cuda_graph_metadata": {8: [planned_wrapper(_custom_mask_buf=torch.zeros(1))]}},
     "custom mask"),
])
def test_adapt_refuses_what_it_does_not_fit_and_changes_nothing(fib, case, over, why):
    draft = draft_backend(fib, **over)
    with pytest.raises(ValueError, match=why):
        dflash_host_plan.adapt(draft)
    assert "needs_cpu_seq_lens" not in vars(draft)
    for wrappers in draft.prefill_cuda_graph_metadata.values():
        assert wrappers[0].begin_forward == "plan()"


def test_adapt_refuses_a_backend_that_is_not_flashinfers(fib):
    with pytest.raises(ValueError, match="TritonAttnBackend, not FlashInfer's"):
        dflash_host_plan.adapt(type("TritonAttnBackend", (), {})())


def test_adapt_worker_leaves_a_draft_window_alone(fib):
    draft = draft_backend(fib)
    worker = SimpleNamespace(use_compact_draft_cache=True, draft_model_runner=SimpleNamespace(attn_backend=draft))
    assert "draft window" in dflash_host_plan.adapt_worker(worker)
    assert "needs_cpu_seq_lens" not in vars(draft)
    worker.use_compact_draft_cache = False
    assert "bs 1..4" in dflash_host_plan.adapt_worker(worker) and draft.needs_cpu_seq_lens is False


def test_wrapped_init_cuda_graphs_adapts_after_the_capture_and_never_raises(fib, monkeypatch):
    order = []
    draft = draft_backend(fib)
    worker = SimpleNamespace(use_compact_draft_cache=False, draft_model_runner=SimpleNamespace(attn_backend=draft))

    def init_cuda_graphs(self):
        order.append(("captured", "needs_cpu_seq_lens" in vars(draft)))
        return "result"

    monkeypatch.setenv(dflash_host_plan.ENV_VAR, "1")
    assert dflash_host_plan._wrap(init_cuda_graphs)(worker) == "result"
    assert order == [("captured", False)] and draft.needs_cpu_seq_lens is False
    broken = SimpleNamespace()   # no draft_model_runner: logged, the server goes on as SGLang has it
    assert dflash_host_plan._wrap(lambda self: "ok")(broken) == "ok"


def test_host_bound_check_counts_requests_below_the_device_and_skips_padding():
    check = dflash_host_plan.HostBoundCheck()
    indptr = torch.tensor([0, 17, 17 + 40, 17 + 40 + 17])   # device lengths 17, 40, 17 (the last is padding)
    check(torch.tensor([17, 48, 1]), indptr)                  # exact, 8 over, a padded slot (host 1)
    assert (check.plans, check.violations, check.min_slack) == (1, 0, 0)
    check(torch.tensor([17, 39, 1]), indptr)
    assert (check.plans, check.violations, check.min_slack) == (2, 1, -1)


def test_install_wraps_the_real_worker_once_and_uninstalls():
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    original = DFlashWorkerV2.__dict__["init_cuda_graphs"]
    try:
        assert dflash_host_plan.install() and dflash_host_plan.is_installed() and not dflash_host_plan.install()
        assert getattr(DFlashWorkerV2.__dict__["init_cuda_graphs"], dflash_host_plan._MARK) is original
    finally:
        dflash_host_plan.uninstall()
    assert DFlashWorkerV2.__dict__["init_cuda_graphs"] is original and not dflash_host_plan.is_installed()
    assert not dflash_host_plan.install_from_env({})
    try:
        assert dflash_host_plan.install_from_env({"SM120_DFLASH_HOST_PLAN": "check"})
    finally:
        dflash_host_plan.uninstall()


# ---------------------------------------------------------------- GPU: SGLang's plan path and FlashInfer's kernel
def reference(q, k_pool, v_pool, slots, sm_scale):
    """Float64 DFlash draft attention of one request: every block row sees every key (non-causal)."""
    k = k_pool[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)   # [keys, heads, dim]
    v = v_pool[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * sm_scale
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


@pytest.mark.gpu
@pytest.mark.parametrize("check", [False, True], ids=["on", "check"])
def test_graph_replays_planned_from_host_bounds_match_the_reference(fib, seed, check):
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper
    from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(seed)
    bs, pool, max_ctx = 4, 24_000, 9_000
    sm_scale = 1 / math.sqrt(DIM)
    qo_buf = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    kv_indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    kv_indices_buf = torch.zeros(3 * pool, dtype=torch.int32, device=dev)
    last_page = torch.ones(bs, dtype=torch.int32, device=dev)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD",
                                            use_cuda_graph=True, backend="fa2", qo_indptr_buf=qo_buf,
                                            paged_kv_indptr_buf=kv_indptr_buf, paged_kv_indices_buf=kv_indices_buf,
                                            paged_kv_last_page_len_buf=last_page)
    req_to_token = torch.zeros(bs, max_ctx + BLOCK, dtype=torch.int32, device=dev)
    # the fields of FlashInferIndicesUpdaterPrefill that call_begin_forward reads on this path
    updater = SimpleNamespace(attn_backend=SimpleNamespace(dq_paged_kernel_lens=None), num_qo_heads=HEADS,
                              num_kv_heads=KV_HEADS, head_dim=DIM, q_data_type=torch.bfloat16,
                              data_type=torch.bfloat16, kv_last_page_len=last_page, _swa_kv_pool=None,
                              req_to_token=req_to_token)
    spec = make_draft_block_spec_info(draft_token_num=BLOCK, device=dev)
    req_pool_indices = torch.arange(bs, dtype=torch.int32, device=dev)

    def plan(prefix_lens, host_lens):
        seq_lens = torch.tensor(prefix_lens, dtype=torch.int32, device=dev)
        fib.FlashInferIndicesUpdaterPrefill.call_begin_forward(
            updater, None, w, req_pool_indices, seq_lens, int(sum(host_lens)), seq_lens, None, None,
            kv_indptr_buf, qo_buf, False, spec, seq_lens_cpu=torch.tensor(host_lens, dtype=torch.int32))

    k_pool = torch.zeros(pool, KV_HEADS, DIM, dtype=torch.bfloat16, device=dev)
    v_pool = torch.zeros_like(k_pool)
    q = torch.zeros(bs * BLOCK, HEADS, DIM, dtype=torch.bfloat16, device=dev)
    # capture as SGLang does: a real plan() at the fill length (1), then the graph of the forward
    plan([1] * bs, [1 + BLOCK] * bs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w.forward(q, (k_pool, v_pool), causal=False, sm_scale=sm_scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.forward(q, (k_pool, v_pool), causal=False, sm_scale=sm_scale)
    backend = draft_backend(fib, {bs: [w]})
    assert dflash_host_plan.adapt(backend, check=check) == [bs]

    cases = [([1, 127, 129, 5000], "exact"), ([8191, 1, 300, 2], "two blocks"),
             ([4096, 4097, 33, 7777], "far above"), ([1, 1, 1, 1], "exact")]
    for prefix_lens, bound in cases:
        kv_lens = [n + BLOCK for n in prefix_lens]
        extra = {"exact": [0] * bs, "two blocks": [BLOCK] * bs,
                 "far above": torch.randint(1, 3000, (bs,), generator=gen).tolist()}[bound]
        host = [n + e for n, e in zip(kv_lens, extra)]
        # fresh inputs; NaN in every slot no request owns, so a key read past a true length shows
        slots = torch.randperm(pool, generator=gen)[:sum(kv_lens)].to(dev, torch.int32)
        k_pool.fill_(float("nan"))
        v_pool.fill_(float("nan"))
        k_pool[slots.long()] = torch.randn(len(slots), KV_HEADS, DIM, generator=gen).to(dev, torch.bfloat16)
        v_pool[slots.long()] = torch.randn(len(slots), KV_HEADS, DIM, generator=gen).to(dev, torch.bfloat16)
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        req_to_token.zero_()
        for r, (start, n) in enumerate(zip([0] + list(torch.tensor(kv_lens).cumsum(0)[:-1]), kv_lens)):
            req_to_token[r, :n] = slots[int(start):int(start) + n]
        plan(prefix_lens, host)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{prefix_lens} ({bound}): NaN in the output"
        for r, n in enumerate(kv_lens):
            want = reference(q[r * BLOCK:(r + 1) * BLOCK], k_pool, v_pool, req_to_token[r, :n].long(), sm_scale)
            got = out[r * BLOCK:(r + 1) * BLOCK].float()
            # bf16 inputs and output: one bf16 rounding of O (2^-9 relative) plus fp32 accumulation
            torch.testing.assert_close(got, want.float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"request {r} ({n} keys, host bound {bound}): {m}")
    if check:
        chk = backend.prefill_cuda_graph_metadata[bs][0].begin_forward.check
        assert chk.plans == len(cases) and chk.violations == 0 and chk.min_slack == 0
