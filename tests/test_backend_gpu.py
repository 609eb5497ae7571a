"""Sm120MlaAttnBackend against SGLang's TritonAttnBackend on the same ModelRunner stand-in.

The stand-in is SGLang's own test kit runner (sglang.test.kits.attention_unittest:
MockMLAModelRunner with a real ReqToTokenPool and MLATokenToKVPool); both backends read and
write the same pool, with request rows scattered over it.

- GPU tests (@pytest.mark.gpu; `python -m pytest tests/test_backend_gpu.py` on the GPU
  machine): the real kernel in bf16; forward_decode, and forward_extend in TARGET_VERIFY
  (with and without a tree mask) and in DRAFT_EXTEND_V2 (an MTP draft's), match Triton within
  bf16 tolerance, eagerly and under CUDA-graph replay with new lengths, masks and KV locations.
- CPU test: the same harness in a subprocess under TRITON_INTERPRET=1 (float32), with a
  float64 torch implementation of the kernel's contract in place of the CUDA kernel. It
  checks the wiring: decode, verify and draft extend reach the kernel with SGLang's metadata
  (also through the CUDA-graph buffers), EAGLE's multi-step draft decode runs each step on
  it, prefill stays on Triton, and without a usable kernel the registered factory raises at
  construction, naming the cause.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sm120_workbook.mla import DIM_QK, DIM_V, SM_SCALE


# ---------------------------------------------------------------- the harness
class ReferenceKernelOps:
    """The kernel's contract (sm120_workbook.kernels.mla_verify_attention) in float64 torch.

    It asserts the dtypes the real kernel demands, so wiring mistakes show on CPU too.
    """

    KV_DTYPE = torch.float32
    calls = 0

    @staticmethod
    def kernel_available():
        return True, "float64 torch reference"

    class MlaVerifyWorkspace:
        def __init__(self, max_tokens, heads, device=None, num_splits=None):
            self.max_tokens, self.heads, self.nbytes = max_tokens, heads, 0

    @classmethod
    def mla_verify_attention(cls, q, kv_pool, qo_indptr, kv_indptr, kv_indices, *, out, lse,
                             workspace, sm_scale, max_q_len, k_extend=None, custom_mask=None,
                             mask_indptr=None):
        cls.calls += 1
        assert qo_indptr.dtype == torch.int32 and kv_indptr.dtype == torch.int32
        assert kv_indices.dtype in (torch.int32, torch.int64)
        assert out.shape == (q.shape[0], q.shape[1], DIM_V) and lse.shape == q.shape[:2]
        assert q.shape[1] == workspace.heads and q.shape[0] <= workspace.max_tokens
        assert (custom_mask is None) == (mask_indptr is None)
        kv = kv_pool.reshape(kv_pool.shape[0], DIM_QK).double()
        ke = None if k_extend is None else k_extend.reshape(-1, DIM_QK).double()
        for b in range(qo_indptr.numel() - 1):
            q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
            n = q1 - q0
            assert 1 <= n <= max_q_len
            rows = kv[kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()]
            prefix = rows.shape[0]
            keys = rows if ke is None else torch.cat([rows, ke[q0:q1]])
            s = torch.einsum("thd,kd->thk", q[q0:q1].double(), keys) * sm_scale
            if ke is not None:
                visible = torch.ones(n, prefix + n, dtype=torch.bool)
                if custom_mask is None:
                    visible[:, prefix:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
                else:
                    m0 = int(mask_indptr[b])
                    m = custom_mask[m0:m0 + n * (prefix + n)].view(n, prefix + n).bool()
                    visible[:, prefix:] = m[:, prefix:]
                s = s.masked_fill(~visible[:, None, :], float("-inf"))
            out[q0:q1] = torch.einsum("thk,kd->thd", torch.softmax(s, -1),
                                      keys[:, :DIM_V]).to(out.dtype)
            lse[q0:q1] = torch.logsumexp(s, -1).to(lse.dtype)
        return out


def make_runner(*, device, dtype, heads, num_draft_tokens, max_requests, max_context_len, poison=False):
    """SGLang's MLA test-kit runner: real req-to-token and MLA KV pools on `device`.

    poison: the pool starts as NaN, and each batch writes fresh rows for its own slots only
    (_rows): a backend that reads a slot no request owns (the pad slot 0 among them) gives NaN."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        MLAAttentionCase, MockMLAModelRunner, TinyMLAModelConfig)

    case = MLAAttentionCase(name="sm120_mla", backend="triton",
                            forward_mode=ForwardMode.TARGET_VERIFY, num_heads=heads,
                            page_size=1, prefix_lens=(1,) * max_requests,
                            extend_lens=(num_draft_tokens,) * max_requests)
    config = TinyMLAModelConfig(num_heads=heads, kv_lora_rank=DIM_V,
                                qk_rope_head_dim=DIM_QK - DIM_V, hidden_size=64,
                                context_len=max_context_len)
    runner = MockMLAModelRunner(case=case, model_config=config, dtype=dtype, device=device,
                                max_context_len=max_context_len, kv_lora_rank=DIM_V,
                                qk_rope_head_dim=DIM_QK - DIM_V, runner_batch_size=max_requests)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    key = runner.token_to_kv_pool.get_key_buffer(0)
    if poison:
        key.fill_(float("nan"))
    else:
        key.copy_(torch.randn(key.shape, generator=gen).to(dtype))
    # Each request's rows scattered over the pool, as after churn.
    runner.slot_order = (torch.randperm(key.shape[0] - 1, generator=gen) + 1).to(device)
    return runner


def make_layer(heads):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=heads, head_dim=DIM_QK, scaling=SM_SCALE, num_kv_heads=1,
                          layer_id=0, v_head_dim=DIM_V)


def _rows(runner, prefix_lens, extra, gen):
    """Each request's slots (prefix and `extra` rows after it) in req_to_token, and fresh KV in
    them (a step writes its own tokens' over theirs)."""
    ctx = runner.model_config.context_len
    device = runner.device
    for i, length in enumerate(prefix_lens):
        slots = runner.slot_order[i * ctx:i * ctx + length + extra]
        runner.req_to_token_pool.req_to_token[i, :length + extra] = slots
        _fresh_kv(runner, slots, gen)
    return torch.tensor(prefix_lens, dtype=torch.int64, device=device)


def _fresh_kv(runner, slots, gen):
    key = runner.token_to_kv_pool.get_key_buffer(0)
    key[slots] = torch.randn(len(slots), *key.shape[1:], generator=gen).to(device=key.device, dtype=key.dtype)


def decode_batch(runner, prefix_lens, gen):
    """A decode step: each request's new token sits at position prefix_len."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device, heads = runner.device, runner.model_config.num_attention_heads
    prefix = _rows(runner, prefix_lens, 1, gen)
    seq = prefix + 1
    bs = len(prefix_lens)
    loc = torch.stack([runner.req_to_token_pool.req_to_token[i, n]
                       for i, n in enumerate(prefix_lens)]).long()
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                      input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
                      req_pool_indices=torch.arange(bs, device=device), seq_lens=seq,
                      seq_lens_cpu=seq.cpu(), out_cache_loc=loc, seq_lens_sum=int(seq.sum()),
                      positions=prefix.clone())
    return fb, *_qkv(bs, heads, runner.dtype, device, gen)


def verify_batch(runner, prefix_lens, num_draft_tokens, gen, tree_mask):
    """A target-verify step: seq_lens are the prefixes, the draft KV comes as k."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device, heads = runner.device, runner.model_config.num_attention_heads
    n = num_draft_tokens
    prefix = _rows(runner, prefix_lens, n, gen)
    bs = len(prefix_lens)
    loc = torch.cat([runner.req_to_token_pool.req_to_token[i, p:p + n]
                     for i, p in enumerate(prefix_lens)]).long()
    positions = torch.cat([torch.arange(p, p + n) for p in prefix_lens]).to(device)
    custom_mask = None
    if tree_mask:
        parts = []
        for p in prefix_lens:
            m = torch.ones(n, p + n, dtype=torch.bool)
            tree = torch.tril(torch.ones(n, n, dtype=torch.bool))
            # a two-branch tree: token 2 sees the root but not token 1
            if n > 2:
                tree[2, 1] = False
            m[:, p:] = tree
            parts.append(m.flatten())
        custom_mask = torch.cat(parts).to(device)
    spec = SimpleNamespace(custom_mask=custom_mask, draft_token_num=n)
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs,
                      input_ids=torch.zeros(bs * n, dtype=torch.int64, device=device),
                      req_pool_indices=torch.arange(bs, device=device), seq_lens=prefix,
                      seq_lens_cpu=prefix.cpu(), out_cache_loc=loc,
                      seq_lens_sum=int(prefix.sum()), positions=positions, spec_info=spec)
    return fb, *_qkv(bs * n, heads, runner.dtype, device, gen)


def dflash_verify_batch(runner, prefix_lens, num_draft_tokens, gen):
    """DFlash's target verify: a causal chain of num_draft_tokens a request, with SGLang's own
    DFlashVerifyInput, which carries no mask (DFlashWorkerV2 sends none)."""
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    fb, q, k, v = verify_batch(runner, prefix_lens, num_draft_tokens, gen, tree_mask=False)
    fb.spec_info = DFlashVerifyInput(draft_token=None, positions=None, draft_token_num=num_draft_tokens)
    return fb, q, k, v


def dflash_capture_mask(backend, max_requests, num_draft_tokens):
    """The mask SGLang's graph runner puts in a DFlash capture's spec_info for `backend`
    (decode_cuda_graph_runner, 0.5.17): None where its list of backends with a causal path names
    the class (resolve_dflash_verify_mask_policy; TritonAttnBackend is there), else all ones,
    sized as its buffers.custom_mask (max_bs x seq_len_fill_value 1 + max tokens, times the
    tokens a request). A replay's spec_info has none either way."""
    from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy

    _, builds_mask = resolve_dflash_verify_mask_policy(backend)
    n = (max_requests + max_requests * num_draft_tokens) * num_draft_tokens
    return torch.ones(n, dtype=torch.bool, device=backend.device) if builds_mask else None


def extend_batch(runner, prefix_lens, extend_lens, gen):
    """A prefill/extend step (stays on Triton)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device, heads = runner.device, runner.model_config.num_attention_heads
    ctx = runner.model_config.context_len
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        slots = runner.slot_order[i * ctx:i * ctx + p + e]
        runner.req_to_token_pool.req_to_token[i, :p + e] = slots
        _fresh_kv(runner, slots, gen)
    bs, total = len(prefix_lens), sum(extend_lens)
    seq = torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)], device=device)
    loc = torch.cat([runner.req_to_token_pool.req_to_token[i, p:p + e]
                     for i, (p, e) in enumerate(zip(prefix_lens, extend_lens))]).long()
    extend = torch.tensor(extend_lens, dtype=torch.int32, device=device)
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=bs,
                      input_ids=torch.zeros(total, dtype=torch.int64, device=device),
                      req_pool_indices=torch.arange(bs, device=device), seq_lens=seq,
                      seq_lens_cpu=seq.cpu(), out_cache_loc=loc, seq_lens_sum=int(seq.sum()),
                      positions=torch.cat([torch.arange(p, p + e) for p, e in
                                           zip(prefix_lens, extend_lens)]).to(device))
    fb.extend_prefix_lens = torch.tensor(prefix_lens, dtype=torch.int32, device=device)
    fb.extend_prefix_lens_cpu = list(prefix_lens)
    fb.extend_seq_lens = extend
    fb.extend_seq_lens_cpu = list(extend_lens)
    fb.extend_start_loc = torch.cumsum(extend, 0) - extend
    fb.extend_num_tokens = total
    return fb, *_qkv(total, heads, runner.dtype, device, gen)


def draft_extend_batch(runner, prefix_lens, num_draft_tokens, gen):
    """An EAGLE v2 draft extend (an MTP draft model's): num_draft_tokens new tokens a request
    after its prefix, as SGLang's eagle worker builds it (seq_lens after the write)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb, q, k, v = extend_batch(runner, prefix_lens, [num_draft_tokens] * len(prefix_lens), gen)
    fb.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    fb.spec_info = SimpleNamespace(extend_seq_lens_tensor=fb.extend_seq_lens.clone(), custom_mask=None)
    return fb, q, k, v


def draft_decode_batch(runner, prefix_lens, steps, gen, topk=1):
    """The input of an EAGLE multi-step draft decode: each request's draft tokens after its
    prefix, `steps` a branch, branch after branch (the multi-step backend builds each step's
    kv_indices from these), and one query a request and branch."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device, heads = runner.device, runner.model_config.num_attention_heads
    prefix = _rows(runner, prefix_lens, steps * topk, gen)
    bs = len(prefix_lens)
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                      input_ids=torch.zeros(bs * topk, dtype=torch.int64, device=device),
                      req_pool_indices=torch.arange(bs, device=device), seq_lens=prefix,
                      seq_lens_cpu=prefix.cpu(), out_cache_loc=None, seq_lens_sum=int(prefix.sum()),
                      positions=prefix.repeat_interleave(topk),
                      spec_info=SimpleNamespace(kv_indptr=None, kv_indices=None))
    return fb, *_qkv(bs * topk, heads, runner.dtype, device, gen)


def _qkv(tokens, heads, dtype, device, gen):
    q = torch.randn(tokens, heads, DIM_QK, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(tokens, 1, DIM_QK, generator=gen).to(device=device, dtype=dtype)
    return q, k, k[..., :DIM_V].clone()


def run_eager(backend, layer, fb, q, k, v):
    backend.init_forward_metadata(fb)
    if fb.forward_mode.is_decode():
        return backend.forward_decode(q.clone(), k.clone(), v.clone(), layer, fb)
    return backend.forward_extend(q.clone(), k.clone(), v.clone(), layer, fb)


# ---------------------------------------------------------------- CPU: the wiring
def _cpu_wiring_checks() -> dict:
    """Runs in a subprocess with TRITON_INTERPRET=1; returns what the parent test asserts."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    import sm120_workbook.patches as plugin
    from sm120_workbook.patches.backend import Sm120MlaAttnBackend

    out = {}
    heads, ndt, max_requests = 4, 3, 4
    runner = make_runner(device="cpu", dtype=torch.float32, heads=heads, num_draft_tokens=ndt,
                         max_requests=max_requests, max_context_len=64)
    layer = make_layer(heads)
    gen = torch.Generator().manual_seed(7)
    ops = ReferenceKernelOps
    triton = TritonAttnBackend(runner)
    import logging
    import logging.handlers

    lines = logging.handlers.BufferingHandler(capacity=100)   # keeps the records it is handed
    backend_log = logging.getLogger("sm120_workbook.patches.backend")
    backend_log.addHandler(lines)
    level = backend_log.level
    backend_log.setLevel(logging.INFO)
    sm120 = Sm120MlaAttnBackend(runner, kernel_ops=ops)
    runner.is_draft_worker = True   # a draft model's runner: its own line, not the server's routes
    Sm120MlaAttnBackend(runner, kernel_ops=ops)
    runner.is_draft_worker = False
    backend_log.removeHandler(lines)
    backend_log.setLevel(level)
    out["start_lines"] = [r.getMessage() for r in lines.buffer]

    def compare(name, batch, graph=None):
        fb, q, k, v = batch
        calls = ops.calls
        want = run_eager(triton, layer, fb, q, k, v)
        if graph is None:
            got = run_eager(sm120, layer, fb, q, k, v)
        else:  # the CUDA-graph path's buffers (capture, then a replay-style refill)
            sm120.init_forward_metadata_out_graph(fb, in_capture=graph == "capture")
            forward = sm120.forward_decode if fb.forward_mode.is_decode() else sm120.forward_extend
            got = forward(q.clone(), k.clone(), v.clone(), layer, fb)
        out[name] = {"max_abs_diff": float((want - got).abs().max()),
                     "kernel_calls": ops.calls - calls, "shape_ok": want.shape == got.shape}

    compare("decode", decode_batch(runner, [7, 20, 33], gen))
    # the parent's split-KV scratch, which only its own decode kernel reads: one split here
    out["attn_logits_splits"] = {"eager": sm120.forward_metadata.attn_logits.shape[2],
                                 "triton": triton.max_kv_splits}
    compare("verify_tree_mask", verify_batch(runner, [5, 17, 30], ndt, gen, tree_mask=True))
    compare("verify_causal", verify_batch(runner, [9, 2, 40], ndt, gen, tree_mask=False))
    compare("extend_stays_on_triton", extend_batch(runner, [0, 6], [5, 3], gen))
    compare("draft_extend", draft_extend_batch(runner, [4, 19, 31], ndt, gen))
    # a window wider than the kernel's 16 queries (multi-layer EAGLE's can be) stays on Triton
    compare("draft_extend_wide_on_triton", draft_extend_batch(runner, [4, 9], 17, gen))
    sm120.init_cuda_graph_state(max_requests, max_requests * ndt)
    out["attn_logits_splits"]["graph"] = sm120.cuda_graph_attn_logits.shape[2]
    compare("graph_decode_capture", decode_batch(runner, [7, 20, 33], gen), graph="capture")
    compare("graph_decode_replay", decode_batch(runner, [11, 3, 50], gen), graph="replay")
    compare("graph_verify_capture", verify_batch(runner, [5, 17, 30], ndt, gen, True),
            graph="capture")
    compare("graph_verify_replay", verify_batch(runner, [25, 1, 8], ndt, gen, True),
            graph="replay")
    out["graph_qo_indptr_dtype"] = str(sm120.qo_indptr.dtype)

    # DFlash's verify through the graph path: the capture's spec_info carries the graph runner's
    # all-ones mask (SGLang's list of causal backends names TritonAttnBackend, not this subclass),
    # and no replay refills it. Triton, on that list, runs the chain causally: so must the kernel.
    def compare_dflash(name, batch, capture):
        fb, q, k, v = batch
        calls = ops.calls
        want = run_eager(triton, layer, fb, q, k, v)   # no mask: Triton's causal chain
        fb.spec_info.custom_mask = dflash_capture_mask(sm120, max_requests, ndt) if capture else None
        sm120.init_forward_metadata_out_graph(fb, in_capture=capture)
        got = sm120.forward_extend(q.clone(), k.clone(), v.clone(), layer, fb)
        out[name] = {"max_abs_diff": float((want - got).abs().max()),
                     "kernel_calls": ops.calls - calls, "shape_ok": want.shape == got.shape}

    out["dflash_capture_mask"] = dflash_capture_mask(sm120, max_requests, ndt) is not None
    compare_dflash("graph_dflash_verify_capture", dflash_verify_batch(runner, [5, 17, 30], ndt, gen), True)
    compare_dflash("graph_dflash_verify_replay", dflash_verify_batch(runner, [25, 1, 8], ndt, gen), False)

    # A replay padded to the captured batch: 3 requests on the graph of 4, the metadata from
    # SGLang's own replay view (build_replay_fb_view) over buffers whose tail is a pad request
    # (req_pool_indices 0, seq_len the runner's fill value 1). The real rows must match Triton.
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view

    def compare_padded(name, batch, width):
        fb, q, k, v = batch
        calls = ops.calls
        want = run_eager(triton, layer, fb, q, k, v)
        raw_bs, bs = fb.batch_size, max_requests
        def pad(t, value, n=bs - raw_bs):
            return torch.cat([t, t.new_full((n,) + tuple(t.shape[1:]), value)])
        buffers = SimpleNamespace(input_ids=torch.zeros(bs * width, dtype=torch.int64),
                                  positions=torch.zeros(bs * width, dtype=torch.int64),
                                  req_pool_indices=pad(fb.req_pool_indices, 0), seq_lens=pad(fb.seq_lens, 1),
                                  seq_lens_cpu=pad(fb.seq_lens_cpu, 1), encoder_lens=None,
                                  mamba_track_indices=None)
        view = build_replay_fb_view(fb, buffers, bs, raw_bs, bs * width, 1, fb.forward_mode, False)
        sm120.init_forward_metadata_out_graph(view, in_capture=False)
        # the graph's forward runs on padded tensors; the pad tokens write the dummy slot 0
        run = SimpleNamespace(**{**vars(view), "out_cache_loc": pad(fb.out_cache_loc, 0, (bs - raw_bs) * width)})
        qp, kp = pad(q, 0.0, (bs - raw_bs) * width), pad(k, 0.0, (bs - raw_bs) * width)
        forward = sm120.forward_decode if fb.forward_mode.is_decode() else sm120.forward_extend
        got = forward(qp, kp, kp[..., :DIM_V].clone(), layer, run)[: q.shape[0]]
        out[name] = {"max_abs_diff": float((want - got).abs().max()),
                     "kernel_calls": ops.calls - calls, "shape_ok": want.shape == got.shape}

    compare_padded("graph_decode_padded", decode_batch(runner, [13, 4, 41], gen), 1)
    compare_padded("graph_verify_padded", verify_batch(runner, [21, 2, 11], ndt, gen, True), ndt)
    # after the verify graph's checks: a replay reuses the metadata of the mode last captured
    compare("graph_draft_extend_capture", draft_extend_batch(runner, [4, 19, 31], ndt, gen),
            graph="capture")
    compare("graph_draft_extend_replay", draft_extend_batch(runner, [30, 2, 12], ndt, gen),
            graph="replay")

    # EAGLE's draft decode steps (Sm120MlaMultiStepDraftBackend against SGLang's Triton one, 3
    # steps): the parent builds each step's kv_indices; each step's decode reaches the kernel.
    # topk 1 eagerly; topk 4 (16 rows: more than the backend's 4 requests x 3 draft tokens)
    # eagerly and through the CUDA-graph path (capture, then a replay's refill of new lengths).
    from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend

    from sm120_workbook.patches.backend import Sm120MlaMultiStepDraftBackend

    steps = 3

    def draft_steps(name, topk, batch, graph=None):
        triton_steps = TritonMultiStepDraftBackend(runner, topk, steps)
        sm120_steps = Sm120MlaMultiStepDraftBackend(runner, topk, steps, kernel_ops=ops)
        for m in (triton_steps, sm120_steps):   # the test kit's server args leave it None; a server's is set
            m.page_size = m.page_size or 1
        out["draft_step_backends"] = [type(b).__name__ for b in sm120_steps.attn_backends]
        fb, q, k, v = batch
        triton_steps.init_forward_metadata(fb)
        want = [b.forward_decode(q.clone(), k.clone(), v.clone(), layer, fb, save_kv_cache=False)
                for b in triton_steps.attn_backends]
        if graph is None:
            sm120_steps.init_forward_metadata(fb)
        else:   # capture on `graph`'s batch, then refill the buffers for fb, as a replay does
            sm120_steps.init_cuda_graph_state(len(prefix_lens_of(fb)), len(prefix_lens_of(fb)) * topk)
            sm120_steps.init_forward_metadata_out_graph(graph[0], in_capture=True)
            sm120_steps.init_forward_metadata_out_graph(fb, in_capture=False)
        before = ops.calls
        got = [b.forward_decode(q.clone(), k.clone(), v.clone(), layer, fb, save_kv_cache=False)
               for b in sm120_steps.attn_backends]
        out[name] = {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(want, got)),
                     "kernel_calls": ops.calls - before,
                     "kv_lens": [int(b.forward_metadata.kv_indptr[len(prefix_lens_of(fb)) * topk])
                                 for b in sm120_steps.attn_backends]}

    def prefix_lens_of(fb):
        return fb.seq_lens.tolist()

    draft_steps("draft_decode_steps", 1, draft_decode_batch(runner, [6, 23, 40], steps, gen))
    draft_steps("draft_decode_topk4", 4, draft_decode_batch(runner, [6, 9, 3, 11], steps, gen, topk=4))
    draft_steps("draft_decode_topk4_graph", 4, draft_decode_batch(runner, [2, 12, 7, 5], steps, gen, topk=4),
                graph=draft_decode_batch(runner, [6, 9, 3, 11], steps, gen, topk=4))

    # A layer the parent would run without a causal mask is refused, not masked causally.
    from sglang.srt.layers.radix_attention import AttentionType

    encoder = make_layer(heads)
    encoder.attn_type = AttentionType.ENCODER_ONLY
    fb, q, k, v = verify_batch(runner, [5, 9], ndt, gen, tree_mask=False)
    try:
        run_eager(sm120, encoder, fb, q, k, v)
        out["encoder_layer_error"] = None
    except ValueError as e:
        out["encoder_layer_error"] = str(e)

    # Without an injected kernel, the registered factory must refuse here (no CUDA GPU).
    plugin.register_backend()
    try:
        ATTENTION_BACKENDS[plugin.BACKEND_NAME](runner)
        out["factory_error"] = None
    except RuntimeError as e:
        out["factory_error"] = str(e)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only wiring test (it expects the factory to refuse for lack of "
                    "a GPU); on a GPU the real-kernel tests below cover the same paths")
def test_cpu_wiring_against_triton_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "SM120_BACKEND_WIRING": "1"}
    env.pop("SM120_KV_SORT", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True,
                          text=True, env=env, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    for name in ("decode", "verify_tree_mask", "verify_causal", "draft_extend", "graph_decode_capture",
                 "graph_decode_replay", "graph_verify_capture", "graph_verify_replay",
                 "graph_draft_extend_capture", "graph_draft_extend_replay",
                 "graph_decode_padded", "graph_verify_padded", "graph_dflash_verify_capture",
                 "graph_dflash_verify_replay"):
        assert out[name]["shape_ok"], name
        assert out[name]["kernel_calls"] == 1, f"{name} did not reach the kernel: {out[name]}"
        assert out[name]["max_abs_diff"] < 1e-4, f"{name}: {out[name]}"
    for name in ("extend_stays_on_triton", "draft_extend_wide_on_triton"):
        assert out[name] == {"max_abs_diff": 0.0, "kernel_calls": 0, "shape_ok": True}, (name, out[name])
    assert out["graph_qo_indptr_dtype"] == "torch.int64"  # so the int32 copy was exercised
    splits = out["attn_logits_splits"]
    assert splits["eager"] == splits["graph"] == 1 and splits["triton"] > 1, splits
    assert out["dflash_capture_mask"], "SGLang's DFlash capture no longer hands this backend a mask"
    # EAGLE's draft decode: two step backends on the kernel, each step one draft token longer a
    # branch; at topk 4 with 16 rows, eagerly and through the graph path's buffers
    assert out["draft_step_backends"] == ["Sm120MlaAttnBackend"] * 2
    for name, prefix, topk in (("draft_decode_steps", [6, 23, 40], 1), ("draft_decode_topk4", [6, 9, 3, 11], 4),
                               ("draft_decode_topk4_graph", [2, 12, 7, 5], 4)):
        steps = out[name]
        assert steps["kernel_calls"] == 2 and steps["max_abs_diff"] < 1e-4, (name, steps)
        rows = len(prefix) * topk
        assert steps["kv_lens"] == [topk * sum(prefix) + rows, topk * sum(prefix) + 2 * rows], (name, steps)
    assert "ENCODER_ONLY; the kernel runs causal decoder self-attention only" in (out["encoder_layer_error"] or "")
    assert out["factory_error"] and "no CUDA GPU" in out["factory_error"], out["factory_error"]
    # the target runner's line names its routes (the test kit's runner says --attention-backend
    # triton, so decode reads as off the kernel); the draft runner's line names only itself
    target, warning, draft = out["start_lines"]
    assert target.startswith("sm120_mla (pid ") and "on the sm120 kernel" in target, out["start_lines"]
    assert warning.startswith("sm120_mla: decode runs on triton"), out["start_lines"]
    assert draft.startswith("sm120_mla (pid ") and "a draft model's MLA backend" in draft, out["start_lines"]


# ---------------------------------------------------------------- GPU: the real kernel
GPU_HEADS, GPU_NDT, GPU_MAX_REQUESTS, GPU_CONTEXT = 16, 4, 4, 2048


@pytest.fixture(scope="module")
def gpu_setup():
    from sm120_workbook import kernels

    # A GPU is present (the gpu mark skips otherwise), so a kernel that cannot build is a
    # failure, not a skip.
    ok, why = kernels.kernel_available()
    assert ok, f"sm120 kernel not available on this GPU machine: {why}"
    runner = make_runner(device="cuda", dtype=torch.bfloat16, heads=GPU_HEADS,
                         num_draft_tokens=GPU_NDT, max_requests=GPU_MAX_REQUESTS,
                         max_context_len=GPU_CONTEXT, poison=True)
    yield runner, make_layer(GPU_HEADS)
    runner._server_args_override.restore()


def _assert_bf16_close(got, want, what):
    """Ours against SGLang's Triton backend on the same pool and metadata: a test of the wiring
    (the kernel itself meets the float64 reference in test_kernel_gpu.py). Both outputs are bf16
    (a rounding of up to 2^-9 relative each) from fp32 sums in another order; with unit-normal
    KV the outputs stay within about +-3, so a right answer differs by ~1e-2 at most, and 2e-2
    is that with room. The cosine catches what a tolerance per element may not: a mask or a
    prefix off by a few keys moves every row a little (0.96-0.9995 for a kernel that ignores the
    tree mask, at these lengths). NaN anywhere fails: the pool's unowned slots are NaN."""
    assert not got.isnan().any(), f"{what}: NaN in the output (a slot no request owns was read, or a row unwritten)"
    got, want = got.float(), want.float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{what}: {m}")
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.9995, f"{what}: cosine {cos:.6f}"


def _batches(runner, mode, gen, lens_list, tree_mask=True):
    if mode == "decode":
        return [decode_batch(runner, lens, gen) for lens in lens_list]
    if mode == "draft_extend":
        return [draft_extend_batch(runner, lens, GPU_NDT, gen) for lens in lens_list]
    if mode == "dflash":
        return [dflash_verify_batch(runner, lens, GPU_NDT, gen) for lens in lens_list]
    return [verify_batch(runner, lens, GPU_NDT, gen, tree_mask) for lens in lens_list]


def _triton_and_sm120(gpu_setup, mode, tree_mask, seed):
    """SGLang's Triton backend and ours on one runner, with three batches of fresh inputs."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sm120_workbook.patches.backend import Sm120MlaAttnBackend

    runner, layer = gpu_setup
    triton, sm120 = TritonAttnBackend(runner), Sm120MlaAttnBackend(runner)
    batches = _batches(runner, mode, torch.Generator().manual_seed(seed), LENS, tree_mask)
    return triton, sm120, layer, batches


MODES = [("decode", True), ("verify", True), ("verify", False), ("draft_extend", False), ("dflash", False)]
MODE_IDS = ["decode", "verify-tree", "verify-chain", "draft-extend", "dflash-verify"]
LENS = [[37, 300, 1029], [1500, 5, 777], [64, 1200, 2]]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,tree_mask", MODES, ids=MODE_IDS)
def test_gpu_eager_matches_triton(gpu_setup, mode, tree_mask, seed):
    triton, sm120, layer, batches = _triton_and_sm120(gpu_setup, mode, tree_mask, seed)
    for i, batch in enumerate(batches):
        want = run_eager(triton, layer, *batch)
        got = run_eager(sm120, layer, *batch)
        _assert_bf16_close(got, want, f"{mode} eager batch {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode,tree_mask", MODES, ids=MODE_IDS)
def test_gpu_cuda_graph_replay_matches_triton(gpu_setup, mode, tree_mask, seed):
    """Capture once, replay with new lengths, masks, KV locations and inputs. DFlash's capture
    carries the mask SGLang's graph runner gives this backend, its replays none (as served)."""
    triton, sm120, layer, batches = _triton_and_sm120(gpu_setup, mode, tree_mask, seed)
    sm120.init_cuda_graph_state(GPU_MAX_REQUESTS, GPU_MAX_REQUESTS * GPU_NDT)
    fb0, q0, k0, v0 = batches[0]
    if mode == "dflash":
        fb0.spec_info.custom_mask = dflash_capture_mask(sm120, GPU_MAX_REQUESTS, GPU_NDT)
    q_buf, k_buf, v_buf = q0.clone(), k0.clone(), v0.clone()
    loc_buf = fb0.out_cache_loc.clone()
    fb0.out_cache_loc = loc_buf
    forward = sm120.forward_decode if mode == "decode" else sm120.forward_extend
    sm120.init_forward_metadata_out_graph(fb0, in_capture=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(q_buf.clone(), k_buf.clone(), v_buf.clone(), layer, fb0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(q_buf, k_buf, v_buf, layer, fb0)
    if mode == "dflash":
        fb0.spec_info.custom_mask = None   # its replay below, as DFlash sends it
    for i, (fb, q, k, v) in enumerate(batches[1:] + batches[:1]):
        want = run_eager(triton, layer, fb, q, k, v)
        q_buf.copy_(q)
        k_buf.copy_(k)
        v_buf.copy_(v)
        loc_buf.copy_(fb.out_cache_loc)
        fb.out_cache_loc = loc_buf
        sm120.init_forward_metadata_out_graph(fb, in_capture=False)
        graph.replay()
        torch.cuda.synchronize()
        _assert_bf16_close(out, want, f"{mode} replay {i}")


@pytest.mark.gpu
def test_gpu_registered_factory_builds_the_backend(gpu_setup):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    import sm120_workbook.patches as plugin
    from sm120_workbook.patches.backend import Sm120MlaAttnBackend

    runner, _ = gpu_setup
    plugin.register_backend()
    try:
        backend = ATTENTION_BACKENDS[plugin.BACKEND_NAME](runner)
        assert isinstance(backend, Sm120MlaAttnBackend) and backend.kernel_ops is not None
        assert backend.kernel_heads == GPU_HEADS
    finally:
        plugin.uninstall_spec_compat()
        plugin.unregister_backend()


@pytest.mark.gpu
def test_gpu_graph_state_leaves_out_the_parents_decode_scratch():
    """The CUDA-graph buffers of sm120_mla against Triton's at notebook 05's shape (8 heads, 384
    tokens, 16,720 context): Triton keeps a split-KV scratch for its decode kernel (256 splits for
    MLA on a GPU of 132+ SMs, 1.5 GiB), which this backend's decode never reads. Session 50 on an
    H200: 1.557 GiB against 0.082 GiB (the kernel's own workspace and the parent's other buffers)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sm120_workbook import kernels
    from sm120_workbook.patches.backend import Sm120MlaAttnBackend

    ok, why = kernels.kernel_available()
    assert ok, f"sm120 kernel not available on this GPU machine: {why}"
    runner = make_runner(device="cuda", dtype=torch.bfloat16, heads=8, num_draft_tokens=8, max_requests=48,
                         max_context_len=16720)
    taken = {}
    for cls in (TritonAttnBackend, Sm120MlaAttnBackend):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        backend = cls(runner)
        backend.init_cuda_graph_state(48, 384)
        torch.cuda.synchronize()
        taken[cls.__name__] = (torch.cuda.memory_allocated() - before) / 2**30
        del backend
        torch.cuda.empty_cache()
    print(f"graph state, GiB: {taken}")
    assert taken["Sm120MlaAttnBackend"] < 0.2 * taken["TritonAttnBackend"], taken


if __name__ == "__main__" and os.environ.get("SM120_BACKEND_WIRING") == "1":
    print("RESULT " + json.dumps(_cpu_wiring_checks()))


# ---------------------------------------------------------------- the benchmark's baselines
@pytest.mark.gpu
@pytest.mark.parametrize("impl,q_len", [("triton_decode", 1), ("triton_verify", 16), ("flashmla", 16), ("flashmla", 1),
                                        ("flashinfer_mla", 16), ("flashinfer_mla_fa2", 16)])
@pytest.mark.parametrize("ctx", [777, 65_537])
def test_benchmark_baselines_compute_the_reference(impl, q_len, ctx):
    """Each baseline the benchmark times, called as it calls it (bench.BUILDERS; triton_decode
    with the splits and MLA path an SGLang server uses), gives the float64 reference's answer on
    a skewed batch: a wrong argument would otherwise change only its speed. The benchmark checks
    each baseline at 1k only, so 65,537 (past 64k: FlashMLA's page-64 tail, Triton's split sizes
    and FlashInfer's plan at the contexts the targets judge) is checked here."""
    from sm120_workbook.kernels.bench import REF_TOLERANCE, Shape, check_against_reference

    if impl.startswith("flashinfer"):
        pytest.importorskip("flashinfer", reason="FlashInfer is not installed here")
    if impl == "flashmla":
        from sm120_workbook.hardware import unsupported_reason

        why = unsupported_reason(impl, torch.cuda.get_device_capability())
        if why:   # the import succeeds on sm_120 (sgl_kernel loads its .so lazily); the call would not
            pytest.skip(why)
        pytest.importorskip("sgl_kernel.flash_mla", reason="sgl_kernel's FlashMLA is not installed here")
    assert check_against_reference(impl, Shape(3, 8, q_len, ctx, short_ctx=100)) < REF_TOLERANCE
