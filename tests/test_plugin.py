"""The SGLang plugin: entry point, registration, idempotence, and that it changes nothing unasked."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import sm120_workbook.patches as plugin  # noqa: E402
from sm120_workbook.patches import kv_sort, mha_draft  # noqa: E402

GROUP = "sglang.srt.plugins"


@pytest.fixture
def clean_plugin_state(monkeypatch):
    """Each test starts and ends with nothing registered or installed by the plugin."""
    monkeypatch.delenv(plugin.SELECTED_ENV, raising=False)   # restored afterwards

    def reset():
        plugin.unregister_backend()
        plugin.uninstall_spec_compat()
        plugin.uninstall_selection_hook()
        kv_sort.uninstall()
        mha_draft.uninstall()
        plugin._last_message = None

    reset()
    yield
    reset()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def plugin_log():
    handler = _Lines()
    logging.getLogger("sm120_workbook.patches").addHandler(handler)
    yield handler.lines
    logging.getLogger("sm120_workbook.patches").removeHandler(handler)


def test_entry_point_is_discoverable_and_names_load_plugin():
    eps = [ep for ep in entry_points(group=GROUP) if ep.name == "sm120_workbook"]
    assert len(eps) == 1, f"entry points in {GROUP}: {list(entry_points(group=GROUP))}"
    assert eps[0].value == "sm120_workbook.patches:load_plugin"
    assert eps[0].load() is plugin.load_plugin


def test_sglang_loader_in_a_fresh_process():
    """Through SGLang's own load_plugins(): import alone registers nothing; loading registers
    the backend (registry and CLI choices) and the warm-up, and leaves need_sort alone without
    the env var; the non-MLA draft step is in place (it acts only where sm120_mla is selected);
    with SM120_KV_SORT=1 a second load_plugin() call installs the override."""
    script = textwrap.dedent("""
        import json, os, torch
        os.environ.pop("SM120_KV_SORT", None)
        import sm120_workbook.patches as plugin
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.entrypoints.warmup import _warmup_registry
        out = {"after_import": {"registry": "sm120_mla" in ATTENTION_BACKENDS,
                                "choices": "sm120_mla" in ATTENTION_BACKEND_CHOICES,
                                "kv_sort": plugin.kv_sort.is_installed(),
                                "warmup": "sm120_long_prompt" in _warmup_registry,
                                "mha_draft": plugin.mha_draft.is_installed()}}
        from sglang.srt.plugins import load_plugins
        load_plugins()
        a = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", None, False)
        out["after_load"] = {"registry": "sm120_mla" in ATTENTION_BACKENDS,
                             "choices": ATTENTION_BACKEND_CHOICES.count("sm120_mla"),
                             "kv_sort": plugin.kv_sort.is_installed(), "need_sort": a.need_sort,
                             "spec_compat": plugin.spec_compat_installed(),
                             "warmup": "sm120_long_prompt" in _warmup_registry,
                             "mha_draft": plugin.mha_draft.is_installed(),
                             "selection": plugin.selection_hook_installed()}
        os.environ["SM120_KV_SORT"] = "1"
        plugin.load_plugin()
        a = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", None, False)
        out["after_env"] = {"choices": ATTENTION_BACKEND_CHOICES.count("sm120_mla"),
                            "kv_sort": plugin.kv_sort.is_installed(), "need_sort": a.need_sort}
        print("RESULT " + json.dumps(out))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("SM120_KV_SORT", "SGLANG_PLUGINS", plugin.SELECTED_ENV)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["after_import"] == {"registry": False, "choices": False, "kv_sort": False, "warmup": False,
                                   "mha_draft": False}
    assert out["after_load"] == {"registry": True, "choices": 1, "kv_sort": False, "need_sort": False,
                                 "spec_compat": False, "warmup": True, "mha_draft": True, "selection": True}
    assert out["after_env"] == {"choices": 1, "kv_sort": True, "need_sort": True}
    # The plugin announces itself, with its pid, in the process's log (stderr).
    announcements = [x for x in proc.stderr.splitlines() if "sm120_workbook plugin (pid" in x]
    assert len(announcements) == 2, proc.stderr[-3000:]
    assert "KV sort override off" in announcements[0]
    assert "KV sort override on" in announcements[1]


def test_load_plugin_registers_with_sglang_and_is_idempotent(clean_plugin_state, plugin_log,
                                                             monkeypatch):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    monkeypatch.delenv(kv_sort.ENV_VAR, raising=False)
    monkeypatch.delenv(plugin.SELECTED_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    before = dict(ATTENTION_BACKENDS)
    plugin.load_plugin()
    plugin.load_plugin()
    assert plugin.is_registered()
    assert mha_draft.is_installed()   # self-gated: it acts only where sm120_mla is selected
    assert ATTENTION_BACKEND_CHOICES.count(plugin.BACKEND_NAME) == 1
    assert set(ATTENTION_BACKENDS) - set(before) == {plugin.BACKEND_NAME}
    assert all(ATTENTION_BACKENDS[k] is v for k, v in before.items())  # nothing else touched
    assert not kv_sort.is_installed()
    assert not plugin.spec_compat_installed()
    assert len(plugin_log) == 1 and f"pid {os.getpid()}" in plugin_log[0]
    plugin.unregister_backend()
    assert plugin.BACKEND_NAME not in ATTENTION_BACKENDS
    assert plugin.BACKEND_NAME not in ATTENTION_BACKEND_CHOICES


def test_load_plugin_with_env_and_command_line_selection(clean_plugin_state, plugin_log,
                                                         monkeypatch):
    monkeypatch.setenv(kv_sort.ENV_VAR, "1")
    monkeypatch.setattr(sys, "argv", ["sglang", "serve", "--attention-backend", "sm120_mla"])
    plugin.load_plugin()
    assert plugin.is_registered() and kv_sort.is_installed() and plugin.spec_compat_installed()
    assert any("KV sort override installed" in x for x in plugin_log)
    assert any("registered and selected" in x and "KV sort override on" in x for x in plugin_log)
    assert any("accept sm120_mla like triton" in x for x in plugin_log)


_SELECTION_SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, sys

    def scheduler(server_args, queue):
        # what run_scheduler_process does first: SGLang's load_plugins(), in a spawned process
        # with the launcher's environment and argv, then a separate draft worker's backend check
        from sglang.srt.plugins import load_plugins
        from sglang.srt.speculative import draft_worker_common
        import sm120_workbook.patches as plugin
        load_plugins()
        draft = draft_worker_common._resolve_draft_attention_backend_fallback(
            draft_server_args=server_args, algo_label="DSPARK")
        queue.put({"spec_compat": plugin.spec_compat_installed(), "draft_backend": draft})

    def launched(args):
        # what Engine._launch_subprocesses does before it spawns a scheduler
        from sglang.srt.plugins import load_plugins
        load_plugins()
        args.check_server_args()
        return os.environ.pop(plugin.SELECTED_ENV, None)

    if __name__ == "__main__":
        target, config = sys.argv[1], sys.argv[2]
        from sglang.srt.server_args import ServerArgs, prepare_server_args
        import sm120_workbook.patches as plugin
        # an Engine(server_args=...) whose ServerArgs was built before any plugin loaded
        prebuilt = ServerArgs(model_path=target, load_format="dummy", skip_tokenizer_init=True, device="cuda",
                              speculative_algorithm="NGRAM", speculative_draft_attention_backend="sm120_mla")
        out = {"prebuilt": launched(prebuilt)}
        common = ["--model-path", target, "--load-format", "dummy", "--skip-tokenizer-init",
                  "--device", "cuda", "--speculative-algorithm", "NGRAM"]
        out["in_argv"] = plugin.backend_selected_in_argv()
        out["other_backend"] = launched(prepare_server_args(common + ["--attention-backend", "flashinfer"]))
        out["engine_kwargs"] = launched(ServerArgs(model_path=target, load_format="dummy", skip_tokenizer_init=True,
                                                   device="cuda", speculative_algorithm="NGRAM",
                                                   speculative_draft_attention_backend="sm120_mla"))
        args = prepare_server_args(common + ["--config", config])
        out["config"] = launched(args)
        os.environ[plugin.SELECTED_ENV] = out["config"] or ""   # as the launcher leaves it for its schedulers
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=scheduler, args=(args, queue), daemon=True)
        child.start()
        out["scheduler"] = queue.get(timeout=200)
        child.join(timeout=30)
        print("RESULT " + json.dumps(out))
""")


def test_a_draft_backend_named_in_a_config_file_or_engine_kwargs_reaches_the_schedulers(tmp_path):
    """argv does not show a backend named in a --config file or given to Engine, and a separate
    draft worker checks its backend name before any target backend is built. With the selection
    step, SGLang's own launch sequence (load_plugins(), then check_server_args(), as
    Engine._launch_subprocesses runs them) sets SELECTED_ENV for ServerArgs from --config
    (prepare_server_args), from keywords and built before the plugin loaded, and not for another
    backend; a spawned process running SGLang's load_plugins() with that environment accepts the
    draft-only sm120_mla: SGLang's own `_resolve_draft_attention_backend_fallback` keeps it
    instead of falling back to FlashInfer."""
    from sm120_workbook.dummy_models import materialize_model

    target = materialize_model("k2_tp8_slice", layers=4, dest=tmp_path / "target")
    config = tmp_path / "server.yaml"
    config.write_text("attention-backend: flashinfer\nspeculative-draft-attention-backend: sm120_mla\n")
    script = tmp_path / "launcher.py"
    script.write_text(_SELECTION_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", plugin.SELECTED_ENV)}
    proc = subprocess.run([sys.executable, str(script), str(target), str(config)], capture_output=True,
                          text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert out == {"prebuilt": "1", "in_argv": False, "other_backend": None, "engine_kwargs": "1", "config": "1",
                   "scheduler": {"spec_compat": True, "draft_backend": "sm120_mla"}}


def test_the_selection_step_reads_the_four_backend_fields():
    assert plugin._BACKEND_FIELDS == ("attention_backend", "decode_attention_backend",
                                      "prefill_attention_backend", "speculative_draft_attention_backend")
    assert plugin.backend_selected_in(SimpleNamespace(attention_backend="triton", decode_attention_backend="sm120_mla"))
    assert not plugin.backend_selected_in(SimpleNamespace(attention_backend="triton", model_path="sm120_mla"))


@pytest.mark.parametrize("argv,selected", [
    (["x", "--attention-backend", "sm120_mla"], True),
    (["x", "--decode-attention-backend=sm120_mla"], True),
    (["x", "--speculative-draft-attention-backend", "sm120_mla"], True),
    (["x", "--attention-backend", "triton"], False),
    (["x", "--model-path", "sm120_mla"], False),
    (["x", "--attention-backend"], False),
])
def test_backend_selected_in_argv(argv, selected):
    assert plugin.backend_selected_in_argv(argv) is selected


def test_spec_compat_gives_sm120_mla_the_triton_draft_backends(clean_plugin_state):
    from sglang.srt.speculative import draft_worker_common
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    args = SimpleNamespace(speculative_draft_attention_backend=None, attention_backend="sm120_mla",
                           decode_attention_backend=None, prefill_attention_backend=None)
    factory = DraftBackendFactory(args, None, 1, 3)
    backend_map = {"triton": lambda: "triton-draft-backend"}
    with pytest.raises(ValueError, match="sm120_mla"):  # stock SGLang refuses the name
        factory._create_backend("decode_attention_backend", backend_map, "no {backend_type}")
    stock_supported = draft_worker_common._SUPPORTED_DRAFT_BACKENDS

    assert plugin.install_spec_compat() is True
    assert plugin.install_spec_compat() is False
    assert factory._create_backend("decode_attention_backend", backend_map,
                                   "no {backend_type}") == "triton-draft-backend"
    assert "sm120_mla" in draft_worker_common._SUPPORTED_DRAFT_BACKENDS
    # Other names behave as before.
    args.attention_backend = "fa3"
    with pytest.raises(ValueError, match="fa3"):
        factory._create_backend("decode_attention_backend", backend_map, "no {backend_type}")

    plugin.uninstall_spec_compat()
    assert draft_worker_common._SUPPORTED_DRAFT_BACKENDS is stock_supported
    args.attention_backend = "sm120_mla"
    with pytest.raises(ValueError):
        factory._create_backend("decode_attention_backend", backend_map, "no {backend_type}")


def test_spec_compat_puts_an_mla_drafts_decode_steps_and_extend_on_the_kernel(clean_plugin_state, monkeypatch):
    """EAGLE / MTP: for an MLA draft model, SGLang's own draft-decode and draft-extend makers give
    way to the kernel's backends; a non-MLA draft (an EAGLE3 head) keeps SGLang's Triton ones, and
    --speculative-draft-attention-backend triton keeps the draft on Triton."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from sm120_workbook.patches import backend

    built = []
    monkeypatch.setattr(backend, "Sm120MlaMultiStepDraftBackend",
                        lambda runner, topk, steps: built.append(("multi-step", runner.name, topk, steps)) or "sm120-steps")
    monkeypatch.setattr(backend, "Sm120MlaAttnBackend", lambda runner: built.append(("extend", runner.name)) or "sm120-extend")
    # SGLang's Triton makers as methods of the factory still (the comparison is with the bound
    # method), but naming themselves: the real ones would build backends on this stand-in runner
    monkeypatch.setattr(DraftBackendFactory, "_create_triton_decode_backend", lambda self: "triton-steps")
    monkeypatch.setattr(DraftBackendFactory, "_create_triton_prefill_backend", lambda self: "triton-extend")
    # what a published server's runtime context says by default (the draft extend on the prefill
    # backend's name; both are None here, so attention_backend decides)
    from sglang.srt.speculative import draft_utils

    monkeypatch.setattr(draft_utils, "get_spec", lambda: SimpleNamespace(speculative_attention_mode="prefill"))
    plugin.install_spec_compat()

    def made(use_mla, kind, draft_backend=None):
        # through SGLang's own create_* methods, so that their maps (not a copy here) are what the
        # plugin has to recognise
        args = SimpleNamespace(speculative_draft_attention_backend=draft_backend, attention_backend="sm120_mla",
                               decode_attention_backend=None, prefill_attention_backend=None)
        runner = SimpleNamespace(name="draft", use_mla_backend=use_mla,
                                 model_config=SimpleNamespace(hf_config=object()))
        f = DraftBackendFactory(args, runner, 1, 3)
        return f.create_decode_backend() if kind == "decode" else f.create_draft_extend_backend()

    assert (made(True, "decode"), made(True, "extend")) == ("sm120-steps", "sm120-extend")
    assert built == [("multi-step", "draft", 1, 3), ("extend", "draft")]
    built.clear()
    assert (made(False, "decode"), made(False, "extend")) == ("triton-steps", "triton-extend")
    assert made(True, "decode", draft_backend="triton") == "triton-steps"
    assert built == []


def test_an_mla_draft_whose_triton_maker_is_not_recognised_stays_on_triton_and_says_so(
        clean_plugin_state, plugin_log):
    """A `triton` entry that is not SGLang's own maker (another SGLang wrapping it): the draft keeps
    that entry, with a warning that the kernel's draft backends were not used."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    plugin.install_spec_compat()
    args = SimpleNamespace(speculative_draft_attention_backend=None, attention_backend="sm120_mla",
                           decode_attention_backend=None, prefill_attention_backend=None)
    f = DraftBackendFactory(args, SimpleNamespace(use_mla_backend=True), 1, 3)
    assert f._create_backend("decode_attention_backend", {"triton": lambda: "wrapped-triton"},
                             "no {backend_type}") == "wrapped-triton"
    assert any("not SGLang 0.5.17's own Triton draft maker" in x for x in plugin_log), plugin_log
    # judged only where sm120_mla is the name chosen: a triton server's draft says nothing
    plugin_log.clear()
    args.attention_backend = "triton"
    assert f._create_backend("decode_attention_backend", {"triton": lambda: "wrapped-triton"},
                             "no {backend_type}") == "wrapped-triton"
    assert not any("Triton draft maker" in x for x in plugin_log), plugin_log


def _mid_resolution_server_args(**fields):
    """A real ServerArgs as the DFLASH hook sees it: still writable (before materialization)."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(**fields)
    args = override.install()
    object.__setattr__(args, "_declarations_materialized", False)
    return override, args


@pytest.mark.parametrize("fields", [
    {"attention_backend": "sm120_mla"},
    {"attention_backend": "flashinfer", "decode_attention_backend": "sm120_mla"},   # the README's line
    {"attention_backend": "sm120_mla", "prefill_attention_backend": "flashinfer"},
    {"attention_backend": "sm120_mla", "prefill_attention_backend": "triton"},
    {"attention_backend": "triton", "decode_attention_backend": "sm120_mla"},
    {"attention_backend": "triton"}, {"attention_backend": "fa3"}, {"attention_backend": "fa4"},
    {"attention_backend": "flashmla"}])
def test_dflash_draft_backend_is_sglangs_own(clean_plugin_state, fields):
    """With the plugin's patches installed, SGLang's own DFLASH hook resolves the draft backend a
    server names none for (for sm120_mla its fallback, flashinfer), and service.dflash_draft_backend
    (the launcher's and the charts' "usual") says the same."""
    from sglang.srt.arg_groups import speculative_hook

    from sm120_workbook.service import dflash_draft_backend

    plugin.install_spec_compat()
    override, args = _mid_resolution_server_args(speculative_draft_attention_backend=None, **fields)
    try:
        speculative_hook._resolve_dflash_draft_attention_backend(args)
        resolved = args.speculative_draft_attention_backend
    finally:
        override.restore()
    # as /server_info holds them: --attention-backend, and --prefill-attention-backend where named
    assert dflash_draft_backend(fields["attention_backend"], fields.get("prefill_attention_backend")) == resolved
    prefill = fields.get("prefill_attention_backend") or fields["attention_backend"]
    if prefill == "sm120_mla":
        assert resolved == "flashinfer"


def test_attention_routes_name_where_each_phase_runs():
    from types import SimpleNamespace

    from sm120_workbook.patches.backend import attention_routes

    def routes(attn="sm120_mla", prefill=None, decode=None, algo="NGRAM", mode="prefill"):
        return attention_routes(SimpleNamespace(
            attention_backend=attn, prefill_attention_backend=prefill, decode_attention_backend=decode,
            speculative_algorithm=algo, speculative_attention_mode=mode))

    # one backend: everything but prefill on the kernel, prefill on the Triton parent (warned)
    clause, warning = routes()
    assert clause == "decode and target verify on the sm120 kernel; prefill and extend on Triton"
    assert warning.startswith("sm120_mla: prompts prefill on SGLang's Triton extend kernel")
    assert ("--attention-backend flashinfer --decode-attention-backend sm120_mla "
            "--speculative-attention-mode decode prefills on FlashInfer's MLA kernels instead") in warning
    assert routes(algo=None)[0] == "decode on the sm120 kernel; prefill and extend on Triton"
    # the README's hybrid: flashinfer as --attention-backend, verify follows decode in decode mode;
    # nothing to warn of
    hybrid = ("decode and target verify on the sm120 kernel; prefill and extend on flashinfer "
              "(SGLang's hybrid backend)")
    assert routes(attn="flashinfer", decode="sm120_mla", mode="decode") == (hybrid, None)
    assert routes(attn="flashinfer", decode="sm120_mla", algo=None) == (hybrid.replace(" and target verify", ""), None)
    # the same split spelt the other way round resolves alike (SGLang's attention_backends_of),
    # but SGLang keeps its chunked prefix cache off (keyed on --attention-backend): warned, with
    # the spelling that turns it on
    clause, warning = routes(prefill="flashinfer", mode="decode")
    assert clause == hybrid
    assert warning.startswith("sm120_mla: SGLang turns its chunked prefix cache on by --attention-backend alone, "
                              "and sm120_mla is not in its list")
    assert warning.endswith("spell the same backends --attention-backend flashinfer --decode-attention-backend "
                            "sm120_mla --speculative-attention-mode decode")
    # ... and not when the user turned the cache off, or the prefill side cannot use it
    assert attention_routes(SimpleNamespace(
        attention_backend="sm120_mla", prefill_attention_backend="flashinfer", decode_attention_backend=None,
        speculative_algorithm="NGRAM", speculative_attention_mode="decode", disable_chunked_prefix_cache=True)) == (
        hybrid, None)
    assert "chunked prefix cache" not in routes(prefill="triton", mode="decode")[1]
    assert routes(prefill="torch_native", mode="decode")[1] is None   # not a backend in SGLang's list
    # the split with no --attention-backend: SGLang fills in its default (triton for MLA on sm_120)
    clause, warning = routes(attn=None, prefill="flashinfer", decode="sm120_mla", mode="decode")
    assert clause == hybrid and "on sm_120, --attention-backend left out becomes SGLang's default" in warning
    # in a server, the backend passes the flag as SGLang resolved it: the GPU's default decides
    split = SimpleNamespace(attention_backend=None, prefill_attention_backend="flashinfer",
                            decode_attention_backend="sm120_mla", speculative_algorithm="NGRAM",
                            speculative_attention_mode="decode")
    assert "and triton is not in its list" in attention_routes(split, base="triton")[1]
    assert attention_routes(split, base="fa3") == (hybrid, None)
    # mixed chunks (plain decode only) put decode tokens in an extend batch, on the prefill side
    mixed = attention_routes(SimpleNamespace(
        attention_backend="flashinfer", prefill_attention_backend=None, decode_attention_backend="sm120_mla",
        speculative_algorithm=None, enable_mixed_chunk=True))[0]
    assert mixed.endswith("; with --enable-mixed-chunk, decode tokens batched beside a prefill run on flashinfer")
    unchunked = attention_routes(SimpleNamespace(   # no chunked prefill: SGLang mixes nothing
        attention_backend="flashinfer", prefill_attention_backend=None, decode_attention_backend="sm120_mla",
        speculative_algorithm=None, enable_mixed_chunk=True, chunked_prefill_size=-1))[0]
    assert "mixed" not in unchunked
    # a split in the default prefill mode sends verify to the prefill side
    clause, warning = routes(prefill="flashinfer")
    assert clause.startswith("decode on the sm120 kernel")
    assert "target verify runs on flashinfer, not on the sm120 kernel: add --speculative-attention-mode decode" in warning
    # sm120_mla as the prefill side only: decode elsewhere, verify on the kernel in prefill mode
    clause, warning = routes(decode="triton")
    assert clause.startswith("target verify on the sm120 kernel; prefill and extend on Triton")
    assert "decode runs on triton, not on the sm120 kernel" in warning
    assert routes(decode="triton", mode="decode")[0].startswith("no phase on the sm120 kernel")
    # a Triton prefill beside the kernel is still the slow one
    assert "Triton extend kernel" in routes(prefill="triton", mode="decode")[1]
    assert attention_routes(None) == routes(algo=None)   # a runner without server_args


def test_routes_of_a_command_line_parse_with_sglang(clean_plugin_state):
    from sm120_workbook.patches.backend import routes_of_command

    readme = ("--attention-backend flashinfer --decode-attention-backend sm120_mla "
              "--speculative-attention-mode decode --speculative-algorithm NGRAM").split()
    hybrid = ("decode and target verify on the sm120 kernel; prefill and extend on flashinfer "
              "(SGLang's hybrid backend)")
    assert routes_of_command(readme) == (hybrid, None)
    # the other spelling: SGLang's list of chunked-prefix-cache backends, as parsed, has flashinfer
    # and not sm120_mla, and --disable-chunked-prefix-cache is read from SGLang's own field
    other = ("--attention-backend sm120_mla --prefill-attention-backend flashinfer "
             "--speculative-attention-mode decode --speculative-algorithm NGRAM").split()
    clause, warning = routes_of_command(other)
    assert clause == hybrid and "chunked prefix cache" in warning
    assert routes_of_command(other + ["--disable-chunked-prefix-cache"]) == (hybrid, None)
    # SGLang's own field: mixed chunks named for plain decode (speculation turns them off)
    clause, _ = routes_of_command(["--attention-backend", "sm120_mla", "--enable-mixed-chunk"])
    assert clause.endswith("with --enable-mixed-chunk, decode tokens batched beside a prefill run on Triton")
    clause, warning = routes_of_command(["--attention-backend", "sm120_mla"])
    assert clause == "decode on the sm120 kernel; prefill and extend on Triton" and "Triton extend" in warning


def test_the_prefix_cache_warning_follows_sglangs_list_and_gate(monkeypatch):
    """The warning reads SGLang's list, not a copy: a backend added to it (as out-of-tree
    platforms do) is taken as turning the cache on. And its premise is SGLang's gate: the
    cache is decided by the resolved --attention-backend alone."""
    import inspect
    from types import SimpleNamespace

    from sglang.srt import server_args
    from sglang.srt.model_executor.model_runner_components import misc_utils

    from sm120_workbook.patches.backend import prefix_cache_kept_off

    args = SimpleNamespace(attention_backend="sm120_mla", disable_chunked_prefix_cache=False)
    assert prefix_cache_kept_off(args, "flashinfer") is not None
    supported = server_args.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS
    monkeypatch.setattr(server_args, "CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS", [*supported, "sm120_mla"])
    assert prefix_cache_kept_off(args, "flashinfer") is None
    gate = inspect.getsource(misc_utils.maybe_disable_chunked_prefix_cache)
    assert "get_exec().kernel.attention_backend" in gate and "CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS" in gate


def test_attention_routes_read_sglangs_own_server_args_fields():
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    names = {f.name for f in dataclasses.fields(ServerArgs)}
    assert {"attention_backend", "prefill_attention_backend", "decode_attention_backend", "speculative_algorithm",
            "speculative_attention_mode", "disable_chunked_prefix_cache", "enable_mixed_chunk",
            "chunked_prefill_size"} <= names
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    assert defaults["speculative_attention_mode"] == "prefill" and defaults["prefill_attention_backend"] is None


@pytest.fixture(scope="module")
def eagle3_heads(tmp_path_factory):
    """A K2-shaped target (8 layers: SGLang's default EAGLE3 layers are distinct) and both heads."""
    from sm120_workbook.dummy_models import materialize_eagle3_draft, materialize_model

    root = tmp_path_factory.mktemp("eagle3")
    target = materialize_model("k2_tp8_slice", layers=8, dest=root / "target")
    return target, {head: materialize_eagle3_draft(target, dest=root / head, head=head) for head in ("mla", "llama")}


def _eagle_hook(algorithm, model_path, draft_model_path, **fields):
    """(speculative_draft_model_path, speculative_draft_attention_backend) after SGLang's own
    dispatch runs its EAGLE-family server-argument hook on a real ServerArgs with `fields`."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    fields = {"speculative_draft_attention_backend": None, **fields}   # none named unless a test names one
    override, args = _mid_resolution_server_args(
        model_path=str(model_path), speculative_draft_model_path=draft_model_path and str(draft_model_path),
        speculative_algorithm=algorithm, skip_tokenizer_init=True, load_format="dummy", speculative_num_steps=3,
        speculative_eagle_topk=1, speculative_num_draft_tokens=4, **fields)
    try:
        SpeculativeAlgorithm.from_string(algorithm).handle_server_args(args)
        return args.speculative_draft_model_path, args.speculative_draft_attention_backend
    finally:
        override.restore()


@pytest.mark.parametrize("fields, head, expected", [
    ({"attention_backend": "flashinfer", "decode_attention_backend": "sm120_mla"}, "llama", "flashinfer"),
    ({"attention_backend": "flashinfer", "decode_attention_backend": "sm120_mla"}, "mla", None),
    ({"attention_backend": "sm120_mla"}, "llama", "flashinfer"),
    ({"attention_backend": "sm120_mla", "prefill_attention_backend": "flashinfer"}, "llama", "flashinfer"),
    ({"attention_backend": "sm120_mla"}, "mla", None),
    ({"attention_backend": "flashinfer", "decode_attention_backend": "sm120_mla",
      "speculative_draft_attention_backend": "triton"}, "llama", "triton"),     # named: left alone
    ({"attention_backend": "triton"}, "llama", None),
    ({"attention_backend": "flashinfer"}, "llama", None)])
def test_a_non_mla_eagle3_head_drafts_on_flashinfer_under_sm120_mla(clean_plugin_state, eagle3_heads, plugin_log,
                                                                    fields, head, expected):
    """SGLang's own EAGLE3 server-argument hook, as its dispatch calls it, with the plugin's step
    installed: a Llama head under sm120_mla, none named, gets FlashInfer, the draft backend the
    service's records and charts take as usual (service.usual_draft_backend); an MLA head, a named
    backend and other backends keep SGLang's (the decode backend)."""
    from sm120_workbook.service import usual_draft_backend

    target, heads = eagle3_heads
    assert mha_draft.install() and not mha_draft.install()
    _, resolved = _eagle_hook("EAGLE3", target, heads[head], **fields)
    assert resolved == expected
    named = fields.get("speculative_draft_attention_backend")
    decode = fields.get("decode_attention_backend") or fields["attention_backend"]
    assert (resolved or decode) == (named or usual_draft_backend("eagle3", decode, mha_eagle3_head=head == "llama"))
    said = [line for line in plugin_log if "is not MLA" in line]
    assert bool(said) == (expected == "flashinfer" and named is None)


def test_the_draft_backend_step_never_stops_a_server(clean_plugin_state, eagle3_heads, plugin_log, monkeypatch):
    """A draft config the step cannot read leaves the draft backend to SGLang, with a warning."""
    def unreadable(server_args):
        raise OSError("no config.json")

    target, heads = eagle3_heads
    mha_draft.install()
    monkeypatch.setattr(mha_draft, "draft_is_mla", unreadable)
    _, resolved = _eagle_hook("EAGLE3", target, heads["llama"], attention_backend="sm120_mla")
    assert resolved is None
    assert any("could not tell whether the draft model" in line and "no config.json" in line for line in plugin_log)


def test_an_mtp_draft_keeps_the_kernel(clean_plugin_state, tmp_path):
    """EAGLE with the model's own MTP layer (SGLang drafts from --model-path): MLA, so the step
    names nothing and the draft stays on sm120_mla's kernel."""
    from sm120_workbook.dummy_models import materialize_model

    target = materialize_model("k2_tp8_slice", layers=4, dest=tmp_path / "target", mtp_layers=1)
    mha_draft.install()
    drafted_from, resolved = _eagle_hook("EAGLE", target, None, attention_backend="flashinfer",
                                         decode_attention_backend="sm120_mla")
    assert drafted_from == str(target) and resolved is None


def test_the_tested_sglang_is_pyprojects_pin():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert f"sglang=={plugin.TESTED_SGLANG}" in extras["project"]["optional-dependencies"]["gpu"]


def test_another_sglang_is_named_in_a_warning_before_anything_is_patched(clean_plugin_state, plugin_log,
                                                                         monkeypatch):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.5.23" if name == "sglang" else real(name))
    monkeypatch.setattr(plugin, "_version_warned", False)
    monkeypatch.delenv(kv_sort.ENV_VAR, raising=False)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    plugin.load_plugin()
    plugin.load_plugin()
    warnings = [x for x in plugin_log if "SGLang 0.5.23 is installed" in x]
    assert len(warnings) == 1 and f"tested against SGLang {plugin.TESTED_SGLANG}" in warnings[0]
    assert plugin_log.index(warnings[0]) == 0 and plugin.is_registered()
    monkeypatch.setattr(metadata, "version", real)
    assert plugin.untested_sglang_warning() is None   # the installed one is the pin


def test_the_draft_name_patches_go_in_whole_or_not_at_all(clean_plugin_state, monkeypatch, plugin_log):
    """An SGLang without `_SUPPORTED_DRAFT_BACKENDS` (0.5.23) gets neither patch and a warning,
    not a patched factory beside a failure that reads as 'not installed'."""
    from sglang.srt.speculative import draft_worker_common
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    stock = DraftBackendFactory.__dict__["_create_backend"]
    monkeypatch.delattr(draft_worker_common, "_SUPPORTED_DRAFT_BACKENDS")
    with pytest.raises(AttributeError):
        plugin.install_spec_compat()
    assert DraftBackendFactory.__dict__["_create_backend"] is stock and not plugin.spec_compat_installed()
    plugin._install_spec_compat_or_warn()
    assert any("could not patch the speculative draft paths" in x for x in plugin_log)
    assert DraftBackendFactory.__dict__["_create_backend"] is stock


def test_a_kv_sort_failure_leaves_the_other_steps_and_says_so(clean_plugin_state, plugin_log, monkeypatch):
    def broken():
        raise RuntimeError("no need_sort here")

    monkeypatch.setattr(kv_sort, "install", broken)
    monkeypatch.setenv(kv_sort.ENV_VAR, "1")
    monkeypatch.setattr(sys, "argv", ["sglang", "serve", "--attention-backend", "sm120_mla"])
    plugin.load_plugin()
    assert plugin.is_registered() and mha_draft.is_installed() and plugin.spec_compat_installed()
    assert any("the KV sort override (SM120_KV_SORT) failed: RuntimeError('no need_sort here')" in x
               for x in plugin_log)
    assert any("KV sort override NOT installed although SM120_KV_SORT=1" in x for x in plugin_log)


def test_a_dflash_verify_on_the_parents_path_reads_no_capture_mask(monkeypatch):
    """SGLang's graph runner hands a DFlash capture of this backend an all-ones mask (its list of
    causal backends names TritonAttnBackend, not the subclass), which the parent binds and no
    replay refills. A non-MLA model (kernel_ops None) runs the parent's Triton path: for a DFlash
    verify it gets the metadata without the mask, and the captured metadata is left as it was; an
    EAGLE tree keeps its mask."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers.attention.triton_backend import ForwardMetadata, TritonAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy
    from sglang.srt.speculative.spec_info import SpecInputType

    from sm120_workbook.patches.backend import Sm120MlaAttnBackend

    seen = []
    monkeypatch.setattr(TritonAttnBackend, "forward_extend",
                        lambda self, *a, **kw: seen.append(self.forward_metadata.custom_mask) or "out")
    backend = object.__new__(Sm120MlaAttnBackend)
    backend.kernel_ops = None   # a non-MLA model: every phase on the parent's Triton kernels
    assert resolve_dflash_verify_mask_policy(backend)[1], "SGLang now captures this class without a mask"
    fields = {f: None for f in ForwardMetadata.__dataclass_fields__}
    captured = ForwardMetadata(**dict(fields, custom_mask=torch.ones(8, dtype=torch.bool)))
    backend.forward_metadata = captured
    dflash = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY,
                             spec_info=DFlashVerifyInput(draft_token=None, positions=None, draft_token_num=4))
    assert backend.forward_extend(None, None, None, None, dflash) == "out"
    assert seen[-1] is None and backend.forward_metadata is captured and captured.custom_mask is not None
    eagle = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY,
                            spec_info=SimpleNamespace(spec_input_type=SpecInputType.EAGLE_VERIFY))
    backend.forward_extend(None, None, None, None, eagle)
    assert seen[-1] is captured.custom_mask


def test_a_registration_failure_leaves_the_other_steps_and_says_so(clean_plugin_state, plugin_log, monkeypatch):
    """SGLang only logs a plugin's exception: an unguarded registration would skip every step after
    it. Guarded, the opt-in steps still install and the status line says what is missing."""
    def broken():
        raise RuntimeError("no attention registry here")

    monkeypatch.setattr(plugin, "register_backend", broken)
    monkeypatch.setattr(plugin, "is_registered", lambda: False)
    monkeypatch.setenv(kv_sort.ENV_VAR, "1")
    plugin.load_plugin()
    assert mha_draft.is_installed()
    assert any("registering the sm120_mla attention backend failed: RuntimeError('no attention registry here')" in x
               for x in plugin_log)
    assert any("attention backend 'sm120_mla' NOT registered (see the warning above)" in x
               and "KV sort override on (SM120_KV_SORT=1)" in x for x in plugin_log)
