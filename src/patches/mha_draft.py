"""A draft model without MLA (an EAGLE3 Llama head) drafts on FlashInfer when sm120_mla is selected.

The kernel serves MLA only. Under `sm120_mla`, a draft model with another attention (SpecForge's
Llama EAGLE3 head for Kimi K2: one MHA layer) falls back to the backend's parent, SGLang's
Triton backend, whose draft extend reads the whole prefix with one CTA a head: on the H200 at
64k a step took 12.2 ms with it, 6.4 ms with FlashInfer's fa2 kernels (NOTES.md, session 37).
`--speculative-draft-attention-backend flashinfer` gives the draft FlashInfer, and a launch line
without it should not be the slow one.

SGLang resolves the draft attention backend among its server-argument hooks when none is named:
DFLASH's in `_resolve_dflash_draft_attention_backend` (sglang/srt/arg_groups/speculative_hook.py),
Kimi K3's DSPARK in kimi_k3_hook. This adds the same step after `_handle_eagle_family` (EAGLE,
EAGLE3 and STANDALONE): when no draft backend is named, `sm120_mla` serves the prefill or decode
side, and SGLang's own ModelConfig of the draft says it is not MLA, the field is set to
flashinfer, as the flag would set it, and the line is logged. Anything named on the command line is left alone;
an MLA draft (DeepSeek-V3's MTP layer, a Kimi K2.5/K2.6 EAGLE3 head) keeps drafting on the kernel.
Installed by the plugin in every process; it changes no server that does not select sm120_mla.
"""
from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

# The draft backend a non-MLA draft gets under sm120_mla: FlashInfer runs MHA drafts on its fa2
# (mma.sync) kernels on sm_80-sm_120 alike.
MHA_DRAFT_BACKEND = "flashinfer"
_MARK = "_sm120_mha_draft_original"


def draft_is_mla(server_args) -> bool:
    """Whether SGLang's own ModelConfig of the draft model (`speculative_draft_model_path`) has
    MLA attention, the test SGLang's model runner makes (`use_mla_backend`)."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    config = ModelConfig.from_server_args(server_args, model_path=server_args.speculative_draft_model_path,
                                          is_draft_model=True)
    return config.attention_arch == AttentionArch.MLA


def draft_backend_for(server_args) -> str | None:
    """The draft attention backend this plugin names for `server_args` mid-resolution: FlashInfer
    for a draft model that is not MLA under sm120_mla with none named, else None (SGLang's own)."""
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

    from . import BACKEND_NAME

    if server_args.speculative_draft_attention_backend or not server_args.speculative_draft_model_path:
        return None
    if BACKEND_NAME not in attention_backends_of(resolved_view(server_args)):
        return None
    return None if draft_is_mla(server_args) else MHA_DRAFT_BACKEND


def resolve_draft_backend(server_args) -> None:
    """Set `speculative_draft_attention_backend` where draft_backend_for names one, and say so."""
    backend = draft_backend_for(server_args)
    if backend is None:
        return
    server_args.speculative_draft_attention_backend = backend
    logger.info("sm120_workbook (pid %d): the %s draft model %s is not MLA, which the sm120 kernel does "
                "not serve: its attention runs on %s (--speculative-draft-attention-backend names another)",
                os.getpid(), server_args.speculative_algorithm, server_args.speculative_draft_model_path, backend)


def _hook_module():
    from sglang.srt.arg_groups import speculative_hook

    return speculative_hook


def is_installed() -> bool:
    return hasattr(_hook_module()._handle_eagle_family, _MARK)


def install() -> bool:
    """Run resolve_draft_backend after SGLang's EAGLE-family hook; True if this call installed it.
    SGLang's dispatch (SpeculativeAlgorithm.handle_server_args) imports the hook at each call,
    so the module attribute is the place."""
    mod = _hook_module()
    if is_installed():
        return False
    original = mod._handle_eagle_family

    @functools.wraps(original)
    def handle_eagle_family(server_args):
        original(server_args)
        try:
            resolve_draft_backend(server_args)
        except Exception as e:  # noqa: BLE001 - a step of ours never stops a server
            logger.warning("sm120_workbook (pid %d): could not tell whether the draft model %s is MLA (%r); "
                           "its attention backend stays SGLang's choice", os.getpid(),
                           server_args.speculative_draft_model_path, e)

    setattr(handle_eagle_family, _MARK, original)
    mod._handle_eagle_family = handle_eagle_family
    return True


def uninstall() -> None:
    """Restore SGLang's hook (for tests)."""
    mod = _hook_module()
    original = getattr(mod._handle_eagle_family, _MARK, None)
    if original is not None:
        mod._handle_eagle_family = original
