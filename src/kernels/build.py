"""Building the kernel with torch.utils.cpp_extension.load_inline.

The CUDA source stays in real files (mla_verify.cuh, mla_verify.cu) that load_inline reads,
so nvcc, editors and diffs see ordinary CUDA. The build is cached under a name that hashes
the sources, the flags, the target arch and the toolchain (torch, the nvcc that load_inline
runs and the environment variables nvcc and torch read for it), and a file lock serialises it:
eight TP workers starting at once build it once and load the same .so.

Environment:
- SM120_KERNEL_CACHE: the cache folder (default ~/.cache/sm120_workbook/torch_extensions, or
  under $XDG_CACHE_HOME).
- SM120_BUILD_LOCK_TIMEOUT_S: how long a process waits for another's build of the same key
  (default 1800 s) before it gives up and names the lock.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
from pathlib import Path

from filelock import FileLock, Timeout

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("mla_verify.cuh", "mla_verify_wide.cuh", "mma_peak.cuh", "mla_verify.cu")
# No -std: load_inline adds the one its torch's headers need when none is given (newer torch
# refuses anything below C++20, which a pinned -std=c++17 would have broken); the sources build
# as C++17 (the resource report) and as C++20 (launcher_check_command).
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
CPP_DECLS = """
#include <torch/extension.h>
void mla_verify_forward(const at::Tensor& q, const at::Tensor& kv_pool, const at::Tensor& qo_indptr,
                        const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                        const c10::optional<at::Tensor>& k_extend, const c10::optional<at::Tensor>& custom_mask,
                        const c10::optional<at::Tensor>& mask_indptr, at::Tensor& out, at::Tensor& lse,
                        at::Tensor& ws_o, at::Tensor& ws_lse, double sm_scale, int64_t max_q_len,
                        int64_t num_splits, int64_t tile_keys, int64_t cta_rows);
void mma_sync_peak(at::Tensor& out, int64_t iters, int64_t threads_per_block);
at::Tensor wide_phase_trace();
at::Tensor cta_timeline();
std::vector<at::Tensor> pool_trace();
"""


def cache_dir() -> Path:
    base = os.environ.get("SM120_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sm120_workbook", "torch_extensions")
    return Path(base)


def _arch_flags(capability: tuple[int, int]) -> list[str]:
    major, minor = capability
    # sm_120 and sm_90 get their arch-specific targets; the code uses no arch-only instruction,
    # so this only lets ptxas tune for the chip.
    suffix = "a" if (major, minor) in {(9, 0), (10, 0), (12, 0)} else ""
    arch = f"{major}{minor}{suffix}"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def launcher_check_command(obj: str, arch: str = "120a") -> list[str]:
    """nvcc compiling the launcher (mla_verify.cu) with this torch's headers and load_inline's
    flags, to PTX only (no ptxas, ~2 min): what a machine without a GPU can check of the host code
    and every template it instantiates. The resource report (resources.py) assembles the kernels.
    C++20, as load_inline picks for torch releases whose headers refuse anything older."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    includes = [KERNEL_DIR, *cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return ["nvcc", *cpp_extension.COMMON_NVCC_FLAGS, *NVCC_FLAGS, "-std=c++20",
            f"-gencode=arch=compute_{arch},code=compute_{arch}", "-diag-suppress=3189",
            *[f"-I{p}" for p in includes], "-DTORCH_EXTENSION_NAME=sm120_mla_check",
            "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-c", str(KERNEL_DIR / "mla_verify.cu"), "-o", str(obj)]


def _define_flags(defines: tuple[str, ...]) -> list[str]:
    # sorted: the same defines in another order are the same build (one cache entry, one compile)
    return [f"-D{d}" for d in sorted(defines)]


# Read by nvcc itself or by torch's build for it: each changes the binary without changing the
# command line ninja compares, so each must change the cache entry.
_COMPILER_ENV = ("PYTORCH_NVCC", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN")


_NVCC_IDENTITIES: dict[str | None, str] = {}


def _nvcc_identity(cuda_home: str | None) -> str:
    """The `nvcc --version` of the toolkit load_inline compiles with (torch's CUDA_HOME). Kept
    once it answers; a failure (no such nvcc, or one slow under eight workers' start-up) is
    asked again next time, not kept for the process's life."""
    import subprocess

    if cuda_home in _NVCC_IDENTITIES:
        return _NVCC_IDENTITIES[cuda_home]
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else "nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:   # no such nvcc, or one that hangs
        return f"{nvcc}: {type(e).__name__}: {e}"
    _NVCC_IDENTITIES[cuda_home] = out
    return out


# The oldest nvcc release that knows each target _arch_flags asks for: the arch-specific ones,
# and sm_103 and sm_121 (GB10), which came in 12.9, and sm_110 (Thor), in 13.0.
MIN_NVCC = {(12, 0): (12, 8), (12, 1): (12, 9), (11, 0): (13, 0), (10, 0): (12, 8), (10, 3): (12, 9),
            (9, 0): (12, 0)}


def nvcc_release(identity: str) -> tuple[int, int] | None:
    """(major, minor) from `nvcc --version` text ("... release 13.0, V13.0.88"), None if absent."""
    m = re.search(r"release (\d+)\.(\d+)", identity)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_toolkit(capability: tuple[int, int], identity: str, torch_cuda: str | None) -> None:
    """The nvcc that load_inline will run can build for this GPU and links the CUDA runtime torch
    uses. load_inline checks neither (torch's version check is in BuildExtension only): an old
    nvcc fails deep in a build log, another major links a second runtime into the process."""
    release = nvcc_release(identity)
    if release is None:
        raise RuntimeError(f"no usable nvcc for the kernel build (torch's CUDA_HOME; set CUDA_HOME to a CUDA "
                           f"toolkit): {identity.splitlines()[-1] if identity else 'no output'}")
    need = MIN_NVCC.get(capability)
    target = _arch_flags(capability)[0].rsplit("=", 1)[1]   # sm_120a, sm_121, ...
    if need and release < need:
        raise RuntimeError(f"nvcc {release[0]}.{release[1]} cannot build for {target}; it needs CUDA "
                           f"{need[0]}.{need[1]} or newer (set CUDA_HOME to a newer toolkit)")
    if torch_cuda and int(torch_cuda.split(".")[0]) != release[0]:
        raise RuntimeError(f"nvcc {release[0]}.{release[1]} and torch's CUDA {torch_cuda} differ in major "
                           f"version: the kernel would link another CUDA runtime than torch's; set CUDA_HOME to "
                           f"a CUDA {torch_cuda.split('.')[0]}.x toolkit")


def _toolchain() -> str:
    # The .so links against this torch and CUDA runtime and this Python's ABI: two virtual
    # environments sharing the cache must not load each other's builds. And the compiler: a
    # toolkit upgraded in place, or NVCC_APPEND_FLAGS="-G" in one process, must not become every
    # later process's cached build.
    import torch
    from torch.utils import cpp_extension

    env = " ".join(f"{k}={os.environ[k]}" for k in _COMPILER_ENV if k in os.environ)
    return (f"torch {torch.__version__} cuda {torch.version.cuda} py{sys.version_info[0]}.{sys.version_info[1]} "
            f"{cpp_extension.CUDA_HOME} {_nvcc_identity(cpp_extension.CUDA_HOME)} {env}")


def source_dir_of(source_dir=None, arg: str = "source_dir") -> Path:
    """The folder whose kernel sources a build compiles: the shipped ones (None), or another
    revision's (an A/B run, ab.py). It must hold every file of SOURCES; the error names `arg`,
    the caller's own name for the folder."""
    if source_dir is None:
        return KERNEL_DIR
    d = Path(source_dir).resolve()
    missing = [n for n in SOURCES if not (d / n).is_file()]
    if missing:
        raise ValueError(f"{arg}: {d} lacks {', '.join(missing)} (a kernel source folder holds {', '.join(SOURCES)})")
    return d


def sources_sha256(source_dir=None) -> str:
    """A digest of the kernel sources in `source_dir` (the shipped ones by default): what names
    an A/B baseline made from a folder outside git (`git show REV:src/kernels/F` gives the same)."""
    src = source_dir_of(source_dir)
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (src / name).read_bytes())
    return h.hexdigest()


def build_key(capability: tuple[int, int], defines: tuple[str, ...] = (), source_dir=None) -> str:
    src = source_dir_of(source_dir)
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((src / name).read_bytes())
    if src != KERNEL_DIR:   # another folder's build: its own entry even for the same sources (its -I differs)
        h.update(str(src).encode())
    h.update(CPP_DECLS.encode())
    h.update(" ".join(NVCC_FLAGS + _arch_flags(capability) + _define_flags(defines)).encode())
    h.update(_toolchain().encode())
    return h.hexdigest()[:16]


# How long a process waits for another one's build of the same key (one build takes ~1 min on
# the H200 machine, ~34 variants in parallel ~4 min) before it says which lock it waited on.
LOCK_TIMEOUT_ENV = "SM120_BUILD_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 1800.0


def lock_timeout_s() -> float:
    """$SM120_BUILD_LOCK_TIMEOUT_S, read when a build waits: a number of seconds above 0 (filelock
    would take 0 as "fail at once" and a negative one as "wait forever")."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={raw!r}: must be a number of seconds above 0 "
                         f"(default {DEFAULT_LOCK_TIMEOUT_S:.0f})")
    return value


def load_kernel_module(capability: tuple[int, int] | None = None, verbose: bool = False,
                       defines: tuple[str, ...] = (), source_dir=None):
    """Compile (once, cached and locked) and import the extension for a GPU capability
    (default: the current device's). `defines` builds a variant (the ablation switches in
    mla_verify.cuh, e.g. ("ABLATE_NO_LOADS",)); the default build has none. `source_dir`: another
    revision's kernel sources (source_dir_of), for an A/B run in one process."""
    import torch

    if capability is None:
        if not torch.cuda.is_available():
            raise RuntimeError("the sm120_mla kernel needs a CUDA GPU; none is visible to torch")
        capability = torch.cuda.get_device_capability()
    src = source_dir_of(source_dir)
    return _load_for(tuple(capability), verbose, tuple(defines), None if src == KERNEL_DIR else str(src))


def build_command(defines: tuple[str, ...] = (), source_dir=None) -> list[str]:
    """A child process that compiles (or finds cached) one build: for building variants in
    parallel, or before a tool (compute-sanitizer) that would make nvcc crawl."""
    src = None if source_dir is None else str(source_dir_of(source_dir))
    return [sys.executable, "-c", "from sm120_workbook.kernels.build import load_kernel_module as l; "
            f"l(defines={tuple(defines)!r}, source_dir={src!r})"]


def build_in_parallel(define_sets, source_dirs=(None,)) -> None:
    """Compile (or find cached) each build of `define_sets`, as many at once as there are CPUs
    (nvcc is single-threaded, and one build holds ~1-2 GB). On the H200 machine's 16 cores, 34
    builds took 249 s (session 19); one after another, at ~65 s each, they take ~35 minutes.
    Each define set is built from each of `source_dirs` (None: the shipped sources)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    sets = sorted({tuple(sorted(d)) for d in define_sets})   # the build key ignores the order
    builds = [(d, src) for src in source_dirs for d in sets]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        codes = list(pool.map(lambda b: subprocess.run(build_command(*b)).returncode, builds))
    failed = [b if b[1] else b[0] for b, rc in zip(builds, codes) if rc != 0]
    if failed:
        raise RuntimeError(f"variant build failed: {failed}")


@functools.lru_cache(maxsize=None)
def _load_for(capability: tuple[int, int], verbose: bool, defines: tuple[str, ...] = (), source_dir=None):
    from torch.utils.cpp_extension import load_inline

    src = source_dir_of(source_dir)
    if capability < (8, 0):
        raise RuntimeError(f"the sm120_mla kernel needs sm_80 or newer (mma.sync bf16, cp.async); "
                           f"this GPU is sm_{capability[0]}{capability[1]}")
    import torch
    from torch.utils import cpp_extension

    check_toolkit(capability, _nvcc_identity(cpp_extension.CUDA_HOME), torch.version.cuda)
    name = f"sm120_mla_{build_key(capability, defines, source_dir)}"
    build_dir = cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cu = (src / "mla_verify.cu").read_text()
    timeout = lock_timeout_s()
    lock = FileLock(str(build_dir) + ".lock", timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        # an OS lock, released when its holder dies: a live process holds it
        raise RuntimeError(f"waited {timeout:.0f} s for the build lock {lock.lock_file}: a live process is still "
                           f"building this kernel (a hung nvcc?); find it with `fuser {lock.lock_file}` and end it, "
                           f"or raise {LOCK_TIMEOUT_ENV}") from None
    try:
        # torch's own lock inside the build folder: some torch releases use a lock file (FileBaton)
        # that a builder killed mid-build leaves behind, and the next load_inline then waits on it
        # forever. Every builder of this key holds our lock first, so none can be using it now.
        (build_dir / "lock").unlink(missing_ok=True)
        return load_inline(
            name=name,
            cpp_sources=[CPP_DECLS],
            cuda_sources=[cu],
            functions=["mla_verify_forward", "mma_sync_peak", "wide_phase_trace", "cta_timeline", "pool_trace"],
            extra_cuda_cflags=NVCC_FLAGS + _arch_flags(capability) + _define_flags(defines) + [f"-I{src}"],
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    finally:
        lock.release()
