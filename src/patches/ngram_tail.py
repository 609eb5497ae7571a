"""NGRAM draft prep without copying the prompt: O(trie depth) host work a step, not O(context).

SGLang 0.5.17's `NGRAMWorker._prepare_draft_tokens` and `_update_ngram_corpus`
(sglang/srt/speculative/ngram_worker.py) each call `list(req.origin_input_ids)` on every
verify step, then keep only its last `max_trie_depth` (18) tokens. `origin_input_ids` is an
`array('q')`, so `list()` makes one Python int per prompt token: at 64k context the two
calls cost ~3 ms of host time a step (torch-profiler stacks, H200, 2026-11-29), more than
the whole GPU part of a verify step with the sm120_mla kernel (~1.4 ms), and the GPU idles.

The override changes nothing in those methods' logic. While either method runs, the
module's name `list` resolves to `_tail_list`, which returns only the last `max_trie_depth`
items of an `array` (the prompt); every other argument is copied as before. Both call sites
pass the copy to `_efficient_concat_last_n(seq1, seq2, n)`, which reads at most the last n
items of seq1, so the draft tokens and the corpus inserts are the same (tests/test_ngram_tail.py
runs the real methods both ways). Opt-in: $SM120_NGRAM_TAIL=1 in the server's environment
(the plugin installs it in every process); it applies to every attention backend alike.
"""
from __future__ import annotations

import builtins
import contextvars
import functools
import logging
import os
from array import array

from .env_switch import env_requested, install_or_warn

logger = logging.getLogger(__name__)

ENV_VAR = "SM120_NGRAM_TAIL"
_METHODS = ("_prepare_draft_tokens", "_update_ngram_corpus")
_MARK = "_sm120_ngram_tail_original"
_depth: contextvars.ContextVar[int | None] = contextvars.ContextVar("sm120_ngram_tail_depth", default=None)


def requested(environ=None) -> bool:
    """Whether $SM120_NGRAM_TAIL asks for the override ("1", "true", "yes", "on")."""
    return env_requested(ENV_VAR, environ)


def _tail_list(iterable=(), /):
    """`list`, except that inside the wrapped methods an array (a prompt) keeps only its tail."""
    depth = _depth.get()
    if depth is not None and isinstance(iterable, array) and len(iterable) > depth:
        return builtins.list(iterable[len(iterable) - depth:])
    return builtins.list(iterable)


def _wrap(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        token = _depth.set(int(self.max_trie_depth))
        try:
            return method(self, *args, **kwargs)
        finally:
            _depth.reset(token)

    setattr(wrapper, _MARK, method)
    return wrapper


def _module():
    from sglang.srt.speculative import ngram_worker

    return ngram_worker


def is_installed() -> bool:
    worker = _module().NGRAMWorker
    return all(hasattr(worker.__dict__.get(m), _MARK) for m in _METHODS)


def install() -> bool:
    """Wrap the two methods and bind the module's `list` to `_tail_list`; True if this call did."""
    mod = _module()
    if is_installed():
        return False
    missing = [m for m in _METHODS if m not in mod.NGRAMWorker.__dict__]
    if missing or "list" in mod.__dict__:
        raise RuntimeError(f"sm120_workbook: NGRAM tail override does not fit this SGLang "
                           f"(missing {missing}, module list bound: {'list' in mod.__dict__})")
    for m in _METHODS:
        setattr(mod.NGRAMWorker, m, _wrap(mod.NGRAMWorker.__dict__[m]))
    mod.list = _tail_list
    logger.info("sm120_workbook (pid %d): NGRAM draft prep copies only the last max_trie_depth "
                "prompt tokens (NGRAMWorker.%s)", os.getpid(), ", ".join(_METHODS))
    return True


def uninstall() -> None:
    mod = _module()
    for m in _METHODS:
        original = getattr(mod.NGRAMWorker.__dict__[m], _MARK, None)
        if original is not None:
            setattr(mod.NGRAMWorker, m, original)
    mod.__dict__.pop("list", None)


def install_from_env(environ=None) -> bool:
    """Install when $SM120_NGRAM_TAIL asks for it; a failure is logged, never raised (the
    server runs unpatched rather than not at all)."""
    if not requested(environ):
        return False
    return install_or_warn(install, logger, f"{ENV_VAR}=1 but the NGRAM tail override")
