"""The SGLang 0.5.17 general plugin: the `sm120_mla` attention backend and the KV sort override.

SGLang's `sglang.srt.plugins.load_plugins()` finds `load_plugin` through the entry point
(group `sglang.srt.plugins`, name `sm120_workbook`, value `sm120_workbook.patches:load_plugin`)
and calls it once per process: in the launcher (`sglang serve`, `python -m
sglang.launch_server`, `Engine.__init__`) before the server arguments are parsed, and in
every scheduler / TP worker (`run_scheduler_process`) before the model is built. Schedulers
that SGLang runs as Ray actors (sglang/srt/ray/scheduler_actor.py) call no `load_plugins()`:
there nothing of this applies.

What it does in each process:
- registers the backend name `sm120_mla` with SGLang's own `register_attention_backend`
  (sglang/srt/layers/attention/attention_registry.py) and adds it to the CLI choices with
  `add_attention_backend_choices` (sglang/srt/server_args.py). A new name changes no run
  that does not select it.
- installs the need_sort override (`kv_sort`) when $SM120_KV_SORT=1, and nothing otherwise.
- installs the NGRAM draft-prep fix (`ngram_tail`: no per-step copy of the whole prompt)
  when $SM120_NGRAM_TAIL=1, and nothing otherwise.
- installs the DFlash host-plan timing probe (`dflash_host_plan`: a DFlash draft on FlashInfer
  planned from host bounds, so no step waits on a copy of the lengths, but with wrong draft
  attention for some requests) when $SM120_DFLASH_HOST_PLAN=probe, and nothing otherwise.
- registers the warm-up `sm120_long_prompt` with SGLang's warm-up registry (`warmup`), which
  runs only where `--warmups sm120_long_prompt` asks for it.
- adds a step to SGLang's EAGLE-family server-argument hook (`mha_draft`): a draft model that
  is not MLA (an EAGLE3 Llama head) under sm120_mla, with no draft backend named, drafts on
  FlashInfer instead of falling back to Triton. Servers that do not select sm120_mla are untouched.
- when the command line selects `sm120_mla`, lets the speculative-decoding draft paths accept
  the name wherever they accept `triton` (`install_spec_compat`). A name given in a `--config`
  file or to `Engine`, which argv does not show, reaches the scheduler processes through
  $SM120_MLA_SELECTED, set by a step after SGLang checks the server's arguments before it
  launches them (`install_selection_hook`). The backend's factory also installs the patches
  when it first builds the backend. DFLASH's draft backend is SGLang's own choice: it takes the
  prefill backend where its draft runs on it, and falls back to FlashInfer for `sm120_mla`.

Importing this package changes nothing; `load_plugin()` is idempotent. Under an SGLang other
than the one it was tested with (TESTED_SGLANG, pyproject's pin) it says so in every process's
log before it patches anything.
"""
from __future__ import annotations

import functools
import logging
import os
import sys

from . import dflash_host_plan, kv_sort, mha_draft, ngram_tail, warmup
from .env_switch import install_or_warn

BACKEND_NAME = "sm120_mla"
# The backend and the patches reach into this release's internals (TritonAttnBackend's buffers and
# ForwardMetadata, the allocators, the draft factories); a CPU test holds it to pyproject's pin.
TESTED_SGLANG = "0.5.17"
_BACKEND_FLAGS = ("--attention-backend", "--decode-attention-backend",
                  "--prefill-attention-backend", "--speculative-draft-attention-backend")
_BACKEND_FIELDS = tuple(flag[2:].replace("-", "_") for flag in _BACKEND_FLAGS)   # ServerArgs' names
# Set by the selection step (install_selection_hook) where a server's arguments name sm120_mla;
# the scheduler processes inherit it.
SELECTED_ENV = "SM120_MLA_SELECTED"
_SELECTION_MARK = "_sm120_selection_original"

logger = logging.getLogger(__name__)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (Jupyter and pytest swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _ensure_log_handler() -> None:
    """Give the plugin's logger its own stderr handler.

    The launcher and `run_scheduler_process` call load_plugins() before SGLang's
    configure_logger(), so INFO lines through the (still unconfigured) root logger would be
    dropped; our own handler makes the plugin's lines show in every rank's log, once.
    """
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


# ---------------------------------------------------------------- backend registration
def _create_backend(runner):
    """The registered factory; SGLang calls it with the ModelRunner (as for `triton`)."""
    from .backend import create_backend

    return create_backend(runner)


def register_backend() -> bool:
    """Register `sm120_mla` in SGLang's backend registry and CLI choices (idempotent).

    Returns True if this call added anything.
    """
    from sglang.srt.layers.attention.attention_registry import (ATTENTION_BACKENDS,
                                                                register_attention_backend)
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    changed = False
    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not _create_backend:
        register_attention_backend(BACKEND_NAME)(_create_backend)
        changed = True
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
        changed = True
    return changed


def is_registered() -> bool:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    return ATTENTION_BACKENDS.get(BACKEND_NAME) is _create_backend and \
        BACKEND_NAME in ATTENTION_BACKEND_CHOICES


def unregister_backend() -> None:
    """Take the name out of SGLang's registry and choices again (for tests)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    if ATTENTION_BACKENDS.get(BACKEND_NAME) is _create_backend:
        del ATTENTION_BACKENDS[BACKEND_NAME]
    while BACKEND_NAME in ATTENTION_BACKEND_CHOICES:
        ATTENTION_BACKEND_CHOICES.remove(BACKEND_NAME)


def backend_selected_in(server_args) -> bool:
    """Whether a ServerArgs names `sm120_mla` in one of the fields the backend flags set."""
    return any(getattr(server_args, field, None) == BACKEND_NAME for field in _BACKEND_FIELDS)


def selection_hook_installed() -> bool:
    from sglang.srt.server_args import ServerArgs

    return hasattr(ServerArgs.__dict__["check_server_args"], _SELECTION_MARK)


def install_selection_hook() -> bool:
    """Pass a server's `sm120_mla` selection on to the processes it starts, whatever spelt it.

    argv shows a name given on the command line, not one given in a `--config` file (SGLang merges
    that into a list of its own) or to `Engine` (keywords, or a ServerArgs built before the plugin
    loaded), and the scheduler processes see only argv. So a step after `ServerArgs.check_server_args`,
    which SGLang's `Engine._launch_subprocesses` calls on every launch path that spawns processes
    (after its own `load_plugins()`, before it spawns a scheduler; Ray's actors do not inherit the
    environment), sets SELECTED_ENV where the arguments name the backend; the schedulers, spawned
    with this environment, then install the draft-name patches in their `load_plugin`. Without it
    a draft-only `sm120_mla` (a separate draft worker's check of `_SUPPORTED_DRAFT_BACKENDS` comes
    before any target backend is built) falls back to FlashInfer.
    Once set, it stays for the servers this process starts later (a draft's own ServerArgs copy must
    not clear it); the patches act only where the name reaches them, so that costs nothing.
    Returns True if this call installed the step."""
    from sglang.srt.server_args import ServerArgs

    if selection_hook_installed():
        return False
    original = ServerArgs.__dict__["check_server_args"]

    @functools.wraps(original)
    def check_server_args(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if backend_selected_in(self):
            os.environ[SELECTED_ENV] = "1"
        return result

    setattr(check_server_args, _SELECTION_MARK, original)
    ServerArgs.check_server_args = check_server_args
    return True


def uninstall_selection_hook() -> None:
    """Restore SGLang's method (for tests)."""
    from sglang.srt.server_args import ServerArgs

    original = getattr(ServerArgs.__dict__["check_server_args"], _SELECTION_MARK, None)
    if original is not None:
        ServerArgs.check_server_args = original


def backend_selected() -> bool:
    """Whether this process's command line, or its launcher's resolved arguments, name `sm120_mla`."""
    return backend_selected_in_argv() or os.environ.get(SELECTED_ENV) == "1"


def backend_selected_in_argv(argv: list[str] | None = None) -> bool:
    """Whether the command line names `sm120_mla` for an attention-backend flag.

    Scheduler processes are spawned with the launcher's sys.argv, so this holds there too.
    """
    argv = sys.argv if argv is None else argv
    for i, arg in enumerate(argv):
        for flag in _BACKEND_FLAGS:
            if arg == f"{flag}={BACKEND_NAME}":
                return True
            if arg == flag and i + 1 < len(argv) and argv[i + 1] == BACKEND_NAME:
                return True
    return False


# ---------------------------------------------------------------- speculative-decoding name patches
_compat_originals: list[tuple[object, str, object]] = []


def _patch(owner, name: str, value) -> None:
    _compat_originals.append((owner, name, owner.__dict__[name] if isinstance(owner, type)
                              else getattr(owner, name)))
    setattr(owner, name, value)


def spec_compat_installed() -> bool:
    return bool(_compat_originals)


def install_spec_compat() -> bool:
    """Let the draft-side backend choices accept `sm120_mla` where they accept `triton` (but one).

    Two places in SGLang 0.5.17 check draft backends by name:
    - `DraftBackendFactory._create_backend` (sglang/srt/speculative/draft_utils.py): the
      EAGLE / EAGLE3 multi-step draft-decode and draft-extend backends. For an MLA draft model
      (DeepSeek-V3's MTP layer, an EAGLE3-MLA head) `sm120_mla` gets the kernel's own: `Sm120MlaMultiStepDraftBackend`
      and `Sm120MlaAttnBackend`, in place of SGLang's TritonMultiStepDraftBackend and
      TritonAttnBackend; any other map (a non-MLA draft, a factory of another SGLang) gets the
      `triton` entry. `--speculative-draft-attention-backend triton` keeps the draft on Triton.
    - `_SUPPORTED_DRAFT_BACKENDS` (sglang/srt/speculative/draft_worker_common.py): the
      separate draft workers (DSpark); the name is added to the tuple. A DSpark draft is not MLA,
      so there it runs the Triton backend (the backend's log line says so, and names
      `--speculative-draft-attention-backend flashinfer`).
    Not patched: Frozen-KV MTP with topk > 1 (frozen_kv_mtp_worker_v2) accepts only `triton` and
    `trtllm_mha` by name and refuses `sm120_mla` at start-up in its own words; there
    `--speculative-draft-attention-backend triton` keeps the draft on Triton.
    A third, `_resolve_dflash_draft_attention_backend` (sglang/srt/arg_groups/speculative_hook.py),
    is left as it is: DFLASH's draft, with no backend named, takes the prefill backend, and for
    `sm120_mla` SGLang's fallback, FlashInfer, whose draft step at 64k is a fraction of Triton's
    (NOTES.md, session 38). Each patch only changes what happens when the name `sm120_mla`
    reaches it. Returns True if this call installed them.
    """
    if _compat_originals:
        return False
    from sglang.srt.speculative import draft_worker_common
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    # Both targets are read before either is patched: an SGLang without one of them gets
    # neither patch (and the caller's warning), never half of them.
    create_backend = DraftBackendFactory.__dict__["_create_backend"]
    supported = draft_worker_common._SUPPORTED_DRAFT_BACKENDS

    def _create_backend_accepting_sm120(self, backend_name, backend_map, error_template):
        if "triton" in backend_map and BACKEND_NAME not in backend_map:
            triton_entry = backend_map["triton"]   # chosen (and judged) only where the name is sm120_mla
            backend_map = {**backend_map, BACKEND_NAME: lambda: _draft_backend_on_kernel(self, triton_entry)()}
        return create_backend(self, backend_name, backend_map, error_template)

    _patch(DraftBackendFactory, "_create_backend", _create_backend_accepting_sm120)
    if BACKEND_NAME not in supported:
        _patch(draft_worker_common, "_SUPPORTED_DRAFT_BACKENDS", (*supported, BACKEND_NAME))
    logger.info("sm120_workbook (pid %d): speculative draft paths accept %s like triton "
                "(DraftBackendFactory._create_backend, draft_worker_common._SUPPORTED_DRAFT_BACKENDS)",
                os.getpid(), BACKEND_NAME)
    return True


def _draft_backend_on_kernel(factory, triton_entry):
    """The `sm120_mla` entry of a DraftBackendFactory map whose `triton` entry is `triton_entry`:
    the kernel's draft backends where the entry is SGLang's own Triton draft-decode or
    draft-extend maker and the draft model is MLA, else `triton_entry` itself."""
    runner = factory.draft_model_runner
    if not getattr(runner, "use_mla_backend", False):
        return triton_entry
    from .backend import Sm120MlaAttnBackend, Sm120MlaMultiStepDraftBackend

    if triton_entry == getattr(factory, "_create_triton_decode_backend", None):
        return lambda: Sm120MlaMultiStepDraftBackend(runner, factory.topk, factory.speculative_num_steps)
    if triton_entry == getattr(factory, "_create_triton_prefill_backend", None):
        return lambda: Sm120MlaAttnBackend(runner)
    logger.warning("sm120_workbook (pid %d): an MLA draft's `triton` entry %r is not SGLang %s's own "
                   "Triton draft maker, so it stays as it is: this draft step runs on Triton, not on "
                   "the kernel", os.getpid(), triton_entry, TESTED_SGLANG)
    return triton_entry


def _install_spec_compat_or_warn() -> None:
    # A failure here must not stop the server: only speculative runs need these names.
    try:
        install_spec_compat()
    except Exception as e:
        logger.warning("sm120_workbook (pid %d): could not patch the speculative draft paths "
                       "for %s (%r); EAGLE/DFLASH drafts may refuse the name", os.getpid(),
                       BACKEND_NAME, e)


def uninstall_spec_compat() -> None:
    """Restore the patched SGLang attributes (for tests)."""
    while _compat_originals:
        owner, name, original = _compat_originals.pop()
        setattr(owner, name, original)


def _register_warmup_or_warn() -> None:
    # Only a server started with --warmups sm120_long_prompt needs it; never stop one over it.
    try:
        warmup.register_warmup()
    except Exception as e:
        logger.warning("sm120_workbook (pid %d): could not register the warm-up %s (%r)",
                       os.getpid(), warmup.WARMUP_NAME, e)


def untested_sglang_warning() -> str | None:
    """What to tell a user whose SGLang is not TESTED_SGLANG (None where it is, or none is found)."""
    from importlib import metadata

    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None
    if version == TESTED_SGLANG:
        return None
    return (f"sm120_workbook (pid {os.getpid()}): SGLang {version} is installed, but this plugin was "
            f"written and tested against SGLang {TESTED_SGLANG}, whose internals it uses (TritonAttnBackend's "
            f"metadata and buffers, the KV allocators, the draft-backend factory); a patch that no longer "
            f"fits is reported below as it is skipped, and the backend may fail or be wrong. "
            f"Install sglang=={TESTED_SGLANG} to run what was tested.")


# ---------------------------------------------------------------- the entry point
def load_plugin() -> None:
    """SGLang's general-plugin entry point; runs in the launcher and in every TP worker."""
    _ensure_log_handler()
    global _version_warned
    warning = None if _version_warned else untested_sglang_warning()
    if warning:
        logger.warning(warning)
        _version_warned = True
    # Guarded like every step: a registry this SGLang lacks leaves the opt-in steps below working
    # (SGLang only logs a plugin's exception, and would skip them all) and says so.
    registered = install_or_warn(lambda: register_backend() or is_registered(), logger,
                                 f"registering the {BACKEND_NAME} attention backend")
    kv_sort_on = install_or_warn(kv_sort.install_from_env, logger, f"the KV sort override ({kv_sort.ENV_VAR})")
    ngram_tail.install_from_env()
    dflash_host_plan.install_from_env()
    _register_warmup_or_warn()
    install_or_warn(mha_draft.install, logger, "the draft backend step for non-MLA drafts")
    install_or_warn(install_selection_hook, logger, f"the step that passes on a server's {BACKEND_NAME} selection")
    selected = backend_selected()
    if selected:
        _install_spec_compat_or_warn()
    message = (f"sm120_workbook plugin (pid {os.getpid()}): attention backend {BACKEND_NAME!r} "
               + ("registered" if registered else "NOT registered (see the warning above)")
               + f"{' and selected' if selected else ''}; KV sort override "
               + (f"on ({kv_sort.ENV_VAR}=1)" if kv_sort_on
                  else f"NOT installed although {kv_sort.ENV_VAR}=1 (see the warning above)" if kv_sort.requested()
                  else f"off (set {kv_sort.ENV_VAR}=1 to enable)"))
    global _last_message
    if message != _last_message:  # a second call with nothing new stays quiet
        logger.info(message)
        _last_message = message


_last_message: str | None = None
_version_warned = False


__all__ = ["BACKEND_NAME", "load_plugin", "register_backend", "is_registered",
           "unregister_backend", "backend_selected", "backend_selected_in", "backend_selected_in_argv",
           "install_selection_hook", "uninstall_selection_hook", "selection_hook_installed", "install_spec_compat",
           "uninstall_spec_compat", "spec_compat_installed", "kv_sort", "ngram_tail", "dflash_host_plan",
           "mha_draft", "warmup"]
