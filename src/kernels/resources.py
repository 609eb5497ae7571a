"""What the kernel costs in registers, shared memory and spills, per target arch, from nvcc.

Needs nvcc only (no GPU, no torch headers): mla_verify.cuh is plain CUDA. ptxas reports
registers, spills and static shared memory; the kernel's shared memory is dynamic, so its
size comes from a tiny host program that prints sizeof(TileConfig<KEYS>::Shared) and of the
wide kernel's Shared.

    python -m sm120_workbook.kernels.resources [--write]

With nvdisasm (the `test` extra installs it) the report also counts what each kernel's mma.sync
loops issue, per arch (sass_loops.py): the H200 times the sm_90 loop, an RTX PRO 6000 runs the
sm_120a one.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

from .build import KERNEL_DIR
from .sass_loops import cubin_loops, loop_table, nvdisasm_version

ARCHS = ("sm_120a", "sm_90")
SM120_SMEM_LIMIT = 101_376   # 99 KB opt-in per block on sm_120
_FUNC = re.compile(r"Function properties for (\S+)")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def _nvcc() -> str:
    exe = shutil.which("nvcc")
    if not exe:
        raise RuntimeError("nvcc is not on PATH; install the CUDA toolkit to build or inspect the kernel")
    return exe


# The combine step's instantiations: (split groups, bf16 partials, preload). combine_groups in
# mla_verify.cuh picks 1, 4 or 16 groups without the preload; with it (COMBINE_PRELOAD) the launcher
# takes 16, 8 or 4. Both kernels' partials are bf16 (SPLIT_BF16_PARTIALS, WIDE_BF16_PARTIALS); the
# fp32 ones are the SPLIT_BF16_PARTIALS=0 build's.
COMBINE_INSTANCES = ((1, True, False), (4, True, False), (16, True, False),
                     (16, True, True), (8, True, True), (4, True, True),
                     (1, False, False), (4, False, False), (16, False, False),
                     (16, False, True), (8, False, True), (4, False, True))
_COMBINE = re.compile(r"mla_verify_combine_kernelILi(\d+)ELb(\d)ELb(\d)E")


# Every attention kernel the launcher (mla_verify.cu) may run.
ATTENTION_KERNELS = ("mla_verify_split_kernel<16>", "mla_verify_split_kernel<16, 1>",
                     "mla_verify_split_kernel<16, 1, true>", "mla_verify_split_kernel<32>",
                     "wide::mla_verify_wide_kernel<false>", "wide::mla_verify_wide_kernel<true>")
# ... instantiated by taking their addresses, which names no signature: sass_compare builds older
# revisions too (v31 gave the attention kernels a second argument).
ATTENTION_INSTANCES = "[[maybe_unused]] static const void* const kAttentionKernels[] = {\n" + "".join(
    f"    reinterpret_cast<const void*>(&sm120_mla::{kernel}),\n" for kernel in ATTENTION_KERNELS) + "};\n"


def _kernel_label(mangled: str) -> str | None:
    """Readable names: mla_verify_split_kernel<16> (two m16 tiles) mangles to ...ILi16ELi2E...,
    mla_verify_split_kernel<16, 1> (one m16 tile, decode) to ...ILi16ELi1ELb0E..., and
    mla_verify_split_kernel<16, 1, true> (rows as the mma's N, decode at up to 8 heads) to ...ILb1E..."""
    if "mla_verify_split_kernel" in mangled:
        for keys in (16, 32):
            if f"ILi{keys}ELi1ELb1E" in mangled:
                return f"mla_verify_split_kernel<{keys}, 1, true>"
            if f"ILi{keys}ELi1E" in mangled:
                return f"mla_verify_split_kernel<{keys}, 1>"
            if f"ILi{keys}E" in mangled:
                return f"mla_verify_split_kernel<{keys}>"
    if "mla_verify_wide_kernel" in mangled:   # <false>: batch 1; <true>: batches, with the pool
        return "mla_verify_wide_kernel<batched>" if "ILb1E" in mangled else "mla_verify_wide_kernel"
    if m := _COMBINE.search(mangled):
        return combine_label(int(m[1]), m[2] == "1", m[3] == "1")
    return None   # a device function (cta_sync), not a kernel


def combine_label(groups: int, bf16: bool, preload: bool) -> str:
    """mla_verify_combine_kernel<16>, <8, bf16, preload>, ..."""
    return f"mla_verify_combine_kernel<{groups}{', bf16' if bf16 else ''}{', preload' if preload else ''}>"


def compile_kernels(arch: str, cubin: Path, kernel_dir: Path = KERNEL_DIR, defines: tuple[str, ...] = ()) -> str:
    """Every kernel the launcher may run, from `kernel_dir`'s headers, into `cubin` for one arch;
    returns ptxas's -v report."""
    src = cubin.with_suffix(".cu")
    src.write_text('#include "mla_verify_wide.cuh"\n' + ATTENTION_INSTANCES
                   + "".join(f'template __global__ void sm120_mla::mla_verify_combine_kernel<{g}, {str(b).lower()}, '
                             f'{str(p).lower()}>(const sm120_mla::Params);\n' for g, b, p in COMBINE_INSTANCES))
    proc = subprocess.run([_nvcc(), "-cubin", "-O3", "-std=c++17", f"-arch={arch}", "-Xptxas", "-v",
                           f"-I{kernel_dir}", *(f"-D{d}" for d in defines), "-o", str(cubin), str(src)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
    return proc.stderr


def ptxas_report(arch: str, loops: bool = False) -> dict[str, dict]:
    """Per-kernel registers, spill bytes and static shared memory for one arch; with `loops`,
    also each mma.sync loop's SASS counts (sass_loops.py, which needs nvdisasm)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        report = parse_ptxas(compile_kernels(arch, cubin))
        sass = cubin_loops(cubin) if loops else {}
    for mangled, stats in sass.items():
        if stats and (name := _kernel_label(mangled)):
            report[name]["loops"] = [asdict(st) for st in stats]
    return report


def parse_ptxas(stderr: str) -> dict[str, dict]:
    """{kernel label: registers, spill and stack bytes, static shared memory} from ptxas -v."""
    report, current = {}, None
    for line in stderr.splitlines():
        if m := _FUNC.search(line):
            current = _kernel_label(m.group(1))
            if current:
                report[current] = {}
        elif current and (m := _SPILL.search(line)):
            report[current].update(stack_bytes=int(m[1]), spill_store_bytes=int(m[2]), spill_load_bytes=int(m[3]))
        elif current and (m := _USED.search(line)):
            report[current]["registers"] = int(m[1])
            s = _SMEM.search(line)
            report[current]["static_smem_bytes"] = int(s[1]) if s else 0
    return report


# Each kernel's dynamic shared memory, as the launcher sizes it (mla_verify.cu): the split kernel's
# TileConfig<KEYS> (its one-m16-tile build shares TileConfig<16>), the wide kernel's own.
_SMEM_OF = {"mla_verify_split_kernel<16>": "TileConfig<16>::kSmemBytes",
            "mla_verify_split_kernel<16, 1>": "TileConfig<16>::kSmemBytes",
            "mla_verify_split_kernel<16, 1, true>": "TileConfig<16>::kSmemBytes",
            "mla_verify_split_kernel<32>": "TileConfig<32>::kSmemBytes",
            "mla_verify_wide_kernel": "wide::kSmemBytes", "mla_verify_wide_kernel<batched>": "wide::kSmemBytes"}


def dynamic_smem_bytes() -> dict[str, int]:
    """Dynamic shared memory per kernel (the split kernel's TileConfig<KEYS> and the wide
    kernel), from a host-only program (it runs without a GPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "smem.cu"
        src.write_text('#include <cstdio>\n#include "mla_verify_wide.cuh"\n'
                       'int main() { std::printf("' + " ".join(["%d"] * len(_SMEM_OF)) + '\\n", '
                       + ", ".join(f"sm120_mla::{expr}" for expr in _SMEM_OF.values()) + "); }\n")
        exe = Path(tmp) / "smem"
        subprocess.run([_nvcc(), "-std=c++17", "-arch=sm_80", f"-I{KERNEL_DIR}", "-o", str(exe), str(src)],
                       check=True, capture_output=True, text=True)
        sizes = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
        return {name: int(v) for name, v in zip(_SMEM_OF, sizes)}


def resource_report(archs=ARCHS) -> dict:
    """{arch: {kernel: {registers, spill bytes, smem bytes, and where nvdisasm is found, its
    mma.sync loops' SASS counts}}} plus the budget verdict."""
    from ..provenance import nvcc_version

    smem = dynamic_smem_bytes()
    out = {"nvcc": nvcc_version(), "nvdisasm": nvdisasm_version(), "smem_limit_sm120": SM120_SMEM_LIMIT, "archs": {}}
    for arch in archs:
        rep = ptxas_report(arch, loops=out["nvdisasm"] is not None)
        for name, nbytes in smem.items():
            rep[name]["dynamic_smem_bytes"] = nbytes
        for k in rep.values():
            k.setdefault("dynamic_smem_bytes", 0)
            k["smem_bytes"] = k["static_smem_bytes"] + k["dynamic_smem_bytes"]
        out["archs"][arch] = rep
    return out


def recorded_report() -> dict:
    """The report as `make kernel-resources` last wrote it (data/results/kernel_resources.json),
    for a machine without nvcc."""
    from ..results import results_dir

    return json.loads((results_dir() / "kernel_resources.json").read_text())


def resources_frame(report: dict):
    """One row per (arch, kernel): registers, shared memory, spill stores and loads, and stack
    bytes. Kernels by name within each arch, so that a live build and the recorded report (whose
    kernels come in another order) print alike."""
    import pandas as pd

    cols = ("registers", "smem_bytes", "spill_store_bytes", "spill_load_bytes", "stack_bytes")
    return pd.DataFrame([{"arch": arch, "kernel": name, **{c: k[c] for c in cols}}
                         for arch, kernels in report["archs"].items() for name, k in sorted(kernels.items())])


def budget_lines(frame) -> list[str]:
    """For each kernel of the build (attention and combine) on each arch: "OK" within sm_120's
    shared memory with no spills (stores or loads) and no stack, else "OVER BUDGET", beside the
    numbers it was judged on. Only source-fixed quantities, so the lines are the same from any
    nvcc that builds the kernel."""
    out = []
    for r in frame.itertuples():
        spills = r.spill_store_bytes + r.spill_load_bytes
        ok = r.smem_bytes <= SM120_SMEM_LIMIT and spills == 0 and r.stack_bytes == 0
        out.append(f"{r.arch:8s} {r.kernel:44s} smem {r.smem_bytes:6d} B of {SM120_SMEM_LIMIT} B, "
                   f"spills {spills} B, stack {r.stack_bytes} B: {'OK' if ok else 'OVER BUDGET'}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write data/results/kernel_resources.json")
    args = ap.parse_args(argv)
    rep = resource_report()
    for arch, kernels in rep["archs"].items():
        for name, k in kernels.items():
            print(f"{arch:8s} {name:44s} regs={k['registers']:3d} smem={k['smem_bytes']:6d} B "
                  f"spill={k['spill_store_bytes'] + k['spill_load_bytes']} B")
    if rep["nvdisasm"]:
        print(f"mma.sync loops (nvdisasm {rep['nvdisasm']}):")
        print(loop_table(rep).to_string(index=False))
    else:
        print("no nvdisasm, so no loop counts: pip install nvidia-cuda-nvdisasm (the `test` extra)")
    if args.write:
        from ..provenance import provenance
        from ..results import cli_command, results_dir

        path = results_dir() / "kernel_resources.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prov = provenance(cli_command("sm120_workbook.kernels.resources", argv))
        path.write_text(json.dumps({**rep, "provenance": prov}, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
