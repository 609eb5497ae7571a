"""The `sm120_long_prompt` warm-up (patches/warmup.py) through SGLang's own registry and runner.

SGLang's `execute_warmups` runs it against a stand-in tokenizer manager that records the
requests (SGLang's own GenerateReqInput); the prompt lengths are checked against SGLang's
chunked prefill size and context-length rules; the flag round-trips through SGLang's parser.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.entrypoints.warmup", reason="needs SGLang (make setup installs it)")

import sm120_workbook.patches as plugin  # noqa: E402
from sm120_workbook import decode_bench, service  # noqa: E402
from sm120_workbook.patches import warmup  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sm120_workbook.dummy_models import materialize_model

    return materialize_model("k2_tp8_slice", 3, dest=tmp_path_factory.mktemp("model"))


@pytest.fixture
def registered():
    warmup.unregister_warmup()
    warmup.register_warmup()
    yield
    warmup.unregister_warmup()


class _TokenizerManager:
    """What the warm-up reads of SGLang's TokenizerManager, and a generate_request that records."""

    def __init__(self, chunk=8192, context_len=70000, max_req_input_len=None, reserved=0,
                 finish=None):
        self.server_args = SimpleNamespace(chunked_prefill_size=chunk)
        self.context_len = context_len
        self.max_req_input_len = max_req_input_len
        self.num_reserved_tokens = reserved
        self.model_config = SimpleNamespace(vocab_size=163840)
        self.requests = []
        self.finish = finish or {"type": "length", "length": warmup.DECODE_TOKENS}

    async def generate_request(self, obj, request=None):
        self.requests.append(obj)
        yield {"meta_info": {"finish_reason": self.finish}}


def _run(tm, names=(warmup.WARMUP_NAME,), mode="null"):
    from sglang.srt.entrypoints.warmup import execute_warmups

    asyncio.run(execute_warmups(mode, list(names), tm))


def test_the_two_prompts_cross_a_chunk_and_extend_the_first(registered):
    tm = _TokenizerManager(chunk=8192)
    _run(tm)
    first, second = tm.requests
    assert len(first.input_ids) == 8192 + warmup.PAST_ONE_CHUNK   # its second chunk has a prefix
    assert len(second.input_ids) == len(first.input_ids) + warmup.EXTENSION
    assert second.input_ids[:len(first.input_ids)] == first.input_ids   # a radix-cache prefix
    assert min(second.input_ids) >= warmup.LOWEST_TOKEN_ID and max(second.input_ids) < 163840
    for r in (first, second):
        assert r.sampling_params == {"max_new_tokens": warmup.DECODE_TOKENS, "temperature": 0.0,
                                     "ignore_eos": True}
        assert r.bootstrap_room is None
    # a PD prefill server gets SGLang's fake bootstrap, as its own warm-ups do
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    pd = _TokenizerManager()
    _run(pd, mode="prefill")
    assert all(r.bootstrap_room == 0 and r.bootstrap_host == FAKE_BOOTSTRAP_HOST for r in pd.requests)


def test_an_aborted_prompt_fails_the_start_with_sglangs_message(registered):
    # an abort without a status code reaches the warm-up, which raises
    tm = _TokenizerManager(finish={"type": "abort", "message": "out of memory in the KV pool"})
    with pytest.raises(RuntimeError, match="aborted the 8448-token warm-up prompt: out of memory"):
        _run(tm)
    # one with a status SGLang raises itself (a 400: ValueError), through SGLang's execute_warmups

    class _Refusing(_TokenizerManager):
        async def generate_request(self, obj, request=None):
            self.requests.append(obj)
            raise ValueError("Input length (8448 tokens) exceeds the maximum allowed length")
            yield   # an async generator, as SGLang's

    with pytest.raises(ValueError, match="exceeds the maximum allowed length"):
        _run(_Refusing())


@pytest.mark.parametrize("chunk,context,max_input,reserved,expected", [
    (8192, 70000, None, 0, (8448, 8512)),
    (16384, 131072, None, 0, (16640, 16704)),
    (-1, 70000, None, 0, (warmup.NO_CHUNK_PROMPT, warmup.NO_CHUNK_PROMPT + warmup.EXTENSION)),
    (None, 70000, None, 0, (warmup.NO_CHUNK_PROMPT, warmup.NO_CHUNK_PROMPT + warmup.EXTENSION)),
    (8192, 8300, None, 0, (8290, 8291)),         # cut to the context, less the decode tokens
    (8192, 70000, 8400, 0, (8398, 8399)),        # the scheduler's max_req_input_len
    (8192, 8300, None, 100, (8190, 8191)),       # SGLang's reserved tokens count too
])
def test_prompt_lengths_fit_what_sglang_accepts(chunk, context, max_input, reserved, expected):
    first, second = warmup.prompt_lengths(chunk, context, max_input, reserved)
    assert (first, second) == expected and first < second
    assert _sglang_accepts(second, context, max_input, reserved)
    # at the edge, where the edge is SGLang's: one more token is refused
    if second + 1 + reserved + warmup.DECODE_TOKENS > context or (max_input and second + 1 >= max_input):
        assert not _sglang_accepts(second + 1, context, max_input, reserved)


def _sglang_accepts(n_input: int, context: int, max_input: int | None, reserved: int) -> bool:
    """SGLang 0.5.17's own checks of a warm-up request of n_input ids: the tokenizer manager's
    (`_validate_one_request`: context length, reserved tokens, max_new_tokens) and the scheduler's
    (`validate_input_length` against max_req_input_len)."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.managers.utils import validate_input_length

    # the real class's methods on the fields they read, without a running server behind it
    manager = object.__new__(TokenizerManager)
    manager.__dict__.update(context_len=context, num_reserved_tokens=reserved, allow_auto_truncate=False,
                            validate_total_tokens=True, is_generation=True,
                            server_args=SimpleNamespace(enable_custom_logit_processor=False))
    ids = [1] * n_input
    req = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": warmup.DECODE_TOKENS})
    try:
        TokenizerManager._validate_one_request(manager, req, ids)
    except ValueError:
        return False
    return max_input is None or validate_input_length(SimpleNamespace(origin_input_ids=ids), max_input, False) is None


def test_prompt_lengths_name_the_argument():
    with pytest.raises(ValueError, match="^context_len: must be a positive int"):
        warmup.prompt_lengths(8192, 0)
    with pytest.raises(ValueError, match="^context_len: 10 tokens leave no room"):
        warmup.prompt_lengths(8192, 10)


def test_a_short_context_warns_that_one_chunk_holds_the_prompt(registered, caplog):
    tm = _TokenizerManager(chunk=8192, context_len=4096)
    with caplog.at_level("WARNING", logger=warmup.__name__):
        _run(tm)
    assert "fits one chunk" in caplog.text
    assert len(tm.requests) == 2


def test_registration_is_sglangs_own_and_idempotent():
    from sglang.srt.entrypoints.warmup import _warmup_registry

    warmup.unregister_warmup()
    before = dict(_warmup_registry)
    assert warmup.register_warmup() is True
    assert warmup.register_warmup() is False
    assert _warmup_registry[warmup.WARMUP_NAME] is warmup.long_prompt_warmup
    assert {k: v for k, v in _warmup_registry.items() if k != warmup.WARMUP_NAME} == before
    warmup.unregister_warmup()
    assert warmup.WARMUP_NAME not in _warmup_registry


def test_load_plugin_registers_the_warmup(monkeypatch):
    from sglang.srt.entrypoints.warmup import _warmup_registry

    warmup.unregister_warmup()
    monkeypatch.setattr("sys.argv", ["pytest"])
    monkeypatch.delenv(plugin.kv_sort.ENV_VAR, raising=False)        # nothing else installed
    monkeypatch.delenv(plugin.ngram_tail.ENV_VAR, raising=False)
    monkeypatch.delenv(plugin.SELECTED_ENV, raising=False)
    try:
        plugin.load_plugin()
        assert _warmup_registry.get(warmup.WARMUP_NAME) is warmup.long_prompt_warmup
    finally:
        warmup.unregister_warmup()
        plugin.unregister_backend()
        plugin.mha_draft.uninstall()   # load_plugin's SGLang hooks stay out of later tests
        plugin.uninstall_selection_hook()


# ---- the launcher side: ServerConfig.warmups and decode_bench --warmups ---------------------------

def test_warmups_reach_sglangs_parser_and_unknown_names_are_refused(model_dir, sglang_parser):
    cfg = service.resolve_config(service.ServerConfig(model_dir, "triton", tp=1,
                                                      warmups=[warmup.WARMUP_NAME, "prefill_shapes"]))
    assert sglang_parser.parse_args(service.launch_args(cfg)).warmups == "sm120_long_prompt,prefill_shapes"
    plain = service.resolve_config(service.ServerConfig(model_dir, "triton", tp=1))
    assert "--warmups" not in service.launch_args(plain)
    with pytest.raises(ValueError, match="^warmups: 'sm120_long_promt' is not a warm-up of the installed SGLang"):
        service.resolve_config(service.ServerConfig(model_dir, "triton", tp=1, warmups=("sm120_long_promt",)))
    with pytest.raises(ValueError, match="^warmups: a sequence of warm-up names"):
        service.check_warmups("sm120_long_prompt")


def test_decode_bench_refuses_an_unknown_warmup_before_any_launch(tmp_path, capsys):
    with pytest.raises(SystemExit):
        decode_bench.main(["--tp", "1", "--backends", "triton", "--warmups", "prefil_shapes",
                           "--no-record", "--log-dir", str(tmp_path)])
    assert "warmups: 'prefil_shapes' is not a warm-up" in capsys.readouterr().err


def test_a_plugin_name_needs_the_installed_entry_point(monkeypatch):
    """Without the entry point SGLang's launcher never registers our names: refused up front."""
    monkeypatch.setattr(service, "plugin_installed", lambda: False)
    with pytest.raises(ValueError, match="^warmups: 'sm120_long_prompt' comes from this project's SGLang plugin"):
        service.check_warmups(["sm120_long_prompt"])
    with pytest.raises(ValueError, match="^attention_backend: 'sm120_mla' comes from this project's SGLang plugin"):
        service.check_attention_backend("sm120_mla")
    service.check_warmups(["prefill_shapes"])   # SGLang's own: no plugin needed
