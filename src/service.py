"""A live SGLang server as a context manager: launch, wait until healthy, talk to it, and
always tear it down (its whole process group), whatever happens in between.

    with SGLangServer(ServerConfig(model_path=dir, attention_backend="triton")) as srv:
        result = srv.generate(input_ids, max_new_tokens=64)

`python -m sglang.launch_server` runs as a real subprocess in its own session (so a kernel
interrupt in Jupyter reaches only us, and we decide how the server ends). Teardown sends
SIGTERM to the process group, then SIGKILL after a grace period, on normal exit, on any
exception, on KeyboardInterrupt, and from a finalizer at interpreter exit, so no orphan keeps
the GPUs. Everything that can be checked before launching is checked before launching: the
attention backend name, the context length against the model config, the port.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as md
import json
import math
import numbers
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Iterable, Sequence

from . import project_root
from .dummy_models import EAGLE3_HEADS, eagle3_aux_layers, heads_per_rank, max_context

DEFAULT_HOST = "127.0.0.1"
# Attention backends that our plugin (the `sglang.srt.plugins` entry point of this project)
# adds to SGLang's choices when it loads in the launcher process.
try:
    from .patches import BACKEND_NAME as _PLUGIN_BACKEND
    from .patches.mha_draft import MHA_DRAFT_BACKEND as _PLUGIN_MHA_DRAFT_BACKEND
except ImportError:  # the plugin package is absent from this copy
    _PLUGIN_BACKEND, _PLUGIN_MHA_DRAFT_BACKEND = "sm120_mla", "flashinfer"
PLUGIN_BACKENDS = (_PLUGIN_BACKEND,)
SPEC_ALGORITHMS = {"none": None, "ngram": "NGRAM", "dflash": "DFLASH", "eagle": "EAGLE", "eagle3": "EAGLE3"}
# Models whose EAGLE draft SGLang 0.5.17 builds from the model's own MTP layer (NextN), drafting
# from --model-path itself (arg_groups/speculative_hook.py, _handle_eagle_family).
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
# The EAGLE family: draft steps and tree width (--speculative-num-steps, --speculative-eagle-topk).
# "eagle" drafts with the model's MTP layer; "eagle3" with an EAGLE3 draft folder (for Kimi K2.x
# an MLA head, SGLang's Eagle3DeepseekV2ForCausalLM, or a Llama one with MHA attention;
# dummy_models.materialize_eagle3_draft writes either).
EAGLE_SPECS = ("eagle", "eagle3")
EAGLE3_DRAFT_ARCHITECTURES = tuple(EAGLE3_HEADS.values())
# The draft attention backend an EAGLE3 Llama head (MHA) takes under sm120_mla unless one is given,
# the plugin's choice in SGLang's server-argument hook (patches.mha_draft: on Triton its draft extend
# reads the prefix with one CTA a head; H200, 64k: 12.2 ms a step on Triton, 6.4 ms on FlashInfer's
# fa2 kernels; NOTES session 37). Records read what ran from /server_info.
MHA_EAGLE3_DRAFT_BACKEND = _PLUGIN_MHA_DRAFT_BACKEND
# Speculation modes with a draft model of its own: its passes go through SGLang's expert recorder
# (empty rows), and --speculative-draft-attention-backend names its attention backend.
DRAFT_MODEL_SPECS = ("dflash", "eagle", "eagle3")
# The backends SGLang 0.5.17 runs a DFlash draft on when its prefill backend is one of them
# (arg_groups/speculative_hook.py, _resolve_dflash_draft_attention_backend; trtllm_mha only for an
# all-sliding or causal draft, which DFlash's is not); any other, sm120_mla included, falls back to
# flashinfer on CUDA. tests/test_plugin.py holds this against SGLang's own function.
DFLASH_DRAFT_BACKENDS = ("flashinfer", "fa3", "fa4", "triton")


def dflash_draft_backend(attention_backend: str | None, prefill_backend: str | None = None) -> str:
    """The backend SGLang gives a DFlash draft none is named for: the prefill backend
    (`prefill_backend`, else `attention_backend`) where DFLASH_DRAFT_BACKENDS has it, else
    flashinfer. Under sm120_mla that is FlashInfer (H200, 16 layers: NOTES session 38)."""
    prefill = prefill_backend or attention_backend
    return prefill if prefill in DFLASH_DRAFT_BACKENDS else "flashinfer"


def usual_draft_backend(spec: str, decode_backend: str, prefill_backend: str | None = None,
                        mha_eagle3_head: bool = False) -> str:
    """The attention backend a draft runs on when its server names none: the plugin's for an EAGLE3
    Llama head (`mha_eagle3_head`) under sm120_mla (patches.mha_draft: MHA_EAGLE3_DRAFT_BACKEND),
    else SGLang's (dflash_draft_backend for DFlash, the decode backend for EAGLE(3))."""
    if spec == "eagle3" and mha_eagle3_head and decode_backend == _PLUGIN_BACKEND:
        return MHA_EAGLE3_DRAFT_BACKEND
    return dflash_draft_backend(decode_backend, prefill_backend) if spec == "dflash" else decode_backend


# Backends whose KV pages are larger than one token (SGLang snaps FlashMLA to 64).
# The page size SGLang 0.5.17 forces on these backends (arg_groups/overrides.py,
# _mla_backend_page_constraints): NGRAM's tree breadth has to follow it, and records name it.
PAGED_BACKENDS = {"flashmla": 64, "cutlass_mla": 128, "trtllm_mla": 64, "tokenspeed_mla": 64,
                  "cutedsl_mla": 64, "hpc_ops": 64}
# Backends SGLang 0.5.17 runs an EAGLE tree (topk > 1) on with pages above one token
# (arg_groups/speculative_hook.py, _PAGE_TREE_SPEC_BACKENDS).
PAGED_TREE_BACKENDS = ("flashinfer", "fa3", "triton")
LOG_TAIL_LINES = 60
# /generate: the longest silence from the server, before the first chunk (the first token: at
# most 41 s in the H200 records, 128k on 16 layers with the Triton prefill; on a fresh machine a
# server's first prompt longer than one chunk can wait 16-33 s more while kernels are built) or
# between two chunks, before the request is given up as stalled (it was requests' read timeout of
# 1,800 s)
STALL_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
EXPERT_DUMP_GLOB = "expert_distribution_recorder_*.pt"


class ServerError(RuntimeError):
    """The SGLang server could not be started or talked to."""


class PortInUseError(ServerError):
    pass


class ServerStartError(ServerError):
    """The server died or never became healthy; `log_tail` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = "", log_path: Path | None = None):
        super().__init__(message)
        self.log_tail = log_tail
        self.log_path = log_path


# SGLang 0.5.17's expert recorder and DFlash: with the recorder's unbounded buffer, every DFlash
# server of session 32 (16 layers, H200; triton and sm120_mla alike) stopped in its first recorded
# request. The mechanism, in SGLang's source and reproduced on the CPU with its own recorder
# (tests/test_service.py): every ModelRunner forward, the draft's included, goes through the one
# global recorder; DFlashWorkerV2 runs the draft's forward under torch.inference_mode and the
# target's under no_grad; and the unbounded step buffer (--expert-distribution-recorder-buffer-size
# -1) reallocates when full (at the 129th append, the 257th, ...; a dump keeps its size), in the
# grad mode of the pass that fills it. Grown by a draft pass, it is an inference tensor the
# target's next pass may not write. Which pass that is depends on the chunks of the requests
# recorded before: session 32's first recorded request had two prefill chunks, which puts draft
# passes on the odd appends from the 3rd; 9880eff's 4-layer servers, which ran, had one (4k), which
# puts target passes there. So that pair is refused whatever the shape. A circular buffer (a
# positive size) is allocated once, at start-up, and never grown: DFlash servers record with one.
DFLASH_RECORDER_CRASH = ("SGLang 0.5.17's expert recorder with an unbounded buffer (expert_record_buffer -1) can "
                         "stop a DFlash server mid-request (RuntimeError: Inplace update to inference "
                         "tensor outside InferenceMode; so it did to every recording DFlash server of "
                         "session 32 on the H200, with triton and sm120_mla alike)")


# ---- what SGLang accepts ------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _server_args_module():
    """sglang.srt.server_args, imported without the UserWarnings some of SGLang's modules print on
    a machine without a usable Triton (a notebook's checked cell would keep them as its output)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")
            from sglang.srt import server_args
    except Exception as e:  # noqa: BLE001 - any import failure means we cannot validate
        raise ServerError(f"cannot import sglang.srt.server_args to validate the launch: {e!r}") from e
    return server_args


def installed_attention_backends() -> tuple[str, ...]:
    """SGLang's own --attention-backend choices (sglang.srt.server_args, as installed)."""
    return tuple(_server_args_module().ATTENTION_BACKEND_CHOICES)


# Every flag launch_args may emit, for any config (a test reads them from its source), and
# --disable-cuda-graph (the config's cuda_graph too): extra_args may set none of them.
CONFIG_FLAGS = ("--model-path", "--load-format", "--skip-tokenizer-init", "--attention-backend", "--tp",
                "--mem-fraction-static", "--host", "--port", "--decode-attention-backend",
                "--prefill-attention-backend", "--speculative-attention-mode", "--context-length", "--page-size",
                "--enable-metrics", "--expert-distribution-recorder-mode",
                "--expert-distribution-recorder-buffer-size", "--speculative-algorithm",
                "--speculative-num-draft-tokens", "--speculative-draft-model-path",
                "--speculative-draft-attention-backend", "--speculative-num-steps", "--speculative-eagle-topk",
                "--speculative-ngram-max-bfs-breadth", "--cuda-graph-max-bs-decode",
                "--cuda-graph-backend-decode", "--cuda-graph-backend-prefill", "--warmups", "--disable-cuda-graph")


@functools.lru_cache(maxsize=1)
def _server_args_parser():
    """SGLang's own parser of launch arguments, reporting only what it is given (no defaults, nothing
    required), raising instead of exiting; built once (parsing leaves it as it is)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    _server_args_module().ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        action.default, action.required = argparse.SUPPRESS, False
    return parser


def extra_args_fields(extra_args: Sequence[str]) -> set[str]:
    """The ServerArgs fields `extra_args` set, as SGLang's parser reads them: an alias (--tp-size
    for --tp) or an abbreviation (--page for --page-size) names the same field."""
    import argparse

    try:
        given, _ = _server_args_parser().parse_known_args(list(extra_args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"extra_args: SGLang's parser refuses {list(extra_args)!r} ({e})") from None
    return set(vars(given))


@functools.lru_cache(maxsize=1)
def config_fields() -> frozenset[str]:
    """The ServerArgs fields that launch_args sets from a config's own fields (CONFIG_FLAGS)."""
    by_flag = {o: a.dest for a in _server_args_parser()._actions for o in a.option_strings}
    fields = set()
    for flag in CONFIG_FLAGS:   # launch_args's --tp is an abbreviation, as argparse resolves it
        fields |= {by_flag[flag]} if flag in by_flag else {d for o, d in by_flag.items() if o.startswith(flag)}
    return frozenset(fields)


def plugin_installed() -> bool:
    """Whether SGLang will find this project's plugin (installed entry point, not just a path)."""
    eps = md.entry_points(group="sglang.srt.plugins")
    return any(ep.value.split(":")[0].startswith("sm120_workbook") for ep in eps)


def attention_backend_choices() -> list[str]:
    return sorted(set(installed_attention_backends()) | set(PLUGIN_BACKENDS))


def warmup_choices() -> list[str]:
    """The names `--warmups` accepts: SGLang's warm-up registry with our plugin's added."""
    try:
        from sglang.srt.entrypoints.warmup import _warmup_registry
    except Exception as e:  # noqa: BLE001 - any import failure means we cannot validate
        raise ServerError(f"cannot import sglang.srt.entrypoints.warmup to validate warm-ups: {e!r}") from e
    from .patches.warmup import WARMUP_NAME
    return sorted(set(_warmup_registry) | {WARMUP_NAME})


def check_warmups(names) -> None:
    """Every name a registered warm-up: SGLang only logs a warning for an unknown one."""
    from .patches.warmup import WARMUP_NAME

    if isinstance(names, str) or not all(isinstance(n, str) and n and "," not in n for n in names):
        raise ValueError(f"warmups: a sequence of warm-up names, got {names!r}")
    choices = warmup_choices()
    for name in names:
        _check_choice("warmups", "a warm-up", name, choices, from_plugin=name == WARMUP_NAME)


def check_attention_backend(name: str, arg: str = "attention_backend") -> None:
    _check_choice(arg, "an attention backend", name, attention_backend_choices(),
                  from_plugin=name in PLUGIN_BACKENDS)


def _check_choice(arg: str, kind: str, name: str, choices, from_plugin: bool) -> None:
    """`name` among SGLang's choices (ours added); a name of our plugin needs its entry point
    installed, or SGLang's launcher would not know it."""
    if name not in choices:
        raise ValueError(f"{arg}: {name!r} is not {kind} of the installed SGLang or of our "
                         f"plugin; choices: {', '.join(choices)}")
    if from_plugin and not plugin_installed():
        raise ValueError(f"{arg}: {name!r} comes from this project's SGLang plugin, whose entry "
                         "point is not installed here; install the project (pip install "
                         "--no-deps .) so SGLang's launcher finds it")


def known_gpu_count() -> int | None:
    """CUDA GPUs this process may use (CUDA_VISIBLE_DEVICES respected); None where torch cannot
    count them (not installed, or its query failed). A machine without a driver counts 0."""
    try:
        import torch
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch or a broken one: the count is unknown
        return None


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use (CUDA_VISIBLE_DEVICES respected); no torch: none."""
    return known_gpu_count() or 0


def resolve_tp(tp: int) -> int:
    """tp = -1 means every visible GPU."""
    if isinstance(tp, bool) or not isinstance(tp, int):   # True would pass as tp 1
        raise ValueError(f"tp: must be -1 (all visible GPUs) or a positive int, got {tp!r}")
    if tp == -1:
        n = visible_gpu_count()
        if n < 1:
            raise ServerError("tp=-1 asks for every visible GPU, but no CUDA GPU is visible")
        return n
    if tp < 1:
        raise ValueError(f"tp: must be -1 (all visible GPUs) or a positive int, got {tp!r}")
    return tp


def check_tp_visible(tp: int) -> None:
    """tp no more than the GPUs this process sees, where torch can count them: otherwise SGLang
    fails only once its tp workers start, a start failure after the launch. Only a launch of
    SGLang itself needs it: a test's fake server runs on none."""
    n = known_gpu_count()
    if n is None or tp <= n:
        return
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"only {n} {'is' if n == 1 else 'are'} visible" if n else "no CUDA GPU is visible"
    raise ValueError(f"tp: {tp} needs {tp} GPU{'s' if tp > 1 else ''}, and {seen} here"
                     + (f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""))


# ---- ports --------------------------------------------------------------------------------

def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port) -> None:
    """A TCP port a server can listen on: 0 would bind a port of the OS's choosing, which passes
    the free-port check and leaves /health asked on the wrong one until the start-up timeout."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port: must be an int in 1..65535, got {port!r}")


def check_port_free(port: int, host: str = DEFAULT_HOST) -> None:
    """Raise PortInUseError naming the port when something holds it."""
    check_port(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # The server's own socket uses SO_REUSEADDR, so only a live holder should count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(
                f"port {port} on {host} is already in use ({e.strerror}); stop whatever holds "
                f"it (e.g. an earlier server: `ss -ltnp | grep :{port}`) or choose another port"
            ) from None


# ---- configuration ------------------------------------------------------------------------

@dataclasses.dataclass
class ServerConfig:
    """Everything that decides how one SGLang server is launched."""

    model_path: str | Path
    attention_backend: str = "triton"
    # A prefill on another backend (SGLang's hybrid backend); decode and target-verify stay on
    # attention_backend (--speculative-attention-mode decode). None: one backend for all.
    prefill_attention_backend: str | None = None
    # The same hybrid spelt with the prefill backend as --attention-backend and attention_backend
    # as --decode-attention-backend: SGLang resolves the same two backends, but gates its chunked
    # prefix cache (MHA for prompt chunks after the first) on --attention-backend alone.
    prefill_as_base: bool = False
    tp: int = -1                             # -1: every visible GPU
    mem_fraction_static: float = 0.8
    context_length: int | None = None
    page_size: int | None = None
    spec: str = "none"                      # "none" | "ngram" | "dflash" | "eagle" | "eagle3"
    num_draft_tokens: int | None = None
    draft_model_path: str | Path | None = None
    # --speculative-draft-attention-backend. None: SGLang's choice with the plugin's step
    # (usual_draft_backend): MHA_EAGLE3_DRAFT_BACKEND for an EAGLE3 Llama head under sm120_mla
    # (patches.mha_draft); for DFlash dflash_draft_backend (FlashInfer under sm120_mla); for EAGLE(3)
    # the decode backend: with sm120_mla an MLA draft (the MTP layer, an EAGLE3-MLA head) decodes
    # and extends on the kernel (patches.install_spec_compat).
    draft_attention_backend: str | None = None
    # EAGLE and EAGLE3: draft steps and tree width (SGLang's own choice for DeepSeek-V3, 3 and 1);
    # num_draft_tokens defaults to steps + 1 (a chain) at topk 1.
    eagle_steps: int = 3
    eagle_topk: int = 1
    ngram_max_bfs_breadth: int | None = None
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = 4        # batch 1 is measured; small graphs start faster
    enable_metrics: bool = True
    expert_record: bool = True               # --expert-distribution-recorder-mode stat
    # Forward passes the recorder keeps between a start and a dump: -1 an unbounded buffer that
    # grows when full (not with a draft model: DFLASH_RECORDER_CRASH); N > 0 a circular buffer of N passes,
    # allocated at start-up, which overwrites the oldest pass beyond N.
    expert_record_buffer: int = -1
    # SGLang warm-ups run before the server listens (--warmups), e.g. patches.warmup's
    # "sm120_long_prompt", which takes the first long prompt's kernel builds out of requests.
    warmups: tuple[str, ...] = ()
    host: str = DEFAULT_HOST
    port: int | None = None                  # None: a free port is picked
    extra_args: tuple[str, ...] = ()

    def base_attention_backend(self) -> str:
        """What --attention-backend names (and /server_info reports): the prefill backend for a
        hybrid spelt prefill_as_base, else attention_backend."""
        if self.prefill_attention_backend is not None and self.prefill_as_base:
            return self.prefill_attention_backend
        return self.attention_backend

    def model_config(self) -> dict:
        path = Path(self.model_path) / "config.json"
        if not path.is_file():
            raise ValueError(f"model_path: {path} does not exist")
        return json.loads(path.read_text())


def check_mem_fraction_static(value) -> None:
    """--mem-fraction-static: a number in (0, 1), else an error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"mem_fraction_static: must be in (0, 1), got {value!r}")


def check_int(name: str, value, least: int = 1) -> None:
    """An int (not a bool) of at least `least`, else an error naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        need = "a positive int" if least == 1 else f"an int >= {least}"
        raise ValueError(f"{name}: must be {need}, got {value!r}")


def eagle_verify_tokens(eagle_steps: int, eagle_topk: int = 1, draft_tokens: int | None = None,
                        name: str = "num_draft_tokens") -> int:
    """The tokens an EAGLE or EAGLE3 server verifies a request: a chain's (topk 1) steps + 1, where
    `draft_tokens` is None or that; a tree's (topk > 1) `draft_tokens`, which it needs, within what
    its steps offer (SGLang picks draft_tokens - 1 of topk + (steps - 1) x topk^2 candidates,
    eagle_utils.organize_draft_results). Errors name `name`, the caller's argument for the count."""
    check_int("eagle_steps", eagle_steps)
    check_int("eagle_topk", eagle_topk)
    chain = eagle_steps + 1
    if draft_tokens is None:
        if eagle_topk != 1:
            raise ValueError(f"{name}: an EAGLE tree (eagle_topk {eagle_topk}) needs it given")
        return chain
    check_int(name, draft_tokens, least=2)
    if eagle_topk == 1 and draft_tokens != chain:
        raise ValueError(f"{name}: a chain of {eagle_steps} EAGLE steps verifies {chain} tokens, got {draft_tokens}")
    offered = eagle_topk + (eagle_steps - 1) * eagle_topk ** 2
    if draft_tokens - 1 > offered:
        raise ValueError(f"{name}: {eagle_steps} EAGLE steps at topk {eagle_topk} offer {offered} draft "
                         f"tokens, fewer than the {draft_tokens - 1} that {draft_tokens} verified tokens need")
    return draft_tokens


def check_positive(name: str, value) -> None:
    """A finite number above 0 (a timeout, an interval), else an error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a positive number, got {value!r}")


def resolve_config(cfg: ServerConfig) -> ServerConfig:
    """Validate a config before launching and fill in what SGLang would require.

    Raises ValueError naming the argument: a value of the wrong type or range (a bool for an
    int, a port outside 1..65535, extra_args as one string), unknown backend, context longer
    than the model allows, tp not dividing the heads, a DFlash draft that does not match the
    target, EAGLE on a model without an MTP layer, EAGLE3 without an EAGLE3 draft folder. Fills
    in page_size, NGRAM's draft tokens and tree breadth, EAGLE's verified tokens and a free port.
    """
    cfg = dataclasses.replace(cfg)
    model = cfg.model_config()
    check_attention_backend(cfg.attention_backend)
    if cfg.prefill_attention_backend is not None:
        check_attention_backend(cfg.prefill_attention_backend, "prefill_attention_backend")
    elif cfg.prefill_as_base:
        raise ValueError("prefill_as_base: needs a prefill_attention_backend to put first")
    cfg.tp = resolve_tp(cfg.tp)
    heads_per_rank(model, cfg.tp)  # raises when tp does not divide the heads
    check_mem_fraction_static(cfg.mem_fraction_static)
    # SGLang's parser would take none of these as given (a float, a bool's str, 0 or less)
    for name in ("page_size", "cuda_graph_max_bs", "ngram_max_bfs_breadth"):
        if getattr(cfg, name) is not None:
            check_int(name, getattr(cfg, name))
    if not isinstance(cfg.extra_args, (list, tuple)) or not all(isinstance(a, str) for a in cfg.extra_args):
        # one string would be launched a character an argument
        raise ValueError(f"extra_args: a list or tuple of str, one launch argument each, got {cfg.extra_args!r}")
    cfg.extra_args = tuple(cfg.extra_args)
    if cfg.port is not None:
        check_port(cfg.port)
    limit = max_context(model)
    if cfg.context_length is not None:
        check_int("context_length", cfg.context_length)
        if cfg.context_length > limit:
            raise ValueError(f"context_length: {cfg.context_length} is longer than the model "
                             f"allows ({limit} from its config's max_position_embeddings)")
    if cfg.warmups:
        check_warmups(cfg.warmups)   # before tuple(): one name as a str would become its letters
    cfg.warmups = tuple(cfg.warmups)
    if (isinstance(cfg.expert_record_buffer, bool) or not isinstance(cfg.expert_record_buffer, numbers.Integral)
            or cfg.expert_record_buffer == 0 or cfg.expert_record_buffer < -1):
        raise ValueError(f"expert_record_buffer: -1 (unbounded) or a positive number of forward "
                         f"passes, got {cfg.expert_record_buffer!r}")
    cfg.expert_record_buffer = int(cfg.expert_record_buffer)
    if cfg.spec not in SPEC_ALGORITHMS:
        raise ValueError(f"spec: must be one of {sorted(SPEC_ALGORITHMS)}, got {cfg.spec!r}")
    if cfg.num_draft_tokens is not None and cfg.spec != "none":
        # one token verifies nothing beyond the bonus token (and SGLang then reports no verify steps)
        check_int("num_draft_tokens", cfg.num_draft_tokens, least=2)
    if cfg.page_size is None:
        cfg.page_size = default_page_size(cfg.attention_backend, cfg.prefill_attention_backend)
    if cfg.spec == "ngram":
        if cfg.num_draft_tokens is None:
            cfg.num_draft_tokens = 8
        # SGLang refuses NGRAM trees (breadth > 1) on paged backends other than flashinfer.
        if cfg.ngram_max_bfs_breadth is None and (cfg.page_size or 1) > 1:
            cfg.ngram_max_bfs_breadth = 1
    if cfg.draft_attention_backend is not None:
        check_attention_backend(cfg.draft_attention_backend, "draft_attention_backend")
    if cfg.spec in EAGLE_SPECS:
        _resolve_eagle(cfg, model)
    if cfg.spec == "dflash":
        if cfg.draft_model_path is None:
            raise ValueError("draft_model_path: DFlash needs a draft model folder")
        dpath = Path(cfg.draft_model_path) / "config.json"
        if not dpath.is_file():
            raise ValueError(f"draft_model_path: {dpath} does not exist")
        dflash = json.loads(dpath.read_text()).get("dflash_config", {})
        if dflash.get("num_target_layers") != model["num_hidden_layers"]:
            raise ValueError(f"draft_model_path: draft expects {dflash.get('num_target_layers')} "
                             f"target layers, the model has {model['num_hidden_layers']}")
        block = dflash.get("block_size")
        if cfg.num_draft_tokens is None:
            cfg.num_draft_tokens = block
        if block is not None and cfg.num_draft_tokens != block:
            raise ValueError(f"num_draft_tokens: {cfg.num_draft_tokens} differs from the draft's "
                             f"block_size {block} (SGLang requires them equal for DFlash)")
    if cfg.spec in DRAFT_MODEL_SPECS and cfg.expert_record and cfg.expert_record_buffer < 0:
        # EAGLE's draft passes (the MTP layer, whose routing SGLang leaves out, or an EAGLE3 head,
        # dense) go through the recorder too, as DFlash's do: the same unbounded buffer.
        why = DFLASH_RECORDER_CRASH + ("" if cfg.spec == "dflash" else
                                       f"; {cfg.spec.upper()}'s draft passes go through the recorder as DFlash's do")
        raise ValueError(f"expert_record_buffer: {why}; give {cfg.spec} a circular buffer (a positive "
                         "expert_record_buffer above a recorded request's forward passes) or "
                         "expert_record=False")
    if cfg.num_draft_tokens is not None and cfg.attention_backend == _PLUGIN_BACKEND:
        from .kernels.verify_attention import MAX_Q_LEN

        if cfg.num_draft_tokens > MAX_Q_LEN:
            raise ValueError(f"num_draft_tokens: {cfg.num_draft_tokens} exceed the {_PLUGIN_BACKEND} "
                             f"kernel's {MAX_Q_LEN} queries per request")
    if cfg.port is None:
        cfg.port = free_port(cfg.host)
    # SGLang's parser keeps the last of a repeated flag: an extra_args flag of a config field would
    # win there while the health check, the identity check and the records went on with the field
    clash = sorted(extra_args_fields(cfg.extra_args) & config_fields()) if cfg.extra_args else []
    if clash:
        raise ValueError(f"extra_args: sets {clash}, which the config's own fields set; use those fields instead")
    return cfg


def _resolve_eagle(cfg: ServerConfig, model: dict) -> None:
    """EAGLE with the model's own MTP layer, as SGLang serves DeepSeek-V3 (the config must have one;
    no separate draft folder), or EAGLE3 with a draft folder of an EAGLE3 architecture; for both
    the chain's draft count is steps + 1."""
    if cfg.spec == "eagle":
        arch = (model.get("architectures") or [None])[0]
        if arch not in MTP_ARCHITECTURES or not model.get("num_nextn_predict_layers"):
            raise ValueError(f"model_path: EAGLE here drafts with the model's own MTP layer, which needs "
                             f"an architecture in {MTP_ARCHITECTURES} and num_nextn_predict_layers >= 1 "
                             f"in its config (this one: {arch}, {model.get('num_nextn_predict_layers')!r}); "
                             "dummy_models.materialize_model(..., mtp_layers=1) writes one")
        if cfg.draft_model_path is not None:
            raise ValueError("draft_model_path: EAGLE drafts with the model's own MTP layer (SGLang "
                             "takes --model-path); leave it None (EAGLE3 takes a draft folder)")
    else:
        if cfg.draft_model_path is None:
            raise ValueError("draft_model_path: EAGLE3 needs a draft model folder "
                             "(dummy_models.materialize_eagle3_draft writes an MLA or a Llama one)")
        dpath = Path(cfg.draft_model_path) / "config.json"
        if not dpath.is_file():
            raise ValueError(f"draft_model_path: {dpath} does not exist")
        draft = json.loads(dpath.read_text())
        arch = (draft.get("architectures") or [None])[0]
        if arch not in EAGLE3_DRAFT_ARCHITECTURES:
            raise ValueError(f"draft_model_path: an EAGLE3 draft has an architecture in "
                             f"{EAGLE3_DRAFT_ARCHITECTURES}, this one {arch!r}")
        if not ((draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                or draft.get("eagle_aux_hidden_state_layer_ids")):
            eagle3_aux_layers(int(model["num_hidden_layers"]))   # SGLang's default layers must differ
    cfg.num_draft_tokens = eagle_verify_tokens(cfg.eagle_steps, cfg.eagle_topk, cfg.num_draft_tokens)
    # what SGLang's check reads is --attention-backend
    check_eagle_tree_pages(cfg.eagle_topk, cfg.page_size, cfg.base_attention_backend())


def default_page_size(attention_backend: str, prefill_attention_backend: str | None = None) -> int | None:
    """The page size SGLang needs for these backends (None: its default, one token). One KV pool
    serves both backends of a hybrid: the larger page."""
    paged = [PAGED_BACKENDS[b] for b in (attention_backend, prefill_attention_backend) if b in PAGED_BACKENDS]
    return max(paged) if paged else None


def check_eagle_tree_pages(eagle_topk: int, page_size: int | None, base_backend: str) -> None:
    """SGLang 0.5.17 refuses an EAGLE tree (topk > 1) on pages above one token unless
    --attention-backend is one of PAGED_TREE_BACKENDS; refused here, before a start."""
    if eagle_topk > 1 and (page_size or 1) > 1 and base_backend not in PAGED_TREE_BACKENDS:
        raise ValueError(f"eagle_topk: SGLang 0.5.17 runs an EAGLE tree on pages of {page_size} tokens only "
                         f"with {PAGED_TREE_BACKENDS} as --attention-backend, not {base_backend}")


def launch_args(cfg: ServerConfig) -> list[str]:
    """The `sglang.launch_server` arguments for a resolved config."""
    hybrid = cfg.prefill_attention_backend is not None
    a = ["--model-path", str(cfg.model_path), "--load-format", "dummy", "--skip-tokenizer-init",
         "--attention-backend", cfg.base_attention_backend(), "--tp", str(cfg.tp),
         "--mem-fraction-static", str(cfg.mem_fraction_static),
         "--host", cfg.host, "--port", str(cfg.port)]
    if hybrid:   # target verify on the decode side, with the kernel
        a += (["--decode-attention-backend", cfg.attention_backend] if cfg.prefill_as_base
              else ["--prefill-attention-backend", cfg.prefill_attention_backend])
        a += ["--speculative-attention-mode", "decode"]
    if cfg.context_length is not None:
        a += ["--context-length", str(cfg.context_length)]
    if cfg.page_size is not None:
        a += ["--page-size", str(cfg.page_size)]
    if cfg.enable_metrics:
        a += ["--enable-metrics"]
    if cfg.expert_record:
        # -1 by default, an unbounded buffer: SGLang's circular default (1000 passes) would drop
        # long runs.
        a += ["--expert-distribution-recorder-mode", "stat",
              "--expert-distribution-recorder-buffer-size", str(cfg.expert_record_buffer)]
    if cfg.cuda_graph:
        if cfg.cuda_graph_max_bs is not None:
            a += ["--cuda-graph-max-bs-decode", str(cfg.cuda_graph_max_bs)]
    else:
        a += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    algo = SPEC_ALGORITHMS[cfg.spec]
    if algo:
        a += ["--speculative-algorithm", algo]
        if cfg.num_draft_tokens is not None:
            a += ["--speculative-num-draft-tokens", str(cfg.num_draft_tokens)]
    if cfg.spec in ("dflash", "eagle3"):   # EAGLE drafts with --model-path's own MTP layer
        a += ["--speculative-draft-model-path", str(cfg.draft_model_path)]
    if cfg.spec in EAGLE_SPECS:
        a += ["--speculative-num-steps", str(cfg.eagle_steps), "--speculative-eagle-topk", str(cfg.eagle_topk)]
    if cfg.spec in DRAFT_MODEL_SPECS and cfg.draft_attention_backend:
        a += ["--speculative-draft-attention-backend", cfg.draft_attention_backend]
    if cfg.spec == "ngram" and cfg.ngram_max_bfs_breadth is not None:
        a += ["--speculative-ngram-max-bfs-breadth", str(cfg.ngram_max_bfs_breadth)]
    if cfg.warmups:
        a += ["--warmups", ",".join(cfg.warmups)]
    return a + list(cfg.extra_args)


# ---- process-group teardown ---------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) from /proc/<pid>/stat, or None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    try:   # read while the process exits, the file can come back empty or cut short
        fields = raw[raw.rindex(")") + 2:].split()
        return fields[0], int(fields[1]), int(fields[2])
    except (ValueError, IndexError):
        return None


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def live_group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are still running (zombies excluded)."""
    if not Path("/proc").is_dir():  # not Linux: ask the kernel about the group as a whole
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    out = []
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st and st[2] == pgid and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def port_listeners(port: int) -> set[int | None]:
    """The pids listening on TCP `port` (None for a process this user may not inspect); empty
    when none can be seen, e.g. psutil missing (SGLang depends on it) or refused."""
    try:
        import psutil

        conns = psutil.net_connections(kind="tcp")
    except Exception:  # noqa: BLE001 (ImportError, AccessDenied on some systems): cannot tell
        return set()
    return {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def settled_files(find: Callable[[], Iterable[Path]], count: int, timeout_s: float,
                  poll_s: float) -> tuple[dict[Path, int], bool]:
    """Wait until `find()` gives at least `count` files, none empty and none grown since the look
    before (another process may still be writing them), polling every poll_s for at most
    timeout_s. Returns the files last seen, with their sizes, and whether they settled."""
    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, int] = {}
    while time.monotonic() < deadline:
        now = {p: p.stat().st_size for p in find()}
        if len(now) >= count and now == sizes and all(now.values()):
            return now, True
        sizes = now
        time.sleep(poll_s)
    return sizes, False


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children may leave the group with setsid)."""
    if not Path("/proc").is_dir():
        return []
    children: dict[int, list[int]] = {}
    for p in _all_pids():
        st = _proc_stat(p)
        if st and st[0] not in ("Z", "X"):
            children.setdefault(st[1], []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal_all(pgid: int, pids: Sequence[int], sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pgid: int, pids: Sequence[int]) -> list[int]:
    live = set(live_group_members(pgid))
    for p in pids:
        st = _proc_stat(p)
        if st and st[0] not in ("Z", "X"):
            live.add(p)
    return sorted(live)


def terminate_process_group(pgid: int, grace_s: float = 30.0, extra_pids: Sequence[int] = ()) -> list[int]:
    """SIGTERM the group (and `extra_pids`), wait up to grace_s, then SIGKILL what is left.

    Returns the pids still alive afterwards (empty when all went away).
    """
    pids = sorted(set(extra_pids) | set(descendants(pgid)))
    _signal_all(pgid, pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(pgid, pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pgid, pids):
        pids = sorted(set(pids) | set(descendants(pgid)))
        _signal_all(pgid, pids, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _alive(pgid, pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    return _alive(pgid, pids)


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except Exception:  # noqa: BLE001 - not Linux: the finalizer and teardown still apply
        return None


# Looked up here, at import, because the child runs _die_with_parent between fork and exec,
# where importing or loading a library can deadlock on a lock another thread of ours held
# at the fork (the NVML sampler, tqdm's monitor).
_PRCTL = _load_prctl() if sys.platform == "linux" else None


def _die_with_parent() -> None:
    # In the child between fork and exec: if our process is SIGKILLed (a Jupyter kernel
    # killed outright), the kernel sends the server's main process SIGTERM, and SGLang takes
    # its own workers down with it. Linux only; tied to the thread that started the server.
    _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _finalize_group(pgid: int, grace_s: float) -> None:
    # Runs from weakref.finalize (garbage collection or interpreter exit): never raise.
    try:
        terminate_process_group(pgid, grace_s)
    except Exception:  # noqa: BLE001
        pass


def _is_read_timeout(e: Exception) -> bool:
    """A read timeout: before the response's headers requests raises ReadTimeout; while a stream
    is read it raises a ConnectionError wrapping urllib3's ReadTimeoutError."""
    import requests
    import urllib3

    return isinstance(e, requests.exceptions.ReadTimeout) or any(
        isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in e.args)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a (possibly large) log file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


def default_log_dir() -> Path:
    d = project_root() / "runs" / "service_logs"
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---- the server ---------------------------------------------------------------------------

def _raise_if_aborted(chunk: dict) -> None:
    """SGLang reports an aborted request (out of KV, a scheduler error, a client abort) as an
    ordinary chunk whose finish_reason type is "abort", not as an error."""
    reason = (chunk.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise ServerError(f"/generate aborted by the server: {reason.get('message') or reason}")


@dataclasses.dataclass
class GenerateResult:
    output_ids: list[int]
    meta_info: dict
    ttft_s: float        # request sent -> first streamed chunk (prefill + first token)
    latency_s: float     # request sent -> the last chunk that carried tokens
    # meta_info["completion_tokens"] of the first chunk: SGLang's count is a running total,
    # and a first chunk merged with the next step's output holds more than the prefill's token
    first_chunk_tokens: int = 1
    chunks: int = 1      # streamed chunks that carried tokens

    @property
    def completion_tokens(self) -> int:
        return int(self.meta_info.get("completion_tokens", len(self.output_ids)))


IDENTITY_TRIES = 5   # /server_info after a healthy /health: HTTP errors tolerated, a second apart


class SGLangServer:
    """One `sglang.launch_server` subprocess, healthy inside the `with` block, gone after it.

    launcher: the command that precedes the server arguments (default: this Python with
    `-m sglang.launch_server`); tests point it at a fake server script. Only with the default
    is tp checked against the visible GPUs (check_tp_visible): another launcher's needs are its
    own. stall_timeout_s: the default of `generate`'s (the longest silence of a request's stream).
    """

    def __init__(self, config: ServerConfig, log_path: str | Path | None = None,
                 startup_timeout_s: float = 900.0, grace_s: float = 30.0,
                 launcher: Sequence[str] | None = None, env: dict | None = None,
                 progress: bool = True, validate: bool = True, stall_timeout_s: float = STALL_TIMEOUT_S):
        for name, value in (("startup_timeout_s", startup_timeout_s), ("grace_s", grace_s),
                            ("stall_timeout_s", stall_timeout_s)):
            check_positive(name, value)   # here, not minutes into a start-up
        self.config = config
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.grace_s = grace_s
        self.launcher = list(launcher) if launcher else [sys.executable, "-m", "sglang.launch_server"]
        self._sglang_launcher = not launcher
        self.env = env
        self.progress = progress
        self.validate = validate
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None   # kept after teardown, for logs and checks
        self.expert_dump_dir: Path | None = None
        self.startup_s: float | None = None
        self.server_info: dict | None = None   # /server_info once healthy: SGLang's resolved arguments
        self._finalizer = None
        self._log_file = None

    # -- lifecycle --
    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def command(self) -> list[str]:
        return self.launcher + launch_args(self.config)

    def __enter__(self) -> "SGLangServer":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.stop()
        return False

    def start(self) -> "SGLangServer":
        if self.proc is not None:
            raise ServerError("this server was already started")
        if self.validate:
            self.config = resolve_config(self.config)
            if self._sglang_launcher:
                check_tp_visible(self.config.tp)
        elif self.config.port is None:
            self.config = dataclasses.replace(self.config, port=free_port(self.config.host))
        check_port_free(self.config.port, self.config.host)
        cfg = self.config
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if self.log_path is None:
            self.log_path = default_log_dir() / f"{stamp}_{cfg.attention_backend}_{cfg.spec}_{cfg.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.expert_dump_dir = self.log_path.with_suffix("").with_name(self.log_path.stem + "_experts")
        self.expert_dump_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = str(self.expert_dump_dir)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log_file = open(self.log_path, "wb")
        t0 = time.monotonic()
        try:
            try:
                self.proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                             preexec_fn=_die_with_parent if _PRCTL is not None else None)
            except (OSError, subprocess.SubprocessError) as e:   # a start failure (DFlash's fallback runs)
                why = getattr(e, "strerror", None) or e
                raise ServerStartError(f"launcher: cannot run {self.launcher[0]!r} ({why}; log: {self.log_path})",
                                       log_tail(self.log_path), self.log_path) from e
            self.pid = self.proc.pid
            # The child leads its own process group (pgid == pid); finalize at exit or GC.
            self._finalizer = weakref.finalize(self, _finalize_group, self.proc.pid, self.grace_s)
            self._wait_ready()
        except BaseException:  # including KeyboardInterrupt: leave nothing running
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self) -> None:
        import requests
        from tqdm.auto import tqdm

        cfg = self.config
        deadline = time.monotonic() + self.startup_timeout_s
        t0 = time.monotonic()
        pause = 0.1  # grows to 1 s: quick for fakes and failures, gentle on a real start-up
        with tqdm(total=int(self.startup_timeout_s), unit="s", disable=not self.progress,
                  desc=f"SGLang {cfg.attention_backend}/{cfg.spec} tp={cfg.tp} starting",
                  bar_format="{desc}: {n_fmt}s elapsed (timeout {total_fmt}s) {postfix}") as bar:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    tail = log_tail(self.log_path)
                    raise ServerStartError(
                        f"SGLang server exited with code {rc} during start-up (log: {self.log_path})\n"
                        f"last {LOG_TAIL_LINES} lines of its log:\n{tail}",
                        tail, self.log_path)
                try:
                    if requests.get(self.url + "/health", timeout=5).status_code == 200:
                        self._check_identity()
                        return
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    tail = log_tail(self.log_path)
                    raise ServerStartError(
                        f"SGLang server not healthy after {self.startup_timeout_s:.0f} s (log: {self.log_path})\n"
                        f"last {LOG_TAIL_LINES} lines of its log:\n{tail}",
                        tail, self.log_path)
                bar.n = int(time.monotonic() - t0)
                last = log_tail(self.log_path, 1)
                bar.set_postfix_str(last[-80:], refresh=True)
                time.sleep(pause)
                pause = min(1.0, pause * 1.5)

    def _check_identity(self) -> None:
        """The server that answered is this one. The port was free at launch, but SGLang opens
        it only once the model has loaded, minutes later; a server started meanwhile on the same
        port would otherwise take every measurement under this one's name."""
        import requests

        # /health said ready: an HTTP error here may be a moment's (a few tries), not a start-up's
        for attempt in range(IDENTITY_TRIES):
            r = requests.get(self.url + "/server_info", timeout=30)
            if r.status_code == 200:
                break
            time.sleep(1.0)
        try:
            info = r.json() if r.status_code == 200 else None
        except ValueError:   # requests' JSONDecodeError, a RequestException too: the wait would retry it
            info = None
        if not isinstance(info, dict):
            # healthy but no SGLang answer: not a server to measure, whoever it is; waiting won't change it
            raise ServerStartError(
                f"/server_info on port {self.config.port}: HTTP {r.status_code}, not SGLang's JSON object "
                f"({r.headers.get('Content-Type', 'no Content-Type')}: {r.text[:200]!r}); this server "
                f"(log: {self.log_path}) is stopped\nlast {LOG_TAIL_LINES} lines of its log:\n"
                f"{log_tail(self.log_path)}", log_tail(self.log_path), self.log_path)
        self.server_info = info   # SGLang's resolved arguments, e.g. the DFlash draft's backend
        cfg = self.config
        ours = {"attention_backend": cfg.base_attention_backend(), "model_path": os.path.realpath(cfg.model_path),
                "tp_size": cfg.tp}
        theirs = {"attention_backend": info.get("attention_backend"),
                  "model_path": os.path.realpath(str(info.get("model_path", ""))), "tp_size": info.get("tp_size")}
        differ = {k: (ours[k], theirs[k]) for k in ours if theirs[k] != ours[k]}
        if not differ:   # the same settings may still be another server's: who listens on the port?
            listeners = port_listeners(cfg.port)
            if listeners and not listeners & {self.proc.pid, *descendants(self.proc.pid)}:
                pids = sorted(p for p in listeners if p is not None) or "of another user"
                differ = {"listening process": (self.proc.pid, pids)}
        if differ:
            what = "; ".join(f"{k} {t!r}, ours {o!r}" for k, (o, t) in differ.items())
            raise ServerStartError(f"port {cfg.port} is answered by another SGLang server ({what}); this one "
                                   f"(log: {self.log_path}) is stopped", log_tail(self.log_path), self.log_path)

    def stop(self) -> list[int]:
        """Tear the server down (idempotent). Returns pids that refused to die (normally [])."""
        survivors: list[int] = []
        if self.proc is not None:
            pid = self.proc.pid
            try:
                survivors = terminate_process_group(pid, self.grace_s)
            except BaseException:  # interrupted while waiting out the grace period: kill now
                _signal_all(pid, descendants(pid), signal.SIGKILL)
                raise
            finally:
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                if self._finalizer is not None:
                    self._finalizer.detach()
                # Forget the process once it is reaped: a second stop() must not signal a
                # process group whose pid the OS may have handed to someone else.
                self.proc = None
                self._close_log()
        self._close_log()
        if survivors:
            print(f"WARNING: SGLang processes {survivors} survived SIGKILL", file=sys.stderr)
        return survivors

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines) if self.log_path else ""

    # -- requests --
    def _post(self, path: str, timeout: float = 600, **kw):
        import requests

        r = requests.post(self.url + path, timeout=timeout, **kw)
        if r.status_code != 200:
            raise ServerError(f"POST {path} -> HTTP {r.status_code}: {r.text[:500]}")
        return r

    def generate(self, input_ids: Sequence[int], max_new_tokens: int, stall_timeout_s: float | None = None,
                 stream: bool = True, on_first_token=None) -> GenerateResult:
        """One /generate request of token ids, greedy, ignore_eos; timed on our side.

        With stream=True the first chunk marks the end of prefill (ttft_s), and
        `on_first_token()` (if given) is called then, e.g. to profile only the decode steps.
        A server that sends nothing for `stall_timeout_s` (default: the server's; the prefill, or
        between two chunks; with stream=False, the whole request) raises ServerError with its
        state and log tail, instead of a bare read timeout.
        """
        import requests

        if stall_timeout_s is None:
            stall_timeout_s = self.stall_timeout_s

        ids = [int(i) for i in input_ids]
        if not ids:
            raise ValueError("input_ids: must not be empty")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")
        ctx = self.config.context_length
        if ctx is not None and len(ids) + max_new_tokens > ctx:
            raise ValueError(f"input_ids: {len(ids)} tokens + {max_new_tokens} new exceed the "
                             f"server's context_length {ctx}")
        check_positive("stall_timeout_s", stall_timeout_s)
        payload = {"input_ids": ids, "stream": stream,
                   "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                       "temperature": 0.0}}
        try:
            return self._generate(payload, stream, stall_timeout_s, on_first_token)
        except (requests.exceptions.Timeout, requests.exceptions.ConnectionError,
                requests.exceptions.ChunkedEncodingError) as e:
            code = self.proc.poll() if self.proc is not None else None
            state = ("not one this SGLangServer started" if self.proc is None
                     else "still running" if code is None else f"exited with code {code}")
            if isinstance(e, requests.exceptions.ConnectTimeout):   # also a ConnectionError and a Timeout
                what = f"could not connect within {CONNECT_TIMEOUT_S:g} s"
            elif _is_read_timeout(e):
                what = f"no output for {stall_timeout_s:g} s"
            elif isinstance(e, requests.exceptions.ChunkedEncodingError):
                what = f"the stream broke off ({e})"
            else:
                what = f"connection failed ({e})"
            log = f"; log {self.log_path} ends:\n{self.log_tail(20)}" if self.log_path else ""
            raise ServerError(f"/generate: {what}; the server is {state}{log}") from e

    def _generate(self, payload: dict, stream: bool, stall_timeout_s: float, on_first_token) -> GenerateResult:
        import requests

        t0 = time.perf_counter()
        ttft, last, latency, first_tokens, chunks, seen = None, None, None, 1, 0, 0
        with requests.post(self.url + "/generate", json=payload, stream=stream,
                           timeout=(CONNECT_TIMEOUT_S, stall_timeout_s)) as r:
            if r.status_code != 200:
                raise ServerError(f"/generate -> HTTP {r.status_code}: {r.text[:500]}")
            if not stream:
                last = r.json()
                ttft = float("nan")
                latency = time.perf_counter() - t0
                _raise_if_aborted(last)
            else:
                done = False
                for line in r.iter_lines(decode_unicode=False):
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(body)
                    if "error" in chunk:
                        raise ServerError(f"/generate failed: {chunk['error']}")
                    _raise_if_aborted(chunk)
                    now = time.perf_counter() - t0
                    total = int((chunk.get("meta_info") or {}).get("completion_tokens", seen))
                    if ttft is None:
                        ttft, first_tokens = now, total
                        if on_first_token is not None:
                            on_first_token()
                    if total > seen or latency is None:   # a chunk with new tokens ends the decode so far
                        latency, seen, chunks = now, total, chunks + 1
                    last = chunk
                if not done:   # SGLang ends every stream with [DONE]; an EOF before it is a cut
                    raise requests.exceptions.ChunkedEncodingError("the stream ended before [DONE]")
        if last is None:
            raise ServerError("/generate returned no output")
        return GenerateResult(list(last.get("output_ids") or []), dict(last.get("meta_info") or {}),
                              ttft, latency, first_tokens, chunks)

    def flush_cache(self, retries: int = 10) -> None:
        import requests

        for _ in range(retries):
            r = requests.post(self.url + "/flush_cache", timeout=60)
            if r.status_code == 200:
                return
            time.sleep(0.5)  # refused while requests are still running
        raise ServerError(f"/flush_cache kept failing: HTTP {r.status_code}")

    def metrics(self) -> dict[str, float]:
        """/metrics (Prometheus text) as {name: value summed over label sets}."""
        import requests

        r = requests.get(self.url + "/metrics", timeout=60)
        if r.status_code != 200:
            raise ServerError(f"/metrics -> HTTP {r.status_code} (was --enable-metrics given?)")
        return parse_prometheus(r.text)

    # -- torch profiler (SGLang's /start_profile) --
    def start_profile(self, output_dir: str | Path, num_steps: int, profile_id: str,
                      activities: Sequence[str] = ("CPU", "GPU"), with_stack: bool = False,
                      timeout_s: float = 600) -> None:
        """Profile the next `num_steps` forward steps; each rank writes
        <output_dir>/<profile_id>-TP-<rank>.trace.json.gz when they are done. With num_steps the
        call returns only then, so run it beside the request that makes the steps. with_stack adds
        the Python calls (host time by function; a larger trace, a slower step)."""
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps: expected a positive int, got {num_steps!r}")
        self._post("/start_profile", timeout=timeout_s,
                   json={"output_dir": str(output_dir), "num_steps": num_steps, "activities": list(activities),
                         "with_stack": bool(with_stack), "record_shapes": False, "profile_id": profile_id})

    @staticmethod
    def wait_profile_traces(output_dir: str | Path, profile_id: str, ranks: int = 1,
                            timeout_s: float = 120.0) -> list[Path]:
        """The trace files of a profile, once all `ranks` exist and stopped growing."""
        sizes, settled = settled_files(lambda: Path(output_dir).glob(f"{profile_id}*.trace.json.gz"), ranks,
                                       timeout_s, poll_s=0.5)
        if settled:
            return sorted(sizes)
        raise ServerError(f"profile {profile_id}: {len(sizes)} of {ranks} traces in {output_dir} "
                          f"after {timeout_s:.0f} s")

    # -- expert distribution (SGLang's /start|stop|dump_expert_distribution_record) --
    def start_expert_record(self) -> None:
        self._post("/start_expert_distribution_record")

    def stop_expert_record(self) -> None:
        self._post("/stop_expert_distribution_record")

    def dump_expert_record(self, expected: int = 1, timeout_s: float = 60.0) -> list[Path]:
        """Ask for a dump and return the .pt files SGLang wrote for it.

        SGLang 0.5.17 (stat mode) all-reduces the counts and writes
        expert_distribution_recorder_<time>.pt, holding {"rank", "logical_count": (passes, layers,
        experts), ...}, on every rank whose MoE EP rank is 0: under TP with ep_size 1 that is every
        TP rank (tp // ep_size files, the same counts), into $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR
        (we point it at a folder per server). Then it resets the record. Returned once `expected`
        files exist and none is still growing (torch.save may be writing); the caller deletes them.
        Fewer in timeout_s is an error, and the files that came are deleted: a late one would
        otherwise be read as the next dump's.
        """
        check_int("expected", expected)
        before = set(self.expert_dump_dir.glob(EXPERT_DUMP_GLOB))
        self._post("/dump_expert_distribution_record")
        sizes, settled = settled_files(lambda: set(self.expert_dump_dir.glob(EXPERT_DUMP_GLOB)) - before, expected,
                                       timeout_s, poll_s=0.2)
        if settled:
            return sorted(sizes, key=lambda p: p.stat().st_mtime)
        for p in sizes:
            p.unlink(missing_ok=True)
        raise ServerError(f"expert distribution dump: {len(sizes)} of {expected} files in "
                          f"{self.expert_dump_dir} after {timeout_s:.0f} s")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus exposition text (SGLang's /metrics) -> {sample name: sum over its label sets},
    parsed by prometheus_client, which SGLang itself exports them with."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


SPEC_METRICS = ("sglang:spec_accept_length", "sglang:spec_accept_rate",
                "sglang:spec_verify_calls_total", "sglang:generation_tokens_total")


def spec_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The speculative-decoding counters/gauges that are present."""
    return {k: metrics[k] for k in SPEC_METRICS if k in metrics}
