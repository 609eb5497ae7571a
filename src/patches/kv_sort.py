"""Tier-0 KV defrag: force `need_sort=True` on SGLang's token and paged KV allocators.

SGLang 0.5.17 decides `need_sort` in `KVCacheConfigurator._build_token_to_kv_pool_allocator`
(sglang/srt/mem_cache/kv_cache_configurator.py): True only for PD disaggregation. With
need_sort False a freed slot goes straight back into the free list (appended by
`TokenToKVPoolAllocator.free`, prepended by `PagedTokenToKVPoolAllocator`), so after some
churn a new request's KV rows are scattered over the pool. With need_sort True frees
collect in `release_pages`, and when the free list runs short `merge_and_sort_free`
merges and sorts them, so later allocations come out in ascending runs.

The override wraps `BaseTokenToKVPoolAllocator.__init__`
(sglang/srt/mem_cache/allocator/base.py), where the flag is stored, so it holds for every
code path that builds a TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator (also the
inner allocators of the SWA wrapper) without touching the configurator.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

from .env_switch import env_requested

logger = logging.getLogger(__name__)

ENV_VAR = "SM120_KV_SORT"
# What a process that built an allocator under the override logs (_announce_forced): a server's
# log holding it shows the override ran there, not only that the variable was set.
FORCED_LOG_MARK = "built with need_sort=True"
_MARK = "_sm120_kv_sort_original"
_announced: set[str] = set()


def requested(environ=None) -> bool:
    """Whether $SM120_KV_SORT asks for the override ("1", "true", "yes", "on")."""
    return env_requested(ENV_VAR, environ)


def _base_class():
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    return BaseTokenToKVPoolAllocator


def _sorted_classes() -> tuple[type, ...]:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    return (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)


def is_installed() -> bool:
    """Whether the need_sort override is in place in this process."""
    return hasattr(_base_class().__dict__["__init__"], _MARK)


def install() -> bool:
    """Force need_sort=True for token and paged allocators built from now on.

    Returns True if this call installed it, False if it was already installed.
    """
    base = _base_class()
    if is_installed():
        return False
    original = base.__dict__["__init__"]
    signature = inspect.signature(original)
    if "need_sort" not in signature.parameters:
        raise RuntimeError(f"{base.__module__}.{base.__qualname__}.__init__{signature} takes no need_sort "
                           "(SGLang 0.5.17's does); the override cannot apply to this SGLang")
    sorted_classes = _sorted_classes()

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if isinstance(self, sorted_classes):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()   # a need_sort left to its default is False too
            if not bound.arguments["need_sort"]:
                bound.arguments["need_sort"] = True
                _announce_forced(type(self).__name__)
            args, kwargs = bound.args[1:], bound.kwargs
        original(self, *args, **kwargs)

    setattr(__init__, _MARK, original)
    base.__init__ = __init__
    logger.info("sm120_workbook (pid %d): KV sort override installed: need_sort=True on "
                "TokenToKVPoolAllocator and PagedTokenToKVPoolAllocator (%s)",
                os.getpid(), f"{base.__module__}.{base.__qualname__}.__init__")
    return True


def uninstall() -> bool:
    """Restore SGLang's own allocator constructor. Returns True if it was installed."""
    base = _base_class()
    current = base.__dict__["__init__"]
    original = getattr(current, _MARK, None)
    if original is None:
        return False
    base.__init__ = original
    _announced.clear()
    return True


def install_from_env(environ=None) -> bool:
    """Install the override when $SM120_KV_SORT asks for it; returns whether it is on. Unasked,
    it touches nothing of SGLang's (not even an import) and returns False."""
    if not requested(environ):
        return False
    install()
    return is_installed()


def _announce_forced(class_name: str) -> None:
    # Once per class and process: the first allocator a TP worker builds shows in its log.
    if class_name in _announced:
        return
    _announced.add(class_name)
    logger.info("sm120_workbook (pid %d): %s %s (SGLang chose False)", os.getpid(), class_name, FORCED_LOG_MARK)


def seen_in_log(text: str) -> bool:
    """Whether a server's log says an allocator was built under the override (FORCED_LOG_MARK)."""
    return FORCED_LOG_MARK in text
