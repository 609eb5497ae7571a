"""The need_sort override on SGLang's real allocators (CPU): what it changes, and that it loses nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import (BaseTokenToKVPoolAllocator,  # noqa: E402
                                            PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator)

from sm120_workbook.patches import kv_sort  # noqa: E402


@pytest.fixture
def override():
    """The override installed for one test, and removed after it whatever happens."""
    installed_before = kv_sort.is_installed()
    kv_sort.install()
    yield
    if not installed_before:
        kv_sort.uninstall()


@pytest.fixture
def no_override():
    installed_before = kv_sort.is_installed()
    kv_sort.uninstall()
    yield
    if installed_before:
        kv_sort.install()


def _token_allocator(size, need_sort=False):
    return TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, need_sort)


def _paged_allocator(size, page_size, need_sort=False):
    return PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", None, need_sort)


def test_without_override_need_sort_stays_as_sglang_decided(no_override):
    original = BaseTokenToKVPoolAllocator.__dict__["__init__"]
    assert not kv_sort.is_installed()
    assert _token_allocator(64).need_sort is False
    assert _token_allocator(64, need_sort=True).need_sort is True
    assert _paged_allocator(64, 16).need_sort is False
    assert kv_sort.install_from_env({}) is False
    assert kv_sort.install_from_env({kv_sort.ENV_VAR: "0"}) is False
    assert BaseTokenToKVPoolAllocator.__dict__["__init__"] is original


def test_install_forces_need_sort_and_uninstall_restores(no_override):
    original = BaseTokenToKVPoolAllocator.__dict__["__init__"]
    assert kv_sort.install() is True
    assert kv_sort.install() is False  # idempotent
    try:
        assert _token_allocator(64).need_sort is True
        assert _paged_allocator(64, 16).need_sort is True
        # keyword arguments reach the same wrapper
        a = TokenToKVPoolAllocator(size=64, dtype=torch.bfloat16, device="cpu", kvcache=None,
                                   need_sort=False)
        assert a.need_sort is True
    finally:
        assert kv_sort.uninstall() is True
    assert kv_sort.uninstall() is False
    assert BaseTokenToKVPoolAllocator.__dict__["__init__"] is original
    assert _token_allocator(64).need_sort is False


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("ON", True),
                                            ("0", False), ("", False), ("no", False)])
def test_env_var_values(no_override, value, expected):
    assert kv_sort.requested({kv_sort.ENV_VAR: value}) is expected
    assert kv_sort.install_from_env({kv_sort.ENV_VAR: value}) is expected
    kv_sort.uninstall()


def test_sorted_allocator_hands_out_ascending_runs_after_churn(override):
    """What the override buys: after frees in scrambled order, a merge hands out ascending slots."""
    a = _token_allocator(32)
    held = [a.alloc(4) for _ in range(8)]  # the whole pool
    for i in (5, 1, 7, 3, 0, 6, 2, 4):
        a.free(held[i])
    got = a.alloc(32)
    assert torch.equal(got, torch.arange(1, 33))


def _check_conservation(free_lists, owned, size, first=1):
    everything = torch.cat([*free_lists, *owned]) if owned else torch.cat(free_lists)
    assert everything.numel() == size, f"{everything.numel()} slots accounted for, {size} exist"
    assert torch.equal(torch.sort(everything).values, torch.arange(first, first + size)), \
        "a slot is lost or owned twice"


def _check_ascending(free_pages):
    """The override's point: with need_sort, frees wait in release_pages and reach the free list
    only through a merge that sorts it, so the free list stays strictly ascending."""
    assert torch.all(free_pages[1:] > free_pages[:-1]), "the free list is not in ascending order"


def test_token_allocator_100k_random_ops_lose_and_duplicate_nothing(override, seed):
    rng = np.random.default_rng(seed)
    size = 4096
    a = _token_allocator(size)
    assert a.need_sort is True
    owned: dict[int, torch.Tensor] = {}
    keys: list[int] = []
    merges = failures = 0
    for op in range(100_000):
        r = rng.random()
        if r < 0.5 or not keys:
            need = int(rng.integers(1, 97))
            available = a.available_size()
            had_release = len(a.release_pages) > 0
            got = a.alloc(need)
            if need <= available:
                assert got is not None, f"op {op}: alloc({need}) failed with {available} free"
                assert got.numel() == need
                owned[op] = got
                keys.append(op)
                merges += had_release and len(a.release_pages) == 0
            else:
                assert got is None
                failures += 1
        elif r < 0.95:
            key = keys.pop(int(rng.integers(len(keys))))
            a.free(owned.pop(key))
        else:
            # A scheduler step: several requests freed in one group.
            a.free_group_begin()
            for _ in range(min(len(keys), int(rng.integers(1, 6)))):
                key = keys.pop(int(rng.integers(len(keys))))
                a.free(owned.pop(key))
            a.free_group_end()
        if op % 2000 == 0:
            _check_conservation([a.free_pages, a.release_pages], list(owned.values()), size)
            _check_ascending(a.free_pages)
    _check_conservation([a.free_pages, a.release_pages], list(owned.values()), size)
    _check_ascending(a.free_pages)
    print(f"merges={merges} refused allocs={failures} live={len(owned)}")
    assert merges > 0, "the churn never reached SGLang's merge_and_sort_free"


def test_paged_allocator_random_ops_lose_and_duplicate_nothing(override, seed):
    rng = np.random.default_rng(seed)
    page, pages = 16, 256
    a = _paged_allocator(page * pages, page)
    assert a.need_sort is True
    owned: dict[int, torch.Tensor] = {}
    keys: list[int] = []
    for op in range(20_000):
        if rng.random() < 0.5 or not keys:
            need_pages = int(rng.integers(1, 9))
            available = a.available_size()
            got = a.alloc(need_pages * page)
            if need_pages * page <= available:
                assert got is not None, f"op {op}: alloc failed with {available} free"
                owned[op] = got
                keys.append(op)
            else:
                assert got is None
        elif rng.random() < 0.7:
            key = keys.pop(int(rng.integers(len(keys))))
            a.free(owned.pop(key))
        else:
            # as SGLang's scheduler frees a step's finished requests: free_segment (page
            # representatives, no unique) inside a free group
            a.free_group_begin()
            for _ in range(min(len(keys), int(rng.integers(1, 5)))):
                a.free_segment(owned.pop(keys.pop(int(rng.integers(len(keys))))), start_pos=0)
            a.free_group_end()
        if op % 1000 == 0 or op == 19_999:
            owned_pages = [t[::page] // page for t in owned.values()]
            _check_conservation([a.free_pages, a.release_pages], owned_pages, pages)
            _check_ascending(a.free_pages)


def _stand_in_base(monkeypatch, init):
    """kv_sort's view of SGLang's allocators swapped for a stand-in base class with `init`."""
    base = type("StandInAllocator", (), {"__init__": init})
    child = type("StandInTokenAllocator", (base,), {})
    monkeypatch.setattr(kv_sort, "_base_class", lambda: base)
    monkeypatch.setattr(kv_sort, "_sorted_classes", lambda: (child,))
    return base, child


def test_a_need_sort_left_to_its_default_is_forced_too(monkeypatch):
    """An SGLang whose allocators give need_sort a default (callers then leave it out) still gets
    need_sort=True, not a KeyError at the first allocator the scheduler builds."""
    def init(self, size, need_sort=False):
        self.need_sort = need_sort

    base, child = _stand_in_base(monkeypatch, init)
    assert kv_sort.install() is True
    assert child(8).need_sort is True and child(8, need_sort=False).need_sort is True
    assert kv_sort.uninstall() is True and child(8).need_sort is False


def test_an_allocator_without_need_sort_is_refused_by_name(monkeypatch, caplog):
    """An SGLang whose allocators take no need_sort: install() says so, nothing is patched, and
    the plugin's entry point logs it as a warning and goes on."""
    def init(self, size):
        self.size = size

    base, _ = _stand_in_base(monkeypatch, init)
    with pytest.raises(RuntimeError, match=r"StandInAllocator\.__init__\(self, size\) takes no need_sort"):
        kv_sort.install()
    assert base.__dict__["__init__"] is init and not kv_sort.is_installed()
    from sm120_workbook.patches import env_switch

    with caplog.at_level("WARNING"):
        ok = env_switch.install_or_warn(lambda: kv_sort.install_from_env({kv_sort.ENV_VAR: "1"}),
                                        kv_sort.logger, f"the KV sort override ({kv_sort.ENV_VAR})")
    assert ok is False and "the KV sort override (SM120_KV_SORT) failed" in caplog.text


class _Launch:
    """A Triton kernel's `kernel[grid](...)` call, run by a CPU function instead."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _extend_on_cpu(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive   # SGLang's own CPU version

    new_pages = ((seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size).sum()
    if new_pages <= len(free_pages):   # else alloc_extend returns None after the launch (the GPU
        # kernel reads past the list; the CPU version would raise)
        alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, "cpu")


def _decode_on_cpu(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    # alloc_decode_kernel, request by request: the next slot of its last page, or the first slot
    # of the next free page (in request order) when the token starts a page
    new_page = (seq_lens + page_size - 1) // page_size - (seq_lens - 1 + page_size - 1) // page_size
    starts = torch.cumsum(new_page, 0) - new_page
    if new_page.sum() > len(free_pages):   # alloc_decode returns None after the launch
        return
    for i in range(len(seq_lens)):
        out_indices[i] = free_pages[starts[i]] * page_size if new_page[i] else last_loc[i] + 1


def test_paged_scheduler_steps_keep_the_free_list_ascending(override, seed, monkeypatch):
    """The scheduler's own allocation calls on the paged allocator: alloc_extend for prefills
    (SGLang's CPU version of its Triton kernel), alloc_decode for each running request's token,
    finished requests freed by free_segment inside a free group. With the override the free list
    stays ascending through the merges these calls trigger, and every page is accounted for."""
    from sglang.srt.mem_cache.allocator import paged

    monkeypatch.setattr(paged, "alloc_extend_kernel", _Launch(_extend_on_cpu))
    monkeypatch.setattr(paged, "alloc_decode_kernel", _Launch(_decode_on_cpu))
    rng = np.random.default_rng(seed)
    page, pages = 16, 512
    a = _paged_allocator(page * pages, page)
    rows: list[list[int]] = []   # each running request's KV slots, in order
    merges = 0
    for step in range(3000):
        had_release = len(a.release_pages) > 0
        if rng.random() < 0.3 or not rows:   # a prefill of one new request
            n = int(rng.integers(1, 300))
            zero = torch.zeros(1, dtype=torch.int64)
            seq = torch.tensor([n])
            got = a.alloc_extend(zero, zero, seq, seq, torch.tensor([-1]), n)
            if got is not None:
                rows.append(got.tolist())
        else:   # a decode step of every running request
            seq = torch.tensor([len(r) + 1 for r in rows])
            got = a.alloc_decode(seq, seq, torch.tensor([r[-1] for r in rows]))
            if got is not None:
                for r, loc in zip(rows, got.tolist()):
                    r.append(loc)
        merges += had_release and len(a.release_pages) == 0
        if rows and (got is None or rng.random() < 0.15):   # finished requests leave in one group
            a.free_group_begin()
            for _ in range(min(len(rows), int(rng.integers(1, 4)))):
                a.free_segment(torch.tensor(rows.pop(int(rng.integers(len(rows))))), start_pos=0)
            a.free_group_end()
        if step % 100 == 0:
            slots = [s for r in rows for s in r]
            assert len(slots) == len(set(slots)), f"step {step}: a slot handed to two requests"
            owned = [torch.tensor(sorted({s // page for s in r})) for r in rows]
            _check_conservation([a.free_pages, a.release_pages], owned, pages)
            _check_ascending(a.free_pages)
    print(f"merges={merges} running={len(rows)}")
    assert merges > 0, "the steps never reached SGLang's merge_and_sort_free"
