"""Shared test switches: GPU and nvcc tests skip visibly, with the reason, where they can't run."""
from __future__ import annotations

import argparse
import shutil

import pytest


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):   # mma.sync m16n8k16 bf16, ldmatrix and cp.async need sm_80
        return f"the GPU is sm_{cap[0]}{cap[1]}; the kernel needs sm_80 or newer"
    if shutil.which("nvcc") is None:   # load_inline builds the kernel with nvcc at first use
        return "a GPU but no nvcc on PATH: the kernel cannot be built here"
    return None


def _set(name: str) -> bool:
    import os

    return os.environ.get(name, "").lower() not in ("", "0", "false")


def pytest_configure(config):
    """Under `make test` (SM120_REQUIRE_SGLANG, which it sets after `make setup` installed SGLang)
    and in CI the CPU tests must run against real SGLang code: an install where it does not import
    stops the run, instead of letting every module that imports it skip."""
    why = "SM120_REQUIRE_SGLANG is set" if _set("SM120_REQUIRE_SGLANG") else "CI is set" if _set("CI") else None
    if why:
        try:
            import sglang.srt.server_args  # noqa: F401 - the runtime's Python side, not the bare package
        except Exception as e:  # noqa: BLE001 - any failure to import counts
            raise pytest.UsageError(f"{why} but SGLang does not import ({e!r}): the CPU tests run "
                                    "against real SGLang code; run `make setup`") from None


def pytest_collection_modifyitems(config, items):
    gpu_reason = _gpu_reason()
    nvcc_reason = None if shutil.which("nvcc") else "nvcc is not on PATH"
    for item in items:
        if gpu_reason and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {gpu_reason}"))
        if nvcc_reason and "nvcc" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"nvcc test skipped: {nvcc_reason}"))


@pytest.fixture
def seed():
    """A fresh random seed per test, printed so a failure can be replayed."""
    import random

    s = random.SystemRandom().randrange(2**31)
    print(f"seed={s}")
    return s


@pytest.fixture
def sglang_parser():
    """SGLang's own server-argument parser, as `launch_server` builds it (the launch-line tests
    parse what the workbook would launch with it; tests/test_readme_launch.py builds its own, with
    the plugin registered and abbreviations refused)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser
