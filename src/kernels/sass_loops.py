"""The kernels' loops as ptxas compiled them, per target arch, read from the SASS with nvdisasm.

The H200 runs sm_90 code; an RTX PRO 6000 runs the sm_120a code that ptxas makes from the same
source, and the two are not the same program. One source keeps the mma.sync, ldmatrix and
cp.async counts and the barriers equal on both. The schedule around them is ptxas's own for each
arch, and a round's time on the H200 came down to that schedule more than once (NOTES.md: v21's
MOVs before each mma.sync, the pooled 64-row build's exposed ldmatrix results). This module
counts, for each loop that issues mma.sync, what a CPU can see of it:

- instructions in the loop body (every path; a warp runs one of them a round);
- HMMA, LDSM (ldmatrix), LDGSTS (cp.async), BAR and NOP instructions;
- `ldsm_read_next`: ldmatrix results read by the next instruction, so that the warp waits out
  the load's latency unless another warp of its SMSP has work;
- `movs_into_mma`: MOVs whose result an HMMA then reads as its A or B operand (v21's lesson:
  a fragment that is not the register quad ldmatrix wrote costs one MOV per register).

resources.py puts them in its report (`python -m sm120_workbook.kernels.resources`, and
data/results/kernel_resources.json); notebook 02 shows them. Needs nvcc and nvdisasm (the
nvidia-cuda-nvdisasm wheel, in the `test` extra), no GPU.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# one instruction line of nvdisasm (or cuobjdump -sass): /*0c40*/  @!P0 BRA `(.L_x_12) ;
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P[T\d]+)\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_FUNCTION = re.compile(r"^\.text\.(\S+):|Function : (\S+)")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)|\b0x([0-9a-f]+)\b")
_LABEL_OPERAND = re.compile(r"`\((\.L_x_\d+)\)")
_REG = re.compile(r"\bR(\d+)\b")


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str            # "" or a guard such as "@!P0"
    opcode: str               # "HMMA.16816.F32.BF16", "LDSM.16.M88.4", ...
    operands: tuple[str, ...]
    target: int | None = None  # a branch's target address, or the label another instruction names (BSSY)


def parse_sass(text: str) -> dict[str, list[Instruction]]:
    """{mangled kernel name: its instructions} from nvdisasm's (or cuobjdump's) listing."""
    functions: dict[str, list[tuple[int, str, str, str]]] = {}
    labels: dict[str, dict[str, int]] = {}
    current, pending = None, []
    for line in text.splitlines():
        if m := _FUNCTION.search(line):
            current = m[1] or m[2]
            functions[current], labels[current], pending = [], {}, []
        elif current is None:
            continue
        elif m := _LABEL.match(line.strip()):
            pending.append(m[1])
        elif m := _INSTR.match(line):
            address = int(m[1], 16)
            for label in pending:
                labels[current][label] = address
            pending = []
            functions[current].append((address, m[2] or "", m[3], m[4]))
    out = {}
    for name, rows in functions.items():
        instrs = []
        for address, pred, opcode, ops in rows:
            target = None
            if opcode.startswith(("BRA", "BRX")) and (t := _TARGET.search(ops)):
                target = labels[name].get(t[1]) if t[1] else int(t[2], 16)
            elif t := _LABEL_OPERAND.search(ops):   # BSSY, WARPSYNC.COLLECTIVE, ...: a label, never a constant
                target = labels[name].get(t[1])
            instrs.append(Instruction(address, pred, opcode, tuple(o.strip() for o in ops.split(",") if o.strip()), target))
        out[name] = instrs
    return out


def mma_loops(instrs: list[Instruction]) -> list[list[Instruction]]:
    """The bodies of the loops that issue mma.sync: each runs from a conditional backward
    branch's target to the branch. (An unconditional backward branch is ptxas's out-of-line
    code jumping back, not a loop latch.)"""
    index = {ins.address: i for i, ins in enumerate(instrs)}
    loops = []
    for i, ins in enumerate(instrs):
        # conditional: a guard (@P0 BRA) or a uniform predicate operand (BRA.U !UP0, target)
        conditional = ins.predicate or (ins.operands and re.fullmatch(r"!?U?P\d", ins.operands[0]))
        if (conditional and ins.opcode.startswith("BRA") and ins.target is not None and ins.target < ins.address
                and ins.target in index):
            body = instrs[index[ins.target]:i + 1]
            if any(b.opcode.startswith("HMMA") for b in body):
                loops.append(body)
    return loops


def _span(operand: str, width: int) -> set[int]:
    """The registers R<n> .. R<n + width - 1> that a register operand names (none for RZ, a
    predicate, a constant or an address)."""
    m = re.fullmatch(r"-?\|?R(\d+)(?:\.\w+)*\|?", operand)
    return set(range(int(m[1]), int(m[1]) + width)) if m else set()


_HMMA_WIDTHS = (4, 4, 2, 4)   # HMMA.16816 with bf16 in, fp32 out: D, A, B and C registers


def _writes(ins: Instruction) -> set[int]:
    """The registers an instruction writes: its first operand, as wide as the opcode says."""
    if not ins.operands or ins.opcode.startswith(("ST", "RED", "ATOM", "BRA", "BAR", "LDGSTS", "NOP")):
        return set()
    op = ins.opcode
    if op.startswith("HMMA.16816"):
        width = 4
    elif op.startswith("LDSM"):
        width = int(op.rsplit(".", 1)[1])
    else:
        width = 4 if ".128" in op else 2 if ".64" in op or op.startswith("IMAD.WIDE") else 1
    return _span(ins.operands[0], width)


def _reads(ins: Instruction) -> set[int]:
    """The registers an instruction reads (HMMA's by operand width, others as named)."""
    if ins.opcode.startswith("HMMA.16816"):
        return set().union(*(_span(o, w) for o, w in zip(ins.operands[1:], _HMMA_WIDTHS[1:])))
    sources = ins.operands[1:] if _writes(ins) else ins.operands
    return {int(r) for o in sources for r in _REG.findall(o)}


@dataclass(frozen=True)
class LoopStats:
    instructions: int
    hmma: int
    ldsm: int
    ldgsts: int
    barriers: int
    nops: int
    ldsm_read_next: int
    movs_into_mma: int


def loop_stats(body: list[Instruction]) -> LoopStats:
    count = lambda *prefixes: sum(ins.opcode.startswith(prefixes) for ins in body)
    read_next = sum(1 for a, b in zip(body, body[1:]) if a.opcode.startswith("LDSM") and _writes(a) & _reads(b))
    movs_into_mma = 0
    for i, ins in enumerate(body):
        if not ins.opcode.startswith(("MOV", "IMAD.MOV")):
            continue
        dst = _writes(ins)
        for later in body[i + 1:]:
            if later.opcode.startswith("HMMA.16816"):
                ab = _span(later.operands[1], 4) | _span(later.operands[2], 2)
                if dst & ab:
                    movs_into_mma += 1
                    break
            if dst & _writes(later) or dst & _reads(later):
                break
    return LoopStats(instructions=len(body), hmma=count("HMMA"), ldsm=count("LDSM"), ldgsts=count("LDGSTS"),
                     barriers=count("BAR"), nops=count("NOP"), ldsm_read_next=read_next, movs_into_mma=movs_into_mma)


def nvdisasm() -> str | None:
    """nvdisasm from PATH, else from the nvidia-cuda-nvdisasm wheel."""
    if exe := shutil.which("nvdisasm"):
        return exe
    try:
        import nvidia
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        for exe in sorted(root.glob("cu*/bin/nvdisasm")):
            return str(exe)
    return None


@functools.cache
def nvdisasm_version() -> str | None:
    exe = nvdisasm()
    if not exe:
        return None
    m = re.search(r"release (\S+?),", subprocess.run([exe, "--version"], capture_output=True, text=True).stdout)
    return m[1] if m else "unknown"


def cubin_sass(cubin: Path) -> dict[str, list[Instruction]]:
    """{mangled kernel name: its instructions} for a cubin, from nvdisasm."""
    exe = nvdisasm()
    if not exe:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the `test` extra has it)")
    proc = subprocess.run([exe, str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin}:\n{proc.stderr[-2000:]}")
    return parse_sass(proc.stdout)


def cubin_loops(cubin: Path) -> dict[str, list[LoopStats]]:
    """{mangled kernel name: stats of each mma.sync loop, in address order} for a cubin."""
    return {name: [loop_stats(body) for body in mma_loops(instrs)] for name, instrs in cubin_sass(cubin).items()}


def _warps(kernel: str, loop: dict) -> str:
    """Whose loop it is: the 64-row kernel has one for all its warps; the split kernel's value
    warps issue the copies (cp.async), its score warps none."""
    return "all" if "wide" in kernel else "value" if loop["ldgsts"] else "score"


def loop_table(report: dict):
    """One row per (arch, kernel, loop) of a resource report's `loops` entries (resources.py)."""
    import pandas as pd

    rows = [{"arch": arch, "kernel": name, "warps": _warps(name, loop), **loop}
            for arch, kernels in report["archs"].items() for name, k in kernels.items()
            for loop in k.get("loops") or []]
    return pd.DataFrame(rows)


def loops_by_arch(loops, archs, metrics=("instructions", "nops", "ldsm_read_next", "movs_into_mma")):
    """`loop_table`'s rows side by side per arch: one row per (kernel, warps, hmma), a column per
    metric and arch, for the archs asked for that the report holds."""
    t = loops.pivot_table(index=["kernel", "warps", "hmma"], columns="arch", values=list(metrics),
                          aggfunc="first", sort=False)
    t = t[[(m, a) for m in metrics for a in archs if (m, a) in t.columns]]
    t.columns = [f"{m} {a}" for m, a in t.columns]
    return t.reset_index()
