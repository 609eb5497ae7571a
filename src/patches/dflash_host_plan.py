"""A timing probe: DFlash's FlashInfer draft planned from host bounds, without the per-step sync.

It answers one question: what does the sync cost a DFlash step? Its draft attention is WRONG for
some requests (below), so it is opt-in under a name that says so, $SM120_DFLASH_HOST_PLAN=probe,
and never part of a launch line. Server outputs stay the target's (DFlash verifies every draft
token on the target), but wrong drafts are rejected, so with real weights acceptance falls.

Why the sync: under SGLang 0.5.17 a DFlash server drafts on FlashInfer wherever it prefills on it
(the README's launch line; `service.dflash_draft_backend`). FlashInfer's backend inherits the base
class's `needs_cpu_seq_lens = True`, so `decide_needs_cpu_seq_lens` (managers/overlap_utils.py)
makes `FutureMap.resolve_seq_lens_cpu` copy the lengths to the host and sync every step, and the
draft's graph replay runs FlashInfer's `plan()`, which copies the index arrays to the host again.
The host then prepares each step while the GPU idles (NOTES.md, sessions 38 and 39).

What the probe does: after DFlashWorkerV2 has captured its draft graphs, it installs SGLang's own
sync-free `fast_prefill_plan` (which SGLang installs only for EAGLE's draft-extend graphs) on the
draft backend's target-verify wrappers, and sets that backend instance's `needs_cpu_seq_lens` to
False. The draft then plans from the host upper bounds DFlashWorkerV2 already provides (the
allocator's reservation, at least the committed length plus two blocks).

Why that is wrong (FlashInfer 0.6.15, checked on the H200 by tests/test_dflash_host_plan.py): the
plan gives each request ceil(host length / chunk size) KV chunks and lays out the split partials
and their merge by that count, but the paged prefill kernel writes each row's partials with a
stride of ceil(device length / chunk size) (prefill.cuh, `num_kv_chunks`). Where the two counts
differ, the kernel writes a row's partials over the next row's slots and the merge reads slots
the kernel did not write. A correct sync-free plan needs FlashInfer to take that stride from the
plan; the probe measures what it would gain (both the lengths' copy and `plan()`'s copies gone).

Where the probe does not fit it changes nothing and logs why: a draft backend other than
FlashInfer's fa2, sliding-window or cross-attention wrappers, a draft window
(`--speculative-dflash-draft-window-size`: its host bound leaves out the verify block), or no
captured verify graphs.
"""
from __future__ import annotations

import functools
import logging
import os

from .env_switch import env_value, install_or_warn

logger = logging.getLogger(__name__)

ENV_VAR = "SM120_DFLASH_HOST_PLAN"
PROBE_WORD = "probe"
_OFF_WORDS = frozenset({"", "0", "false", "no", "off"})
_MARK = "_sm120_dflash_host_plan_original"


def requested(environ=None) -> bool:
    """Whether $SM120_DFLASH_HOST_PLAN is "probe" (only that word: the probe's drafts are wrong)."""
    return env_value(ENV_VAR, environ).lower() == PROBE_WORD


def why_not_adaptable(backend) -> str | None:
    """Why a draft backend cannot plan its verify graphs from host bounds; None if it can."""
    from sglang.srt.layers.attention import flashinfer_backend as fib

    if not isinstance(backend, fib.FlashInferAttnBackend):
        return f"the draft backend is {type(backend).__name__}, not FlashInfer's"
    if getattr(backend, "prefill_backend", None) != "fa2":
        return f"FlashInfer's prefill backend is {getattr(backend, 'prefill_backend', None)!r}, not 'fa2'"
    if getattr(backend, "dispatch_reason", None) is not None:
        return f"its wrappers are dispatched per {backend.dispatch_reason} (several wrappers a layer)"
    graphs = getattr(backend, "prefill_cuda_graph_metadata", None) or {}
    if not graphs:
        return "it has no captured target-verify graphs"
    for bs, wrappers in graphs.items():
        for w in wrappers:
            if not getattr(w, "is_cuda_graph_enabled", False) or getattr(w, "_backend", None) != "fa2" \
                    or getattr(w, "_cached_module", None) is None:
                return f"its bs={bs} wrapper is not a planned fa2 CUDA-graph wrapper"
            if getattr(w, "_custom_mask_buf", None) is not None:
                return f"its bs={bs} wrapper has a custom mask (a DFlash draft has none)"
    return None


def adapt(backend) -> list[int]:
    """Plan `backend`'s target-verify graphs from host bounds and stop it asking for host lengths.

    Returns the captured batch sizes adapted; raises ValueError (with the reason) if it cannot."""
    from sglang.srt.layers.attention import flashinfer_backend as fib

    reason = why_not_adaptable(backend)
    if reason is not None:
        raise ValueError(reason)
    for wrappers in backend.prefill_cuda_graph_metadata.values():
        for w in wrappers:
            # call_begin_forward takes its sync-free branch for a begin_forward whose `.func` is
            # fast_prefill_plan, as SGLang's own EAGLE draft-extend graphs have it.
            w.begin_forward = functools.partial(fib.fast_prefill_plan, w)
    backend.needs_cpu_seq_lens = False
    return sorted(backend.prefill_cuda_graph_metadata)


def _worker_class():
    from sglang.srt.speculative import dflash_worker_v2

    return dflash_worker_v2.DFlashWorkerV2


def adapt_worker(worker) -> str:
    """Adapt a DFlash worker's draft backend after its graphs are captured; returns a log line."""
    if getattr(worker, "use_compact_draft_cache", False):
        return ("left as SGLang has it: a draft window is set, and its host bound leaves out the "
                "verify block")
    backend = worker.draft_model_runner.attn_backend
    try:
        sizes = adapt(backend)
    except ValueError as e:
        return f"left as SGLang has it: {e}"
    return (f"TIMING PROBE: the FlashInfer draft's verify graphs (bs {sizes[0]}..{sizes[-1]}) plan "
            f"from host bounds and its backend says needs_cpu_seq_lens False; its attention is wrong "
            f"for a request whose KV chunk count differs between bound and length")


def _wrap(init_cuda_graphs):
    @functools.wraps(init_cuda_graphs)
    def wrapper(self, *args, **kwargs):
        result = init_cuda_graphs(self, *args, **kwargs)
        try:
            line = adapt_worker(self)
        except Exception as e:  # noqa: BLE001 - the server runs as SGLang has it rather than not at all
            line = f"failed, left as SGLang has it: {e!r}"
        logger.warning("sm120_workbook (pid %d): DFlash host plan: %s", os.getpid(), line)
        return result

    setattr(wrapper, _MARK, init_cuda_graphs)
    return wrapper


def is_installed() -> bool:
    return hasattr(_worker_class().__dict__.get("init_cuda_graphs"), _MARK)


def install() -> bool:
    """Wrap DFlashWorkerV2.init_cuda_graphs; True if this call did."""
    cls = _worker_class()
    if is_installed():
        return False
    if "init_cuda_graphs" not in cls.__dict__:
        raise RuntimeError("sm120_workbook: DFlashWorkerV2 defines no init_cuda_graphs in this SGLang")
    cls.init_cuda_graphs = _wrap(cls.__dict__["init_cuda_graphs"])
    return True


def uninstall() -> None:
    cls = _worker_class()
    original = getattr(cls.__dict__.get("init_cuda_graphs"), _MARK, None)
    if original is not None:
        cls.init_cuda_graphs = original


def install_from_env(environ=None) -> bool:
    """Install when $SM120_DFLASH_HOST_PLAN is "probe"; a failure is logged, never raised."""
    if not requested(environ):
        value = env_value(ENV_VAR, environ)
        if value.lower() not in _OFF_WORDS:   # "1", or session 39's "check": say why nothing runs
            logger.warning("sm120_workbook: %s=%s ignored: the DFlash host plan is a timing probe with "
                           "wrong draft attention; %s=%s runs it", ENV_VAR, value, ENV_VAR, PROBE_WORD)
        return False
    return install_or_warn(install, logger, f"{ENV_VAR} set but the DFlash host plan override")
