"""patches/ngram_tail.py against SGLang 0.5.17's own NGRAMWorker methods (run unbound on a stub
worker): same draft-prep inputs and corpus inserts with and without it, and no full copy of
the prompt with it."""
from __future__ import annotations

import sys
import types
from array import array

import numpy as np
import pytest
import torch

from sm120_workbook.patches import ngram_tail

DEPTH, DRAFT = 18, 8


class CountingPrompt(array):
    """A prompt that counts the items a full iteration hands out (slices are plain arrays)."""
    iterated = 0

    def __iter__(self):
        for x in super().__iter__():
            CountingPrompt.iterated += 1
            yield x


@pytest.fixture
def worker_module(monkeypatch):
    try:
        import sgl_kernel.speculative  # noqa: F401
    except ImportError:  # CPU CI: ngram_worker imports one GPU op at the top; none runs here
        pkg, sub = types.ModuleType("sgl_kernel"), types.ModuleType("sgl_kernel.speculative")
        sub.reconstruct_indices_from_tree_mask = None
        pkg.speculative = sub
        monkeypatch.setitem(sys.modules, "sgl_kernel", pkg)
        monkeypatch.setitem(sys.modules, "sgl_kernel.speculative", sub)
    from sglang.srt.speculative import ngram_worker

    yield ngram_worker
    ngram_tail.uninstall()


class Corpus:
    def __init__(self):
        self.got, self.put = None, None

    def synchronize(self):
        pass

    def batch_get(self, req_ids, batch_tokens, total_lens):
        self.got = (list(req_ids), [list(t) for t in batch_tokens], list(total_lens))
        n = len(req_ids) * DRAFT
        return np.zeros(n, dtype=np.int64), np.ones(n * DRAFT, dtype=bool)

    def batch_put(self, batch_tokens):
        self.put = [list(t) for t in batch_tokens]


def _worker(mod, overlap):
    w = mod.NGRAMWorker.__new__(mod.NGRAMWorker)   # no __init__: no GPU, no model
    w.max_trie_depth, w.draft_token_num, w.enable_overlap = DEPTH, DRAFT, overlap
    w.ngram_corpus = Corpus()
    return w


def _batch(prompt_lens, out_lens):
    reqs = []
    for i, (p, o) in enumerate(zip(prompt_lens, out_lens)):
        req = types.SimpleNamespace(rid=f"r{i}", origin_input_ids=CountingPrompt("q", range(1000 * i, 1000 * i + p)),
                                    output_ids=list(range(-o, 0)))
        reqs.append(req)
    accept = torch.arange(len(reqs) * DRAFT, dtype=torch.int64)
    spec = types.SimpleNamespace(accept_tokens=accept, accept_lens=torch.full((len(reqs),), 3, dtype=torch.int32))
    return types.SimpleNamespace(reqs=reqs, spec_info=spec, grammar_needs_sync=lambda: False)


def _run(mod, overlap):
    w, batch = _worker(mod, overlap), _batch([65536, 5, 40], [3, 0, 30])
    CountingPrompt.iterated = 0
    mod.NGRAMWorker._prepare_draft_tokens(w, batch)
    mod.NGRAMWorker._update_ngram_corpus(w, batch)
    return w.ngram_corpus.got, w.ngram_corpus.put, CountingPrompt.iterated


@pytest.mark.parametrize("overlap", [False, True])
def test_same_draft_inputs_and_corpus_inserts_without_the_copy(worker_module, overlap):
    got, put, iterated = _run(worker_module, overlap)
    assert iterated >= 2 * 65536        # unpatched: the whole prompt, twice a step
    assert ngram_tail.install() and ngram_tail.is_installed() and not ngram_tail.install()
    got2, put2, iterated2 = _run(worker_module, overlap)
    assert (got2, put2) == (got, put)
    assert got[2][0] == 65536 + 3 + (3 if overlap else 0)   # total length still the full one
    assert iterated2 == 2 * 5    # only the 5-token prompt, shorter than the trie depth, is copied whole
    ngram_tail.uninstall()
    assert not ngram_tail.is_installed() and "list" not in vars(worker_module)
    assert _run(worker_module, overlap)[:2] == (got, put)


def test_tail_list_outside_the_methods_is_plain_list():
    a = array("q", range(100))
    assert ngram_tail._tail_list(a) == list(range(100)) and ngram_tail._tail_list() == []


def test_env_switch(worker_module):
    assert not ngram_tail.install_from_env({})
    assert not ngram_tail.is_installed()
    assert ngram_tail.install_from_env({"SM120_NGRAM_TAIL": "1"}) and ngram_tail.is_installed()
