"""sass_compare: two revisions' SASS side by side, per kernel and arch (CPU; the build test needs
nvcc and nvdisasm)."""
import shutil

import pytest

from sm120_workbook.kernels.sass_compare import KernelSass, compare, instruction_keys, verdict
from sm120_workbook.kernels.sass_loops import Instruction, nvdisasm


def _loop(shift: int, label: str, reg: str = "R4") -> list[Instruction]:
    """A two-instruction loop whose branch goes back to its first, at another address and label."""
    return [Instruction(0x100 + shift, "", "HMMA.16816.F32.BF16", (reg, "R8", "R12", reg)),
            Instruction(0x110 + shift, "@P0", "BRA", (f"`({label})",), target=0x100 + shift)]


def test_branch_targets_compare_by_distance_not_address():
    assert instruction_keys(_loop(0, ".L_x_3")) == instruction_keys(_loop(0x40, ".L_x_9"))
    assert instruction_keys(_loop(0, ".L_x_3"))[1][2] == ("-1",)


def _kernel(instrs, loops):
    return KernelSass(200, 0, instruction_keys(instrs), [instruction_keys(x) for x in loops])


def test_verdicts():
    base_loop = _loop(0, ".L_x_1")
    prologue = [Instruction(0x0, "", "S2R", ("R0", "SR_TID.X"))]
    base = _kernel(prologue + base_loop, [base_loop])
    assert verdict(base, base) == ("identical", 0)
    longer = _kernel(prologue * 2 + _loop(0x10, ".L_x_2"), [_loop(0x10, ".L_x_2")])
    assert verdict(base, longer) == ("loops identical", 0)
    renamed = _kernel(prologue + _loop(0, ".L_x_1", "R6"), [_loop(0, ".L_x_1", "R6")])
    assert verdict(base, renamed) == ("loops renamed", 0)
    moved = [Instruction(0x100, "", "IADD3", ("R1", "R1", "1", "RZ"))] + _loop(0x10, ".L_x_1")
    assert verdict(base, _kernel(prologue + moved, [moved])) == ("loops differ", 1)


def _listing(first_label: int) -> str:
    """One kernel with a loop and a BSSY, its labels numbered from `first_label` (nvdisasm numbers
    them across the cubin, so another kernel's change renumbers this one's)."""
    a, b = f".L_x_{first_label}", f".L_x_{first_label + 1}"
    return f"""
.text._Z1kv:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BSSY B0, `({b}) ;
{a}:
        /*0020*/                   HMMA.16816.F32.BF16 R20, R12, R16, R20 ;
        /*0030*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0040*/              @!P0 BRA `({a}) ;
        /*0050*/              @P1 BRA `({b}) ;
{b}:
        /*0060*/                   BSYNC B0 ;
        /*0070*/                   EXIT ;
"""


def test_labels_compare_by_position_not_number():
    from sm120_workbook.kernels.sass_loops import mma_loops, parse_sass

    one, other = parse_sass(_listing(3))["_Z1kv"], parse_sass(_listing(40))["_Z1kv"]
    assert one[1].target == 0x60   # BSSY's label is resolved too
    assert instruction_keys(one) == instruction_keys(other)
    loop = instruction_keys(mma_loops(one)[0])
    assert loop[-1][2] == ("-2",) and instruction_keys(one)[5][2] == ("+1",)
    # inside a loop's body, a label past the loop is "outside"
    body = one[2:6]
    assert instruction_keys(body)[3][2] == ("outside",)


def test_loop_boundaries_count():
    """Loops [A, B], [C] and [A], [B, C] issue the same opcodes, but are not the same loops."""
    mk = lambda ops: [("", op, ()) for op in ops]
    first = KernelSass(1, 0, [("", "X", ())], [mk(["A", "B"]), mk(["C"])])
    second = KernelSass(1, 0, [("", "Y", ())], [mk(["A"]), mk(["B", "C"])])
    assert verdict(first, second)[0] == "loops differ"


@pytest.mark.nvcc
def test_a_copy_of_the_shipped_headers_compiles_identical(tmp_path):
    """The whole path, nvcc to verdicts, on sm_120a: the shipped headers in another folder give
    the same SASS for every kernel the launcher may run."""
    if nvdisasm() is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm, in the `test` extra)")
    from sm120_workbook.kernels.build import KERNEL_DIR, SOURCES

    for name in SOURCES:
        shutil.copy(KERNEL_DIR / name, tmp_path / name)
    rows = compare(tmp_path, KERNEL_DIR, archs=("sm_120a",))
    assert len(rows) == 18   # 6 attention builds and 12 combine builds
    assert {r["verdict"] for r in rows} == {"identical"}, [r for r in rows if r["verdict"] != "identical"]
