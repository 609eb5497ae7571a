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
