"""sm120_workbook: an sm_120 MLA verify-attention kernel and its SGLang integration.

Modules: `reference` (the float64 oracle), `roofline`, `hardware`, `provenance`, `results`,
`charts`; subpackages `kernels` (the CUDA kernel) and `patches` (the SGLang plugin).
"""
from __future__ import annotations

import os
from pathlib import Path

__version__ = "0.1.0"


def project_root() -> Path:
    """The checkout that holds data/ and notebooks/.

    $SM120_ROOT wins; else the nearest parent of the working directory with a
    pyproject.toml naming this project; else the folder above this package's source.
    """
    env = os.environ.get("SM120_ROOT")
    if env:
        return Path(env).resolve()
    for d in [Path.cwd(), *Path.cwd().parents]:
        pp = d / "pyproject.toml"
        if pp.is_file() and "sm120-workbook" in pp.read_text(errors="ignore"):
            return d
    return Path(__file__).resolve().parent.parent
