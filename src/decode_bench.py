"""Decode speed of a live SGLang server across context lengths, backends and speculation.

Why not `sglang.bench_one_batch_server`: in SGLang 0.5.17 it (sglang/benchmark/
one_batch_server.py) always loads a tokenizer, from --local-tokenizer-path or the server's
tokenizer_path, even for its random-ids dataset, and our dummy-weight folders hold only a
config.json (the GPU machine cannot download one). So this module does its minimal
equivalent, timed the same way: one streamed /generate request of `ctx` random token ids
(below the vocab size) with `max_new_tokens = N`, ignore_eos; the first streamed chunk marks
the end of prefill (time to first token), and

    tok/s = (completion_tokens - first chunk's tokens) / (last token chunk - first chunk)

SGLang's meta_info["completion_tokens"] is a running total, so the first chunk's count (1
unless the server merged it with the next step's output) is what the decode window leaves
out. (SGLang's bench_one_batch_server divides all N tokens by the decode time: 1/N more.) A
request that did not run to N tokens (an abort, a stop) is an error, never a data point.

Batch 1, CUDA graphs on. With speculation, the response's meta_info gives spec_verify_ct, so
accept length = completion_tokens / spec_verify_ct (SGLang's own definition, bonus token
included) and time per verify step = decode time / spec_verify_ct. Without speculation the
same fields hold 1.0 and the time per decode step.

One server per backend x speculation config, many contexts per server (a start costs
60-160 s), `--context-length` = longest context + decode tokens + a margin.

CLI (GPU machine; appends to data/results/service_decode.jsonl, service_nvml.jsonl,
service_expert_load.jsonl and service_failures.jsonl):

    python -m sm120_workbook.decode_bench --backends triton sm120_mla --spec none dflash

`--spec eagle` is SGLang's EAGLE with the model's own MTP layer (DeepSeek-V3's; the K2-shaped
model is given one, `mtp_layers=1`), `--eagle-steps` draft steps in a chain (topk 1), or a tree
(`--eagle-topk K --eagle-draft-tokens N`). With sm120_mla its draft decodes and extends on the
kernel too, unless `--draft-backend triton`. `--spec eagle3` is SGLang's EAGLE3 with a draft head
of its own (`dummy_models.materialize_eagle3_draft`) on the model without an MTP layer: the same
steps and trees. `--eagle3-head mla` (the default; the layout of the Kimi K2.5/K2.6 heads) drafts
on the same backends as EAGLE; `--eagle3-head llama` (SpecForge's Kimi K2 head, MHA) keeps its
draft's attention on SGLang's own backends: under sm120_mla FlashInfer's, the plugin's step in SGLang's
server-argument hook (patches.mha_draft; Triton's is 1.9x slower a step at 64k), or `--draft-backend`.

DFlash, EAGLE and EAGLE3 servers record experts into a circular buffer of an upper bound on a request's
recorder rows (spec_expert_buffer): their draft passes record empty rows, and SGLang 0.5.17's
unbounded buffer, used for the rest, stops DFlash servers mid-request
(service.DFLASH_RECORDER_CRASH). Records carry the buffer as expert_buffer.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .dummy_models import (EAGLE3_HEADS, eagle3_aux_layers, heads_per_rank, materialize_draft,
                           materialize_eagle3_draft, materialize_model, max_context, model_config, weight_format)
from .notebook_params import check_list_params
from .patches import dflash_host_plan as dflash_host_plan_patch
from .patches import kv_sort
from .provenance import git_commit
from .results import cli_command
from .service import (DRAFT_MODEL_SPECS, EAGLE_SPECS, STALL_TIMEOUT_S, SGLangServer, ServerConfig, ServerError,
                      ServerStartError, check_attention_backend, check_int, check_mem_fraction_static, check_positive,
                      check_eagle_tree_pages, check_tp_visible, check_warmups, default_page_size, dflash_draft_backend,
                      eagle_verify_tokens, log_tail, resolve_tp, spec_metrics)

# decode_bench --dflash-host-plan: "probe" starts the servers with $SM120_DFLASH_HOST_PLAN=probe
# (patches/dflash_host_plan.py, a timing probe with wrong draft attention), "off" without
DFLASH_HOST_PLAN_MODES = ("off", "probe")

DECODE_RESULTS = "service_decode"
NVML_RESULTS = "service_nvml"
EXPERT_RESULTS = "service_expert_load"
FAILURE_RESULTS = "service_failures"
PROFILE_RESULTS = "service_step_profile"
SPEC_MODES = ("none", "dflash", "ngram", "eagle", "eagle3")
DEFAULT_CONTEXTS = (4096, 16384, 65536, 131072)
RECORD_FIELDS = ("backend", "spec", "draft_tokens", "tp", "gpu", "model", "layers", "ctx", "tok_s",
                 "accept_len", "verify_step_ms", "cuda_graph", "commit", "date")
CONTEXT_MARGIN = 256     # tokens beyond ctx + decode tokens + draft window
SERVER_START_ESTIMATE_S = 180.0


class MatrixArgumentError(ValueError):
    """An argument run_matrix's validation step refused, before any server started: the CLI's
    usage error. A ValueError after that is the run's failure, not its arguments'."""


@dataclasses.dataclass(frozen=True)
class ServerPlan:
    """One server start and the contexts measured on it."""

    backend: str
    spec: str
    draft_tokens: int | None
    contexts: tuple[int, ...]


def context_length_for(contexts: Sequence[int], decode_tokens: int, draft_tokens: int | None) -> int:
    """--context-length that fits the longest context, its decode and a draft window."""
    return int(max(contexts) + decode_tokens + 2 * (draft_tokens or 0) + CONTEXT_MARGIN)


def plan_matrix(backends: Sequence[str], contexts: Sequence[int], spec: Sequence[str] = ("none", "dflash"),
                draft_tokens: int = 16, ngram_draft_tokens: int = 8, decode_tokens: int = 256,
                model_max_context: int | None = None, eagle_steps: int = 3, eagle_topk: int = 1,
                eagle_draft_tokens: int | None = None) -> list[ServerPlan]:
    """Servers to start, in order: per backend, each speculation mode; contexts ascending.

    Contexts that cannot fit the model (ctx + decode + margin > model_max_context) are dropped.
    """
    check_list_params(backends=backends, contexts=contexts, spec=spec)
    for b in backends:   # a typo would otherwise be planned, and fail only at its server's start
        check_attention_backend(b, "backends")
    bad = [s for s in spec if s not in SPEC_MODES]
    if bad or not spec:
        raise ValueError(f"spec: entries must be in {SPEC_MODES}, got {list(spec)}")
    if any((not isinstance(c, (int, np.integer))) or c < 1 for c in contexts) or not contexts:
        raise ValueError(f"contexts: must be positive ints, got {list(contexts)}")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, (int, np.integer)) or decode_tokens < 2:
        raise ValueError(f"decode_tokens: must be an int >= 2 (one token comes from prefill), got {decode_tokens!r}")
    check_draft_tokens(backends, spec, draft_tokens, ngram_draft_tokens, eagle_steps, eagle_topk, eagle_draft_tokens)
    if not set(spec) & set(EAGLE_SPECS) and (eagle_topk != 1 or eagle_draft_tokens is not None):
        raise ValueError(f"eagle_topk, eagle_draft_tokens: only {EAGLE_SPECS} take them, and spec is {list(spec)}")
    plans = []
    for backend in dict.fromkeys(backends):
        for s in dict.fromkeys(spec):
            dt = (eagle_verify_tokens(eagle_steps, eagle_topk, eagle_draft_tokens, "eagle_draft_tokens")
                  if s in EAGLE_SPECS else
                  {"none": None, "dflash": draft_tokens, "ngram": ngram_draft_tokens}[s])
            ctxs = sorted({int(c) for c in contexts})
            if model_max_context is not None:
                ctxs = [c for c in ctxs if context_length_for([c], decode_tokens, dt) <= model_max_context]
            if ctxs:
                plans.append(ServerPlan(backend, s, dt, tuple(ctxs)))
    if not plans:
        raise ValueError(f"contexts: none of {sorted(set(contexts))} fits the model's {model_max_context} "
                         f"positions with {decode_tokens} decode tokens and a {CONTEXT_MARGIN}-token margin")
    return plans


def dropped_contexts(plans: Sequence[ServerPlan], contexts: Sequence[int]) -> list[int]:
    """Requested contexts that no planned server measures (they do not fit the model)."""
    kept = {c for p in plans for c in p.contexts}
    return sorted({int(c) for c in contexts} - kept)


SPEC_FALLBACKS = ("", "ngram", "none")   # what may run when a DFlash server fails to start


def check_draft_tokens(backends: Sequence[str], spec: Sequence[str], draft_tokens, ngram_draft_tokens,
                       eagle_steps: int = 3, eagle_topk: int = 1, eagle_draft_tokens: int | None = None) -> None:
    """The draft counts the planned servers will use, checked before any server starts: a DFlash
    block of at least 2, at least 2 NGRAM draft tokens, EAGLE's steps, tree width and tokens
    (eagle_verify_tokens), and for sm120_mla at most the kernel's queries per request."""
    from .kernels.verify_attention import MAX_Q_LEN

    # NGRAM with one draft token verifies nothing beyond the bonus token, and SGLang then leaves
    # spec_verify_ct out of meta_info (tokenizer_manager: only when verify_ct x (draft - 1) > 0)
    counts = {"dflash": ("draft_tokens", draft_tokens, 2), "ngram": ("ngram_draft_tokens", ngram_draft_tokens, 2),
              "eagle": ("eagle_steps", eagle_steps, 1), "eagle3": ("eagle_steps", eagle_steps, 1)}
    for s in dict.fromkeys(spec):
        if s not in counts:
            continue
        name, n, least = counts[s]
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise ValueError(f"{name}: {s} needs an int >= {least}, got {n!r}")
        tokens = eagle_verify_tokens(n, eagle_topk, eagle_draft_tokens, "eagle_draft_tokens") if s in EAGLE_SPECS else n
        if s in EAGLE_SPECS and eagle_draft_tokens is not None:
            name = "eagle_draft_tokens"
        if "sm120_mla" in backends and tokens > MAX_Q_LEN:
            raise ValueError(f"{name}: {tokens} {s} draft tokens exceed the sm120_mla kernel's {MAX_Q_LEN} "
                             "queries per request")


def recorder_rows_per_pass(spec: str, eagle_steps: int = 3) -> int:
    """Recorder rows (forward passes) at most per pass that routes tokens, for a speculation mode.
    DFlash: each verify pass has the draft's pass beside it, whose row is zero. EAGLE: beside the
    target's pass at most the draft extend's and one a draft-decode step past the first, zero rows
    too (SGLang records none of the MTP layer's routing; an EAGLE3 head has no experts):
    eagle_steps + 1. The others: one."""
    return eagle_steps + 1 if spec in EAGLE_SPECS else {"dflash": 2}.get(spec, 1)


def spec_expert_buffer(contexts: Sequence[int], decode_tokens: int, rows_per_pass: int) -> int:
    """The circular recorder buffer (rows, one per forward pass) of a DFlash or EAGLE(3) server: an
    upper bound on one recorded request's routed passes, times `rows_per_pass` (the draft's zero
    rows beside each), so that none is overwritten and _expert_record can tell.
    Its prefill takes at most ctx / 1024 chunks (SGLang's chunked prefill is 2048 tokens and up
    unless set lower) and each decode step emits at least one token; each chunk and each step is
    one routed pass with at most rows_per_pass - 1 draft rows beside it."""
    return rows_per_pass * (-(-max(contexts) // 1024) + decode_tokens) + 16


def resolved_draft_backend(server_info: dict | None, spec: str, mla_draft: bool = True) -> str | None:
    """A DFlash or EAGLE(3) server's draft attention backend as SGLang resolved it (its /server_info):
    --speculative-draft-attention-backend (SGLang writes the DFlash draft's back there), or where an
    info names none: for DFlash SGLang's rule over its backends (dflash_draft_backend), for EAGLE and
    EAGLE3 the decode backend their draft factory falls back to. A draft that is not MLA
    (`mla_draft` False: an EAGLE3 Llama head) left on sm120_mla (the plugin's step in SGLang's hook
    did not run) runs on triton, the entry the plugin's factory patch gives it, and is recorded so.
    None without an info naming a backend."""
    info = server_info or {}
    named = info.get("speculative_draft_attention_backend")
    if not named and spec in EAGLE_SPECS:
        named = info.get("decode_attention_backend") or info.get("attention_backend")
    if not named and spec == "dflash":
        base, prefill = info.get("attention_backend"), info.get("prefill_attention_backend")
        named = dflash_draft_backend(base, prefill) if base or prefill else None
    if spec in EAGLE_SPECS and not mla_draft and named == "sm120_mla":
        return "triton"
    return named


def draft_folder(plan: ServerPlan, model_dir: Path, dest: Path, eagle3_head: str = "mla") -> Path | None:
    """The draft model folder a planned server takes (--speculative-draft-model-path): DFlash's,
    its block the plan's draft tokens; an EAGLE3 head of layout `eagle3_head`; None for the rest
    (EAGLE drafts with the model's MTP layer)."""
    if plan.spec == "dflash":
        return materialize_draft(model_dir, block_size=plan.draft_tokens, dest=dest)
    if plan.spec == "eagle3":
        return materialize_eagle3_draft(model_dir, dest=dest, head=eagle3_head)
    return None


def mha_draft(spec: str, eagle3_head: str = "mla") -> bool:
    """Whether a server's draft model keeps an MHA KV pool of its own (DFlash's, an EAGLE3 Llama
    head's): SGLang sizes it with as many slots as the target's MLA pool (see run_matrix)."""
    return spec == "dflash" or (spec == "eagle3" and eagle3_head == "llama")


def random_input_ids(n: int, vocab_size: int, seed: int, low: int = 100) -> list[int]:
    """n random token ids in [low, vocab_size): no tokenizer, dummy weights, any id will do."""
    if n < 1 or vocab_size <= low:
        raise ValueError(f"n={n}, vocab_size={vocab_size}: need n >= 1 and vocab_size > {low}")
    return np.random.default_rng(seed).integers(low, vocab_size, size=n).tolist()


def decode_stats(completion_tokens: int, ttft_s: float, latency_s: float, meta_info: dict,
                 spec: str, first_chunk_tokens: int = 1) -> dict:
    """tok/s, accept length and step time from one timed request (see the module docstring).

    first_chunk_tokens: the running token count of the first streamed chunk. Tokens up to it
    were made before the first-chunk timestamp, so the decode window holds the rest. With
    speculation, a first chunk of more than one token also holds verify steps the response
    does not count apart; those are estimated from the accept length (`steps_estimated`)."""
    decode_s = latency_s - ttft_s
    decoded = completion_tokens - first_chunk_tokens
    if first_chunk_tokens < 1 or decoded < 1 or not math.isfinite(decode_s) or decode_s <= 0:
        raise ValueError(f"completion_tokens={completion_tokens} ({first_chunk_tokens} in the first chunk), "
                         f"decode time {decode_s:.3f} s: nothing to time after the first chunk")
    steps, estimated = decoded, False
    verify_ct = meta_info.get("spec_verify_ct")
    if spec != "none":
        if not verify_ct:
            raise ValueError("meta_info has no spec_verify_ct: speculation did not run")
        accept = float(meta_info.get("spec_accept_length", completion_tokens / int(verify_ct)))
        # SGLang's accept length counts the prefill's token too (completion / verify steps), so
        # it reads a little high; rounded, not ceiled: 7 tokens at 6.74 a step are one step, not two
        before = max(1, round((first_chunk_tokens - 1) / accept)) if first_chunk_tokens > 1 else 0
        steps, estimated = max(1, int(verify_ct) - before), before > 0
    else:
        accept = 1.0
    return {
        "tok_s": decoded / decode_s,
        "accept_len": accept,
        "verify_step_ms": 1e3 * decode_s / steps,
        "ttft_s": ttft_s,
        "decode_s": decode_s,
        "completion_tokens": int(completion_tokens),
        "first_chunk_tokens": int(first_chunk_tokens),
        "steps_estimated": estimated,
        "spec_verify_ct": int(verify_ct) if verify_ct else None,
        "server_decode_tok_s": meta_info.get("decode_throughput"),
        # what the server took in: the context as sent, and none of it from the prefix cache
        "prompt_tokens": meta_info.get("prompt_tokens"),
        "cached_tokens": meta_info.get("cached_tokens"),
    }


def measure_decode(server: SGLangServer, ctx: int, decode_tokens: int, vocab_size: int, seed: int) -> dict:
    """One timed request of ctx random ids and decode_tokens new tokens on a live server."""
    server.flush_cache()
    before = _safe_metrics(server)
    res = server.generate(random_input_ids(ctx, vocab_size, seed), decode_tokens)
    check_finished(res, decode_tokens)
    sent = res.meta_info.get("prompt_tokens")
    if sent is not None and sent != ctx:   # the point would be named for a context it did not run
        raise ServerError(f"/generate took {sent} prompt tokens, not the {ctx} sent")
    stats = decode_stats(res.completion_tokens, res.ttft_s, res.latency_s, res.meta_info, server.config.spec,
                         res.first_chunk_tokens)
    after = _safe_metrics(server)
    if "sglang:spec_verify_calls_total" in after and "sglang:spec_verify_calls_total" in before:
        stats["metrics_verify_calls"] = (after["sglang:spec_verify_calls_total"]
                                         - before["sglang:spec_verify_calls_total"])
    return stats


def check_finished(res, decode_tokens: int) -> None:
    """A timed request must have run to its length: ignore_eos leaves no other way to stop, so
    anything else (a stop the server chose, fewer tokens) would time a different request."""
    reason = (res.meta_info.get("finish_reason") or {})
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in (None, "length") or res.completion_tokens != decode_tokens:
        raise ServerError(f"/generate finished with {kind!r} after {res.completion_tokens} of "
                          f"{decode_tokens} tokens: not a full timed request")


def _safe_metrics(server: SGLangServer) -> dict:
    if not server.config.enable_metrics:
        return {}
    try:
        return spec_metrics(server.metrics())
    except Exception:  # noqa: BLE001 - metrics are a cross-check, never the measurement
        return {}


@dataclasses.dataclass
class MatrixResult:
    decode: list[dict]
    nvml: list[dict]
    expert: list[dict]
    failures: list[dict]
    profiles: list[dict] = dataclasses.field(default_factory=list)

    def frames(self):
        import pandas as pd

        return (pd.DataFrame(self.decode), pd.DataFrame(self.nvml), pd.DataFrame(self.expert),
                pd.DataFrame(self.failures))


def check_run_settings(mem_fraction_static: float, startup_timeout_s: float, nvml_interval_s: float,
                       time_budget_s: float | None, repeats: int, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
    """The matrix's numeric settings, checked before any launch: inside the run loop a bad one
    would surface as one failure record per server instead of one error."""
    check_mem_fraction_static(mem_fraction_static)
    check_positive("startup_timeout_s", startup_timeout_s)
    check_positive("stall_timeout_s", stall_timeout_s)
    check_positive("nvml_interval_s", nvml_interval_s)
    if time_budget_s is not None:
        check_positive("time_budget_s", time_budget_s)
    check_int("repeats", repeats)


def _writable_dir(name: str, path) -> None:
    """A folder the run writes into, created now and probed with a file: found after the first
    server, a bad one fails every server (log_dir) or loses the records (results_dir)."""
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{name}: {d} exists and is not a folder")
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise ValueError(f"{name}: cannot write into {d} ({e.strerror or e})") from None


def _gpu_name() -> str | None:
    from .provenance import gpu_info

    return gpu_info().get("gpu")


def _gpu_capability() -> tuple[int, int] | None:
    """Device 0's compute capability, or None where torch sees no GPU (a fake server's tests)."""
    try:
        import torch
    except ImportError:
        return None
    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def run_matrix(model: str = "k2_tp8_slice", layers: int = 4, backends: Sequence[str] = ("triton", "sm120_mla", "flashmla"),
               contexts: Sequence[int] = DEFAULT_CONTEXTS, spec: Sequence[str] = ("none", "dflash"),
               draft_tokens: int = 16, ngram_draft_tokens: int = 8, decode_tokens: int = 256,
               tp: int = -1, ep_size: int = 1, allreduce_fusion: bool = False, repeats: int = 1,
               weights: str = "auto", mem_fraction_static: float = 0.8,
               cuda_graph: bool = True, spec_fallback: str | None = "ngram", nvml: bool = True,
               nvml_interval_s: float = 0.2, expert: bool = True, record: bool = False,
               progress: bool = True, seed: int = 0, startup_timeout_s: float = 900.0,
               stall_timeout_s: float = STALL_TIMEOUT_S,
               time_budget_s: float | None = None, command: str | None = None,
               launcher: Sequence[str] | None = None, results_dir: Path | None = None,
               log_dir: Path | None = None, profile_steps: int = 0,
               profile_contexts: Sequence[int] | None = None, profile_with_stack: bool = False,
               ngram_tail: bool = False, prefill_backend: str | None = None,
               prefill_as_base: bool = False, warmups: Sequence[str] = (),
               eagle_steps: int = 3, eagle_topk: int = 1, eagle_draft_tokens: int | None = None,
               draft_backend: str | None = None, eagle3_head: str = "mla",
               dflash_host_plan: str = "off",
               log: Callable[[str], None] = print) -> MatrixResult:
    """Run the whole matrix; return (and with record=True append) decode, NVML, expert records.

    Every argument is checked before the first server starts, a bad one raising
    MatrixArgumentError (a ValueError naming it): among the rest seed >= 0 (numpy's), tp within
    the GPUs torch sees where SGLang's own launcher runs (launcher None), and results_dir (with
    record) and log_dir folders that can be written, created then.

    spec_fallback: when a DFlash server fails to start, run `spec_fallback` ("ngram") in its
    place for that backend (the record's `spec` says which ran). time_budget_s: skip server
    starts that would not finish within this many seconds of the call. launcher: the server
    command prefix (tests use a fake server); results_dir: where record=True appends
    (default data/results/); log_dir: server logs (default runs/service_logs/).
    profile_steps: after a server's measured points, profile this many decode/verify steps
    at each of `profile_contexts` (default: all) with SGLang's torch profiler, and record
    where a step's time goes (step_profile.summarize_trace) in service_step_profile.jsonl;
    profile_with_stack also records the Python calls (host time by function).
    ngram_tail: start the servers with $SM120_NGRAM_TAIL=1 (patches/ngram_tail.py: NGRAM
    draft prep without a per-step copy of the prompt); records carry ngram_tail.
    dflash_host_plan: "probe" starts the servers with $SM120_DFLASH_HOST_PLAN=probe
    (patches/dflash_host_plan.py: a DFlash draft on FlashInfer planned from host bounds, without
    the sync a step; a timing probe, its draft attention is wrong for some requests), "off"
    without; records carry dflash_host_plan.
    prefill_backend: prefills on this SGLang backend instead (e.g. "flashinfer"; decode and
    verify stay on each backend of `backends`); records carry prefill_attention_backend.
    prefill_as_base: spell that hybrid with the prefill backend as --attention-backend
    (ServerConfig.prefill_as_base); records carry prefill_as_base.
    warmups: SGLang warm-ups each server runs before it listens (`--warmups`, e.g.
    "sm120_long_prompt"); their time is in startup_s, and records carry those the server's log
    says it ran (a name SGLang does not know is only warned of, and left out) and warmup_s, the
    time they took by the log's stamps.
    eagle_steps: the draft steps of `spec` "eagle" (SGLang's EAGLE with the model's MTP layer;
    those servers serve the model with one MTP layer) and "eagle3" (an EAGLE3 draft head of layout
    `eagle3_head`, materialize_eagle3_draft, on the model as it is; it needs layers 3 or >= 7). A chain (topk 1)
    verifies eagle_steps + 1 tokens.
    eagle_topk, eagle_draft_tokens: their tree (--speculative-eagle-topk) and the tokens it verifies
    (needed for topk > 1; eagle_verify_tokens); records carry eagle_topk.
    draft_backend: --speculative-draft-attention-backend of the DFlash and EAGLE(3) servers (None:
    flashinfer for an EAGLE3 Llama head under sm120_mla, else SGLang's choice: for DFlash its
    prefill backend where SGLang runs a DFlash draft on it (service.DFLASH_DRAFT_BACKENDS), else
    flashinfer (sm120_mla, flashmla, ...); for EAGLE(3) the decode backend, whose MLA draft then
    runs on sm120_mla's kernel where that is the backend); records carry what SGLang resolved.
    eagle3_head: the EAGLE3 head's layout, "mla" or "llama" (dummy_models.EAGLE3_HEADS; an MHA
    draft, which the kernel does not serve); EAGLE3 records carry it as draft_head.
    """
    from tqdm.auto import tqdm

    from .hardware import unsupported_reason
    from .results import append_records, results_dir as default_results_dir

    t_start = time.monotonic()
    try:   # the validation step: every argument, before the first server starts
        for b in backends:  # a typo should not cost a server start
            check_attention_backend(b)
        prefill_backend = prefill_backend or None   # "" is what records say for none
        if prefill_backend is not None:
            check_attention_backend(prefill_backend, "prefill_backend")
        elif prefill_as_base:
            raise ValueError("prefill_as_base: needs a prefill_backend to put first")
        if warmups:
            check_warmups(warmups)   # before tuple(): one name as a str would become its letters
        warmups = tuple(warmups)
        if draft_backend is not None:
            check_attention_backend(draft_backend, "draft_backend")
        if eagle3_head not in EAGLE3_HEADS:
            raise ValueError(f"eagle3_head: one of {sorted(EAGLE3_HEADS)}, got {eagle3_head!r}")
        if eagle3_head != "mla" and "eagle3" not in spec:
            raise ValueError(f"eagle3_head: only spec eagle3 takes a head, and spec is {list(spec)}")
        if dflash_host_plan not in DFLASH_HOST_PLAN_MODES:
            raise ValueError(f"dflash_host_plan: expected one of {DFLASH_HOST_PLAN_MODES}, got {dflash_host_plan!r}")
        if dflash_host_plan != "off" and list(spec) != ["dflash"]:
            # the probe changes only a DFlash draft; other servers' records would carry it for nothing
            raise ValueError(f"dflash_host_plan: the probe is for spec ['dflash'] alone, and spec is {list(spec)}")
        if (spec_fallback or "") not in SPEC_FALLBACKS:
            raise ValueError(f"spec_fallback: one of {SPEC_FALLBACKS}, got {spec_fallback!r}")
        if spec_fallback:
            check_draft_tokens(backends, [spec_fallback], draft_tokens, ngram_draft_tokens)
        if profile_contexts is not None and not set(profile_contexts) <= set(contexts):
            raise ValueError(f"profile_contexts: {sorted(set(profile_contexts) - set(contexts))} are not among "
                             f"the measured contexts {sorted(set(contexts))}")
        check_run_settings(mem_fraction_static=mem_fraction_static, startup_timeout_s=startup_timeout_s,
                           nvml_interval_s=nvml_interval_s, time_budget_s=time_budget_s, repeats=repeats,
                           stall_timeout_s=stall_timeout_s)
        check_int("seed", seed, least=0)   # numpy's generators take no negative seed
        tp = resolve_tp(tp)
        if not (isinstance(ep_size, int) and ep_size >= 1 and tp % ep_size == 0):
            raise ValueError(f"ep_size: must be a positive divisor of tp={tp}, got {ep_size!r}")
        model_cfg = model_config(model, layers, weights)   # as materialize_model writes it below
        heads = heads_per_rank(model_cfg, tp)
        plans = plan_matrix(backends, contexts, spec, draft_tokens, ngram_draft_tokens, decode_tokens,
                            max_context(model_cfg), eagle_steps, eagle_topk, eagle_draft_tokens)
        if any(p.spec == "eagle3" for p in plans):
            eagle3_aux_layers(layers)
        for p in plans:   # a tree on pages that SGLang refuses: here, not at that server's start
            if p.spec in EAGLE_SPECS:
                check_eagle_tree_pages(eagle_topk, default_page_size(p.backend, prefill_backend),
                                       prefill_backend if prefill_as_base else p.backend)
        if not isinstance(profile_steps, int) or profile_steps < 0:
            raise ValueError(f"profile_steps: expected an int >= 0, got {profile_steps!r}")
        if profile_steps:
            # The profiled request must run more steps than are profiled, or the profiler waits
            # for the next request; a step emits at most draft_tokens + 1 tokens, an EAGLE step
            # (chain or tree) one path of eagle_steps drafts and the bonus token.
            most = max([1] + [eagle_steps + 1 if p.spec in EAGLE_SPECS else (p.draft_tokens or 0) + 1
                              for p in plans])
            if decode_tokens // most <= profile_steps:
                raise ValueError(f"profile_steps: {profile_steps} steps need more than {profile_steps * most} decode "
                                 f"tokens with up to {most} tokens a step; decode_tokens is {decode_tokens}")
        if launcher is None:   # SGLang's own launcher: tp GPUs, where torch can count them (a fake needs none)
            check_tp_visible(tp)
        # the folders last, once nothing else is refused: a refused run leaves none behind
        if record:
            _writable_dir("results_dir", results_dir if results_dir is not None else default_results_dir())
        if log_dir is not None:
            _writable_dir("log_dir", log_dir)
    except ValueError as e:   # a ServerError (tp -1 with no GPU) passes as it is
        raise MatrixArgumentError(str(e)) from e
    # The model and draft folders (config.json only) live as long as the matrix, then go.
    total = sum(len(p.contexts) * repeats for p in plans)
    # The bar in the with too: closed on an error or an interrupt, not only at the end.
    with (tempfile.TemporaryDirectory(prefix="sm120_models_") as workdir,
          tqdm(total=total, desc="decode matrix", unit="run", disable=not progress) as bar):
        model_dir = materialize_model(model, layers, dest=Path(workdir) / "model", weights=weights)
        # EAGLE drafts with the model's own MTP layer: the same model, given one.
        mtp_dir = (materialize_model(model, layers, dest=Path(workdir) / "model-mtp", weights=weights, mtp_layers=1)
                   if any(p.spec == "eagle" for p in plans) else None)
        dropped = dropped_contexts(plans, contexts)
        if dropped:
            log(f"contexts {dropped}: longer than {model} ({max_context(model_cfg)} positions) allows; not measured")
        gpu, capability = _gpu_name(), _gpu_capability()
        # FlashInfer's fused all-reduce JIT-compiles its kernels at every server start when no
        # JIT cache is installed: 259 s of a 444 s TP2 start on the H200s (2026-11-29). Off by
        # default; the same for every backend, so the comparison stands.
        fusion = allreduce_fusion and tp > 1
        # $SM120_KV_SORT passes through to the servers: the records say whether it was on
        common = {"tp": tp, "ep_size": ep_size, "allreduce_fusion": fusion, "ngram_tail": bool(ngram_tail),
                  "dflash_host_plan": dflash_host_plan,
                  "prefill_attention_backend": prefill_backend or "", "prefill_as_base": bool(prefill_as_base),
                  "warmups": ",".join(warmups),
                  "kv_sort": kv_sort.requested(),
                  "gpu": gpu, "model": model, "layers": layers, "heads_per_rank": heads,
                  "weights": weight_format(model_cfg), "decode_tokens": decode_tokens, "batch": 1}
        # the commit the run starts from, as every record names it: $SM120_COMMIT on the GPU machine (a
        # tree without .git), unless the installed package was archived from another (git_commit warns)
        common["commit"] = git_commit()
        # one id for this whole call: records of two backends are "the same run" (one machine, one
        # session) only where it matches; run_id names each server
        common["invocation"] = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        out = MatrixResult([], [], [], [])
        lists = {DECODE_RESULTS: out.decode, NVML_RESULTS: out.nvml, EXPERT_RESULTS: out.expert,
                 FAILURE_RESULTS: out.failures, PROFILE_RESULTS: out.profiles}

        def emit(name: str, recs: list[dict]) -> None:
            # Appended as soon as measured, so a crash or a job timeout loses nothing already done.
            lists[name].extend(recs)
            if record and recs:
                append_records(name, recs, command=command, path=_results_path(results_dir, name))

        def emit_failure(rec: dict) -> None:
            # In its own try: a record write that fails too (a full disk) must not replace the
            # failure being recorded; that stays in the result, and the write's error is logged.
            try:
                emit(FAILURE_RESULTS, [rec])
            except Exception as e:  # noqa: BLE001
                log(f"  could not append this failure to {FAILURE_RESULTS}: {e!r}")

        def over_budget(reserve_s: float) -> bool:
            return time_budget_s is not None and time.monotonic() - t_start + reserve_s > time_budget_s

        queue = list(plans)
        started: set[tuple[str, str]] = set()
        while queue:
            plan = queue.pop(0)
            if (plan.backend, plan.spec) in started:
                continue
            # An unbounded buffer stops DFlash servers (service.DFLASH_RECORDER_CRASH), and EAGLE's
            # draft passes record empty rows as DFlash's do: a circular one for all.
            rows_per_pass = recorder_rows_per_pass(plan.spec, eagle_steps)
            buffer = (spec_expert_buffer(plan.contexts, decode_tokens, rows_per_pass)
                      if expert and plan.spec in DRAFT_MODEL_SPECS else -1)
            # what every record of this plan names of its speculation
            spec_keys = {"spec": plan.spec, "draft_tokens": plan.draft_tokens,
                         "eagle_topk": eagle_topk if plan.spec in EAGLE_SPECS else None,
                         "draft_head": eagle3_head if plan.spec == "eagle3" else None}
            fail = {**common, "backend": plan.backend, **spec_keys, "expert_record": expert,
                    "expert_buffer": buffer}
            unsupported = unsupported_reason(plan.backend, capability) if capability else None
            if unsupported:   # FlashMLA on sm_120: a server start (and DFlash's fallback) would only fail
                log(f"SKIPPED {plan.backend}/{plan.spec}: {unsupported}")
                emit(FAILURE_RESULTS, [{**fail, "status": "skipped", "error": unsupported}])
                continue
            if over_budget(SERVER_START_ESTIMATE_S):
                log(f"SKIPPED {plan.backend}/{plan.spec}: not enough of the {time_budget_s:.0f} s budget left")
                emit(FAILURE_RESULTS, [{**fail, "status": "skipped", "error": "time budget"}])
                continue
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{plan.backend}-{plan.spec}-{uuid.uuid4().hex[:6]}"
            fail["run_id"] = run_id
            ctx_len = context_length_for(plan.contexts, decode_tokens, plan.draft_tokens)
            # DFlash's draft (and an EAGLE3 Llama head) keeps an MHA KV pool with as many slots as
            # the target's MLA pool; sized by --mem-fraction-static alone the two overrun the GPU
            # (H200, 2026-11-29: 10M slots, 77 GB for DFlash's draft K and V, start-up OOM).
            # Batch 1 needs a few contexts' worth of slots.
            extra = ("--max-total-tokens", str(4 * ctx_len)) if mha_draft(plan.spec, eagle3_head) else ()
            if ep_size > 1:   # experts sharded over ep_size of the tp ranks (SGLang's own EP MoE)
                extra += ("--ep-size", str(ep_size))
            if tp > 1 and not fusion:
                extra += ("--enforce-disable-flashinfer-allreduce-fusion",)
            if buffer > 0:
                log(f"{plan.backend}/{plan.spec}: the expert recorder keeps a circular buffer of {buffer} "
                    "forward passes (an unbounded one stops DFlash servers: service.DFLASH_RECORDER_CRASH)")
            drafted = plan.spec in DRAFT_MODEL_SPECS
            cfg = ServerConfig(
                model_path=mtp_dir if plan.spec == "eagle" else model_dir, attention_backend=plan.backend,
                prefill_attention_backend=prefill_backend,
                prefill_as_base=prefill_as_base, warmups=warmups,
                tp=tp,
                mem_fraction_static=mem_fraction_static, extra_args=extra,
                context_length=ctx_len,
                spec=plan.spec, num_draft_tokens=plan.draft_tokens, cuda_graph=cuda_graph,
                expert_record=expert, expert_record_buffer=buffer,
                draft_attention_backend=draft_backend if drafted else None, eagle_steps=eagle_steps,
                eagle_topk=eagle_topk,
                draft_model_path=draft_folder(plan, model_dir, Path(workdir) / f"draft-{run_id}", eagle3_head))
            log(f"server {plan.backend}/{plan.spec} (tp={tp}, contexts {list(plan.contexts)}): starting")
            server_log = None
            try:
                log_path = (Path(log_dir) / f"{run_id}.log") if log_dir else None
                env = {**os.environ, "SM120_NGRAM_TAIL": "1" if ngram_tail else "0",
                       dflash_host_plan_patch.ENV_VAR: dflash_host_plan}
                with SGLangServer(cfg, log_path=log_path, startup_timeout_s=startup_timeout_s,
                                  stall_timeout_s=stall_timeout_s, progress=progress, launcher=launcher,
                                  env=env) as srv:
                    started.add((plan.backend, plan.spec))
                    server_log = srv.log_path
                    log(f"  up in {srv.startup_s:.0f} s (log: {srv.log_path})")
                    start_log = _log_text(srv.log_path) if warmups or common["kv_sort"] else ""
                    ran = warmups_run(start_log, warmups)
                    # the override ran in the server, not only asked for (None: not asked)
                    kv_sort_seen = kv_sort.seen_in_log(start_log) if common["kv_sort"] else None
                    if kv_sort_seen is False:
                        log(f"  WARNING: {kv_sort.ENV_VAR} is set, but the server's log does not say an allocator "
                            f"was {kv_sort.FORCED_LOG_MARK} (is the plugin loaded in its schedulers? Or its "
                            "INFO lines are not logged)")
                    warm_s = warmup_seconds(start_log) if ran else None
                    fail["warmups"] = ",".join(ran)
                    # what SGLang resolved for the draft's attention (records of a draft model only)
                    resolved_draft = (resolved_draft_backend(srv.server_info, plan.spec,
                                                             mla_draft=not mha_draft(plan.spec, eagle3_head))
                                      if drafted else None)
                    if len(ran) < len(warmups):
                        log(f"  WARNING: the server's log does not say it ran the warm-ups "
                            f"{[w for w in warmups if w not in ran]} (SGLang only warns of a name it "
                            "does not know: is the plugin loaded in its launcher? Or its INFO lines "
                            "are not logged)")
                    warm = min(512, max(1, min(plan.contexts) // 2))
                    srv.generate(random_input_ids(warm, model_cfg["vocab_size"], seed + 999), 16)  # warm-up
                    for ctx in plan.contexts:
                        for rep in range(repeats):
                            if over_budget(30.0):
                                log(f"  SKIPPED ctx={ctx}: time budget")
                                emit(FAILURE_RESULTS, [{**fail, "status": "skipped", "ctx": ctx,
                                                        "error": "time budget (after the server start)",
                                                        "startup_s": round(srv.startup_s, 1)}])
                                continue
                            row, nv, ex = _measure_point(srv, ctx, decode_tokens, model_cfg, seed + ctx + rep,
                                                         nvml, nvml_interval_s, expert, tp, buffer,
                                                         rows_per_pass, ep_size)
                            base = {**common, "run_id": run_id, "backend": plan.backend, **spec_keys,
                                    "ctx": ctx, "repeat": rep,
                                    "cuda_graph": cuda_graph, "page_size": srv.config.page_size,
                                    "expert_record": expert, "expert_buffer": buffer,
                                    "warmups": ",".join(ran), "kv_sort_seen": kv_sort_seen,
                                    "warmup_s": warm_s, "nvml_sampled": bool(nv),
                                    "ngram_bfs_breadth": srv.config.ngram_max_bfs_breadth,
                                    "context_length": srv.config.context_length,
                                    "draft_attention_backend": resolved_draft,
                                    "startup_s": round(srv.startup_s, 1)}
                            emit(DECODE_RESULTS, [{**base, **row}])
                            emit(NVML_RESULTS, [{**base, **r} for r in nv])
                            emit(EXPERT_RESULTS, [{**base, **ex}] if ex else [])
                            bar.update(1)
                            bar.set_postfix_str(f"{plan.backend}/{plan.spec} ctx={ctx}: {row['tok_s']:.1f} tok/s")
                            if not progress:
                                log(f"  ctx={ctx}: {row['tok_s']:.1f} tok/s, accept {row['accept_len']:.2f}, "
                                    f"step {row['verify_step_ms']:.2f} ms, ttft {row['ttft_s']:.1f} s")
                    for ctx in (plan.contexts if profile_steps else ()):
                        if profile_contexts is not None and ctx not in profile_contexts:
                            continue
                        if over_budget(60.0):
                            log(f"  SKIPPED profile ctx={ctx}: time budget")
                            continue
                        prof = profile_point(srv, ctx, decode_tokens, model_cfg["vocab_size"], seed + ctx,
                                             profile_steps, Path(srv.log_path).parent / f"{run_id}-profile",
                                             with_stack=profile_with_stack)
                        if record:   # the trace beside the results, named as the record names it
                            dest = (Path(results_dir) if results_dir else default_results_dir()).parent / "traces"
                            dest.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(prof.pop("trace_path"), dest / prof["trace_file"])
                        else:
                            prof.pop("trace_path")
                        emit(PROFILE_RESULTS, [{**common, "warmups": fail["warmups"], "run_id": run_id,
                                                "backend": plan.backend, **spec_keys, "ctx": ctx,
                                                "draft_attention_backend": resolved_draft,
                                                "cuda_graph": cuda_graph, "expert_record": expert,
                                                "expert_buffer": buffer, "with_stack": profile_with_stack, **prof}])
                        log(f"  profile ctx={ctx}: step {prof['per_step_ms']:.2f} ms, GPU busy "
                            f"{100 * (prof['busy_share'] or 0):.0f}%: "
                            + ", ".join(f"{k} {v:.2f}" for k, v in list(prof["gpu_ms_per_step"].items())[:4]))
            except ServerStartError as e:
                log(f"FAILED to start {plan.backend}/{plan.spec}: {str(e).splitlines()[0]}\n"
                    f"  its log ends:\n{_indent(e.log_tail, 15)}")
                fail["warmups"] = ",".join(warmups_run(_log_text(e.log_path) if warmups else "", warmups))
                emit_failure({**fail, "status": "start_failed", "error": str(e).splitlines()[0],
                              "log_tail": e.log_tail[-4000:], "log_path": str(e.log_path)})
                if plan.spec == "dflash" and spec_fallback and (plan.backend, spec_fallback) not in started:
                    dt = ngram_draft_tokens if spec_fallback == "ngram" else None
                    queue.insert(0, ServerPlan(plan.backend, spec_fallback, dt, plan.contexts))
                    log(f"  falling back to {spec_fallback} for {plan.backend}")
            except Exception as e:  # noqa: BLE001 - a request failed mid-run: keep what was measured
                tail = log_tail(server_log) if server_log else ""   # what the server said as it failed
                error = f"{type(e).__name__}: {str(e).splitlines()[0]}" if "\n" in str(e) else repr(e)   # no log twice
                log(f"FAILED during {plan.backend}/{plan.spec}: {error}\n  its log ends:\n{_indent(tail, 15)}")
                emit_failure({**fail, "status": "run_failed", "error": error[:2000],
                              "log_tail": tail[-4000:], "log_path": str(server_log)})
        return out


def profile_point(srv: SGLangServer, ctx: int, decode_tokens: int, vocab_size: int, seed: int,
                  steps: int, out_dir: Path, with_stack: bool = False) -> dict:
    """One request of ctx ids with SGLang's torch profiler on for `steps` decode/verify steps,
    started at the first streamed token (so no prefill chunk is in the window); returns
    step_profile.summarize_trace of rank 0's trace plus the request's own step time."""
    import threading

    from .step_profile import load_trace, summarize_trace

    profile_id = f"p{uuid.uuid4().hex[:8]}"
    errors: list[BaseException] = []

    def start():
        try:
            srv.start_profile(out_dir, steps, profile_id, with_stack=with_stack)
        except BaseException as e:  # noqa: BLE001 - reported below, after the request
            errors.append(e)

    thread = threading.Thread(target=start, daemon=True)
    srv.flush_cache()
    res = srv.generate(random_input_ids(ctx, vocab_size, seed), decode_tokens, on_first_token=thread.start)
    if thread.ident is None:
        raise ServerError("profile: the request streamed no token, so the profiler never started")
    thread.join(timeout=120)
    if thread.is_alive():   # the request ended first: no trace is coming, and waiting for one would stall
        raise ServerError("profile: /start_profile had not returned 120 s after the first token")
    if errors:
        raise errors[0]
    traces = srv.wait_profile_traces(out_dir, profile_id, ranks=srv.config.tp)
    rank0 = next((p for p in traces if "TP-0" in p.name), traces[0])
    summary = summarize_trace(load_trace(rank0), steps)
    check_finished(res, decode_tokens)
    stats = decode_stats(res.completion_tokens, res.ttft_s, res.latency_s, res.meta_info, srv.config.spec,
                         res.first_chunk_tokens)
    # the profiled request's own step time: the profiler's stop and trace export included, so it
    # reads well above an unprofiled step; the trace's window (summary) is what to compare
    return {**summary, "profiled_request_step_ms": round(stats["verify_step_ms"], 4),
            "accept_len": stats["accept_len"], "trace_file": rank0.name, "trace_path": str(rank0)}


def _log_text(log_path: Path | None) -> str:
    return Path(log_path).read_text(errors="replace") if log_path and Path(log_path).is_file() else ""


def warmups_run(log: str, asked: Sequence[str]) -> tuple[str, ...]:
    """The warm-ups of `asked` that a server's log text says it ran (SGLang's execute_warmups
    logs "Running warmup NAME" for each it knows)."""
    return tuple(w for w in asked if f"Running warmup {w}\n" in log)


_LOG_STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] "


def warmup_seconds(log: str) -> float | None:
    """Seconds from SGLang's first "Running warmup" line to its "Warmup ended" in a server's log
    text (its 1 s stamps), part of startup_s; None where the log has not both."""
    start = re.search(_LOG_STAMP + "Running warmup ", log, re.M)
    end = re.search(_LOG_STAMP + "Warmup ended", log[start.end():], re.M) if start else None
    if not end:
        return None
    t0, t1 = (datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S") for m in (start, end))
    return (t1 - t0).total_seconds()


def _indent(text: str, lines: int) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _results_path(results_dir: Path | None, name: str) -> Path | None:
    return None if results_dir is None else Path(results_dir) / f"{name}.jsonl"


def served_gpus(server_info: dict | None, tp: int) -> list[int]:
    """The CUDA indices a server of `tp` ranks runs on: SGLang's base_gpu_id + i x gpu_id_step
    (0, 1, ... by default), as its /server_info resolved them."""
    info = server_info or {}
    base, step = info.get("base_gpu_id", 0), info.get("gpu_id_step", 1)
    base = base if isinstance(base, int) else 0
    step = step if isinstance(step, int) and step > 0 else 1
    return [base + i * step for i in range(tp)]


def _measure_point(srv: SGLangServer, ctx: int, decode_tokens: int, model_cfg: dict, seed: int,
                   nvml: bool, nvml_interval_s: float, expert: bool, tp: int, expert_buffer: int = -1,
                   rows_per_routed_pass: int = 1, ep_size: int = 1):
    from .nvml_sampler import NvmlSampler, NvmlUnavailableError

    recording, start_error = False, None
    if expert:
        try:
            srv.start_expert_record()
            recording = True
        except Exception as e:  # noqa: BLE001 - measured anyway; an idle recorder's dump would read as no load
            start_error = f"start_expert_distribution_record: {e!r}"
    # NVML samples the request alone (its prefill and decode), not the recorder's start and stop,
    # and the server's GPUs alone: an idle neighbour would read as imbalance
    sampler, nvml_error = None, None
    if nvml:
        try:
            sampler = NvmlSampler(interval_s=nvml_interval_s,
                                  gpus=served_gpus(getattr(srv, "server_info", None), tp)).start()
        except NvmlUnavailableError as e:
            sampler, nvml_error = None, str(e)[:500]
    try:
        row = measure_decode(srv, ctx, decode_tokens, model_cfg["vocab_size"], seed)
    finally:
        if sampler is not None:
            sampler.stop()
    if recording:
        try:
            srv.stop_expert_record()
        except Exception:  # noqa: BLE001 - the dump step below fails too, and says why
            pass
    if start_error:   # expert_record stays the server's flag (its hook runs in every captured graph)
        row.update(expert_recording=False, expert_error=start_error[:500])
    nv_rows = []
    if nvml_error:
        row["nvml_error"] = nvml_error
    if sampler is not None and sampler.failure:   # a series cut short would read as an idle GPU
        row["nvml_error"] = sampler.failure[:500]
    elif sampler is not None:  # one record per (GPU, metric) holding the series; no pandas needed here
        metric_errors = {k: v for k, v in sampler.errors.items() if k not in sampler.THREAD_ERRORS}
        if metric_errors:   # a metric the board does not report is absent, and says why
            row["nvml_metric_errors"] = {k: v[:200] for k, v in metric_errors.items()}
        measured = sampler.measured_interval_s
        series: dict[tuple[int, str], tuple[list, list]] = {}
        for t, g, m, v in sampler.rows:
            ts, vs = series.setdefault((g, m), ([], []))
            ts.append(round(float(t), 3))
            vs.append(round(float(v), 2))
        for (g, m), (ts, vs) in sorted(series.items()):
            # interval_s: asked for; interval_measured_s: as the rounds of reads ran (records
            # before it have t, each GPU's from one time per round)
            nv_rows.append({"nvml_gpu": int(g), "metric": m, "interval_s": nvml_interval_s,
                            "interval_measured_s": None if measured is None else round(measured, 3),
                            "t": ts, "value": vs})
    ex = None
    if expert and recording:
        try:
            ex = _expert_record(srv, tp, expert_buffer, rows_per_routed_pass, ep_size)
        except Exception as e:  # noqa: BLE001 - the decode measurement stands without it
            row["expert_error"] = repr(e)[:500]
    return row, nv_rows, ex


def _expert_record(srv: SGLangServer, tp: int, buffer: int = -1, rows_per_routed_pass: int = 1,
                   ep_size: int = 1) -> dict:
    """One dump as a record. `forward_passes` counts the passes that routed tokens (records before
    3486e7d counted every row: 9880eff's DFlash rows include the draft's zero rows). A circular
    buffer may have wrapped once the rows the routed passes account for (rows_per_routed_pass each:
    2 with a DFlash draft, whose passes write zero rows) reach its size: then the record is refused.
    A dump in which no pass routed a token (a recorder that did not run) is refused too."""
    from .expert_balance import balancedness, expert_counts, gpu_load, load_expert_dump, moe_layer_ids, routed_passes

    # every rank of MoE EP rank 0 writes the same all-reduced counts: tp // ep_size files
    paths = srv.dump_expert_record(expected=max(1, tp // max(1, ep_size)))   # all of them, or an error
    try:
        dumps = [load_expert_dump(p) for p in paths]
    finally:
        for p in paths:   # (passes, layers, experts) int32 per dump: megabytes; the record keeps the sum
            p.unlink(missing_ok=True)
    dump = dumps[0]
    if any(not np.array_equal(d["logical_count"], dump["logical_count"]) for d in dumps[1:]):
        raise ValueError(f"the {len(dumps)} files of one expert dump differ: not the all-reduced copies "
                         "SGLang's stat mode writes")
    passes = routed_passes(dump)
    if passes == 0:
        raise ValueError("the expert dump holds no forward pass that routed a token")
    # a wrapped buffer holds at least buffer - (rows - 1) rows of which 1 in rows routed
    if buffer > 0 and (passes + 1) * rows_per_routed_pass - 1 >= buffer:
        raise ValueError(f"expert_buffer: {passes} routed passes (x{rows_per_routed_pass} rows) fill the "
                         f"circular buffer of {buffer} rows; the oldest may have been overwritten")
    ranks = tp
    try:
        counts = expert_counts(dump, ranks_summed=tp)
    except ValueError:  # not tp identical copies (e.g. DP attention): keep the raw sum
        counts, ranks = expert_counts(dump), 1
    moe = moe_layer_ids(counts)
    bal = balancedness(gpu_load(counts[moe], 8)) if moe and counts.shape[1] % 8 == 0 else []
    return {"num_experts": int(counts.shape[1]), "counts": counts.tolist(), "moe_layers": moe,
            "ranks_summed": ranks, "forward_passes": passes, "dump_files": len(paths),
            "balancedness_ep8": [round(float(b), 4) for b in bal]}


def summary_table(decode_records: Sequence[dict]) -> str:
    """A short fixed-width table: backend, spec, ctx, tok/s, accept length, step ms."""
    if not decode_records:
        return "(no decode results)"
    lines = [f"{'backend':<11}{'spec':<8}{'ctx':>8}{'tok/s':>10}{'accept':>8}{'step ms':>9}"]
    for r in sorted(decode_records, key=lambda r: (r["backend"], r["spec"], r["ctx"])):
        lines.append(f"{r['backend']:<11}{r['spec']:<8}{r['ctx']:>8}{r['tok_s']:>10.1f}"
                     f"{r['accept_len']:>8.2f}{r['verify_step_ms']:>9.2f}")
    return "\n".join(lines)


def _install_signal_teardown() -> dict:
    """SIGTERM (a job timeout) would end Python without unwinding `with` blocks; turn it into
    an exception so every SGLangServer tears its process group down first. Returns the old
    handlers."""
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    return {sig: signal.signal(sig, _raise) for sig in (signal.SIGTERM, signal.SIGHUP)}


def cli_parser() -> argparse.ArgumentParser:
    """The command line of `python -m sm120_workbook.decode_bench` (its records' `command`)."""
    p = argparse.ArgumentParser(prog="python -m sm120_workbook.decode_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="k2_tp8_slice", choices=["k2_tp8_slice", "kimi_k2"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--weights", default="auto", choices=["auto", "bf16", "fp8"])
    p.add_argument("--backends", nargs="+", default=["triton", "sm120_mla", "flashmla"])
    p.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
    p.add_argument("--spec", nargs="+", default=["none", "dflash"], choices=list(SPEC_MODES))
    p.add_argument("--spec-fallback", default="ngram", choices=SPEC_FALLBACKS,
                   help="run this when DFlash fails to start ('' for none)")
    p.add_argument("--draft-tokens", type=int, default=16)
    p.add_argument("--ngram-draft-tokens", type=int, default=8)
    p.add_argument("--eagle-steps", type=int, default=3,
                   help="EAGLE (the model's MTP layer) and EAGLE3 (a draft head) draft steps; a chain "
                        "(topk 1) verifies steps + 1 tokens")
    p.add_argument("--eagle-topk", type=int, default=1, help="EAGLE(3) tree width (--speculative-eagle-topk)")
    p.add_argument("--eagle-draft-tokens", type=int, default=None,
                   help="tokens an EAGLE(3) tree verifies (needed for --eagle-topk > 1)")
    p.add_argument("--eagle3-head", choices=sorted(EAGLE3_HEADS), default="mla",
                   help="the EAGLE3 head's layout: mla (Kimi K2.5/K2.6's; its draft on the kernel) or "
                        "llama (SpecForge's Kimi K2 head, MHA: its draft on SGLang's own backends)")
    p.add_argument("--draft-backend", default=None,
                   help="--speculative-draft-attention-backend of DFlash and EAGLE(3) servers (default: "
                        "flashinfer for an EAGLE3 Llama head under sm120_mla; else SGLang's choice: for DFlash the "
                        "prefill backend where it is flashinfer, fa3, fa4 or triton, else flashinfer (sm120_mla, "
                        "flashmla, ...); for EAGLE(3) the decode backend, so sm120_mla's MLA draft runs on the kernel)")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--tp", type=int, default=-1, help="-1: every visible GPU")
    p.add_argument("--ep-size", type=int, default=1, help="expert parallelism over this many of the tp ranks")
    p.add_argument("--allreduce-fusion", action="store_true",
                   help="keep FlashInfer's fused all-reduce at tp > 1 (its JIT build adds minutes to each start)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--no-nvml", action="store_true")
    p.add_argument("--no-expert", action="store_true")
    p.add_argument("--no-record", action="store_true", help="do not append to data/results/")
    p.add_argument("--startup-timeout-s", type=float, default=900)
    p.add_argument("--stall-timeout-s", type=float, default=STALL_TIMEOUT_S,
                   help="give a request up when its stream is silent this long (the prefill included)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="skip server starts that would not finish within this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the measured points, profile this many steps per context (torch profiler)")
    p.add_argument("--profile-contexts", nargs="+", type=int, default=None,
                   help="profile only these contexts (default: all measured)")
    p.add_argument("--ngram-tail", action="store_true",
                   help="start servers with SM120_NGRAM_TAIL=1 (NGRAM draft prep without copying the prompt)")
    p.add_argument("--dflash-host-plan", choices=DFLASH_HOST_PLAN_MODES, default="off",
                   help="probe: start servers with SM120_DFLASH_HOST_PLAN=probe, a timing probe of what the "
                        "FlashInfer draft's per-step sync costs (its draft attention is wrong for some requests)")
    p.add_argument("--prefill-backend", default=None,
                   help="prefill on this SGLang attention backend (e.g. flashinfer); decode and verify "
                        "stay on --backends (SGLang's hybrid backend, --speculative-attention-mode decode)")
    p.add_argument("--prefill-as-base", action="store_true",
                   help="spell that hybrid as --attention-backend PREFILL --decode-attention-backend BACKEND "
                        "(SGLang turns its chunked prefix cache on by --attention-backend)")
    p.add_argument("--warmups", default="",
                   help="SGLang warm-ups (csv) each server runs before it listens, e.g. sm120_long_prompt "
                        "(the first long prompt's kernel builds; time counted in startup_s)")
    p.add_argument("--profile-with-stack", action="store_true",
                   help="also record Python calls in the profile (host time by function)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="append records here instead of data/results/ (e.g. $OUT/results on the device)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default runs/service_logs/)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = cli_parser()
    a = p.parse_args(argv)
    command = cli_command("sm120_workbook.decode_bench", sys.argv[1:] if argv is None else argv)
    previous = _install_signal_teardown()
    try:
        res = _run_matrix_cli(p, a, command)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for f in res.failures:
        print(f"failure: {f['backend']}/{f['spec']}: {f['status']}: {f['error']}")
        if f.get("log_tail"):
            print("  log tail:\n    " + "\n    ".join(f["log_tail"].splitlines()[-25:]))
    print(summary_table(res.decode))
    return 0 if res.decode else 1


def _run_matrix_cli(p: argparse.ArgumentParser, a: argparse.Namespace, command: str) -> MatrixResult:
    try:
        return run_matrix(model=a.model, layers=a.layers, backends=a.backends, contexts=a.contexts, spec=a.spec,
                          draft_tokens=a.draft_tokens, ngram_draft_tokens=a.ngram_draft_tokens,
                          decode_tokens=a.decode_tokens, tp=a.tp, ep_size=a.ep_size,
                          allreduce_fusion=a.allreduce_fusion, repeats=a.repeats, weights=a.weights,
                          mem_fraction_static=a.mem_fraction_static, cuda_graph=not a.no_cuda_graph,
                          spec_fallback=a.spec_fallback or None, nvml=not a.no_nvml, expert=not a.no_expert,
                          record=not a.no_record, progress=sys.stderr.isatty(), seed=a.seed,
                          startup_timeout_s=a.startup_timeout_s, stall_timeout_s=a.stall_timeout_s,
                          time_budget_s=a.time_budget_s,
                          command=command, results_dir=a.results_dir, log_dir=a.log_dir,
                          profile_steps=a.profile_steps, profile_contexts=a.profile_contexts,
                          profile_with_stack=a.profile_with_stack, ngram_tail=a.ngram_tail,
                          prefill_backend=a.prefill_backend, prefill_as_base=a.prefill_as_base,
                          warmups=tuple(n for n in a.warmups.split(",") if n),
                          eagle_steps=a.eagle_steps, eagle_topk=a.eagle_topk,
                          eagle_draft_tokens=a.eagle_draft_tokens, draft_backend=a.draft_backend,
                          eagle3_head=a.eagle3_head, dflash_host_plan=a.dflash_host_plan)
    except MatrixArgumentError as e:   # refused by the validation step, before any launch: a usage error
        p.error(str(e))
    except ServerError as e:   # no GPU for tp -1, or a server that failed (its log tail is in the message)
        sys.exit(f"{p.prog}: {e}")


def describe_plan(plans: Sequence[ServerPlan], decode_tokens: int, contexts: Sequence[int] = ()) -> str:
    """The servers a matrix will start and the contexts measured on each (deterministic); with the
    requested `contexts`, also those no server measures (longer than the model allows)."""
    from .service_charts import ctx_label

    lines = [f"{len(plans)} server starts (one per backend x speculation), "
             f"{sum(len(p.contexts) for p in plans)} measured points, {decode_tokens} decode tokens each:"]
    for p in plans:
        dt = f"{p.draft_tokens} draft tokens" if p.draft_tokens else "-"
        lines.append(f"  {p.backend:<10} {p.spec:<7} {dt:<16} contexts {' '.join(ctx_label(c) for c in p.contexts):<18}"
                     f" --context-length {context_length_for(p.contexts, decode_tokens, p.draft_tokens)}")
    dropped = dropped_contexts(plans, contexts) if contexts else []
    if dropped:
        lines.append(f"  not measured: contexts {dropped} do not fit the model with {decode_tokens} decode tokens")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
