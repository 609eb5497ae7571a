"""DFlash's FlashInfer draft planned from host bounds: no per-step sync, so the overlap scheduler keeps its lead.

Under SGLang 0.5.17 a DFlash server drafts on FlashInfer wherever it prefills on it (the README's
launch line; `service.dflash_draft_backend`). FlashInfer's backend inherits the base class's
`needs_cpu_seq_lens = True`, so `decide_needs_cpu_seq_lens` (managers/overlap_utils.py) makes
`FutureMap.resolve_seq_lens_cpu` copy the lengths to the host and sync every step, and its
CUDA-graph replay calls FlashInfer's `plan()`, which copies the index arrays to the host again.
Both drain the GPU queue, so the host prepares each step while the GPU idles: about 1.57 ms a
step at 64k on the H200, and at 4k the FlashInfer draft loses to Triton's (NOTES.md, session 38).

SGLang already has both halves of a sync-free path; they are only not joined for DFlash:
- `DFlashWorkerV2` hands its draft forward host lengths that bound the device ones from above
  without a sync: the committed prefix plus one verify block when the host has the lengths, else
  the allocator's reservation (`reserved_seq_lens_cpu`, at least the committed length plus two
  blocks: the verify in flight may accept a whole block);
- `flashinfer_backend.fast_prefill_plan` plans a captured fa2 wrapper from host layout alone; SGLang
  installs it only for EAGLE's draft-extend graphs.

After the DFlash worker has captured its draft graphs, this override installs `fast_prefill_plan` on
the draft backend's target-verify wrappers and sets that backend's `needs_cpu_seq_lens` to False, on
that instance only (the scheduler asks after the capture). Why planning from an upper bound is
exact: FlashInfer 0.6.15's paged prefill kernel reads each request's KV length from the device
indptr and clamps every KV chunk to it (`chunk_start = min(..., kv_len)`), so a chunk planned past
the end is empty and merges as weight zero. tests/test_dflash_host_plan.py checks that on a GPU
against a float64 reference, with NaN in every KV slot past the true lengths.

Where it does not fit it changes nothing and logs why: a draft backend other than FlashInfer's
fa2, sliding-window or cross-attention wrappers, a draft window (`--speculative-dflash-draft-window-size`:
its host bound leaves out the verify block), or no captured verify graphs.

Opt-in: $SM120_DFLASH_HOST_PLAN=1 in the server's environment. $SM120_DFLASH_HOST_PLAN=check does
the same and also reads the device lengths back at every plan (a sync: for verifying, not for
timing), logging how often the host bound held.
"""
from __future__ import annotations

import functools
import logging
import os

from .env_switch import TRUE_WORDS

logger = logging.getLogger(__name__)

ENV_VAR = "SM120_DFLASH_HOST_PLAN"
CHECK_WORD = "check"
_MARK = "_sm120_dflash_host_plan_original"
_LOG_EVERY = 50   # plans between the check's log lines (and the first)


def mode(environ=None) -> str:
    """"off", "on" or "check", from $SM120_DFLASH_HOST_PLAN (a true word means "on")."""
    value = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip().lower()
    if value == CHECK_WORD:
        return "check"
    return "on" if value in TRUE_WORDS else "off"


class HostBoundCheck:
    """Counts, at each plan of an adapted wrapper, whether the host KV lengths bound the device's.

    A request whose host length is below its device length would lose its last keys: the plan
    gives it too few chunks. Padded graph slots (host length 1, FlashInfer's fill value; a real
    DFlash request has at least its 16-token block) are skipped: SGLang discards their rows."""

    def __init__(self):
        self.plans = 0
        self.violations = 0
        self.min_slack: int | None = None

    def __call__(self, kv_lens_host, paged_kv_indptr) -> None:
        device = (paged_kv_indptr[1:] - paged_kv_indptr[:-1]).cpu().to(kv_lens_host.dtype)
        real = kv_lens_host > _PAD_LEN
        slack = (kv_lens_host - device)[real]
        self.plans += 1
        low = int(slack.min()) if len(slack) else None
        if low is not None:
            self.min_slack = low if self.min_slack is None else min(self.min_slack, low)
        if low is not None and low < 0:
            self.violations += 1
            logger.error("sm120_workbook: DFlash host plan: host KV lengths %s below the device's %s",
                         kv_lens_host[real].tolist(), device[real].tolist())
        if self.plans % _LOG_EVERY == 1 or (low is not None and low < 0 and self.violations == 1):
            logger.info("sm120_workbook (pid %d): DFlash host plan check: %d plans, %d with a host "
                        "length below the device's, least slack %s tokens", os.getpid(), self.plans,
                        self.violations, self.min_slack)


_PAD_LEN = 1   # FlashInfer's get_cuda_graph_seq_len_fill_value()


class _CheckedPlan:
    """A wrapper's begin_forward that checks the host bound, then runs fast_prefill_plan.

    Its `func` is fast_prefill_plan, which is what call_begin_forward looks at to pass host layout."""

    def __init__(self, wrapper, check: HostBoundCheck):
        from sglang.srt.layers.attention import flashinfer_backend as fib

        self.func, self.wrapper, self.check = fib.fast_prefill_plan, wrapper, check

    def __call__(self, qo_indptr, paged_kv_indptr, *args, **kwargs):
        self.check(kwargs["kv_lens_host"], paged_kv_indptr)
        return self.func(self.wrapper, qo_indptr, paged_kv_indptr, *args, **kwargs)


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


def adapt(backend, *, check: bool = False) -> list[int]:
    """Plan `backend`'s target-verify graphs from host bounds and stop it asking for host lengths.

    Returns the captured batch sizes adapted; raises ValueError (with the reason) if it cannot."""
    from sglang.srt.layers.attention import flashinfer_backend as fib

    reason = why_not_adaptable(backend)
    if reason is not None:
        raise ValueError(reason)
    checker = HostBoundCheck() if check else None
    for wrappers in backend.prefill_cuda_graph_metadata.values():
        for w in wrappers:
            # call_begin_forward takes its sync-free branch for a begin_forward whose `.func` is
            # fast_prefill_plan, as SGLang's own EAGLE draft-extend graphs have it.
            w.begin_forward = _CheckedPlan(w, checker) if check else functools.partial(fib.fast_prefill_plan, w)
    backend.needs_cpu_seq_lens = False
    return sorted(backend.prefill_cuda_graph_metadata)


def _worker_class():
    from sglang.srt.speculative import dflash_worker_v2

    return dflash_worker_v2.DFlashWorkerV2


def adapt_worker(worker, *, check: bool = False) -> str:
    """Adapt a DFlash worker's draft backend after its graphs are captured; returns a log line."""
    if getattr(worker, "use_compact_draft_cache", False):
        return ("left as SGLang has it: a draft window is set, and its host bound leaves out the "
                "verify block")
    backend = worker.draft_model_runner.attn_backend
    try:
        sizes = adapt(backend, check=check)
    except ValueError as e:
        return f"left as SGLang has it: {e}"
    return (f"the FlashInfer draft's verify graphs (bs {sizes[0]}..{sizes[-1]}) plan from host "
            f"bounds, needs_cpu_seq_lens False{' (checked at every plan)' if check else ''}")


def _wrap(init_cuda_graphs):
    @functools.wraps(init_cuda_graphs)
    def wrapper(self, *args, **kwargs):
        result = init_cuda_graphs(self, *args, **kwargs)
        try:
            line = adapt_worker(self, check=mode() == "check")
        except Exception as e:  # noqa: BLE001 - the server runs as SGLang has it rather than not at all
            line = f"failed, left as SGLang has it: {e!r}"
        logger.info("sm120_workbook (pid %d): DFlash host plan: %s", os.getpid(), line)
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
    """Install when $SM120_DFLASH_HOST_PLAN asks for it; a failure is logged, never raised."""
    if mode(environ) == "off":
        return False
    try:
        return install()
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("sm120_workbook: %s set but the DFlash host plan override failed: %r", ENV_VAR, e)
        return False
