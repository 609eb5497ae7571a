"""Where a measurement came from: GPU, driver, library versions, commit, date, command.

Every record written to data/results/ carries this dict, so a chart drawn on a machine
without a GPU can still say exactly what produced its numbers.
"""
from __future__ import annotations

import datetime as _dt
import functools
import os
import importlib.metadata as md
import shutil
import subprocess
import sys

from . import project_root
from .build_commit import archived_commit


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """Short commit of the checkout, with '+dirty' when tracked files differ from it.

    $SM120_COMMIT wins: the GPU machine runs a copy of the tree without .git, so the
    command that ships the tree there passes the commit along. But a package archived from
    another commit (`build_commit`: a wheel made by `git archive`) names the code that runs:
    `pip install --target` without --upgrade keeps an older copy, and a record must not name
    code it did not run. Not cached: a long Jupyter session may commit or edit between two
    recorded runs, and each record names the code it ran.
    """
    archived = archived_commit()
    claimed = os.environ.get("SM120_COMMIT")
    if claimed:
        if archived and not (archived.startswith(claimed) or claimed.startswith(archived)):
            print(f"WARNING: SM120_COMMIT={claimed}, but the sm120_workbook imported here was archived "
                  f"from {archived[:12]} (an older install kept?); records name {archived[:12]}",
                  file=sys.stderr)
            return archived
        return claimed
    if archived:
        return archived
    try:
        root = project_root()
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str | None:
    exe = shutil.which("nvcc")
    if not exe:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "release" in line:
            return line.split("release", 1)[1].split(",")[0].strip()
    return None


def gpu_info() -> dict:
    """The GPU torch sees (device 0), or {'gpu': None, 'driver': None} on a CPU-only machine
    (every provenance key present, PROVENANCE_KEYS)."""
    try:
        import torch
    except ImportError:
        return {"gpu": None, "driver": None}
    if not torch.cuda.is_available():
        return {"gpu": None, "driver": None}
    p = torch.cuda.get_device_properties(0)
    info = {
        "gpu": p.name,
        "gpu_count": torch.cuda.device_count(),
        "sm_arch": f"sm_{p.major}{p.minor}",
        "sm_count": p.multi_processor_count,
        "gpu_mem_gib": round(p.total_memory / 2**30, 1),
        "cuda_runtime": torch.version.cuda,
    }
    # which physical GPU (NVML's "GPU-..." spelling): one model name on two machines is two GPUs
    uuid = getattr(p, "uuid", None)
    if uuid is not None:
        info["gpu_uuid"] = f"GPU-{uuid}"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or not permitted: the driver stays unknown, not guessed
        info["driver"] = None
    return info


def provenance(command: str | None = None) -> dict:
    """The provenance fields every result record carries."""
    rec = dict(gpu_info())
    rec.update({
        "torch": _version("torch"),
        "sglang": _version("sglang"),
        "triton": _version("triton"),
        # FlashInfer runs prefill and some drafts, sgl-kernel FlashMLA: either changes a served step
        "flashinfer": _version("flashinfer-python"),
        "sgl_kernel": _version("sglang-kernel") or _version("sgl-kernel"),
        "nvcc": nvcc_version(),
        "python": sys.version.split()[0],
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
    })
    # which GPUs of the machine this process was given: two jobs side by side on one machine
    # (one per GPU) are then told apart in their records
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        rec["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return rec
