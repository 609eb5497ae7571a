"""Two revisions of the kernel compared by their SASS, per target arch, without a GPU.

A change outside the loops still moves them: ptxas schedules a register-bound kernel as a whole,
so a few instructions in a prologue can reorder its main loop (NOTES.md: v19's larger Params, v26's
slot bound, v30's T, which took twelve spellings to leave the loops alone). A containment or
prologue change is checked here before a device call, against the revision it changes:

    mkdir -p .ab/REV && git archive REV src/kernels | tar -x -C .ab/REV
    python -m sm120_workbook.kernels.sass_compare --baseline .ab/REV/src/kernels [--archs sm_90 sm_120a]

For every kernel the launcher may run (resources.compile_kernels), on each arch: registers,
spill bytes and instruction counts, baseline -> shipped, and a verdict:

- `identical`: the whole kernel, instruction for instruction (addresses aside);
- `loops identical`: its mma.sync loops (sass_loops.mma_loops), registers and all;
- `loops renamed`: the loops' opcodes in the same order, loop by loop; registers, predicates or
  constants differ;
- `loops differ`: anything else; then `loop_lines` counts the lines of the loops' opcode diff.

The H200 runs the sm_90 code and an RTX PRO 6000 the sm_120a code, so both are compared by
default. Needs nvcc and nvdisasm (the `test` extra), no GPU.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .resources import _kernel_label, compile_kernels, parse_ptxas
from .sass_loops import Instruction, cubin_sass, mma_loops

ARCHS = ("sm_90", "sm_120a")

# One instruction as compared. A label (a branch's target, BSSY's reconvergence point) becomes its
# distance in instructions within the compared stretch, or "outside" it: nvdisasm numbers labels
# across the whole cubin and addresses shift with any instruction added before them, so a kernel
# that did not change would otherwise differ by a change in another.
Key = tuple[str, str, tuple[str, ...]]
_LABEL_TEXT = re.compile(r"`\(\.L_x_\d+\)|^0x[0-9a-f]+$")


def instruction_keys(instrs: list[Instruction]) -> list[Key]:
    """Keys of a stretch of instructions (a kernel, or one loop's body)."""
    index = {ins.address: i for i, ins in enumerate(instrs)}
    keys = []
    for i, ins in enumerate(instrs):
        ops = ins.operands
        if ins.target is not None:
            where = f"{index[ins.target] - i:+d}" if ins.target in index else "outside"
            ops = tuple(where if _LABEL_TEXT.search(o) else o for o in ops)
        keys.append((ins.predicate, ins.opcode, ops))
    return keys


@dataclass(frozen=True)
class KernelSass:
    registers: int | None
    spill_bytes: int | None
    instructions: list[Key]
    loops: list[list[Key]]


def kernel_sass(kernel_dir: Path, arch: str, defines: tuple[str, ...] = ()) -> dict[str, KernelSass]:
    """{kernel label: its SASS} for the headers in `kernel_dir`, built for `arch`."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        ptxas = parse_ptxas(compile_kernels(arch, cubin, kernel_dir, defines))
        sass = cubin_sass(cubin)
    out = {}
    for mangled, instrs in sass.items():
        if (name := _kernel_label(mangled)) is None:
            continue
        r = ptxas.get(name, {})
        spills = r.get("spill_store_bytes", 0) + r.get("spill_load_bytes", 0) if "spill_store_bytes" in r else None
        out[name] = KernelSass(r.get("registers"), spills, instruction_keys(instrs),
                               [instruction_keys(body) for body in mma_loops(instrs)])
    return out


def verdict(base: KernelSass, new: KernelSass) -> tuple[str, int]:
    """(verdict, lines of the loops' opcode diff) for one kernel, baseline against shipped."""
    if base.instructions == new.instructions:
        return "identical", 0
    if base.loops == new.loops:
        return "loops identical", 0
    opcodes = lambda loops: [op for loop in loops for op in [k[1] for k in loop] + ["|"]]   # "|" ends a loop
    a, b = opcodes(base.loops), opcodes(new.loops)
    if a == b:
        return "loops renamed", 0
    lines = sum(1 for ln in difflib.unified_diff(a, b, n=0, lineterm="") if ln[:1] in "+-" and ln[:3] not in ("+++", "---"))
    return "loops differ", lines


def compare(baseline: Path, shipped: Path, archs=ARCHS, defines: tuple[str, ...] = ()) -> list[dict]:
    """One row per (arch, kernel): both revisions' registers, spills and instruction counts, and
    the verdict. A kernel that one revision lacks gets the verdict `only in baseline/shipped`."""
    rows = []
    for arch in archs:
        a, b = kernel_sass(baseline, arch, defines), kernel_sass(shipped, arch, defines)
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                rows.append({"arch": arch, "kernel": name, "verdict": f"only in {'shipped' if name in b else 'baseline'}"})
                continue
            v, lines = verdict(a[name], b[name])
            rows.append({"arch": arch, "kernel": name, "registers": f"{a[name].registers} -> {b[name].registers}",
                         "spill_bytes": f"{a[name].spill_bytes} -> {b[name].spill_bytes}",
                         "instructions": f"{len(a[name].instructions)} -> {len(b[name].instructions)}",
                         "loop_sizes": f"{[len(x) for x in a[name].loops]} -> {[len(x) for x in b[name].loops]}",
                         "verdict": v, "loop_lines": lines})
    return rows


def main(argv=None) -> int:
    import pandas as pd

    from .build import KERNEL_DIR, source_dir_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="a folder with the other revision's kernel headers")
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), help="target archs (default: sm_90 sm_120a)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="a define for both builds (repeatable), e.g. a schedule variant's")
    args = ap.parse_args(argv)
    try:
        baseline = source_dir_of(args.baseline, "--baseline")
    except ValueError as e:
        ap.error(str(e))
    try:
        rows = compare(Path(baseline), KERNEL_DIR, args.archs, tuple(args.define))
    except RuntimeError as e:   # nvcc refused an arch or a build: its message, not a traceback
        sys.exit(f"sass_compare: {e}")
    print(pd.DataFrame(rows).fillna("").to_string(index=False))
    changed = [r for r in rows if r["verdict"] not in ("identical", "loops identical")]
    print(f"{len(rows) - len(changed)} of {len(rows)} kernels keep the baseline's loops" +
          ("" if not changed else f"; not: {', '.join(r['arch'] + ' ' + r['kernel'] for r in changed)}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
