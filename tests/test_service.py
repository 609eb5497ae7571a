"""Server lifecycle without a GPU: validation before launch, start-up failures, teardown of the
whole process group, and the measurement path end to end against a fake server.

The fake server is a small Python script (written to tmp_path) given to SGLangServer as its
launcher; it receives the real `sglang.launch_server` arguments and speaks the few HTTP routes
we use (loopback only). Our launch arguments themselves are checked with SGLang's own parser.
"""
from __future__ import annotations

import _thread
import dataclasses
import json
import re
import socket
import sys
import threading
import time

import pytest

from sm120_workbook import decode_bench, service
from sm120_workbook.dummy_models import materialize_draft, materialize_model
from sm120_workbook.results import load_records
from sm120_workbook.service import (PortInUseError, ServerConfig, ServerStartError, SGLangServer,
                                    launch_args, resolve_config)

FAKE_SERVER = r'''
import json, os, signal, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode = os.environ.get("FAKE_MODE", "serve")
argv = sys.argv[1:]
def arg(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default

if mode == "die":
    # A child first, so that the parent's death leaves an orphan in the group to clean up.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    for i in range(100):
        print(f"fake log line {i}", flush=True)
    sys.exit(1)
if mode == "dflash_dies" and "DFLASH" in argv:
    print("DFLASH is not supported by this fake", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    in_group = subprocess.Popen([sys.executable, "-c", code])
    escaped = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    with open(os.environ["FAKE_PIDFILE"], "w") as f:
        json.dump([os.getpid(), in_group.pid, escaped.pid], f)

model = json.load(open(os.path.join(arg("--model-path"), "config.json")))
spec = arg("--speculative-algorithm")
tp = int(arg("--tp", "1"))
recording = {"on": False, "passes": 0}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _reply(self, code=200, body=b"", ctype="text/plain"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            return self._reply(200)
        if self.path == "/server_info" and mode == "server_info_html":   # e.g. a proxy's error page
            return self._reply(200, b"<html>502 Bad Gateway</html>", "text/html")
        if self.path == "/server_info" and mode == "server_info_503":   # healthy, yet never answers it
            return self._reply(503, b"busy", "text/plain")
        if self.path == "/server_info":   # "imposter": another server's answer on our port
            backend = "imposter_backend" if mode == "imposter" else arg("--attention-backend")
            draft = arg("--speculative-draft-attention-backend")
            if spec == "DFLASH" and draft is None:   # SGLang resolves it (test_plugin holds the rule)
                from sm120_workbook.service import dflash_draft_backend
                draft = dflash_draft_backend(arg("--attention-backend"), arg("--prefill-attention-backend"))
            if spec == "EAGLE3" and draft is None:   # the plugin's step in SGLang's hook (test_plugin holds it)
                from sm120_workbook.dummy_models import EAGLE3_LLAMA_ARCH
                from sm120_workbook.service import usual_draft_backend
                head = json.load(open(os.path.join(arg("--speculative-draft-model-path"), "config.json")))
                decode = arg("--decode-attention-backend") or arg("--attention-backend")
                usual = usual_draft_backend("eagle3", decode, mha_eagle3_head=head["architectures"] == [EAGLE3_LLAMA_ARCH])
                draft = usual if usual != decode else None   # SGLang's own choice: the field stays unset
            info = {"attention_backend": backend, "model_path": arg("--model-path"), "tp_size": tp,
                    "speculative_draft_attention_backend": draft}
            return self._reply(200, json.dumps(info).encode(), "application/json")
        if self.path == "/metrics":
            return self._reply(200, b'# TYPE x counter\nsglang:spec_verify_calls_total{model_name="m"} 7\n'
                                    b'sglang:generation_tokens_total{a="1"} 5\nsglang:generation_tokens_total{a="2"} 6\n')
        self._reply(404)
    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(n) or b"{}")
        if self.path == "/generate":
            if mode == "crash_on_generate" and len(body["input_ids"]) > 32:   # after the warm-up
                print("fake CUDA error: an illegal memory access was encountered", flush=True)
                os._exit(5)
            ids, sp = body["input_ids"], body["sampling_params"]
            assert sp["ignore_eos"] is True
            new = sp["max_new_tokens"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(0.02)                     # "prefill"
            if mode == "die_mid_stream":         # one chunk, then the process is gone
                meta = {"completion_tokens": 1, "finish_reason": None}
                self.wfile.write(b"data: " + json.dumps({"output_ids": [0], "meta_info": meta}).encode() + b"\n\n")
                self.wfile.flush()
                print("fake CUDA error: an illegal memory access was encountered", flush=True)
                os._exit(6)
            if mode == "stall_on_generate":      # one chunk, then a scheduler that never answers
                meta = {"completion_tokens": 1, "finish_reason": None}
                self.wfile.write(b"data: " + json.dumps({"output_ids": [0], "meta_info": meta}).encode() + b"\n\n")
                self.wfile.flush()
                print("fake: the scheduler is stuck", flush=True)
                time.sleep(60)
                return
            if mode == "abort_on_generate":      # SGLang's abort: an ordinary chunk, not an error
                meta = {"completion_tokens": 0, "finish_reason": {"type": "abort", "message": "fake: out of KV"}}
                self.wfile.write(b"data: " + json.dumps({"output_ids": [], "meta_info": meta}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                return
            out = []
            accept = 2 if spec else 1
            for i in range(new):
                out.append(i)
                last = i == new - 1
                meta = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                        "finish_reason": {"type": "length"} if last else None}
                if last and spec:
                    meta["spec_verify_ct"] = (new + accept - 1) // accept
                    meta["spec_accept_length"] = new / meta["spec_verify_ct"]
                if recording["on"]:
                    recording["passes"] += 1
                merged = mode == "merged_first" and i < 2   # the first chunk holds 3 tokens
                if (i == 0 or i % accept == 0 or last) and not merged:
                    self.wfile.write(b"data: " + json.dumps({"output_ids": list(out), "meta_info": meta}).encode() + b"\n\n")
                    self.wfile.flush()
                time.sleep(0.001)
            self.wfile.write(b"data: [DONE]\n\n")
            return
        if self.path == "/flush_cache":
            return self._reply(200)
        if self.path == "/start_profile":   # a synthetic trace: 1 ms steps, 0.45 ms of kernels
            import gzip
            ev = []
            for s in range(body["num_steps"]):
                t = 1000.0 * s
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t, "dur": 5})
                ev.append({"ph": "X", "cat": "kernel", "name": "void sm120_mla::mla_verify_split_kernel<16>(sm120_mla::Params)", "ts": t, "dur": 100.0})
                ev.append({"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "ts": t + 100, "dur": 200.0})
                ev.append({"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": t + 300, "dur": 150.0})
            os.makedirs(body["output_dir"], exist_ok=True)
            with gzip.open(os.path.join(body["output_dir"], body["profile_id"] + "-TP-0.trace.json.gz"), "wt") as f:
                json.dump({"traceEvents": ev}, f)
            return self._reply(200)
        if self.path == "/start_expert_distribution_record":
            recording.update(on=True, passes=0)
            return self._reply(200)
        if self.path == "/stop_expert_distribution_record":
            recording["on"] = False
            return self._reply(200)
        if self.path == "/dump_expert_distribution_record":
            import torch
            L, E, k = model["num_hidden_layers"], model["n_routed_experts"], model["num_experts_per_tok"]
            # as SGLang's buffers: a circular one dumps all its rows, the unwritten ones zero
            buffer = int(arg("--expert-distribution-recorder-buffer-size", "-1"))
            count = torch.zeros(buffer if buffer > 0 else max(recording["passes"], 1), L, E, dtype=torch.int32)
            dense = model.get("first_k_dense_replace", 0)
            for p in range(recording["passes"]):
                count[p % len(count)] = 0
                for l in range(dense, L):
                    for j in range(k):
                        count[p % len(count), l, (p * 7 + j * 5 + l) % E] += tp   # all-reduced over tp ranks
            d = os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"]
            dump = {"rank": 0, "logical_count": count, "average_utilization_rate_over_window": None}
            # as SGLang: every rank of MoE EP rank 0 (every TP rank at ep_size 1) writes the same
            # all-reduced counts, and the reply may come before the other ranks' files
            files = int(os.environ.get("FAKE_DUMP_FILES", tp // int(arg("--ep-size", "1"))))
            torch.save(dump, os.path.join(d, f"expert_distribution_recorder_{time.time()}.pt"))

            def the_other_ranks():
                for _ in range(files - 1):
                    time.sleep(0.4)
                    torch.save(dump, os.path.join(d, f"expert_distribution_recorder_{time.time()}.pt"))
            threading.Thread(target=the_other_ranks).start()
            return self._reply(200)
        self._reply(404)

for w in (arg("--warmups") or "").split(","):   # as SGLang's execute_warmups logs each it runs
    if w and w not in os.environ.get("FAKE_UNKNOWN_WARMUPS", "").split(","):
        print(f"[2026-12-01 20:53:21] Running warmup {w}", flush=True)
if arg("--warmups"):
    print("[2026-12-01 20:55:36] Warmup ended", flush=True)
if os.environ.get("FAKE_ECHO_ARGS"):
    print("fake server args: " + " ".join(argv), flush=True)
    print("fake server env SM120_DFLASH_HOST_PLAN=" + os.environ.get("SM120_DFLASH_HOST_PLAN", ""), flush=True)
if os.environ.get("SM120_KV_SORT") == "1" and mode != "kv_sort_silent":
    # the plugin's own announcement, as a scheduler that built its allocator under the override logs it
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True)
    from sm120_workbook.patches import kv_sort
    kv_sort._announce_forced("TokenToKVPoolAllocator")
print("fake server listening", flush=True)
ThreadingHTTPServer((arg("--host"), int(arg("--port"))), H).serve_forever()
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return materialize_model("k2_tp8_slice", 3, dest=tmp_path_factory.mktemp("model"))


@pytest.fixture
def fake(tmp_path):
    p = tmp_path / "fake_sglang_server.py"
    p.write_text(FAKE_SERVER)
    return [sys.executable, str(p)]


def _gone(pid: int) -> bool:
    st = service._proc_stat(pid)
    return st is None or st[0] in ("Z", "X")


def _server(model_dir, fake, tmp_path, monkeypatch, mode, **kw):
    monkeypatch.setenv("FAKE_MODE", mode)
    cfg = ServerConfig(model_dir, "triton", tp=1, context_length=kw.pop("context_length", 70000),
                       **{k: kw.pop(k) for k in list(kw) if k in ServerConfig.__dataclass_fields__})
    return SGLangServer(cfg, log_path=tmp_path / "server.log", launcher=fake, progress=False, **kw)


# ---- launch arguments, checked by SGLang's own parser --------------------------------------

def test_config_flags_hold_every_flag_launch_args_emits():
    """extra_args may not set a flag a config field sets (resolve_config): CONFIG_FLAGS must name
    every one launch_args can emit, whatever the config, so its string constants are read here."""
    import ast
    import inspect

    emitted = {node.value for node in ast.walk(ast.parse(inspect.getsource(launch_args)))
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--")}
    assert emitted and emitted <= set(service.CONFIG_FLAGS), sorted(emitted - set(service.CONFIG_FLAGS))


@pytest.mark.parametrize("backend,spec,cuda_graph", [
    ("triton", "none", True), ("triton", "dflash", True), ("triton", "ngram", False),
    ("flashmla", "none", True), ("flashmla", "ngram", True), ("trtllm_mla", "ngram", True)])
def test_launch_args_parse_with_sglang(model_dir, tmp_path, backend, spec, cuda_graph, sglang_parser):
    draft = materialize_draft(model_dir, 16, dest=tmp_path / "draft") if spec == "dflash" else None
    cfg = resolve_config(ServerConfig(model_dir, backend, tp=1, context_length=70000, spec=spec,
                                      draft_model_path=draft, cuda_graph=cuda_graph,
                                      expert_record_buffer=300 if spec == "dflash" else -1))
    ns = sglang_parser.parse_args(launch_args(cfg))
    assert ns.load_format == "dummy" and ns.skip_tokenizer_init and ns.enable_metrics
    assert ns.attention_backend == backend and ns.tp_size == 1 and ns.context_length == 70000
    assert ns.expert_distribution_recorder_mode == "stat"
    assert ns.expert_distribution_recorder_buffer_size == (300 if spec == "dflash" else -1)
    assert ns.speculative_algorithm == {"none": None, "dflash": "DFLASH", "ngram": "NGRAM"}[spec]
    if backend in ("flashmla", "trtllm_mla"):   # the page size SGLang would force, named up front
        assert ns.page_size == 64
        if spec == "ngram":  # SGLang refuses NGRAM trees on paged non-flashinfer backends
            assert ns.speculative_ngram_max_bfs_breadth == 1
    if spec == "dflash":
        # SGLang's choice (service.dflash_draft_backend) unless named, resolved or not
        assert ns.speculative_num_draft_tokens == 16 and ns.speculative_draft_attention_backend is None
        assert "--speculative-draft-attention-backend" not in launch_args(
            dataclasses.replace(cfg, draft_attention_backend=None))
        named = launch_args(dataclasses.replace(cfg, draft_attention_backend="flashinfer"))
        assert named[named.index("--speculative-draft-attention-backend") + 1] == "flashinfer"
    assert (ns.cuda_graph_backend_decode == "disabled") == (not cuda_graph)


def test_eagle_launches_the_models_mtp_layer_and_parses_with_sglang(tmp_path, sglang_parser):
    """EAGLE drafts with the model's own MTP layer: the config must carry one; SGLang's parser
    reads the chain's steps, topk and verified tokens; the draft backend is SGLang's choice unless
    given; the recorder needs a circular buffer, as DFlash's does."""
    mtp = materialize_model("k2_tp8_slice", 3, dest=tmp_path / "mtp", mtp_layers=1)
    assert json.loads((mtp / "config.json").read_text())["num_nextn_predict_layers"] == 1
    cfg = resolve_config(ServerConfig(mtp, "triton", tp=1, spec="eagle", expert_record_buffer=200))
    ns = sglang_parser.parse_args(launch_args(cfg))
    assert ns.speculative_algorithm == "EAGLE" and ns.speculative_draft_model_path is None
    assert (ns.speculative_num_steps, ns.speculative_eagle_topk, ns.speculative_num_draft_tokens) == (3, 1, 4)
    assert ns.speculative_draft_attention_backend is None
    ns = sglang_parser.parse_args(launch_args(resolve_config(ServerConfig(
        mtp, "triton", tp=1, spec="eagle", eagle_steps=5, expert_record=False, draft_attention_backend="triton"))))
    assert (ns.speculative_num_steps, ns.speculative_num_draft_tokens) == (5, 6)
    assert ns.speculative_draft_attention_backend == "triton"

    plain = materialize_model("k2_tp8_slice", 3, dest=tmp_path / "plain")   # K2's own config: no MTP layer
    for kw, message in [
        (dict(model_path=plain), "^model_path: EAGLE here drafts with the model's own MTP layer"),
        (dict(draft_model_path=tmp_path), "^draft_model_path: EAGLE drafts with the model's own MTP layer"),
        (dict(num_draft_tokens=3), "^num_draft_tokens: a chain of 3 EAGLE steps verifies 4 tokens, got 3"),
        (dict(eagle_topk=4), r"^num_draft_tokens: an EAGLE tree \(eagle_topk 4\) needs it given"),
        (dict(eagle_steps=0), "^eagle_steps: must be a positive int, got 0"),
        (dict(draft_attention_backend="tritn"), "^draft_attention_backend: 'tritn' is not an attention backend"),
        (dict(expert_record_buffer=-1), "^expert_record_buffer: SGLang 0.5.17's expert recorder with an unbounded"),
        (dict(eagle_topk=2, num_draft_tokens="8"), "^num_draft_tokens: must be an int >= 2, got '8'"),
        (dict(attention_backend="sm120_mla", eagle_steps=16),
         "^num_draft_tokens: 17 exceed the sm120_mla kernel's 16 queries per request"),
    ]:
        args = {"model_path": mtp, "attention_backend": "triton", "tp": 1, "spec": "eagle",
                "expert_record_buffer": 200, **kw}
        with pytest.raises(ValueError, match=message):
            resolve_config(ServerConfig(**args))


def test_eagle3_launches_its_draft_folder_and_parses_with_sglang(tmp_path, sglang_parser):
    """EAGLE3 drafts with a head of its own (an MLA one for Kimi K2.x) on the model as it is: the
    draft folder must exist and hold an EAGLE3 architecture; the chain's steps, topk and verified
    tokens reach SGLang's parser as EAGLE's do."""
    from sm120_workbook.dummy_models import materialize_eagle3_draft

    plain = materialize_model("k2_tp8_slice", 3, dest=tmp_path / "plain")
    head = materialize_eagle3_draft(plain, dest=tmp_path / "head")
    cfg = resolve_config(ServerConfig(plain, "triton", tp=1, spec="eagle3", draft_model_path=head,
                                      expert_record_buffer=200))
    ns = sglang_parser.parse_args(launch_args(cfg))
    assert ns.speculative_algorithm == "EAGLE3" and ns.speculative_draft_model_path == str(head)
    assert (ns.speculative_num_steps, ns.speculative_eagle_topk, ns.speculative_num_draft_tokens) == (3, 1, 4)
    assert ns.speculative_draft_attention_backend is None   # SGLang's choice (sm120_mla: the kernel)
    llama = materialize_eagle3_draft(plain, dest=tmp_path / "llama", head="llama")
    ns = sglang_parser.parse_args(launch_args(resolve_config(ServerConfig(plain, "triton", tp=1, spec="eagle3",
                                                                          draft_model_path=llama,
                                                                          expert_record_buffer=200))))
    assert ns.speculative_draft_model_path == str(llama) and ns.speculative_algorithm == "EAGLE3"
    assert ns.speculative_draft_attention_backend is None   # SGLang's own backend: its choice
    # the launcher names a draft backend only where one is given: under sm120_mla a Llama head's is
    # the plugin's step in SGLang's hook (patches.mha_draft, test_plugin), so /server_info says which ran
    for kw, want in [(dict(attention_backend="sm120_mla"), None),
                     (dict(attention_backend="sm120_mla", prefill_attention_backend="flashinfer",
                           prefill_as_base=True), None),
                     (dict(attention_backend="sm120_mla", draft_attention_backend="triton"), "triton"),
                     (dict(attention_backend="sm120_mla", draft_model_path=head), None)]:
        args = {"model_path": plain, "tp": 1, "spec": "eagle3", "draft_model_path": llama,
                "expert_record_buffer": 200, **kw}
        a = launch_args(resolve_config(ServerConfig(**args)))
        named = a[a.index("--speculative-draft-attention-backend") + 1] \
            if "--speculative-draft-attention-backend" in a else None
        assert named == want, kw
    dflash = materialize_draft(plain, block_size=4, dest=tmp_path / "dflash")
    four = materialize_model("k2_tp8_slice", 4, dest=tmp_path / "four")   # SGLang's layers [2, 2, 1]
    tree = resolve_config(ServerConfig(plain, "flashmla", prefill_attention_backend="triton", prefill_as_base=True,
                                       tp=1, spec="eagle3", draft_model_path=head, eagle_topk=4,
                                       num_draft_tokens=8, expert_record=False))
    assert tree.page_size == 64   # a tree on pages passes with triton as --attention-backend
    for kw, message in [
        (dict(draft_model_path=None), "^draft_model_path: EAGLE3 needs a draft model folder"),
        (dict(draft_model_path=tmp_path / "none"), "^draft_model_path: .*config.json does not exist"),
        (dict(draft_model_path=dflash), "^draft_model_path: an EAGLE3 draft has an architecture in"),
        (dict(num_draft_tokens=3), "^num_draft_tokens: a chain of 3 EAGLE steps verifies 4 tokens, got 3"),
        (dict(expert_record_buffer=-1), "^expert_record_buffer: .*; EAGLE3's draft passes go through the recorder"),
        (dict(attention_backend="sm120_mla", eagle_steps=16),
         "^num_draft_tokens: 17 exceed the sm120_mla kernel's 16 queries per request"),
        (dict(model_path=four), r"^layers: an EAGLE3 head reads target layers .* L = 4 gives \[2, 2, 1\]"),
        (dict(eagle_steps=1, eagle_topk=2, num_draft_tokens=8),
         "^num_draft_tokens: 1 EAGLE steps at topk 2 offer 2 draft tokens, fewer than the 7"),
        (dict(attention_backend="flashmla", eagle_topk=4, num_draft_tokens=8),
         r"^eagle_topk: SGLang 0.5.17 runs an EAGLE tree on pages of 64 tokens only with \('flashinfer'"),
    ]:
        args = {"model_path": plain, "attention_backend": "triton", "tp": 1, "spec": "eagle3",
                "draft_model_path": head, "expert_record_buffer": 200, **kw}
        with pytest.raises(ValueError, match=message):
            resolve_config(ServerConfig(**args))


def test_a_prefill_backend_beside_the_decode_one_parses_with_sglang(model_dir, sglang_parser):
    """A prefill on another backend: SGLang's hybrid backend, with target-verify kept on the
    decode side (--speculative-attention-mode decode), as the H200 ran sm120_mla with flashinfer."""
    cfg = resolve_config(ServerConfig(model_dir, "triton", prefill_attention_backend="flashinfer", tp=1,
                                      context_length=70000, spec="ngram"))
    ns = sglang_parser.parse_args(launch_args(cfg))
    assert ns.attention_backend == "triton" and ns.prefill_attention_backend == "flashinfer"
    assert ns.speculative_attention_mode == "decode" and ns.decode_attention_backend is None
    assert "--prefill-attention-backend" not in launch_args(resolve_config(ServerConfig(model_dir, "triton", tp=1)))
    # one KV pool serves both: a paged prefill backend sets the page size SGLang would force
    assert resolve_config(ServerConfig(model_dir, "triton", prefill_attention_backend="trtllm_mla",
                                       tp=1)).page_size == 64
    with pytest.raises(ValueError, match="^prefill_attention_backend: 'flashinfr' is not an attention backend"):
        resolve_config(ServerConfig(model_dir, "triton", prefill_attention_backend="flashinfr", tp=1))


def test_the_hybrid_spelt_prefill_first_resolves_to_the_same_backends(model_dir, sglang_parser):
    """prefill_as_base: --attention-backend PREFILL --decode-attention-backend BACKEND. SGLang's
    own resolution (attention_backends_of) gives the same pair as the other spelling; the base
    differs, which is what SGLang's chunked prefix cache gate reads."""
    from sglang.srt.arg_groups.overrides import attention_backends_of

    spelt = {}
    for as_base in (False, True):
        cfg = resolve_config(ServerConfig(model_dir, "triton", prefill_attention_backend="flashinfer",
                                          prefill_as_base=as_base, tp=1, spec="ngram"))
        ns = sglang_parser.parse_args(launch_args(cfg))
        assert ns.speculative_attention_mode == "decode"
        assert ns.attention_backend == cfg.base_attention_backend() == ("flashinfer" if as_base else "triton")
        spelt[as_base] = attention_backends_of(ns)
    assert spelt[False] == spelt[True] == ("flashinfer", "triton")
    with pytest.raises(ValueError, match="^prefill_as_base: needs a prefill_attention_backend"):
        resolve_config(ServerConfig(model_dir, "triton", prefill_as_base=True, tp=1))


# ---- errors before launch ------------------------------------------------------------------

def test_port_in_use_is_named_and_nothing_launches(model_dir, fake, tmp_path, monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        srv = _server(model_dir, fake, tmp_path, monkeypatch, "serve", port=port)
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            srv.start()
        assert srv.proc is None


def test_unknown_backend_is_refused_before_launch(model_dir, fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "serve")
    srv = SGLangServer(ServerConfig(model_dir, "no_such_backend", tp=1), launcher=fake, progress=False)
    with pytest.raises(ValueError, match="attention_backend: 'no_such_backend'.*triton"):
        srv.start()
    assert srv.proc is None
    assert "sm120_mla" in service.attention_backend_choices()
    assert "flashmla" in service.attention_backend_choices()


def test_context_longer_than_the_model_is_refused(model_dir, fake, tmp_path, monkeypatch):
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "serve", context_length=262145)
    with pytest.raises(ValueError, match="context_length: 262145 is longer than the model allows .262144"):
        srv.start()
    assert srv.proc is None


def test_dflash_draft_must_match_target(model_dir, tmp_path):
    other = materialize_model("k2_tp8_slice", 5, dest=tmp_path / "other")
    draft = materialize_draft(other, 16, dest=tmp_path / "draft")
    with pytest.raises(ValueError, match="draft expects 5 target layers, the model has 3"):
        resolve_config(ServerConfig(model_dir, "triton", tp=1, spec="dflash", draft_model_path=draft))
    draft = materialize_draft(model_dir, 16, dest=tmp_path / "draft3")
    with pytest.raises(ValueError, match="num_draft_tokens: 8 differs"):
        resolve_config(ServerConfig(model_dir, "triton", tp=1, spec="dflash", draft_model_path=draft,
                                    num_draft_tokens=8))


def _dflash_record(monkeypatch, buffer: int, draft_first: bool, passes: int = 300) -> dict:
    """SGLang's own stat-mode recorder (CPU) through `passes` forward passes that alternate as
    DFlashWorkerV2 runs them: the draft's under inference_mode with no MoE layer, the target's
    under no_grad routing 2 tokens (top-2) in each of 2 layers. Returns the dump."""
    import types

    import torch
    from sglang.srt.eplb import expert_distribution as ed

    monkeypatch.setattr(ed, "get_device", lambda: "cpu")          # SGLang asks for an accelerator
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: None)   # one rank
    args = types.SimpleNamespace(expert_distribution_recorder_mode="stat", moe_a2a_backend="none",
                                 expert_distribution_recorder_buffer_size=buffer, device="cpu",
                                 enable_expert_distribution_metrics=False)
    meta = types.SimpleNamespace(num_layers=2, num_physical_experts=4, num_logical_experts=4,
                                 num_local_physical_experts=4, ep_size=1,
                                 physical_to_logical_map=torch.arange(4).repeat(2, 1))
    rec = ed._ExpertDistributionRecorderReal(args, meta, rank=0)
    rec.start_record()
    with torch.no_grad():
        for i in range(passes):
            draft = (i % 2 == 0) == draft_first
            with (torch.inference_mode() if draft else torch.no_grad()), rec.with_forward_pass(i, None):
                for layer in range(0 if draft else 2):
                    with rec.with_current_layer(layer):
                        rec.on_select_experts(torch.tensor([[0, 1], [1, 3]]))
    rec.stop_record()
    return {"logical_count": rec.dump_record("object")["logical_count"].numpy()}


def test_sglangs_unbounded_recorder_buffer_grows_in_the_mode_of_the_pass_that_fills_it(monkeypatch):
    """Why DFlash servers record into a circular buffer (service.DFLASH_RECORDER_CRASH), with
    SGLang's own recorder: every ModelRunner forward, the draft's included, goes through the one
    global recorder; DFlashWorkerV2 runs the draft's under inference_mode; and the unbounded buffer
    grown in such a pass cannot be written by the target's next (no_grad) one. Whether a draft's
    pass is the one that fills it (the 129th, 257th, ...) depends on the passes before: with the
    target's passes there it runs. A circular buffer is allocated at start-up and never grown.
    When SGLang changes any of this, this fails: then look again."""
    import inspect

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sm120_workbook.expert_balance import routed_passes

    assert "get_global_expert_distribution_recorder().with_forward_pass(" in inspect.getsource(ModelRunner.forward)
    assert " ".join("""with torch.inference_mode():
            draft_out = self.draft_model_runner.forward(forward_batch)""".split()) in " ".join(
        inspect.getsource(DFlashWorkerV2).split())

    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        _dflash_record(monkeypatch, -1, draft_first=True)       # grown at the 129th pass, a draft's
    assert routed_passes(_dflash_record(monkeypatch, -1, draft_first=False)) == 150
    for draft_first in (True, False):
        dump = _dflash_record(monkeypatch, 400, draft_first)
        assert dump["logical_count"].shape == (400, 2, 4)        # every row, the unwritten ones zero
        assert routed_passes(dump) == 150                        # the target's passes alone
        assert dump["logical_count"].sum(axis=0).tolist() == [[150, 300, 0, 150]] * 2


def test_dflash_with_the_unbounded_expert_recorder_buffer_is_refused(model_dir, tmp_path):
    """SGLang 0.5.17's recorder with an unbounded buffer stopped every 16-layer DFlash server (H200,
    session 32); a circular buffer or no recorder is let through."""
    draft = materialize_draft(model_dir, 16, dest=tmp_path / "draft")
    with pytest.raises(ValueError, match="^expert_record_buffer: SGLang 0.5.17's expert recorder with an unbounded buffer .expert_record_buffer -1. can stop a DFlash server"):
        resolve_config(ServerConfig(model_dir, "triton", tp=1, spec="dflash", draft_model_path=draft))
    cfg = resolve_config(ServerConfig(model_dir, "triton", tp=1, spec="dflash", draft_model_path=draft,
                                      expert_record=False))
    assert "--expert-distribution-recorder-mode" not in launch_args(cfg)
    cfg = resolve_config(ServerConfig(model_dir, "triton", tp=1, spec="dflash", draft_model_path=draft,
                                      expert_record_buffer=300))
    args = launch_args(cfg)
    assert args[args.index("--expert-distribution-recorder-buffer-size") + 1] == "300"


def test_a_numpy_integer_expert_record_buffer_is_taken(model_dir):
    import numpy as np

    cfg = resolve_config(ServerConfig(model_dir, "triton", tp=1, expert_record_buffer=np.int64(300)))
    assert type(cfg.expert_record_buffer) is int and cfg.expert_record_buffer == 300


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "300"])
def test_the_expert_record_buffer_is_minus_one_or_a_positive_count(model_dir, bad):
    with pytest.raises(ValueError, match=f"^expert_record_buffer: -1 .unbounded. or a positive number of forward passes, got {re.escape(repr(bad))}"):
        resolve_config(ServerConfig(model_dir, "triton", tp=1, expert_record_buffer=bad))


def test_tp_must_divide_heads_and_all_gpus_needs_a_gpu(model_dir):
    with pytest.raises(ValueError, match="tp: 3 does not divide num_attention_heads=8"):
        resolve_config(ServerConfig(model_dir, "triton", tp=3))
    with pytest.raises(ValueError, match="tp: must be -1"):
        service.resolve_tp(0)
    if service.visible_gpu_count() == 0:
        with pytest.raises(service.ServerError, match="no CUDA GPU is visible"):
            resolve_config(ServerConfig(model_dir, "triton"))  # tp defaults to -1: every visible GPU


@pytest.mark.parametrize("kw, match", [
    (dict(port=70000), "port: must be an int in 1..65535, got 70000"),
    (dict(port=-1), "port: must be an int in 1..65535, got -1"),
    (dict(port="abc"), "port: must be an int in 1..65535, got 'abc'"),
    (dict(port=0), "port: must be an int in 1..65535, got 0"),       # the OS's choice: /health on the wrong port
    (dict(port=True), "port: must be an int in 1..65535, got True"),
    (dict(page_size=0), "page_size: must be a positive int, got 0"),
    (dict(page_size=-3), "page_size: must be a positive int, got -3"),
    (dict(cuda_graph_max_bs=0), "cuda_graph_max_bs: must be a positive int, got 0"),
    (dict(context_length=4096.5), "context_length: must be a positive int, got 4096.5"),
    (dict(context_length=0), "context_length: must be a positive int, got 0"),
    (dict(tp=True), "tp: must be -1 .all visible GPUs. or a positive int, got True"),
    (dict(spec="ngram", num_draft_tokens=1), "num_draft_tokens: must be an int >= 2, got 1"),
    (dict(spec="ngram", ngram_max_bfs_breadth=0), "ngram_max_bfs_breadth: must be a positive int, got 0"),
    (dict(extra_args="--disable-radix-cache"), "extra_args: a list or tuple of str, one launch argument each"),
    (dict(extra_args=["--max-running-requests", 4]), "extra_args: a list or tuple of str"),
    # SGLang's parser keeps the last: the server would run on another port than the one checked
    (dict(extra_args=["--port", "40000", "--tp=2"]),
     r"extra_args: sets \['port', 'tp_size'\], which the config's own fields set"),
    # as SGLang's parser reads them: an alias, and an abbreviation of a flag this config leaves out
    (dict(extra_args=["--tensor-parallel-size", "2"]), r"extra_args: sets \['tp_size'\]"),
    (dict(extra_args=["--page", "64"]), r"extra_args: sets \['page_size'\]"),
    (dict(extra_args=["--attention-backend", "nope"]), r"extra_args: SGLang's parser refuses .*invalid choice: 'nope'"),
])
def test_resolve_config_refuses_a_value_of_the_wrong_type_or_range(model_dir, kw, match):
    with pytest.raises(ValueError, match="^" + match):
        resolve_config(ServerConfig(model_dir, "triton", **{"tp": 1, **kw}))


def test_resolve_config_takes_extra_args_as_a_list_and_a_port_at_the_ends(model_dir):
    for port in (1, 65535):
        cfg = resolve_config(ServerConfig(model_dir, "triton", tp=1, port=port, extra_args=["--disable-radix-cache"]))
        assert cfg.port == port and cfg.extra_args == ("--disable-radix-cache",)
        assert launch_args(cfg)[-1] == "--disable-radix-cache"


def test_port_zero_is_refused_unvalidated_too(model_dir, fake, tmp_path, monkeypatch):
    """validate=False skips resolve_config; the port is checked beside its free-port check, which
    port 0 (a port of the OS's choosing) would pass."""
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "serve", port=0, validate=False, startup_timeout_s=5)
    with pytest.raises(ValueError, match="^port: must be an int in 1..65535, got 0"):
        srv.start()
    assert srv.proc is None


def test_tp_above_the_visible_gpus_is_refused_before_sglang_launches(model_dir, tmp_path, monkeypatch):
    """With SGLang's own launcher tp is checked against the GPUs torch counts (none on this
    machine: no launch can work), and not where torch cannot count them. A custom launcher (the
    tests' fake server) is not checked: its needs are its own."""
    monkeypatch.setattr(service, "known_gpu_count", lambda: 0)
    srv = SGLangServer(ServerConfig(model_dir, "triton", tp=1), log_path=tmp_path / "s.log", progress=False)
    with pytest.raises(ValueError, match="^tp: 1 needs 1 GPU, and no CUDA GPU is visible here"):
        srv.start()
    assert srv.proc is None and not (tmp_path / "s.log").exists()
    monkeypatch.setattr(service, "known_gpu_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError,
                       match=r"^tp: 2 needs 2 GPUs, and only 1 is visible here \(CUDA_VISIBLE_DEVICES='3'\)"):
        service.check_tp_visible(2)
    service.check_tp_visible(1)
    monkeypatch.setattr(service, "known_gpu_count", lambda: None)   # no torch: unknown, not checked
    service.check_tp_visible(8)


# ---- start-up failures and teardown ----------------------------------------------------------

def test_server_dying_during_start_reports_log_tail(model_dir, fake, tmp_path, monkeypatch):
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "die")
    with pytest.raises(ServerStartError) as ei:
        srv.start()
    msg = str(ei.value)
    assert "exited with code 1 during start-up" in msg and str(srv.log_path) in msg
    assert "fake log line 99" in msg and "fake log line 40" in msg
    assert "fake log line 39\n" not in msg  # only the last 60 lines
    assert service.live_group_members(srv.pid) == []  # the orphaned child went too


def test_another_server_on_the_port_is_refused(model_dir, fake, tmp_path, monkeypatch):
    """Healthy, but /server_info names another backend: not ours, so the start fails and ours stops."""
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "imposter", grace_s=2)
    with pytest.raises(ServerStartError, match="answered by another SGLang server .*imposter_backend"):
        srv.start()
    assert srv.pid is not None and _gone(srv.pid)


def test_another_server_with_our_settings_on_the_port_is_refused(model_dir, fake, tmp_path, monkeypatch):
    """A server with the same backend, model and tp that takes the port while ours loads (SGLang
    binds it only once the model is in) answers /health and /server_info as ours would: the
    listening process is not in our process tree, so the start fails and ours stops."""
    with _server(model_dir, fake, tmp_path / "other", monkeypatch, "serve", grace_s=2) as other:
        assert service.port_listeners(other.config.port) == {other.pid}
        monkeypatch.setattr(service, "check_port_free", lambda port, host: None)   # the race, forced
        monkeypatch.setenv("FAKE_MODE", "hang")   # ours: still loading, never binds
        ours = SGLangServer(dataclasses.replace(other.config), log_path=tmp_path / "ours.log",
                            launcher=fake, progress=False, grace_s=2)
        with pytest.raises(ServerStartError, match=r"answered by another SGLang server \(listening process "
                                                   r"\[%d\], ours \d+\)" % other.pid):
            ours.start()
        assert _gone(ours.pid) and other.running


def test_a_healthy_server_whose_server_info_is_not_json_fails_to_start_at_once(model_dir, fake, tmp_path, monkeypatch):
    """requests' JSONDecodeError is a RequestException, which the wait for /health retries: the
    start used to wait out its whole timeout and report the server "not healthy"."""
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "server_info_html", startup_timeout_s=20, grace_s=2)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"^/server_info on port \d+: HTTP 200, not SGLang's JSON object "
                                               r"\(text/html: '<html>502 Bad Gateway</html>'\)") as ei:
        srv.start()
    assert time.monotonic() - t0 < 15
    assert "fake server listening" in ei.value.log_tail and "fake server listening" in str(ei.value)
    assert ei.value.log_path == srv.log_path and _gone(srv.pid)


def test_a_healthy_server_whose_server_info_keeps_failing_fails_to_start_soon(model_dir, fake, tmp_path, monkeypatch):
    """An HTTP error from /server_info after /health said ready is retried a few times, then is
    the start's failure, named: not a wait to the start-up timeout that ends "not healthy"."""
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "server_info_503", startup_timeout_s=60, grace_s=2)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"^/server_info on port \d+: HTTP 503"):
        srv.start()
    assert time.monotonic() - t0 < 30 and _gone(srv.pid)


def test_a_missing_launcher_is_a_start_failure(model_dir, tmp_path, monkeypatch):
    """Popen's OSError is a ServerStartError, so run_matrix records start_failed (and DFlash's
    fallback runs) instead of run_failed."""
    missing = str(tmp_path / "no_such_python")
    srv = SGLangServer(ServerConfig(model_dir, "triton", tp=1), log_path=tmp_path / "s.log", launcher=[missing],
                       progress=False)
    with pytest.raises(ServerStartError, match=f"^launcher: cannot run '{re.escape(missing)}' .No such file"):
        srv.start()
    assert srv.proc is None and srv._log_file is None
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                  spec=["dflash"], draft_tokens=4, decode_tokens=12, tp=1, nvml=False,
                                  expert=False, progress=False, launcher=[missing], log_dir=tmp_path / "logs",
                                  log=lambda s: None)
    assert [(f["spec"], f["status"]) for f in res.failures] == [("dflash", "start_failed"), ("ngram", "start_failed")]
    assert all(f["error"].startswith("launcher: cannot run") for f in res.failures)


def test_never_healthy_times_out_and_leaves_nothing(model_dir, fake, tmp_path, monkeypatch):
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "hang", startup_timeout_s=2, grace_s=2)
    with pytest.raises(ServerStartError, match="not healthy after 2 s"):
        srv.start()
    assert _gone(srv.pid)


def test_keyboard_interrupt_during_start_tears_down(model_dir, fake, tmp_path, monkeypatch):
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "hang", grace_s=2)
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with srv:
                pytest.fail("never healthy, so the block must not run")
    finally:
        timer.cancel()
    assert srv.pid is not None and _gone(srv.pid)


def test_an_interrupted_stop_kills_the_group_and_closes_the_log(model_dir, fake, tmp_path, monkeypatch):
    """A KeyboardInterrupt while stop() waits out the grace period: the group is killed at once,
    and the log file is closed too (it was left open when the interrupt skipped the close)."""
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "serve", grace_s=2).start()

    def interrupted(pid, grace_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(service, "terminate_process_group", interrupted)
    with pytest.raises(KeyboardInterrupt):
        srv.stop()
    assert srv.proc is None and srv._log_file is None and _gone(srv.pid)


def test_server_timing_arguments_are_checked_before_a_launch(model_dir, fake, tmp_path, monkeypatch):
    for name, bad in (("startup_timeout_s", float("nan")), ("startup_timeout_s", -5), ("stall_timeout_s", 0),
                      ("grace_s", None)):
        with pytest.raises(ValueError, match=f"^{name}: must be a positive number, got {bad!r}"):
            _server(model_dir, fake, tmp_path, monkeypatch, "serve", **{name: bad})
    assert not (tmp_path / "server.log").exists()


def test_teardown_kills_the_whole_group_even_when_sigterm_is_ignored(model_dir, fake, tmp_path, monkeypatch):
    pidfile = tmp_path / "pids.json"
    monkeypatch.setenv("FAKE_PIDFILE", str(pidfile))
    srv = _server(model_dir, fake, tmp_path, monkeypatch, "stubborn", grace_s=1)
    with pytest.raises(RuntimeError, match="boom"):
        with srv:
            pids = json.loads(pidfile.read_text())
            assert all(not _gone(p) for p in pids)
            raise RuntimeError("boom")
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), [service._proc_stat(p) for p in pids]


def test_server_dies_with_a_killed_parent(model_dir, fake, tmp_path):
    """A Jupyter kernel SIGKILLed outright runs no finalizer: PR_SET_PDEATHSIG covers it."""
    import os
    import signal
    import subprocess

    parent = tmp_path / "parent.py"
    parent.write_text(
        "import sys, time\n"
        "from sm120_workbook.service import SGLangServer, ServerConfig\n"
        f"srv = SGLangServer(ServerConfig({str(model_dir)!r}, 'triton', tp=1), log_path={str(tmp_path / 'p.log')!r},\n"
        f"                   launcher={fake!r}, progress=False, validate=False).start()\n"
        "print(srv.pid, flush=True)\n"
        "time.sleep(600)\n")
    env = {**os.environ, "FAKE_MODE": "serve"}
    p = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        server_pid = int(p.stdout.readline())
        assert not _gone(server_pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(server_pid)
    finally:
        if p.poll() is None:
            p.kill()
        if "server_pid" in locals() and not _gone(server_pid):  # the mechanism failed: clean up
            os.kill(server_pid, signal.SIGKILL)


# ---- talking to a server ------------------------------------------------------------------

def test_generate_metrics_and_expert_dump(model_dir, fake, tmp_path, monkeypatch):
    from sm120_workbook.expert_balance import expert_counts, load_expert_dump

    with _server(model_dir, fake, tmp_path, monkeypatch, "serve", spec="ngram") as srv:
        assert srv.running
        with pytest.raises(ValueError, match="exceed the server's context_length 70000"):
            srv.generate([1] * 69990, 20)
        srv.start_expert_record()
        res = srv.generate(list(range(100, 164)), 9)
        srv.stop_expert_record()
        paths = srv.dump_expert_record()
        dump = load_expert_dump(paths[0])
        m = srv.metrics()
    assert len(paths) == 1
    assert not srv.running
    assert res.completion_tokens == 9 and res.meta_info["spec_verify_ct"] == 5
    assert 0 < res.ttft_s < res.latency_s
    stats = decode_bench.decode_stats(res.completion_tokens, res.ttft_s, res.latency_s, res.meta_info, "ngram")
    assert stats["accept_len"] == pytest.approx(9 / 5)
    assert stats["verify_step_ms"] == pytest.approx(1e3 * (res.latency_s - res.ttft_s) / 5)
    assert m["sglang:generation_tokens_total"] == 11 and m["sglang:spec_verify_calls_total"] == 7
    counts = expert_counts(dump)
    assert counts.shape == (3, 384) and counts[0].sum() == 0 and counts[1].sum() == 9 * 8


def test_every_ranks_expert_dump_file_is_read_and_deleted(model_dir, fake, tmp_path, monkeypatch):
    """SGLang's stat-mode dump is written by every rank of MoE EP rank 0, which under TP at ep_size
    1 is every TP rank (tp // ep_size files of the same counts), some after the HTTP reply: all
    are waited for, compared, and deleted, so none piles up or is read half written."""
    monkeypatch.setenv("FAKE_DUMP_FILES", "3")
    with _server(model_dir, fake, tmp_path, monkeypatch, "serve", spec="ngram") as srv:
        srv.start_expert_record()
        srv.generate(list(range(100, 164)), 9)
        srv.stop_expert_record()
        ex = decode_bench._expert_record(srv, 3)   # asks for tp // ep_size = 3 files
        left = list(srv.expert_dump_dir.glob(service.EXPERT_DUMP_GLOB))
    assert ex["dump_files"] == 3 and ex["forward_passes"] == 9 and left == []


def test_an_expert_dump_with_a_rank_missing_is_an_error_and_leaves_no_file(model_dir, fake, tmp_path, monkeypatch):
    """Fewer files than the ranks that write them: a late one would be read as the next dump's."""
    monkeypatch.setenv("FAKE_DUMP_FILES", "1")
    with _server(model_dir, fake, tmp_path, monkeypatch, "serve", spec="ngram") as srv:
        srv.start_expert_record()
        srv.generate(list(range(100, 164)), 9)
        srv.stop_expert_record()
        with pytest.raises(service.ServerError, match=r"^expert distribution dump: 1 of 2 files in "):
            srv.dump_expert_record(expected=2, timeout_s=1.5)
        assert list(srv.expert_dump_dir.glob(service.EXPERT_DUMP_GLOB)) == []


def test_a_response_for_another_prompt_length_is_refused(monkeypatch):
    """The point is named for the context sent: a server that took another length (a truncation)
    must not be recorded under it."""
    class Res:
        completion_tokens, ttft_s, latency_s, first_chunk_tokens = 8, 0.5, 1.0, 1
        meta_info = {"finish_reason": {"type": "length"}, "prompt_tokens": 4000, "spec_verify_ct": 4}

    class Server:
        config = type("C", (), {"spec": "ngram", "enable_metrics": False})()

        def flush_cache(self):
            pass

        def generate(self, ids, n):
            return Res()

    with pytest.raises(service.ServerError, match=r"^/generate took 4000 prompt tokens, not the 4096 sent"):
        decode_bench.measure_decode(Server(), 4096, 8, 1000, 0)


def test_a_recorder_that_did_not_start_leaves_no_empty_expert_record(monkeypatch):
    """A failed /start_expert_distribution_record used to be swallowed: the dump of the idle
    recorder then made a record of zero passes. Now the point says why and claims no recorder."""
    class Server:
        def start_expert_record(self):
            raise service.ServerError("HTTP 500")

        def dump_expert_record(self, expected=1):
            raise AssertionError("an idle recorder was dumped")

    monkeypatch.setattr(decode_bench, "measure_decode", lambda *a: {"tok_s": 1.0})
    row, nv, ex = decode_bench._measure_point(Server(), 4096, 8, {"vocab_size": 100}, 0, False, 0.2, True, 1)
    # expert_record stays the server's flag: its hook runs in every captured graph, started or not
    assert ex is None and row["expert_recording"] is False and "expert_record" not in row
    assert row["expert_error"].startswith("start_expert_distribution_record: ServerError('HTTP 500'")


def test_an_expert_dump_without_a_routed_pass_is_refused(tmp_path):
    import numpy as np

    with pytest.raises(ValueError, match="no forward pass that routed a token"):
        decode_bench._expert_record(_DumpServer(np.zeros((4, 3, 8), dtype=np.int32), tmp_path), 1)
    assert not list(tmp_path.glob("*.pt"))   # deleted all the same


def test_the_nvml_sampler_is_given_the_servers_gpus(monkeypatch):
    """An idle GPU beside the server's would read as imbalance: the sampler gets the CUDA indices
    SGLang placed the ranks on (base_gpu_id + i x gpu_id_step)."""
    from sm120_workbook import nvml_sampler

    given = []

    class Sampler:
        rows, failure, errors, THREAD_ERRORS = [], None, {}, ()
        measured_interval_s = None

        def __init__(self, interval_s, gpus=None):
            given.append(gpus)

        def start(self):
            return self

        def stop(self):
            pass

    class Server:
        server_info = {"base_gpu_id": 2, "gpu_id_step": 1}

    monkeypatch.setattr(nvml_sampler, "NvmlSampler", Sampler)
    monkeypatch.setattr(decode_bench, "measure_decode", lambda *a: {"tok_s": 1.0})
    decode_bench._measure_point(Server(), 4096, 8, {"vocab_size": 100}, 0, True, 0.2, False, 2)
    assert given == [[2, 3]]
    assert decode_bench.served_gpus(None, 4) == [0, 1, 2, 3]
    assert decode_bench.served_gpus({"base_gpu_id": 0, "gpu_id_step": 2}, 2) == [0, 2]


def test_parse_prometheus():
    """Text as SGLang exports it (prometheus_client's own exposition): samples summed over labels."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    tokens = Counter("sglang:generation_tokens", "x", ["model_name", "tp_rank"], registry=reg)
    tokens.labels("m", "0").inc(3.5)
    tokens.labels("m", "1").inc(1.5)
    Gauge("sglang:spec_accept_length", "x", registry=reg).set(2e3)
    m = service.parse_prometheus(generate_latest(reg).decode())
    assert m["sglang:generation_tokens_total"] == 5.0 and m["sglang:spec_accept_length"] == 2000.0
    assert service.spec_metrics({"sglang:spec_accept_length": 2.0, "other": 1}) == {"sglang:spec_accept_length": 2.0}


# ---- the measurement matrix end to end (fake server) ---------------------------------------

def test_run_matrix_records_and_dflash_fallback(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "dflash_dies")
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64, 256],
                                  spec=["none", "dflash"], draft_tokens=4, decode_tokens=12, tp=1,
                                  nvml=True, record=True, results_dir=tmp_path / "results",
                                  progress=False, launcher=fake, log_dir=tmp_path / "logs",
                                  log=lambda s: None)
    d = load_records("service_decode", path=tmp_path / "results" / "service_decode.jsonl")
    assert sorted(zip(d["spec"], d["ctx"])) == [("ngram", 64), ("ngram", 256), ("none", 64), ("none", 256)]
    for f in decode_bench.RECORD_FIELDS:
        assert f in d.columns, f
    assert set(d["layers"]) == {3} and set(d["tp"]) == {1} and set(d["cuda_graph"]) == {True}
    assert set(d["nvml_sampled"]) == {service.visible_gpu_count() > 0}  # CPU: NVML absent, skipped
    none, ngram = d[d["spec"] == "none"], d[d["spec"] == "ngram"]
    assert (none["accept_len"] == 1.0).all() and (ngram["accept_len"] > 1.5).all()
    assert set(ngram["draft_tokens"]) == {8} and (d["tok_s"] > 0).all()
    fails = load_records("service_failures", path=tmp_path / "results" / "service_failures.jsonl")
    assert list(fails["status"]) == ["start_failed"] and list(fails["spec"]) == ["dflash"]
    assert "DFLASH is not supported by this fake" in fails["log_tail"][0]
    ex = load_records("service_expert_load", path=tmp_path / "results" / "service_expert_load.jsonl")
    assert len(ex) == 4 and all(len(c) == 3 and len(c[0]) == 384 for c in ex["counts"])
    assert list(ex["moe_layers"][0]) == [1, 2]
    assert "commit" in d.columns and "date" in d.columns
    table = decode_bench.summary_table(res.decode)
    assert table.splitlines()[0].split() == ["backend", "spec", "ctx", "tok/s", "accept", "step", "ms"]


@pytest.mark.parametrize("mode, seen", [("serve", True), ("kv_sort_silent", False)])
def test_run_matrix_records_whether_the_kv_sort_ran_in_the_server(fake, tmp_path, monkeypatch, mode, seen):
    """$SM120_KV_SORT asks; the server's log says whether an allocator was built under the override
    (kv_sort_seen), and a server that does not say so is warned about."""
    monkeypatch.setenv("FAKE_MODE", mode)
    monkeypatch.setenv("SM120_KV_SORT", "1")
    lines = []
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64], spec=["none"],
                                  decode_tokens=12, tp=1, nvml=False, expert=False, progress=False, launcher=fake,
                                  log_dir=tmp_path / "logs", log=lines.append)
    (row,) = res.decode
    assert row["kv_sort"] is True and row["kv_sort_seen"] is seen
    assert any("does not say an allocator was built with need_sort=True" in line for line in lines) is (not seen)


def test_run_matrix_profiles_steps(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "serve")
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64, 256],
                                  spec=["ngram"], decode_tokens=48, tp=1, nvml=False, expert=False, record=True,
                                  results_dir=tmp_path / "results", progress=False, launcher=fake,
                                  log_dir=tmp_path / "logs", profile_steps=4, profile_contexts=[256],
                                  log=lambda s: None)
    assert [p["ctx"] for p in res.profiles] == [256]
    prof = load_records("service_step_profile", path=tmp_path / "results" / "service_step_profile.jsonl")
    r = prof.iloc[0]
    assert r["backend"] == "sm120_mla" and r["spec"] == "ngram" and r["steps"] == 4
    assert r["graph_launches"] == 4 and r["kernels"] == 12
    assert r["window_ms"] == pytest.approx(3.45) and r["busy_ms"] == pytest.approx(1.8)
    assert r["gpu_ms_per_step"] == {"gemm": 0.2, "moe": 0.15, "attention: sm120_mla": 0.1}
    assert r["profiled_request_step_ms"] > 0 and "commit" in prof.columns
    assert (tmp_path / "traces" / r["trace_file"]).is_file()   # beside results/, as data/traces


def test_run_matrix_records_the_commit_of_the_code_that_ran(fake, tmp_path, monkeypatch):
    """$SM120_COMMIT names the commit on the GPU machine (a tree without .git), but an installed
    package archived from another commit is the code that ran: its commit goes in the records."""
    from sm120_workbook import build_commit

    monkeypatch.setenv("FAKE_MODE", "serve")
    monkeypatch.setenv("SM120_COMMIT", "b" * 12)
    monkeypatch.setattr(build_commit, "ARCHIVED_FROM", "a" * 40)

    def commits():
        decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64], spec=["none"],
                                decode_tokens=8, tp=1, nvml=False, expert=False, record=True,
                                results_dir=tmp_path / "results", progress=False, launcher=fake,
                                log_dir=tmp_path / "logs", log=lambda s: None)
        return list(load_records("service_decode", path=tmp_path / "results" / "service_decode.jsonl")["commit"])

    assert commits() == ["a" * 40]
    monkeypatch.setattr(build_commit, "ARCHIVED_FROM", "b" * 40)   # the claim agrees with the package
    assert commits() == ["a" * 40, "b" * 12]


def test_run_matrix_skips_a_backend_with_no_kernel_for_the_gpu(fake, tmp_path, monkeypatch):
    """On an RTX PRO 6000 (12.0) the FlashMLA servers are not started (nor DFlash's NGRAM
    fallback): each plan is recorded as skipped, with the reason; the other backends run."""
    monkeypatch.setenv("FAKE_MODE", "serve")
    monkeypatch.setattr(decode_bench, "_gpu_capability", lambda: (12, 0))
    lines = []
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton", "flashmla"], contexts=[64],
                                  spec=["none", "dflash"], draft_tokens=4, decode_tokens=8, tp=1, nvml=False,
                                  expert=False, progress=False, launcher=fake, log_dir=tmp_path, log=lines.append)
    assert {r["backend"] for r in res.decode} == {"triton"}
    skipped = [(f["backend"], f["spec"], f["status"]) for f in res.failures if f["backend"] == "flashmla"]
    assert skipped == [("flashmla", "none", "skipped"), ("flashmla", "dflash", "skipped")]
    assert all("no kernel for this GPU (sm_120)" in f["error"] for f in res.failures if f["backend"] == "flashmla")
    assert any(line.startswith("SKIPPED flashmla/none: flashmla has no kernel") for line in lines)
    assert not any("flashmla/" in line and "starting" in line for line in lines)


def test_run_matrix_records_the_prefill_backend(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "serve")
    with pytest.raises(ValueError, match="^prefill_backend: 'flashinfr'"):
        decode_bench.run_matrix(backends=["triton"], prefill_backend="flashinfr", tp=1, launcher=fake,
                                log=lambda s: None)
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                  spec=["none"], decode_tokens=8, tp=1, nvml=False, expert=False, progress=False,
                                  prefill_backend="flashinfer", launcher=fake, log_dir=tmp_path, log=lambda s: None)
    assert [r["prefill_attention_backend"] for r in res.decode] == ["flashinfer"]
    plain = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                    spec=["none"], decode_tokens=8, tp=1, nvml=False, expert=False,
                                    progress=False, launcher=fake, log_dir=tmp_path, log=lambda s: None)
    assert [r["prefill_attention_backend"] for r in plain.decode] == [""]
    assert [r["prefill_as_base"] for r in res.decode + plain.decode] == [False, False]
    # spelt prefill first: the server reports flashinfer as its attention backend, and that is
    # the identity it is checked against
    based = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                    spec=["none"], decode_tokens=8, tp=1, nvml=False, expert=False,
                                    progress=False, prefill_backend="flashinfer", prefill_as_base=True,
                                    launcher=fake, log_dir=tmp_path, log=lambda s: None)
    assert [(r["prefill_attention_backend"], r["prefill_as_base"]) for r in based.decode] == [("flashinfer", True)]
    assert not based.failures
    # warm-ups: passed to every server, and named in its records ("" for none)
    configs = []
    monkeypatch.setattr(decode_bench, "ServerConfig",
                        lambda *a, **kw: configs.append(ServerConfig(*a, **kw)) or configs[-1])
    warmed = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                     spec=["none"], decode_tokens=8, tp=1, nvml=False, expert=False,
                                     progress=False, warmups=["sm120_long_prompt"], launcher=fake,
                                     log_dir=tmp_path, log=lambda s: None)
    assert [r["warmups"] for r in warmed.decode + plain.decode] == ["sm120_long_prompt", ""]
    assert [r["warmup_s"] for r in warmed.decode + plain.decode] == [135.0, None]   # by the log's stamps
    assert [c.warmups for c in configs] == [("sm120_long_prompt",)]
    # a warm-up the server's log never names did not run (SGLang only warns of an unknown name):
    # said, and left out of the records
    monkeypatch.setenv("FAKE_UNKNOWN_WARMUPS", "sm120_long_prompt")
    said = []
    unrun = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                    spec=["none"], decode_tokens=8, tp=1, nvml=False, expert=False,
                                    progress=False, warmups=["sm120_long_prompt", "prefill_shapes"],
                                    launcher=fake, log_dir=tmp_path, log=said.append)
    assert [r["warmups"] for r in unrun.decode] == ["prefill_shapes"]
    assert any("does not say it ran the warm-ups ['sm120_long_prompt']" in line for line in said)
    with pytest.raises(ValueError, match="^prefill_as_base: needs a prefill_backend"):
        decode_bench.run_matrix(backends=["triton"], prefill_as_base=True, tp=1, launcher=fake, log=lambda s: None)


def test_cli_refuses_unknown_backend_before_any_launch(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        decode_bench.main(["--tp", "1", "--backends", "triton", "trition", "--no-record",
                           "--log-dir", str(tmp_path)])
    assert e.value.code == 2 and "attention_backend: 'trition'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_plan_matrix_orders_and_filters():
    plans = decode_bench.plan_matrix(["triton", "sm120_mla"], [65536, 4096, 4096], ["none", "dflash"],
                                     draft_tokens=16, decode_tokens=256, model_max_context=65536)
    assert [(p.backend, p.spec, p.contexts) for p in plans] == [
        ("triton", "none", (4096,)), ("triton", "dflash", (4096,)),
        ("sm120_mla", "none", (4096,)), ("sm120_mla", "dflash", (4096,))]
    assert decode_bench.context_length_for([4096, 65536], 256, 16) == 65536 + 256 + 32 + 256
    with pytest.raises(ValueError, match="spec"):
        decode_bench.plan_matrix(["triton"], [4096], ["medusa"])
    # EAGLE: a chain of eagle_steps draft steps verifies eagle_steps + 1 tokens
    (plan,) = decode_bench.plan_matrix(["sm120_mla"], [4096], ["eagle"], eagle_steps=5)
    assert (plan.spec, plan.draft_tokens) == ("eagle", 6)
    with pytest.raises(ValueError, match="^eagle_steps: eagle needs an int >= 1, got 0"):
        decode_bench.plan_matrix(["triton"], [4096], ["eagle"], eagle_steps=0)
    with pytest.raises(ValueError, match="^eagle_steps: 17 eagle draft tokens exceed the sm120_mla kernel's 16"):
        decode_bench.plan_matrix(["sm120_mla"], [4096], ["eagle"], eagle_steps=16)
    # a tree (topk > 1) verifies the tokens given, within the kernel's 16
    (plan,) = decode_bench.plan_matrix(["sm120_mla"], [4096], ["eagle3"], eagle_steps=3, eagle_topk=4,
                                       eagle_draft_tokens=8)
    assert (plan.spec, plan.draft_tokens) == ("eagle3", 8)
    for kw, message in [(dict(eagle_topk=4), r"^eagle_draft_tokens: an EAGLE tree \(eagle_topk 4\) needs it given"),
                        (dict(eagle_draft_tokens=5), "^eagle_draft_tokens: a chain of 3 EAGLE steps verifies 4 tokens, got 5"),
                        (dict(eagle_topk=0), "^eagle_topk: must be a positive int, got 0"),
                        (dict(eagle_topk=4, eagle_draft_tokens=1), "^eagle_draft_tokens: must be an int >= 2, got 1"),
                        (dict(eagle_topk=4, eagle_draft_tokens=17),
                         "^eagle_draft_tokens: 17 eagle3 draft tokens exceed the sm120_mla kernel's 16"),
                        (dict(eagle_steps=1, eagle_topk=2, eagle_draft_tokens=8),
                         "^eagle_draft_tokens: 1 EAGLE steps at topk 2 offer 2 draft tokens")]:
        with pytest.raises(ValueError, match=message):
            decode_bench.plan_matrix(["sm120_mla"], [4096], ["eagle3"], **kw)
    with pytest.raises(ValueError, match=r"^eagle_topk, eagle_draft_tokens: only \('eagle', 'eagle3'\) take them"):
        decode_bench.plan_matrix(["sm120_mla"], [4096], ["ngram"], eagle_topk=4, eagle_draft_tokens=8)
    with pytest.raises(ValueError, match="decode_tokens"):
        decode_bench.plan_matrix(["triton"], [4096], ["none"], decode_tokens=1)
    with pytest.raises(ValueError, match="^backends: 'flashml' is not an attention backend"):
        decode_bench.plan_matrix(["triton", "flashml"], [4096], ["none"])
    # contexts the model cannot hold are said in the plan, not dropped unseen
    plans = decode_bench.plan_matrix(["triton"], [4096, 300_000], ["none"], model_max_context=131072)
    assert decode_bench.describe_plan(plans, 256, [4096, 300_000]).splitlines()[-1] == \
        "  not measured: contexts [300000] do not fit the model with 256 decode tokens"
    for kw, name in ((dict(spec='["ngram"]'), "spec"), (dict(backends="sm120_mla"), "backends"),
                     (dict(contexts="[4096]"), "contexts")):   # a list given as papermill's -p text
        args = dict(backends=["sm120_mla"], contexts=[4096], spec=["none"]) | kw
        with pytest.raises(ValueError, match=f"^{name}: a list, got str .*papermill: -y"):
            decode_bench.plan_matrix(**args)


def test_decode_stats_definitions():
    s = decode_bench.decode_stats(101, 1.0, 3.0, {}, "none")
    assert s["tok_s"] == pytest.approx(50.0) and s["verify_step_ms"] == pytest.approx(20.0)
    assert s["accept_len"] == 1.0
    s = decode_bench.decode_stats(101, 1.0, 3.0, {"spec_verify_ct": 25, "spec_accept_length": 101 / 25}, "dflash")
    assert s["tok_s"] == pytest.approx(50.0) and s["verify_step_ms"] == pytest.approx(80.0)
    assert s["accept_len"] == pytest.approx(4.04)
    with pytest.raises(ValueError, match="spec_verify_ct"):
        decode_bench.decode_stats(101, 1.0, 3.0, {}, "ngram")
    ids = decode_bench.random_input_ids(1000, 163840, seed=1)
    assert len(ids) == 1000 and min(ids) >= 100 and max(ids) < 163840


# ---- charts and tables of the records (synthetic frames) -----------------------------------

def _synthetic_decode_records(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    recs = []
    for backend, speed in (("triton", 1.0), ("sm120_mla", 1.5)):
        for spec, accept in (("none", 1.0), ("dflash", 1.0), ("ngram", 4.5)):
            for ctx in (4096, 16384, 65536):
                for rep in range(2):
                    tok_s = speed * 500 * accept / (1 + ctx / 32768) * (1 + 0.002 * rng.standard_normal())
                    recs.append({"backend": backend, "spec": spec, "draft_tokens": None if spec == "none" else 16,
                                 "tp": 1, "gpu": "synthetic", "model": "k2_tp8_slice", "layers": 4,
                                 "weights": "bf16", "ctx": ctx, "tok_s": tok_s, "accept_len": accept,
                                 "verify_step_ms": 1e3 * accept / tok_s, "cuda_graph": True,
                                 "run_id": f"r-{backend}-{spec}", "repeat": rep})
    return recs


def test_decode_points_speedup_and_charts(seed, tmp_path):
    import pandas as pd

    from sm120_workbook import service_charts as sc
    from sm120_workbook.charts import save_chart

    pts = sc.decode_points(pd.DataFrame(_synthetic_decode_records(seed)))
    # two repeats a server: repeat 0 is left out of the medians, so one request each
    assert len(pts) == 2 * 3 * 3 and set(pts["requests"]) == {1} and set(pts["n_runs"]) == {1}
    sp = sc.speedup_over(pts, "triton")
    assert sp[sp["backend"] == "sm120_mla"]["speedup"].between(1.45, 1.55).all()
    assert sp[sp["backend"] == "triton"]["speedup"].round(9).eq(1.0).all()
    table = sc.decode_table(pts)
    assert list(table.columns) == ["config", "spec", "ctx_label", "tok_s", "accept_len", "verify_step_ms", "requests",
                                   "n_runs", "commit", "other_run"]
    assert set(table["ctx_label"]) == {"4k", "16k", "64k"}
    for name, chart in (("speed", sc.decode_speed_chart(pts)), ("speedup", sc.speedup_chart(sp))):
        assert chart.to_dict()["facet"]["column"]["field"] == "spec_title"
        assert all(p.stat().st_size > 0 for p in save_chart(chart, f"decode_{name}_test", tmp_path))
    with pytest.raises(ValueError, match="baseline backend 'flashmla'"):
        sc.speedup_over(pts, "flashmla")
    with pytest.raises(ValueError, match="missing columns"):
        sc.decode_points(pd.DataFrame([{"backend": "triton"}]))


def test_decode_points_keep_the_newest_commit_of_a_point():
    import pandas as pd

    from sm120_workbook import service_charts as sc

    recs = _synthetic_decode_records(0)
    for r in recs:
        r.update(commit="aaaaaaa1111", date="2026-11-29T12:00:00+00:00")
    newer = [dict(r, commit="bbbbbbb2222", date="2026-11-29T15:00:00+00:00", tok_s=r["tok_s"] * 2)
             for r in recs if r["backend"] == "sm120_mla" and r["spec"] == "ngram"]
    # newer records first: runs side by side on one machine append out of date order
    pts = sc.decode_points(pd.DataFrame(newer + recs)).set_index(["backend", "spec", "ctx"])
    assert set(pts.loc[("sm120_mla", "ngram"), "commit"]) == {"bbbbbbb"}   # the old kernel's runs are not mixed in
    assert set(pts.loc[("sm120_mla", "ngram"), "requests"]) == {1}
    assert set(pts.loc[("triton", "ngram"), "commit"]) == {"aaaaaaa"}


def test_recorded_service_results_are_one_gpus(monkeypatch):
    """An H200 point and an RTX PRO 6000 point of one configuration share a label: a recorded
    view keeps one GPU's records (notebook 05's recorded_gpu)."""
    import pandas as pd

    from sm120_workbook import results, service_charts as sc

    frames = {"service_decode": pd.DataFrame([{"model": "m", "gpu": "NVIDIA H200", "tok_s": 1.0},
                                              {"model": "m", "gpu": "NVIDIA RTX PRO 6000 Blackwell", "tok_s": 2.0},
                                              {"model": "other", "gpu": "NVIDIA H200", "tok_s": 3.0}]),
              "service_nvml": pd.DataFrame([{"model": "m", "metric": "power_w"}])}   # no gpu column: not any GPU's
    monkeypatch.setattr(results, "load_records", lambda name, path=None: frames.get(name, pd.DataFrame()))
    got = sc.load_service_results("m", gpu="RTX PRO 6000")
    assert got["decode"]["tok_s"].tolist() == [2.0] and got["nvml"].empty and got["expert"].empty
    assert sc.load_service_results("m")["decode"]["tok_s"].tolist() == [1.0, 2.0]


def test_nvml_records_round_trip_and_pick_point():
    import pandas as pd

    from sm120_workbook import service_charts as sc

    recs = pd.DataFrame([
        {"run_id": "a", "backend": "triton", "spec": "none", "ctx": 4096, "nvml_gpu": 0,
         "metric": "power_w", "t": [0.0, 0.2], "value": [100.0, 110.0]},
        {"run_id": "b", "backend": "sm120_mla", "spec": "dflash", "ctx": 65536, "nvml_gpu": 1,
         "metric": "sm_util_pct", "t": [0.0, 0.2, 0.4], "value": [10.0, 90.0, 95.0]}])
    long = sc.nvml_samples(recs)
    assert len(long) == 5 and list(long.columns[:4]) == ["t", "gpu", "metric", "value"]
    p = sc.pick_point(recs)
    assert p == {"backend": "sm120_mla", "spec": "dflash", "ctx": 65536, "run_id": "b"}
    assert sc.pick_point(recs, backend="triton")["run_id"] == "a"
    # per-GPU charts prefer the run with the most GPUs, whatever its context
    tp = recs.assign(tp=[2, 1])
    assert sc.pick_point(tp, most_gpus=True)["run_id"] == "a"
    assert sc.pick_point(tp)["run_id"] == "b"
    assert len(sc.select_point(long, p)) == 3
    assert sc.ctx_label(131072) == "128k" and sc.ctx_label(1000) == "1000"
    # two repeats of one point each sample from t = 0: the point is one repeat, the last
    reps = pd.concat([recs.assign(repeat=0), recs.assign(repeat=1, value=[[1.0, 2.0], [3.0, 4.0, 5.0]])])
    p = sc.pick_point(reps)
    assert p == {"backend": "sm120_mla", "spec": "dflash", "ctx": 65536, "run_id": "b", "repeat": 1}
    assert sc.select_point(sc.nvml_samples(reps), p)["value"].tolist() == [3.0, 4.0, 5.0]


def test_run_matrix_ep_size_is_checked_and_recorded(fake, tmp_path):
    with pytest.raises(ValueError, match="ep_size: must be a positive divisor of tp=1"):
        decode_bench.run_matrix(backends=["triton"], tp=1, ep_size=2, launcher=fake, log=lambda s: None)
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                  spec=["none"], decode_tokens=8, tp=1, ep_size=1, nvml=False,
                                  progress=False, launcher=fake, log_dir=tmp_path, log=lambda s: None)
    assert [r["ep_size"] for r in res.decode] == [1]
    # one id for the call (pairs within it are one run), the prompt as the server took it
    assert res.decode[0]["invocation"] and res.decode[0]["prompt_tokens"] == res.decode[0]["ctx"]


def test_configs_are_separate_points_and_never_paired_across():
    """The NGRAM host fix and a recorder-off run are their own configurations: pooled and
    paired only with their like, and labelled in tables and charts."""
    import pandas as pd

    from sm120_workbook.service_charts import decode_points, speedup_over

    base = {"gpu": "H200", "model": "m", "layers": 4, "tp": 1, "weights": "bf16", "spec": "ngram",
            "draft_tokens": 8, "ctx": 65536, "accept_len": 6.7, "verify_step_ms": 1.0, "commit": "c",
            "date": "2026-11-29", "expert_record": True}
    df = pd.DataFrame([{**base, "backend": "triton", "tok_s": 120.0},
                       {**base, "backend": "sm120_mla", "tok_s": 1190.0},
                       {**base, "backend": "sm120_mla", "tok_s": 2357.0, "ngram_tail": True},
                       {**base, "backend": "sm120_mla", "tok_s": 827.0, "expert_record": False}])
    tp2 = [{**base, "tp": 2, "backend": b, "tok_s": s} for b, s in (("triton", 110.0), ("sm120_mla", 1390.0))]
    pts = decode_points(pd.concat([df, pd.DataFrame(tp2)]))
    assert sorted(pts["config"]) == ["sm120_mla", "sm120_mla (recorder off)", "sm120_mla + ngram_tail",
                                     "sm120_mla TP2", "triton", "triton TP2"]
    sp = speedup_over(pts, "triton")
    assert sorted(sp["config"]) == ["sm120_mla", "sm120_mla TP2", "triton", "triton TP2"]
    assert sp.loc[sp["config"] == "sm120_mla", "speedup"].item() == pytest.approx(1190 / 120)
    assert sp.loc[sp["config"] == "sm120_mla TP2", "speedup"].item() == pytest.approx(1390 / 110)
    # records may carry tp as 2, 2.0 or "2"
    from sm120_workbook.service_charts import config_label, select_tp
    assert config_label("triton", tp=2.0) == config_label("triton", tp="2") == "triton TP2"
    assert config_label("triton", tp="?") == "triton"
    assert sorted(select_tp(pts.assign(tp=pts["tp"].astype(float)), 2)["config"]) == ["sm120_mla TP2", "triton TP2"]


def test_speedup_table_names_both_commits():
    import pandas as pd

    from sm120_workbook import service_charts as sc

    recs = _synthetic_decode_records(1)
    for r in recs:
        newer = r["backend"] == "sm120_mla"
        r.update(commit="bbbbbbb2222" if newer else "aaaaaaa1111",
                 date="2026-11-29T15:00:00+00:00" if newer else "2026-11-29T12:00:00+00:00")
    sp = sc.speedup_over(sc.decode_points(pd.DataFrame(recs)), "triton")
    t = sc.speedup_table(sp[sp["backend"] == "sm120_mla"])
    assert list(t.columns) == ["config", "spec", "ctx_label", "tok_s", "base_tok_s", "speedup", "step_speedup",
                               "commit", "base_commit"]
    assert set(t["commit"]) == {"bbbbbbb"} and set(t["base_commit"]) == {"aaaaaaa"}
    assert t["speedup"].between(1.45, 1.55).all()


def test_service_targets_measured_not_asserted():
    import pandas as pd

    from sm120_workbook import service_charts as sc

    recs = _synthetic_decode_records(2)   # sm120_mla is 1.5x triton everywhere; ngram 4.5x plain
    pts = sc.decode_points(pd.DataFrame(recs))
    t = sc.service_targets(pts).set_index("target")
    row = t.loc["ngram 4k: sm120_mla >= 3x triton"]
    assert row["met"] is False and 1.45 < row["ratio"] < 1.55
    assert t.loc["ngram 64k: sm120_mla speculation >= plain decode", "met"] is True
    # a side that was never measured is "not measured", not "missed"
    t2 = sc.service_targets(pts[~((pts["backend"] == "triton") & (pts["ctx"] == 16384))]).set_index("target")
    assert t2.loc["ngram 16k: sm120_mla >= 4.3x triton", "met"] is None
    assert t2.loc["ngram 16k: sm120_mla >= 4.3x triton", "measured"] == "not measured"
    # the targets are at TP1: a TP2 run is left out, and asked for by tp=2
    tp2 = sc.decode_points(pd.DataFrame(recs + [dict(r, tp=2, tok_s=r["tok_s"] * (3 if r["backend"] == "sm120_mla" else 1))
                                                for r in recs]))
    assert sc.service_targets(tp2).equals(sc.service_targets(pts))
    t3 = sc.service_targets(tp2, tp=2).set_index("target")
    assert t3.loc["ngram 4k: sm120_mla >= 3x triton", "met"] is True
    assert t3.loc["ngram 4k: sm120_mla >= 3x triton", "config"] == "sm120_mla TP2 (recorder off)"
    # a baseline measured on another model is no pair for it
    other = pts.assign(model=pts["model"].where(pts["backend"] != "triton", "kimi_k2"))
    assert sc.service_targets(other).set_index("target").loc["ngram 4k: sm120_mla >= 3x triton", "met"] is None


def test_server_dying_mid_run_records_its_log_tail(fake, tmp_path, monkeypatch):
    """A server that dies under a measured request: the failure record and the run's log carry
    what the server said last, not only the client's connection error; $SM120_KV_SORT is recorded."""
    monkeypatch.setenv("FAKE_MODE", "crash_on_generate")
    monkeypatch.setenv("SM120_KV_SORT", "1")
    lines = []
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                  spec=["none"], decode_tokens=12, tp=1, nvml=False, expert=False,
                                  progress=False, launcher=fake, log_dir=tmp_path / "logs", log=lines.append)
    (fail,) = res.failures
    assert fail["status"] == "run_failed" and fail["kv_sort"] is True
    assert "illegal memory access" in fail["log_tail"] and fail["log_path"].endswith(".log")
    assert fail["error"].startswith("ServerError: /generate: connection failed") and "\n" not in fail["error"]
    assert any("its log ends" in line and "illegal memory access" in line for line in lines)


@pytest.mark.parametrize("kw, match", [
    (dict(spec=["dflash"], draft_tokens=1), "draft_tokens: dflash needs an int >= 2, got 1"),
    (dict(spec=["ngram"], ngram_draft_tokens=1), "ngram_draft_tokens: ngram needs an int >= 2, got 1"),
    (dict(spec=["none"], mem_fraction_static=1.5), r"mem_fraction_static: must be in \(0, 1\), got 1.5"),
    (dict(spec=["none"], startup_timeout_s=0), "startup_timeout_s: must be a positive number"),
    (dict(spec=["none"], stall_timeout_s=-5), "stall_timeout_s: must be a positive number"),
    (dict(spec=["none"], nvml_interval_s=-1.0), "nvml_interval_s: must be a positive number"),
    (dict(spec=["none"], time_budget_s=0), "time_budget_s: must be a positive number"),
    (dict(spec=["none"], repeats=0), "repeats: must be a positive int"),
    (dict(spec=["none"], contexts=[10_000_000]), r"contexts: none of \[10000000\] fits"),
    (dict(spec=["ngram"], ngram_draft_tokens=17, backends=["sm120_mla"]), "exceed the sm120_mla kernel's 16"),
    (dict(spec=["dflash"], spec_fallback="dflash"), "spec_fallback: one of"),
    (dict(spec=["none"], profile_steps=2, profile_contexts=[65]), r"profile_contexts: \[65\] are not among"),
    (dict(spec=["dflash"], dflash_host_plan="on"), r"dflash_host_plan: expected one of \('off', 'probe'\)"),
    (dict(spec=["none", "dflash"], dflash_host_plan="probe"), r"the probe is for spec \['dflash'\] alone"),
    (dict(spec=["none"], seed=-5000), "^seed: must be an int >= 0, got -5000"),   # numpy's generators refuse it
    (dict(spec=["none"], seed=True), "^seed: must be an int >= 0, got True"),
    (dict(spec=["none"], decode_tokens=40.0), r"^decode_tokens: must be an int >= 2 \(one token .*got 40.0$"),
    (dict(spec=["none"], warmups="sm120_long_prompt"), "^warmups: a sequence of warm-up names, got 'sm120"),
    # the second server's tree: refused before the first one starts
    (dict(spec=["eagle"], backends=["triton", "flashmla"], eagle_topk=4, eagle_draft_tokens=8),
     r"^eagle_topk: SGLang 0.5.17 runs an EAGLE tree on pages of 64 tokens only .* not flashmla$"),
])
def test_run_matrix_refuses_bad_plans_before_any_launch(fake, tmp_path, kw, match):
    kw = {"backends": ["triton"], "contexts": [64], "decode_tokens": 40, **kw}
    with pytest.raises(decode_bench.MatrixArgumentError, match=match):
        decode_bench.run_matrix(tp=1, launcher=fake, log_dir=tmp_path / "logs", log=lambda s: None, **kw)
    assert not (tmp_path / "logs").exists()


def test_run_matrix_refuses_folders_it_cannot_write_before_any_launch(fake, tmp_path, monkeypatch):
    """log_dir and (with record) results_dir are created and probed in the validation step: found
    after the first server, a file named as the log folder failed every server (run_failed), and
    an uncreatable results folder raised from the failure handler's own record write."""
    monkeypatch.setenv("FAKE_MODE", "serve")
    (tmp_path / "afile").write_text("")
    kw = dict(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64], spec=["none"], decode_tokens=8,
              tp=1, nvml=False, expert=False, progress=False, launcher=fake, log=lambda s: None)
    with pytest.raises(decode_bench.MatrixArgumentError, match=f"^log_dir: {re.escape(str(tmp_path))}/afile exists "
                                                               "and is not a folder"):
        decode_bench.run_matrix(log_dir=tmp_path / "afile", **kw)
    bad = tmp_path / "afile" / "results"
    with pytest.raises(decode_bench.MatrixArgumentError,
                       match=f"^results_dir: cannot write into {re.escape(str(bad))}"):
        decode_bench.run_matrix(record=True, results_dir=bad, log_dir=tmp_path / "logs", **kw)
    assert not (tmp_path / "logs").exists()   # the folders come last: a refused run leaves none
    # without record the results folder is never written, so not checked
    res = decode_bench.run_matrix(results_dir=bad, log_dir=tmp_path / "logs", **kw)
    assert len(res.decode) == 1 and not res.failures
    made = tmp_path / "new" / "logs"
    res = decode_bench.run_matrix(record=True, results_dir=tmp_path / "new" / "results", log_dir=made, **kw)
    assert len(res.decode) == 1 and list(made.glob("*.log"))
    assert len(load_records("service_decode", path=tmp_path / "new" / "results" / "service_decode.jsonl")) == 1


def test_run_matrix_checks_tp_against_the_gpus_only_for_sglangs_launcher(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "serve")
    monkeypatch.setattr(service, "known_gpu_count", lambda: 1)
    kw = dict(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64], spec=["none"], decode_tokens=8,
              tp=2, nvml=False, expert=False, progress=False, log_dir=tmp_path / "logs", log=lambda s: None)
    with pytest.raises(decode_bench.MatrixArgumentError, match="^tp: 2 needs 2 GPUs, and only 1 is visible here"):
        decode_bench.run_matrix(**kw)
    assert not (tmp_path / "logs").exists()
    res = decode_bench.run_matrix(launcher=fake, **kw)   # a fake server of 2 "ranks" runs on none
    assert [r["tp"] for r in res.decode] == [2] and not res.failures


@pytest.mark.parametrize("mode, status", [("die", "start_failed"), ("crash_on_generate", "run_failed")])
def test_a_failure_whose_record_cannot_be_written_is_kept(fake, tmp_path, monkeypatch, mode, status):
    """The failure handlers' record write in its own try: a full disk must not replace the error
    being recorded (it raised out of the handler, and the run's failures were never printed)."""
    from sm120_workbook import results

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("FAKE_MODE", mode)
    monkeypatch.setattr(results, "append_records", full)
    lines = []
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                  spec=["none"], decode_tokens=12, tp=1, nvml=False, expert=False, record=True,
                                  results_dir=tmp_path / "results", progress=False, launcher=fake,
                                  log_dir=tmp_path / "logs", log=lines.append)
    assert [f["status"] for f in res.failures] == [status]
    assert any(line.startswith("  could not append this failure to service_failures: OSError(28")
               for line in lines)


def test_decode_stats_refuses_a_missing_first_token_time():
    with pytest.raises(ValueError, match="nothing to time"):
        decode_bench.decode_stats(100, float("nan"), 2.0, {}, "none")


def test_profile_steps_need_enough_decode_tokens(fake, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="profile_steps"):
        decode_bench.run_matrix(backends=["triton"], contexts=[64], spec=["ngram"], decode_tokens=40, tp=1,
                                profile_steps=5, launcher=fake, log=lambda s: None)   # 8 drafts: 9 tokens a step
    # an EAGLE tree of 3 steps emits at most 4 tokens a step, whatever its 8 verified tokens
    tree = dict(backends=["triton"], contexts=[64], spec=["eagle3"], decode_tokens=40, tp=1, layers=3,
                eagle_steps=3, eagle_topk=4, eagle_draft_tokens=8, launcher=fake, nvml=False, expert=False,
                progress=False, record=False, log_dir=tmp_path / "tree", log=lambda s: None)
    with pytest.raises(ValueError, match=r"^profile_steps: 10 steps need more than 40 decode tokens with up to 4"):
        decode_bench.run_matrix(profile_steps=10, **tree)
    monkeypatch.setenv("FAKE_MODE", "die")   # accepted: it gets as far as a server start
    res = decode_bench.run_matrix(profile_steps=9, spec_fallback=None, **tree)
    assert [f["status"] for f in res.failures] == ["start_failed"]


def test_failures_table_names_the_cause_from_the_server_log():
    import pandas as pd

    from sm120_workbook.service_charts import failure_cause, failures_table

    tail = "loading\ntorch.OutOfMemoryError: CUDA out of memory.\n\n[x] Received sigquit from a child process.\n"
    assert failure_cause(tail) == "torch.OutOfMemoryError: CUDA out of memory."
    assert failure_cause("just stopped\n") == "just stopped" and failure_cause(float("nan")) == ""
    f = pd.DataFrame([{"backend": "triton", "spec": "dflash", "status": "start_failed", "log_tail": tail,
                       "error": "SGLang server exited with code -9 during start-up (log: /x.log)"},
                      {"backend": "triton", "spec": "ngram", "status": "skipped", "error": "time budget"}])
    t = failures_table(f)
    assert list(t["error"]) == ["SGLang server exited with code -9 during start-up", "time budget"]
    assert list(t["cause in the server log"]) == ["torch.OutOfMemoryError: CUDA out of memory.", ""]
    # SGLang's crash diagnostics follow the exception with lines that also say "error"
    crash = ("    self._buffer[self._size] = value\nRuntimeError: Inplace update to inference tensor\n\n"
             "[t] SIGQUIT received.\n[t] Pyspy failed (py-spy dump --pid 1). Error: py-spy: not found\n")
    assert failure_cause(crash) == "RuntimeError: Inplace update to inference tensor"
    t = failures_table(pd.DataFrame([{"backend": "triton", "spec": "dflash", "status": "run_failed", "log_tail": crash,
                                      "error": "ServerError: /generate: the stream broke off; log /x/y.log ends:"}]))
    assert list(t["error"]) == ["ServerError: /generate: the stream broke off"]


def test_dflash_records_the_draft_backend_sglang_resolved(fake, tmp_path, monkeypatch):
    """The DFlash draft's attention backend is read back from /server_info (SGLang resolves one
    none is named for: triton's own, flashinfer for sm120_mla), and recorded; other specs record
    none."""
    monkeypatch.setenv("FAKE_MODE", "serve")
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton", "sm120_mla"], contexts=[64],
                                  spec=["dflash", "none"], draft_tokens=4, decode_tokens=12, tp=1, nvml=False,
                                  expert=False, progress=False, launcher=fake, log_dir=tmp_path / "logs",
                                  log=lambda s: None)
    assert {(r["backend"], r["spec"], r["draft_attention_backend"]) for r in res.decode} == {
        ("triton", "dflash", "triton"), ("sm120_mla", "dflash", "flashinfer"),
        ("triton", "none", None), ("sm120_mla", "none", None)}


def test_eagle_servers_serve_the_model_with_an_mtp_layer(fake, tmp_path, monkeypatch):
    """An EAGLE plan launches the model given one MTP layer, with its chain's steps and the draft
    backend asked for (none: SGLang's choice), records a circular expert buffer of steps + 1 rows a
    routed pass, and what SGLang resolved for the draft."""
    monkeypatch.setenv("FAKE_MODE", "serve")
    monkeypatch.setenv("FAKE_ECHO_ARGS", "1")
    for draft_backend in (None, "triton"):
        res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64],
                                      spec=["eagle", "none"], eagle_steps=2, decode_tokens=12, tp=1, nvml=False,
                                      expert=True, progress=False, launcher=fake, log_dir=tmp_path / "logs",
                                      draft_backend=draft_backend, log=lambda s: None)
        eagle = [r for r in res.decode if r["spec"] == "eagle"]
        assert eagle and all(r["draft_tokens"] == 3 and r["draft_attention_backend"] == (draft_backend or "sm120_mla")
                             and r["expert_buffer"] == decode_bench.spec_expert_buffer([64], 12, 3) for r in eagle)
        assert {r["draft_attention_backend"] for r in res.decode if r["spec"] == "none"} == {None}
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    eagle_logs = [t for n, t in logs.items() if "-eagle-" in n]
    assert len(eagle_logs) == 2 and all("--speculative-num-steps 2 --speculative-eagle-topk 1" in t
                                        and "/model-mtp " in t for t in eagle_logs), logs
    assert all("/model " in t for n, t in logs.items() if "-none-" in n), logs


@pytest.mark.parametrize("mode", ["off", "probe"])
def test_run_matrix_passes_the_dflash_host_plan_to_the_servers_and_records(fake, tmp_path, monkeypatch, mode):
    monkeypatch.setenv("FAKE_MODE", "serve")
    monkeypatch.setenv("FAKE_ECHO_ARGS", "1")
    monkeypatch.setenv("SM120_DFLASH_HOST_PLAN", "probe" if mode == "off" else "off")   # the caller's own does not leak
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64],
                                  spec=["dflash"], draft_tokens=4, decode_tokens=12, tp=1, nvml=False,
                                  expert=False, progress=False, launcher=fake, log_dir=tmp_path / "logs",
                                  dflash_host_plan=mode, log=lambda s: None)
    assert res.decode and {r["dflash_host_plan"] for r in res.decode} == {mode}
    (log,) = [p.read_text() for p in (tmp_path / "logs").glob("*.log")]
    assert f"fake server env SM120_DFLASH_HOST_PLAN={mode}\n" in log


def test_eagle3_servers_take_an_mla_draft_head(fake, tmp_path, monkeypatch):
    """An EAGLE3 plan launches the model as it is with an EAGLE3-MLA draft folder of its own, the
    chain's steps, a circular expert buffer of steps + 1 rows a routed pass, and the draft backend
    SGLang resolved (the decode backend)."""
    monkeypatch.setenv("FAKE_MODE", "serve")
    monkeypatch.setenv("FAKE_ECHO_ARGS", "1")
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64],
                                  spec=["eagle3"], eagle_steps=2, decode_tokens=12, tp=1, nvml=False,
                                  expert=True, progress=False, launcher=fake, log_dir=tmp_path / "logs",
                                  log=lambda s: None)
    assert res.decode and all(r["spec"] == "eagle3" and r["draft_tokens"] == 3
                              and r["draft_attention_backend"] == "sm120_mla"
                              and r["expert_buffer"] == decode_bench.spec_expert_buffer([64], 12, 3)
                              for r in res.decode)
    (log,) = [p.read_text() for p in (tmp_path / "logs").glob("*.log")]
    assert "--speculative-algorithm EAGLE3" in log and "--speculative-num-steps 2 --speculative-eagle-topk 1" in log
    assert re.search(r"--model-path \S+/model --", log) and re.search(r"--speculative-draft-model-path \S+/draft-", log)
    assert {r["eagle_topk"] for r in res.decode} == {1}
    with pytest.raises(ValueError, match="^layers: an EAGLE3 head reads target layers"):   # before any start
        decode_bench.run_matrix(model="k2_tp8_slice", layers=4, backends=["sm120_mla"], contexts=[64],
                                spec=["none", "eagle3"], decode_tokens=12, tp=1, nvml=False, progress=False,
                                launcher=fake, log_dir=tmp_path / "four", log=lambda s: None)
    assert not (tmp_path / "four").exists()
    # a tree: its width and tokens reach the server and the records
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64],
                                  spec=["eagle3", "none"], eagle_steps=2, eagle_topk=4, eagle_draft_tokens=6,
                                  decode_tokens=12, tp=1, nvml=False, expert=False, progress=False, launcher=fake,
                                  log_dir=tmp_path / "tree", log=lambda s: None)
    assert {(r["spec"], r["draft_tokens"], r["eagle_topk"]) for r in res.decode} == {("eagle3", 6, 4), ("none", None, None)}
    (log,) = [p.read_text() for p in (tmp_path / "tree").glob("*-eagle3-*.log")]
    assert "--speculative-num-draft-tokens 6" in log and "--speculative-eagle-topk 4" in log


def test_eagle3_servers_take_a_llama_head(fake, tmp_path, monkeypatch):
    """`eagle3_head="llama"`: SpecForge's Kimi K2 layout (MHA). Its folder names SGLang's Llama
    EAGLE3 architecture, its MHA KV pool is bounded as DFlash's is (--max-total-tokens), its draft
    runs FlashInfer unless told otherwise (the plugin's step in SGLang's hook; Triton is 1.9x slower
    a step at 64k), and its records say the head and the draft backend that ran: the charts name a
    Triton draft, not the usual one."""
    import pandas as pd

    from sm120_workbook.dummy_models import EAGLE3_LLAMA_ARCH, materialize_eagle3_draft
    from sm120_workbook.service_charts import decode_points

    monkeypatch.setenv("FAKE_MODE", "serve")
    monkeypatch.setenv("FAKE_ECHO_ARGS", "1")
    launched = []   # the architecture of each draft folder the matrix writes (it deletes them after)

    def materialize(*args, **kw):
        path = materialize_eagle3_draft(*args, **kw)
        launched.append(json.loads((path / "config.json").read_text())["architectures"])
        return path

    monkeypatch.setattr(decode_bench, "materialize_eagle3_draft", materialize)
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64],
                                  spec=["eagle3"], eagle_steps=2, decode_tokens=12, tp=1, nvml=False,
                                  expert=True, progress=False, launcher=fake, log_dir=tmp_path / "logs",
                                  eagle3_head="llama", log=lambda s: None)
    assert launched == [[EAGLE3_LLAMA_ARCH]]
    assert res.decode and all(r["draft_head"] == "llama" and r["draft_attention_backend"] == "flashinfer"
                              for r in res.decode)
    (log,) = [p.read_text() for p in (tmp_path / "logs").glob("*.log")]
    assert re.search(r"--max-total-tokens \d+", log)
    assert re.search(r"--speculative-draft-model-path \S+/draft-", log)
    assert "--speculative-draft-attention-backend" not in log   # the plugin's step names it in the server
    pts = decode_points(pd.DataFrame(res.decode))
    assert set(pts["draft_backend"]) == {""} and set(pts["config"]) == {"sm120_mla, Llama EAGLE3 head"}
    # a draft backend given is kept: Triton, the plugin's own choice, is then a named point
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["sm120_mla"], contexts=[64],
                                  spec=["eagle3"], eagle_steps=2, decode_tokens=12, tp=1, nvml=False,
                                  expert=True, progress=False, launcher=fake, log_dir=tmp_path / "logs_t",
                                  eagle3_head="llama", draft_backend="triton", log=lambda s: None)
    assert {r["draft_attention_backend"] for r in res.decode} == {"triton"}
    pts = decode_points(pd.DataFrame(res.decode))
    assert set(pts["draft_backend"]) == {"triton"}
    assert set(pts["config"]) == {"sm120_mla + triton draft, Llama EAGLE3 head"}
    assert decode_bench.resolved_draft_backend({"decode_attention_backend": "sm120_mla"}, "eagle3",
                                               mla_draft=False) == "triton"
    assert decode_bench.resolved_draft_backend({"speculative_draft_attention_backend": "flashinfer"}, "eagle3",
                                               mla_draft=False) == "flashinfer"
    # a DFlash info naming no draft backend: SGLang's rule over its backends; no info, none
    assert decode_bench.resolved_draft_backend({"attention_backend": "sm120_mla"}, "dflash") == "flashinfer"
    assert decode_bench.resolved_draft_backend({"attention_backend": "sm120_mla",
                                                "prefill_attention_backend": "triton"}, "dflash") == "triton"
    assert decode_bench.resolved_draft_backend(None, "dflash") is None
    for kw, message in [(dict(eagle3_head="mha"), r"^eagle3_head: one of \['llama', 'mla'\]"),
                        (dict(eagle3_head="llama", spec=["none"]), "^eagle3_head: only spec eagle3 takes a head")]:
        with pytest.raises(ValueError, match=message):
            decode_bench.run_matrix(**{"model": "k2_tp8_slice", "layers": 3, "backends": ["sm120_mla"],
                                       "contexts": [64], "spec": ["eagle3"], "tp": 1, "nvml": False,
                                       "progress": False, "launcher": fake, "log_dir": tmp_path / "bad",
                                       "log": lambda s: None, **kw})
    assert not (tmp_path / "bad").exists()


def test_dflash_servers_record_into_a_circular_buffer(fake, tmp_path, monkeypatch):
    """With the recorder asked for, DFlash servers record into a circular buffer sized above a
    request's passes (and say so); the others keep the unbounded one."""
    monkeypatch.setenv("FAKE_MODE", "serve")
    said = []
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64],
                                  spec=["dflash", "none"], draft_tokens=4, decode_tokens=12, tp=1, nvml=False,
                                  expert=True, progress=False, launcher=fake, log_dir=tmp_path / "logs",
                                  log=said.append)
    buffer = decode_bench.spec_expert_buffer([64], 12, 2)
    assert buffer == 2 * (1 + 12) + 16
    assert {(r["spec"], r["expert_record"], r["expert_buffer"]) for r in res.decode} == {
        ("dflash", True, buffer), ("none", True, -1)}
    assert {r["spec"] for r in res.expert} == {"dflash", "none"}
    assert [line for line in said if "circular buffer" in line] == [
        f"triton/dflash: the expert recorder keeps a circular buffer of {buffer} forward passes (an "
        "unbounded one stops DFlash servers: service.DFLASH_RECORDER_CRASH)"]
    dflash = [r for r in res.expert if r["spec"] == "dflash"]
    assert dflash and all(0 < r["forward_passes"] < buffer for r in dflash)   # the zero rows do not count


class _DumpServer:
    """A server whose expert dump is the given logical_count."""

    def __init__(self, count, tmp_path):
        self.count, self.tmp_path = count, tmp_path

    def dump_expert_record(self, expected=1):
        import torch

        paths = [self.tmp_path / f"expert_distribution_recorder_{i}.pt" for i in range(expected)]
        for path in paths:
            torch.save({"rank": 0, "logical_count": torch.as_tensor(self.count)}, path)
        return paths


def test_an_expert_record_whose_circular_buffer_may_have_wrapped_is_refused(monkeypatch, tmp_path):
    """SGLang's own recorder through DFlash's alternating passes: once the buffer has wrapped only
    about half its rows route (the draft's are zero), so the check counts 2 rows a routed pass."""
    import numpy as np

    fits = _dflash_record(monkeypatch, 100, draft_first=False, passes=90)      # 45 routed passes
    wrapped = _dflash_record(monkeypatch, 100, draft_first=False, passes=600)  # 300, 50 of them kept
    assert decode_bench._expert_record(_DumpServer(fits["logical_count"], tmp_path), 1, 100, 2)["forward_passes"] == 45
    with pytest.raises(ValueError, match=r"^expert_buffer: 50 routed passes \(x2 rows\) fill the circular buffer of 100 rows"):
        decode_bench._expert_record(_DumpServer(wrapped["logical_count"], tmp_path), 1, 100, 2)
    full = np.zeros((4, 3, 8), dtype=np.int32)
    full[:, 1, 2] = 1                                                        # every row routed
    assert decode_bench._expert_record(_DumpServer(full, tmp_path), 1)["forward_passes"] == 4   # unbounded
    with pytest.raises(ValueError, match="^expert_buffer: 4 routed passes"):
        decode_bench._expert_record(_DumpServer(full, tmp_path), 1, 4)
    full[3] = 0                                                              # 3 of 4 rows routed
    assert decode_bench._expert_record(_DumpServer(full, tmp_path), 1, 4)["forward_passes"] == 3
    odd = _dflash_record(monkeypatch, 101, draft_first=False, passes=600)    # 50 routed of 101 rows
    with pytest.raises(ValueError, match="^expert_buffer: 50 routed passes"):
        decode_bench._expert_record(_DumpServer(odd["logical_count"], tmp_path), 1, 101, 2)


def test_routed_passes_of_an_empty_dump_is_zero():
    import numpy as np

    from sm120_workbook.expert_balance import routed_passes

    assert routed_passes({"logical_count": np.zeros((0, 3, 8))}) == 0


def test_spec_expert_buffer_holds_a_requests_passes():
    # rows a pass x (128k in 1024-token chunks: 128, + one verify pass a decode token: 128) + 16
    rows = decode_bench.recorder_rows_per_pass
    assert (rows("dflash"), rows("eagle", 3), rows("eagle", 5), rows("eagle3", 3), rows("ngram"), rows("none")) == \
        (2, 4, 6, 4, 1, 1)
    assert decode_bench.spec_expert_buffer([16384, 131072], 128, 2) == 2 * (128 + 128) + 16
    assert decode_bench.spec_expert_buffer([1], 1, 4) == 4 * (1 + 1) + 16


def test_generate_raises_on_an_aborted_request(model_dir, fake, tmp_path, monkeypatch):
    with _server(model_dir, fake, tmp_path, monkeypatch, "abort_on_generate") as srv:
        with pytest.raises(service.ServerError, match="aborted by the server: fake: out of KV"):
            srv.generate(list(range(100, 164)), 9)


def test_generate_names_a_stalled_stream(model_dir, fake, tmp_path, monkeypatch):
    """A server that stops sending mid-stream: a ServerError after stall_timeout_s that says the
    server still runs and ends with its log, not requests' bare read timeout after 30 minutes."""
    with _server(model_dir, fake, tmp_path, monkeypatch, "stall_on_generate", stall_timeout_s=1) as srv:
        with pytest.raises(ValueError, match="stall_timeout_s: must be a positive number"):
            srv.generate(list(range(100, 164)), 9, stall_timeout_s=0)
        with pytest.raises(ValueError, match="stall_timeout_s: must be a positive number"):
            srv.generate(list(range(100, 164)), 9, stall_timeout_s=float("inf"))
        t0 = time.monotonic()
        with pytest.raises(service.ServerError, match=r"no output for 1 s; the server is still running(.|\n)*"
                                                      r"the scheduler is stuck"):
            srv.generate(list(range(100, 164)), 9)   # the server's stall_timeout_s
        assert time.monotonic() - t0 < 10


def test_read_timeouts_are_told_from_other_connection_errors():
    import requests
    import urllib3

    read = urllib3.exceptions.ReadTimeoutError(None, "/generate", "Read timed out.")
    assert service._is_read_timeout(requests.exceptions.ReadTimeout("before the headers"))
    assert service._is_read_timeout(requests.exceptions.ConnectionError(read))   # mid-stream
    connect = urllib3.exceptions.ConnectTimeoutError(None, "Connection to 127.0.0.1 timed out")
    assert not service._is_read_timeout(requests.exceptions.ConnectTimeout(connect))
    assert not service._is_read_timeout(requests.exceptions.ConnectionError("Connection refused"))


@pytest.mark.parametrize("mode, match", [("crash_on_generate", "connection failed"),   # before the headers
                                         ("die_mid_stream", r"the stream broke off \(the stream ended before \[DONE\]")])
def test_generate_names_a_server_that_died_mid_request(model_dir, fake, tmp_path, monkeypatch, mode, match):
    """Dead before its answer or in the middle of the stream: never a partial output taken as a
    whole one, always the server's last words."""
    with _server(model_dir, fake, tmp_path, monkeypatch, mode) as srv:
        with pytest.raises(service.ServerError, match=match + r"(.|\n)*illegal memory access"):
            srv.generate(list(range(100, 164)), 9)


def test_generate_counts_the_first_chunk_and_times_the_last_token(model_dir, fake, tmp_path, monkeypatch):
    with _server(model_dir, fake, tmp_path, monkeypatch, "merged_first") as srv:
        res = srv.generate(list(range(100, 164)), 9)
    assert res.first_chunk_tokens == 3 and res.completion_tokens == 9 and res.chunks == 7
    s = decode_bench.decode_stats(res.completion_tokens, res.ttft_s, res.latency_s, res.meta_info, "none",
                                  res.first_chunk_tokens)
    assert s["tok_s"] == pytest.approx(6 / (res.latency_s - res.ttft_s))


def test_decode_stats_leaves_the_first_chunks_tokens_out():
    s = decode_bench.decode_stats(101, 1.0, 3.0, {}, "none", first_chunk_tokens=5)
    assert s["tok_s"] == pytest.approx(96 / 2.0) and s["verify_step_ms"] == pytest.approx(2e3 / 96)
    assert not s["steps_estimated"] and s["first_chunk_tokens"] == 5
    # speculation: 4 tokens beyond the prefill's one in the first chunk, ~1 verify step at accept 4
    meta = {"spec_verify_ct": 25, "spec_accept_length": 4.0}
    s = decode_bench.decode_stats(101, 1.0, 3.0, meta, "ngram", first_chunk_tokens=5)
    assert s["steps_estimated"] and s["verify_step_ms"] == pytest.approx(2e3 / 24)
    # 7 tokens after the prefill's at 128 / 19 = 6.74 a step: one verify step, not two
    s = decode_bench.decode_stats(128, 1.0, 1.09, {"spec_verify_ct": 19}, "ngram", first_chunk_tokens=8)
    assert s["verify_step_ms"] == pytest.approx(90 / 18)
    with pytest.raises(ValueError, match="nothing to time after the first chunk"):
        decode_bench.decode_stats(5, 1.0, 3.0, {}, "none", first_chunk_tokens=5)


@pytest.mark.parametrize("meta,n,match", [
    ({"completion_tokens": 9, "finish_reason": {"type": "stop"}}, 9, "'stop' after 9 of 9"),
    ({"completion_tokens": 7, "finish_reason": {"type": "length"}}, 9, "after 7 of 9")])
def test_check_finished_refuses_a_short_or_stopped_request(meta, n, match):
    res = service.GenerateResult([], meta, 0.1, 1.0)
    with pytest.raises(service.ServerError, match=match):
        decode_bench.check_finished(res, n)
    decode_bench.check_finished(service.GenerateResult([], {"completion_tokens": n}, 0.1, 1.0), n)


def test_run_matrix_says_which_contexts_it_drops_and_leaves_no_model_folders(fake, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("FAKE_MODE", "serve")
    lines = []
    res = decode_bench.run_matrix(model="k2_tp8_slice", layers=3, backends=["triton"], contexts=[64, 10_000_000],
                                  spec=["none"], decode_tokens=12, tp=1, nvml=False, expert=False,
                                  progress=False, launcher=fake, log_dir=tmp_path / "logs", log=lines.append)
    assert [r["ctx"] for r in res.decode] == [64] and not res.failures
    assert any("contexts [10000000]" in line and "not measured" in line for line in lines)
    assert not list(tmp_path.glob("sm120_models_*"))


def test_cli_names_a_bad_argument_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        decode_bench.main(["--tp", "1", "--mem-fraction-static", "1.5", "--no-record"])
    assert e.value.code == 2
    assert "mem_fraction_static: must be in (0, 1)" in capsys.readouterr().err


@pytest.mark.parametrize("args, match", [
    (["--seed", "-5000", "--no-record"], "seed: must be an int >= 0, got -5000"),
    (["--log-dir", "{tmp}/afile", "--no-record"], "log_dir: {tmp}/afile exists and is not a folder"),
    (["--results-dir", "{tmp}/afile/results"], "results_dir: cannot write into {tmp}/afile/results"),
    (["--tp", "2", "--no-record"], "tp: 2 needs 2 GPUs, and only 1 is visible here"),
])
def test_cli_refuses_bad_run_arguments_before_any_launch(fake, tmp_path, monkeypatch, capsys, args, match):
    """Each of these used to surface only after a server had started: a failure record per server,
    or a traceback from the failure handler itself."""
    launched = []

    class Server(SGLangServer):   # the CLI's servers, on the fake; tp is checked against 1 GPU
        def __init__(self, cfg, **kw):
            launched.append(cfg.attention_backend)
            super().__init__(cfg, **{**kw, "launcher": fake})

    monkeypatch.setattr(decode_bench, "SGLangServer", Server)
    monkeypatch.setattr(service, "known_gpu_count", lambda: 1)
    monkeypatch.setenv("FAKE_MODE", "serve")
    (tmp_path / "afile").write_text("")
    argv = ["--tp", "1", "--layers", "3", "--backends", "triton", "--spec", "none", "--contexts", "64",
            "--decode-tokens", "8", "--no-nvml", "--no-expert", "--log-dir", str(tmp_path / "logs")]
    with pytest.raises(SystemExit) as e:
        decode_bench.main(argv + [a.format(tmp=tmp_path) for a in args])
    assert e.value.code == 2 and match.format(tmp=tmp_path) in capsys.readouterr().err
    assert launched == [] and not (tmp_path / "logs").exists()


def test_cli_turns_only_the_validation_steps_errors_into_usage_errors(monkeypatch, capsys):
    """A ValueError after servers have run is the run's failure: not exit 2 with a usage line."""
    def run(**kw):
        raise ValueError("raised after a server ran")

    monkeypatch.setattr(decode_bench, "run_matrix", run)
    with pytest.raises(ValueError, match="raised after a server ran"):
        decode_bench.main(["--tp", "1", "--no-record"])
    assert "usage:" not in capsys.readouterr().err

    def refused(**kw):
        raise decode_bench.MatrixArgumentError("seed: must be an int >= 0, got -1")

    monkeypatch.setattr(decode_bench, "run_matrix", refused)
    with pytest.raises(SystemExit) as e:
        decode_bench.main(["--tp", "1", "--no-record"])
    assert e.value.code == 2 and "error: seed: must be an int >= 0" in capsys.readouterr().err


def test_nvml_samples_the_request_alone(monkeypatch):
    """The NVML window opens after the expert recorder starts and closes before it stops: it holds
    the request (prefill and decode) and no HTTP call of the recorder's."""
    from sm120_workbook import nvml_sampler

    events = []

    class Sampler:
        rows = [(0.0, 0, "sm_util_pct", 50.0)]
        errors, THREAD_ERRORS, measured_interval_s = {}, ("sampler", "stop"), None
        failure = None

        def __init__(self, interval_s, gpus=None):
            pass

        def start(self):
            events.append("sampler start")
            return self

        def stop(self):
            events.append("sampler stop")

    class Server:
        def start_expert_record(self):
            events.append("recorder start")

        def stop_expert_record(self):
            events.append("recorder stop")

    monkeypatch.setattr(nvml_sampler, "NvmlSampler", Sampler)
    monkeypatch.setattr(decode_bench, "measure_decode", lambda *a: events.append("request") or {"tok_s": 1.0})
    monkeypatch.setattr(decode_bench, "_expert_record", lambda srv, tp, buffer, rows, ep: {"counts": []})
    row, nv, ex = decode_bench._measure_point(Server(), 4096, 8, {"vocab_size": 100}, 0, True, 0.2, True, 1)
    assert events == ["recorder start", "sampler start", "request", "sampler stop", "recorder stop"]
    assert row == {"tok_s": 1.0} and nv[0]["metric"] == "sm_util_pct" and ex == {"counts": []}


def test_a_point_whose_nvml_sampling_failed_is_not_recorded_as_sampled(monkeypatch):
    """A sampler whose thread ended early (or outlived stop()) says so in `failure`: the point
    keeps no cut series, which would read as an idle GPU, and names the error."""
    from sm120_workbook import nvml_sampler

    class Sampler:
        rows = [(0.0, 0, "sm_util_pct", 50.0)]
        errors, THREAD_ERRORS, measured_interval_s = {}, ("sampler", "stop"), None
        failure = "sampling stopped at 0.0 s: OSError('driver went away')"

        def __init__(self, interval_s, gpus=None):
            pass

        def start(self):
            return self

        def stop(self):
            pass

    monkeypatch.setattr(nvml_sampler, "NvmlSampler", Sampler)
    monkeypatch.setattr(decode_bench, "measure_decode", lambda *a: {"tok_s": 1.0})
    row, nv, ex = decode_bench._measure_point(object(), 4096, 8, {"vocab_size": 100}, 0, True, 0.2, False, 1)
    assert nv == [] and row == {"tok_s": 1.0, "nvml_error": Sampler.failure} and ex is None
