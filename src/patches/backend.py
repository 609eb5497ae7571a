"""`Sm120MlaAttnBackend`: SGLang's Triton backend, the sm_120 MLA kernel on decode, verify, draft extend.

The class subclasses `TritonAttnBackend` (sglang/srt/layers/attention/triton_backend.py)
and keeps all of its metadata: kv_indptr (int32), kv_indices (int64, one entry per token),
qo_indptr, custom_mask and mask_indptr (int64), built per batch in `init_forward_metadata`
or, under CUDA graphs, written into the buffers of `init_cuda_graph_state` by
`init_forward_metadata_out_graph` before capture and before every replay. Only the
attention call of three phases of an MLA model changes:

- decode (`forward_decode`): one query per request; the new token's KV is saved to the pool
  first, exactly as the parent does, and is the last entry of the request's kv_indices;
- target verify (`forward_extend` in TARGET_VERIFY): the draft tokens' KV (`k`) goes to the
  kernel as `k_extend`, beside the prefix rows, with SGLang's tree mask as it is;
- draft extend (`forward_extend` in DRAFT_EXTEND_V2, an EAGLE/MTP draft model's backend): the
  same call without a mask, as the parent runs it (prefix rows, then a causal chain over the
  extended tokens); a window wider than the kernel's queries stays on the parent's Triton path.

`Sm120MlaMultiStepDraftBackend` runs an MLA draft model's EAGLE draft-decode steps on the kernel
too (one query per request and branch). Prefill, extend and every non-MLA model run the parent's
Triton kernels.

The kernel's buffers (lse, workspace, the decode qo_indptr, an int32 copy of the parent's int64
qo_indptr for verify and draft extend) are allocated once per backend and sliced per call, so
decode, verify and draft extend can be captured in CUDA graphs. If the kernel cannot build or
run here, the constructor raises (the server fails at start, naming the cause): this backend
never serves quietly on another kernel.

Use it with the default page size 1 and a bf16 KV cache (`--kv-cache-dtype auto` on a
bf16/fp8-weight model). `--attention-backend sm120_mla` alone prefills on Triton, slow at long
prompts. `hybrid_flags()` prefill on FlashInfer instead (SGLang's hybrid backend; in `decode` mode
it sends target verify to the decode side, this backend). Spelt with flashinfer as
--attention-backend, SGLang also turns on its chunked prefix cache, which it keys on that flag
alone. `attention_routes` says what the server does.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend, TritonMultiStepDraftBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.speculative.spec_info import SpecInputType

from ..mla import DIM_QK, DIM_V
from . import BACKEND_NAME

logger = logging.getLogger(__name__)

DEFAULT_MAX_Q_LEN = 16


def hybrid_flags(prefill: str = "flashinfer") -> str:
    """The launch flags that keep decode and verify on this backend and prefill on `prefill`,
    with SGLang's chunked prefix cache on where `prefill` supports it (README, "Prefill")."""
    return (f"--attention-backend {prefill} --decode-attention-backend {BACKEND_NAME} "
            "--speculative-attention-mode decode")


def attention_routes(server_args, base: str | None = None) -> tuple[str, str | None]:
    """Which phases a server runs on the sm120 kernel and where it prefills, from its ServerArgs
    resolved as SGLang resolves them (`attention_backends_of`: a split field falls back to
    --attention-backend; with a split, HybridAttnBackend sends target verify to the decode side
    only in --speculative-attention-mode decode). Returns the start-up line's clause and a
    warning where the flags keep decode or verify off the kernel, prefill on Triton's extend
    kernel, or SGLang's chunked prefix cache off beside a prefill backend that could use it.
    `base` is --attention-backend as the server resolved it (`runtime_attention_backend`),
    where a server calls this; without it the arguments' value is read. A server_args of None
    (a test runner) reads as --attention-backend sm120_mla."""
    from sglang.srt.arg_groups.overrides import attention_backends_of

    if server_args is None:
        server_args = SimpleNamespace(attention_backend=BACKEND_NAME, prefill_attention_backend=None,
                                      decode_attention_backend=None, speculative_algorithm=None)
    prefill, decode = attention_backends_of(server_args)
    speculative = getattr(server_args, "speculative_algorithm", None) is not None
    mode = getattr(server_args, "speculative_attention_mode", "prefill")
    verify = decode if prefill == decode or mode == "decode" else prefill
    on_kernel = [phase for phase, side in (("decode", decode), ("target verify", verify))
                 if side == BACKEND_NAME and (phase == "decode" or speculative)]
    prefill_kernels = "Triton" if prefill in (BACKEND_NAME, "triton") else prefill
    clause = (f"{' and '.join(on_kernel) or 'no phase'} on the sm120 kernel; prefill and extend on "
              f"{prefill_kernels}" + (" (SGLang's hybrid backend)" if prefill != decode else ""))
    chunked = getattr(server_args, "chunked_prefill_size", None)
    if (getattr(server_args, "enable_mixed_chunk", False) and not speculative and decode == BACKEND_NAME
            and (chunked is None or chunked > 0)):
        # A mixed batch is an extend: its decode tokens run where prefill does (SGLang mixes
        # only with chunked prefill on, and turns mixing off under speculation).
        clause += f"; with --enable-mixed-chunk, decode tokens batched beside a prefill run on {prefill_kernels}"
    warnings = []
    if decode != BACKEND_NAME:
        warnings.append(f"decode runs on {decode}, not on the sm120 kernel")
    if speculative and verify != BACKEND_NAME:
        warnings.append(f"target verify runs on {verify}, not on the sm120 kernel"
                        + (": add --speculative-attention-mode decode" if decode == BACKEND_NAME else ""))
    if prefill_kernels == "Triton":
        warnings.append("prompts prefill on SGLang's Triton extend kernel, slow at long contexts "
                        f"(10 s at 64k for 16 layers on an H200); {hybrid_flags()} prefills on "
                        "FlashInfer's MLA kernels instead")
    elif (why := prefix_cache_kept_off(server_args, prefill, base)) is not None:
        warnings.append(f"{why}, so each prompt chunk after the first prefills on absorbed MLA (with "
                        "flashinfer, 16 layers on an H200: 1.62 s against 0.87 s to the first token at 64k); "
                        f"spell the same backends {hybrid_flags(prefill)}")
    return clause, ("sm120_mla: " + "; ".join(warnings)) if warnings else None


def prefix_cache_kept_off(server_args, prefill: str, base: str | None = None) -> str | None:
    """Why SGLang keeps its chunked prefix cache off although the prefill backend could use it,
    or None. SGLang decides by --attention-backend alone, as resolved at load
    (`maybe_disable_chunked_prefix_cache` reads the runtime context's kernel.attention_backend),
    against its list of backends whose kernels read the chunked layout; a user's
    --disable-chunked-prefix-cache is a choice, not a mistake. `base`: the resolved flag, where
    known; else the arguments' value (None: left to SGLang's default, which depends on the GPU)."""
    from sglang.srt.server_args import CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS as supported

    if prefill not in supported or getattr(server_args, "disable_chunked_prefix_cache", False):
        return None
    if base is None:
        base = getattr(server_args, "attention_backend", None)
    if base in supported:
        return None
    if base is None:
        return ("on sm_120, --attention-backend left out becomes SGLang's default for MLA, triton, and "
                "SGLang turns its chunked prefix cache on by that flag alone (on Hopper the default, fa3, "
                "has it)")
    return (f"SGLang turns its chunked prefix cache on by --attention-backend alone, and {base} is not "
            "in its list")


def runtime_attention_backend() -> str | None:
    """--attention-backend as SGLang resolved it in this server process (its runtime context,
    where a default has been filled in), or None outside a server. Only a server's own backend
    should ask: any process with a published context answers for that context."""
    try:
        from sglang.srt.runtime_context import get_exec

        return get_exec().kernel.attention_backend
    except Exception:   # no context published here (ValueError), or another SGLang: a start-up
        return None     # line must never stop a server


def routes_of_command(args: list[str]) -> tuple[str, str | None]:
    """attention_routes of a `sglang.launch_server` command line (its arguments), parsed by
    SGLang's own parser: what a server started so would log. --model-path may be left out.
    Registers the backend first, as the plugin does in every server process, so that the
    parser knows the name."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from . import register_backend

    register_backend()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    if "--model-path" not in args:
        args = ["--model-path", "MODEL", *args]
    return attention_routes(parser.parse_args(args))


def load_kernel_ops():
    """The kernel package, or a RuntimeError that says why it cannot run here."""
    try:
        from sm120_workbook import kernels
    except Exception as e:  # an import error is a cause worth showing as it is
        raise RuntimeError(f"sm120_mla: cannot import sm120_workbook.kernels ({e!r}); "
                           "choose another --attention-backend, e.g. triton") from e
    ok, why = kernels.kernel_available()
    if not ok:
        raise RuntimeError(f"sm120_mla: the MLA kernel cannot run here: {why}; "
                           "choose another --attention-backend, e.g. triton")
    return kernels


def _is_dflash_verify(forward_batch) -> bool:
    """DFlash verifies a causal chain and sends no mask. But SGLang's graph runner gives a capture
    an all-ones one for a backend its list of causal backends does not name (by class: this
    subclass of Triton's, or the hybrid around it), the parent binds its mask buffer to it, and no
    replay refills it: read, it would hide the drafts (the buffer's zeros) or show them all (its
    ones). So a DFlash verify reads no mask, on the kernel and on the parent's path alike."""
    return getattr(forward_batch.spec_info, "spec_input_type", None) == SpecInputType.DFLASH_VERIFY


class Sm120MlaAttnBackend(TritonAttnBackend):
    """TritonAttnBackend whose MLA decode, target verify and draft extend run `mla_verify_attention`.

    `kernel_ops` defaults to `sm120_workbook.kernels` (imported here, at construction); a
    test may pass another object with the same `mla_verify_attention`,
    `MlaVerifyWorkspace` and `kernel_available` (and optional `KV_DTYPE`, `MAX_Q_LEN`).
    """

    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf=None, *,
                 kernel_ops=None):
        super().__init__(model_runner, skip_prefill=skip_prefill, kv_indptr_buf=kv_indptr_buf)
        self.kernel_ops = None
        # A speculative draft model's runner builds its backends by the target's names too: its
        # line says so, and the server's routes are the target runner's to tell.
        draft = bool(getattr(model_runner, "is_draft_worker", False))
        if not self.use_mla:
            # An MHA draft (an EAGLE3 Llama head) on Triton: its draft extend reads the whole prefix
            # with one CTA a head, 4.4 ms a step at 64k on an H200 against FlashInfer's 0.08 ms.
            logger.info("sm120_mla (pid %d): %s is not an MLA model; every phase of it runs the "
                        "Triton backend%s", os.getpid(), "the draft model" if draft else "the model",
                        " (--speculative-draft-attention-backend flashinfer runs it on FlashInfer, "
                        "much faster at long contexts)" if draft else "")
            return
        if kernel_ops is None:
            kernel_ops = load_kernel_ops()
        else:
            ok, why = kernel_ops.kernel_available()
            if not ok:
                raise RuntimeError(f"sm120_mla: the MLA kernel cannot run here: {why}")
        self.kernel_ops = kernel_ops
        # Decode never reaches the parent's Triton kernel on this path, so its split-KV scratch
        # (attn_logits, tokens x heads x max_kv_splits x 512 fp32, which the graphs keep and each
        # eager decode step allocates) needs one split, not the up to 256 the parent sizes for MLA
        # on a GPU of 132+ SMs: 1.5 GiB of graph buffers at 8 heads and 384 tokens, 6 GiB at 16
        # heads and 768.
        self.max_kv_splits = 1
        # Out of torch.compile's tracing, as the parent keeps its Triton kernels: the launch's
        # host checks (data_ptr alignment) would break every layer's graph (--enable-torch-compile).
        self._mla_verify_attention = torch.compiler.disable(kernel_ops.mla_verify_attention)
        self._check_runner(model_runner)
        self.kernel_heads = self.num_head
        self.kernel_max_q_len = getattr(kernel_ops, "MAX_Q_LEN", DEFAULT_MAX_Q_LEN)
        # Verify and draft extend put num_draft_tokens queries per request, decode one. A draft's
        # decode-step backend (skip_prefill) decodes only, one query per branch: sized for one a
        # request here, Sm120MlaMultiStepDraftBackend grows it to its branches.
        self.tokens_per_request = 1 if skip_prefill else max(1, self.num_draft_tokens or 1)
        max_requests = model_runner.req_to_token_pool.size
        self._alloc_kernel_buffers(max_requests * self.tokens_per_request, max_requests)
        sizes = (self.kernel_heads, self.kernel_max_tokens, self.kernel_workspace_bytes / 2**20)
        if draft:
            logger.info("sm120_mla (pid %d): a draft model's MLA backend (%d heads, up to %d tokens, "
                        "workspace %.1f MiB)", os.getpid(), *sizes)
            return
        route, advice = attention_routes(getattr(model_runner, "server_args", None),
                                         base=runtime_attention_backend())
        logger.info("sm120_mla (pid %d): MLA %s (%d heads, up to %d tokens, workspace %.1f MiB)",
                    os.getpid(), route, *sizes)
        if advice:
            logger.warning(advice)

    # ------------------------------------------------------------------ setup
    def _check_runner(self, model_runner) -> None:
        ops = self.kernel_ops
        if self.dcp_size > 1:
            raise ValueError(f"sm120_mla: decode context parallelism (dcp_size={self.dcp_size}) "
                             "is not supported by the kernel; use --attention-backend triton")
        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            raise ValueError("sm120_mla: sliding-window attention is not supported")
        if getattr(self, "_translate_kv_loc", None) is not None:
            # A unified pool maps request slots to other rows; the verify path's fallback read
            # of the drafts' KV would need the same mapping, which this backend does not do.
            raise ValueError("sm120_mla: unified (translated) KV pools are not supported; "
                             "use --attention-backend triton")
        pool = self.token_to_kv_pool
        key = pool.get_key_buffer(getattr(pool, "start_layer", 0) or 0)
        kv_dtype = getattr(ops, "KV_DTYPE", torch.bfloat16)
        dim_qk = getattr(ops, "DIM_QK", DIM_QK)
        if key.dtype != kv_dtype or key.shape[-1] != dim_qk:
            raise ValueError(f"sm120_mla: needs a {kv_dtype} MLA KV cache with {dim_qk}-wide rows "
                             f"(kv_lora_rank 512 + rope 64); this pool has {key.dtype} rows of "
                             f"{key.shape[-1]} (use --kv-cache-dtype auto)")
        max_q_len = getattr(ops, "MAX_Q_LEN", DEFAULT_MAX_Q_LEN)
        if self.num_draft_tokens and self.num_draft_tokens > max_q_len:
            raise ValueError(f"sm120_mla: speculative_num_draft_tokens={self.num_draft_tokens} "
                             f"exceeds the kernel's {max_q_len} queries per request")
        if not 1 <= self.num_head <= 128:
            raise ValueError(f"sm120_mla: {self.num_head} query heads per rank; the kernel "
                             "takes 1..128")

    def _alloc_kernel_buffers(self, max_tokens: int, max_requests: int) -> None:
        device = self.device
        self.kernel_max_tokens = max_tokens
        self.kernel_lse = torch.empty((max_tokens, self.kernel_heads), dtype=torch.float32,
                                      device=device)
        self.kernel_workspace = self.kernel_ops.MlaVerifyWorkspace(max_tokens, self.kernel_heads,
                                                                   device)
        # Decode: request i's query is token i.
        self.decode_qo_indptr = torch.arange(max_tokens + 1, dtype=torch.int32, device=device)
        # The parent's own qo_indptr buffer (graphs; eager draft extend) is int64; the kernel takes int32.
        self.verify_qo_indptr = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)

    @property
    def kernel_workspace_bytes(self) -> int:
        ws = self.kernel_workspace
        return getattr(ws, "nbytes", 0) + self.kernel_lse.numel() * 4

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None,
                              cuda_graph_num_kv_splits_buf=None):
        super().init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf=kv_indices_buf,
                                      cuda_graph_num_kv_splits_buf=cuda_graph_num_kv_splits_buf)
        # Grow once, before any capture, if the graphs outsize the constructor's bound.
        self.reserve_kernel_buffers(max_num_tokens, max_bs)

    def reserve_kernel_buffers(self, max_tokens: int, max_requests: int) -> None:
        """Grow the kernel's buffers (never shrink) to take max_tokens queries of max_requests."""
        if self.kernel_ops is None:
            return
        if max_tokens > self.kernel_max_tokens or max_requests + 1 > self.verify_qo_indptr.numel():
            self._alloc_kernel_buffers(max(max_tokens, self.kernel_max_tokens),
                                       max(max_requests, self.verify_qo_indptr.numel() - 1))

    def _on_kernel(self, forward_mode) -> bool:
        """Whether `forward_extend` runs this mode on the kernel: target verify and draft extend."""
        return self.kernel_ops is not None and (forward_mode.is_target_verify()
                                                or forward_mode.is_draft_extend_v2())

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        qo_indptr = self.forward_metadata.qo_indptr
        if self._on_kernel(forward_batch.forward_mode) and qo_indptr.dtype != torch.int32:
            # eager draft extend: the parent's qo_indptr is its int64 buffer; the kernel takes int32
            self.verify_qo_indptr[: qo_indptr.numel()].copy_(qo_indptr)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        mode = forward_batch.forward_mode
        if self._on_kernel(mode):
            # Once per forward, outside the graph: the parent refilled its int64 qo_indptr (a
            # replay reuses the capture's metadata, a view of the same buffer), over the batch it
            # took (`_apply_cuda_graph_metadata`).
            bs = len(forward_batch.req_pool_indices) if mode.is_target_verify() else forward_batch.batch_size
            self.verify_qo_indptr[: bs + 1].copy_(self.qo_indptr[: bs + 1])

    # ------------------------------------------------------------------ forward
    def _check_layer(self, layer, sinks, score_mod) -> None:
        if layer.qk_head_dim != DIM_QK or layer.v_head_dim != DIM_V:
            raise ValueError(f"sm120_mla: layer {layer.layer_id} has head dims "
                             f"{layer.qk_head_dim}/{layer.v_head_dim}; the kernel takes "
                             f"{DIM_QK}/{DIM_V}")
        if layer.tp_q_head_num != self.kernel_heads:
            raise ValueError(f"sm120_mla: layer {layer.layer_id} has {layer.tp_q_head_num} "
                             f"heads, the workspace {self.kernel_heads}")
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            # the parent runs these without a causal mask; the kernel masks every call causally
            raise ValueError(f"sm120_mla: layer {layer.layer_id} is {layer.attn_type.name}"
                             f"{' cross-attention' if layer.is_cross_attention else ''}; the kernel "
                             "runs causal decoder self-attention only")
        if sinks is not None or score_mod is not None:
            raise ValueError("sm120_mla: attention sinks and score_mod are not supported")
        if layer.logit_cap and layer.logit_cap > 0:
            raise ValueError("sm120_mla: logit capping is not supported")
        if layer.xai_temperature_len is not None and layer.xai_temperature_len > 0:
            raise ValueError("sm120_mla: xai temperature scaling is not supported")
        for name in ("k_scale_float", "v_scale_float"):
            scale = getattr(layer, name, None)
            if scale is not None and scale != 1.0:
                raise ValueError(f"sm120_mla: layer {layer.layer_id} has {name}={scale}; the "
                                 "kernel reads the cache unscaled")

    def _write_loc(self, forward_batch) -> KVWriteLoc:
        return KVWriteLoc(forward_batch.out_cache_loc, self.forward_metadata.swa_out_cache_loc,
                          full_loc=self.forward_metadata.out_cache_loc_full_physical)

    def _attend(self, q, layer, out, *, qo_indptr, max_q_len, k_extend=None, custom_mask=None,
                mask_indptr=None):
        tokens = q.shape[0]
        meta = self.forward_metadata
        self._mla_verify_attention(
            q.view(tokens, layer.tp_q_head_num, DIM_QK),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            qo_indptr, meta.kv_indptr, meta.kv_indices,
            out=out.view(tokens, layer.tp_q_head_num, DIM_V),
            lse=self.kernel_lse[:tokens], workspace=self.kernel_workspace,
            sm_scale=layer.scaling, max_q_len=max_q_len, k_extend=k_extend,
            custom_mask=custom_mask, mask_indptr=mask_indptr)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
                       score_mod=None, aux_tensors=None):
        if self.kernel_ops is None:
            return super().forward_decode(q, k, v, layer, forward_batch,
                                          save_kv_cache=save_kv_cache, sinks=sinks,
                                          score_mod=score_mod, aux_tensors=aux_tensors)
        self._check_layer(layer, sinks, score_mod)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache:
            # As TritonAttnBackend.forward_decode does for MLA.
            if layer.k_scale is not None:
                k.div_(layer.k_scale)
            self.token_to_kv_pool.set_kv_buffer(layer, self._write_loc(forward_batch), k, v)
        batch = self.forward_metadata.kv_indptr.shape[0] - 1
        return self._attend(q, layer, out, qo_indptr=self.decode_qo_indptr[: batch + 1],
                            max_q_len=1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
                       score_mod=None, aux_tensors=None):
        mode = forward_batch.forward_mode
        # A draft-extend window wider than the kernel's queries (multi-layer EAGLE's can be) stays
        # on the parent's Triton kernel.
        on_kernel = self._on_kernel(mode) and not (
            mode.is_draft_extend_v2() and int(self.forward_metadata.max_extend_len) > self.kernel_max_q_len)
        if not on_kernel:
            # The parent's Triton path (a non-MLA model) reads the metadata's mask. A DFlash verify
            # gets, for this call only, the metadata without it; the captured metadata itself is
            # left as it is (replays reuse it).
            meta = self.forward_metadata
            unmasked = _is_dflash_verify(forward_batch) and getattr(meta, "custom_mask", None) is not None
            if unmasked:
                self.forward_metadata = dataclasses.replace(meta, custom_mask=None)
            try:
                return super().forward_extend(q, k, v, layer, forward_batch,
                                              save_kv_cache=save_kv_cache, sinks=sinks,
                                              score_mod=score_mod, aux_tensors=aux_tensors)
            finally:
                if unmasked:
                    self.forward_metadata = meta
        self._check_layer(layer, sinks, score_mod)
        out = getattr(forward_batch, "_attn_output", None)
        if out is None:
            out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if k is None and v is None:
            # The model already wrote the draft KV: read it back, as the parent does.
            k = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[forward_batch.out_cache_loc]
        elif k is None or v is None:
            raise ValueError("Both k and v should be None or not None")
        elif save_kv_cache:
            # As TritonAttnBackend.forward_extend does for MLA.
            if layer.k_scale is None:
                self._set_kv_buffer(forward_batch, layer, self._write_loc(forward_batch), k, v)
            else:
                self.token_to_kv_pool.set_kv_buffer(layer, self._write_loc(forward_batch),
                                                    k.clone().div_(layer.k_scale), v)
        meta = self.forward_metadata
        qo_indptr = meta.qo_indptr
        if qo_indptr.dtype != torch.int32:  # the int32 copy made with the metadata, out of graph
            qo_indptr = self.verify_qo_indptr[: qo_indptr.numel()]
        # None in draft extend and in DFlash's verify (_is_dflash_verify): a causal chain
        custom_mask = None if _is_dflash_verify(forward_batch) else meta.custom_mask
        return self._attend(q, layer, out, qo_indptr=qo_indptr, max_q_len=int(meta.max_extend_len),
                            k_extend=k.contiguous(), custom_mask=custom_mask,
                            mask_indptr=meta.mask_indptr if custom_mask is not None else None)


class Sm120MlaMultiStepDraftBackend(TritonMultiStepDraftBackend):
    """SGLang's Triton multi-step draft-decode backend (EAGLE / MTP draft steps) with an
    `Sm120MlaAttnBackend` for each step: an MLA draft model's decode steps run on the kernel.

    The parent fills the draft's per-step kv_indptr / kv_indices (its own buffers, also under CUDA
    graphs) and hands each step's backend its slice; every step is a decode, one query per request
    and branch. A non-MLA draft's steps run the parent's Triton kernels.
    """

    def __init__(self, model_runner, topk: int, speculative_num_steps: int, *, kernel_ops=None):
        super().__init__(model_runner, topk, speculative_num_steps)
        # The parent built Triton backends over its kv_indptr rows: the same, on the kernel.
        self.attn_backends = [Sm120MlaAttnBackend(model_runner, skip_prefill=True,
                                                  kv_indptr_buf=self.kv_indptr[i], kernel_ops=kernel_ops)
                              for i in range(self.speculative_num_steps - 1)]
        # A step decodes topk branches a request (the parent's kv_indptr rows are sized so).
        requests = model_runner.req_to_token_pool.size
        for step in self.attn_backends:
            step.reserve_kernel_buffers(requests * topk, requests * topk)


def create_backend(runner):
    """The factory registered as `sm120_mla` (SGLang passes the ModelRunner, as to `triton`)."""
    # Same precondition as SGLang's `triton` factory.
    assert not runner.model_config.is_encoder_decoder, (
        "Cross attention is not supported in the sm120_mla attention backend.")
    from . import _install_spec_compat_or_warn

    # The backend is selected in this process: let the draft workers built after the target
    # (EAGLE / MTP, DSpark) accept its name.
    _install_spec_compat_or_warn()
    return Sm120MlaAttnBackend(runner)
