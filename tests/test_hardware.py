"""Machine description, the target table, and the GPU ceilings (which refuse to run on CPU)."""
from __future__ import annotations

import os

import pytest
import torch

from sm120_workbook.hardware import (NoGPUError, describe_machine, measure_bf16_matmul_tflops,
                                     measure_copy_bandwidth, target_hardware_table)
from sm120_workbook.roofline import TARGET_GPUS

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU; the CPU error path can't be shown")


def test_describe_machine():
    m = describe_machine()
    for key in ("gpus", "driver", "torch", "sglang", "triton", "nvcc", "python", "cpu_count"):
        assert key in m
    assert m["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert len(m["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_target_hardware_table():
    df = target_hardware_table()
    assert list(df.index) == list(TARGET_GPUS)
    rtx = df.loc["RTX PRO 6000 Blackwell"]
    assert (rtx["arch"], rtx["SMs"], rtx["mem GB/s (spec)"], rtx["smem/block (B)"], rtx["wgmma"]) == \
        ("sm_120", 188, 1792.0, 101376, "no")
    h200 = df.loc["H200"]
    assert (h200["arch"], h200["SMs"], h200["mem GB/s (spec)"], h200["wgmma"]) == ("sm_90", 132, 4800.0, "yes")


@no_gpu
def test_copy_bandwidth_raises_on_cpu():
    with pytest.raises(NoGPUError, match="CUDA GPU"):
        measure_copy_bandwidth(nbytes=1 << 20, repeats=1)


@no_gpu
def test_matmul_rate_raises_on_cpu():
    with pytest.raises(NoGPUError, match="CUDA GPU"):
        measure_bf16_matmul_tflops(n=256, repeats=1)


def test_no_gpu_error_is_a_runtime_error():
    assert issubclass(NoGPUError, RuntimeError)


@pytest.mark.parametrize("call, name", [
    (lambda: measure_copy_bandwidth(nbytes=10), "nbytes"),
    (lambda: measure_copy_bandwidth(repeats=0), "repeats"),
    (lambda: measure_bf16_matmul_tflops(n=8), "n"),
    (lambda: measure_bf16_matmul_tflops(warmup=-1), "warmup"),
])
def test_bad_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.gpu
def test_ceilings_on_gpu():
    copy = measure_copy_bandwidth(nbytes=256 << 20, repeats=5)
    assert copy["bytes_moved"] == 2 * (256 << 20) and 10 < copy["copy_gbps"] < 20_000
    # read + write of the buffer, over the median time (GB/s = bytes / (ms x 1e6))
    assert copy["copy_gbps"] == pytest.approx(2 * (256 << 20) / (copy["ms_median"] * 1e6), rel=1e-9)
    mm = measure_bf16_matmul_tflops(n=2048, repeats=5)
    assert 1 < mm["bf16_tflops"] < 5_000
    assert mm["bf16_tflops"] == pytest.approx(2 * 2048**3 / (mm["ms_median"] * 1e9), rel=1e-9)   # 2n^3 FLOPs


def test_provenance_names_the_visible_gpus_when_set(monkeypatch):
    from sm120_workbook.provenance import provenance

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert provenance("x")["cuda_visible_devices"] == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "cuda_visible_devices" not in provenance("x")


def test_recorded_ceilings_one_median_per_gpu():
    """Many recorded runs of one GPU give one measured bar (their median), under the target
    table's name for it, so the chart neither stacks runs nor splits "NVIDIA H200" from "H200"."""
    import pandas as pd

    from sm120_workbook.hardware import ceilings_frame, recorded_ceilings

    rec = pd.DataFrame({"gpu": ["NVIDIA H200"] * 3 + ["NVIDIA A100-SXM4-80GB"],
                        "date": ["2026-11-29T10:00", "2026-11-30T09:00", "2026-11-29T11:00", "2026-11-29"],
                        "copy_gbps": [4100.0, 4200.0, 4150.0, 1500.0],
                        "bf16_tflops": [770.0, 790.0, 780.0, 280.0]})
    t = recorded_ceilings(rec).set_index("gpu")
    assert t.loc["H200", "runs"] == 3 and t.loc["H200", "copy_gbps"] == 4150.0
    assert (t.loc["H200", "first"], t.loc["H200", "last"]) == ("2026-11-29", "2026-11-30")
    assert t.loc["H200", "bf16_tflops_min"] == 770.0 and "NVIDIA A100-SXM4-80GB" in t.index
    assert t.loc["H200", "mma_sync_runs"] == 0   # none of these runs measured it
    t = recorded_ceilings(rec.assign(mma_sync_tflops=[600.0, None, 620.0, 200.0])).set_index("gpu")
    assert (t.loc["H200", "mma_sync_tflops"], t.loc["H200", "mma_sync_runs"]) == (610.0, 2)
    f = ceilings_frame(rec)
    measured = f[f["source"].str.startswith("measured")]
    assert len(measured) == 4 and set(measured["gpu"]) == {"H200", "NVIDIA A100-SXM4-80GB"}
    assert measured[(measured["gpu"] == "H200") & (measured["metric"] == "memory GB/s")]["value"].item() == 4150.0
    assert set(measured[measured["gpu"] == "H200"]["source"]) == {
        "measured, recorded: median of 3 runs, 2026-11-29 to 2026-11-30"}
    inputs = f[~f["source"].str.startswith("measured")].set_index(["gpu", "metric"])["source"]
    assert inputs[("RTX PRO 6000 Blackwell", "memory GB/s")] == "roofline input: spec"
    assert inputs[("RTX PRO 6000 Blackwell", "bf16 TFLOP/s")] == "roofline input: measured by others"
    assert set(inputs[["H200"]]) == {"roofline input: recorded median"}
    assert len(recorded_ceilings(None)) == 0 and len(ceilings_frame(None)) == 2 * 2
    # the saved chart names where its measured bars come from
    from sm120_workbook.hardware import ceilings_chart
    from sm120_workbook.results import source_label

    title = ceilings_chart(f, source_label(rec.assign(commit="abc1234def"), live=False)).to_dict()["title"]
    assert title["subtitle"] == "recorded: NVIDIA A100-SXM4-80GB, NVIDIA H200; commit abc1234; 2026-11-29..2026-11-30"


def test_describe_provenance_counts_many_commits():
    """Thirty recorded runs name their commit count and the newest commit, not thirty hashes."""
    import pandas as pd

    from sm120_workbook.results import describe_provenance

    df = pd.DataFrame({"gpu": ["NVIDIA H200"] * 5, "commit": [c * 40 for c in "abcde"],
                       "date": [f"2026-11-2{i}" for i in (5, 9, 6, 7, 8)]})
    line = describe_provenance(df)
    assert "commits=5 (newest bbbbbbbbbbbb)" in line and "dates=2026-11-25..2026-11-29" in line
    assert f"commit={'a' * 40},{'b' * 40};" in describe_provenance(df.iloc[:2])
    # a commit from a dirty tree keeps its mark, and is counted; a record without a date is no date
    df.loc[1, "commit"] = "4d14ecc+dirty"
    df.loc[2, "date"] = None
    line = describe_provenance(df)
    assert "commits=5 (newest 4d14ecc+dirty; 1 from a dirty tree)" in line and "nan" not in line
    df.loc[1, "commit"] = "b" * 12 + "+dirty"
    assert f"(newest {'b' * 12}+dirty;" in describe_provenance(df)


def test_live_gpu_is_off_under_nbval(monkeypatch):
    """nbval (notebooks/conftest.py) sets SM120_RECORDED_ONLY: a GPU machine then renders the
    recorded results the notebooks were saved with, instead of running live; the reason names
    the GPU first, so a machine without one prints the same line either way."""
    import torch

    from sm120_workbook.hardware import RECORDED_ONLY_ENV, live_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(RECORDED_ONLY_ENV, raising=False)
    assert live_gpu() == (True, "")
    monkeypatch.setenv(RECORDED_ONLY_ENV, "1")
    ok, why = live_gpu()
    assert not ok and RECORDED_ONLY_ENV in why
    monkeypatch.setenv(RECORDED_ONLY_ENV, "0")
    assert live_gpu()[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(RECORDED_ONLY_ENV, "1")
    assert live_gpu() == (False, "no CUDA GPU (torch.cuda.is_available() is False)")


def test_nbval_conftest_sets_recorded_only():
    import runpy
    from pathlib import Path

    from sm120_workbook.hardware import RECORDED_ONLY_ENV

    conftest = Path(__file__).resolve().parent.parent / "notebooks" / "conftest.py"
    saved = os.environ.pop(RECORDED_ONLY_ENV, None)
    try:
        runpy.run_path(str(conftest))
        assert os.environ.get(RECORDED_ONLY_ENV) == "1"
    finally:
        os.environ.pop(RECORDED_ONLY_ENV, None)
        if saved is not None:
            os.environ[RECORDED_ONLY_ENV] = saved


def test_nbval_reports_only_a_cells_machine_skip_as_skipped():
    """The notebooks' own skip lines (every one printed as "SKIPPED ... on this machine: why") turn
    a passed nbval cell into a skip; a live run's "SKIPPED ctx=..." or a data gap's "SKIPPED: the
    fit needs ..." do not, since those cells did run."""
    import json
    import runpy
    from pathlib import Path

    notebooks = Path(__file__).resolve().parent.parent / "notebooks"
    skipped_here = runpy.run_path(str(notebooks / "conftest.py"))["SKIPPED_HERE"]
    gated = 0
    for nb in sorted(notebooks.glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            src = "".join(cell["source"])
            if cell["cell_type"] == "code" and "print(f\"SKIPPED" in src and "on this machine" in src:
                gated += 1
                lines = [line for out in cell.get("outputs", []) if out.get("name") == "stdout"
                         for line in "".join(out["text"]).splitlines() if line.startswith("SKIPPED")]
                assert lines and all(skipped_here.match(line) for line in lines), (nb.name, lines)
    assert gated >= 6   # 00, 02, 03 (two), 04, 05
    for line in ("SKIPPED ctx=65536: server died", "SKIPPED flashmla/none: no sm_90", "SKIPPED: the fit needs sm120_mla"):
        assert not skipped_here.match(line)


def test_flashmla_is_refused_where_sgl_kernel_ships_no_kernel():
    """sgl_kernel's FlashMLA is sm_90a / sm_100 / sm_103 code: on an RTX PRO 6000 (12.0) or an
    sm_86 it is recorded as unsupported instead of being called; other libraries are not judged."""
    from sm120_workbook.hardware import unsupported_reason

    assert unsupported_reason("flashmla", (9, 0)) is None and unsupported_reason("flashmla", (10, 3)) is None
    why = unsupported_reason("flashmla", (12, 0))
    assert why.startswith("flashmla has no kernel for this GPU (sm_120)") and "9.x or 10.x" in why
    assert "sm_86" in unsupported_reason("flashmla", (8, 6))
    assert unsupported_reason("flashinfer_mla_fa2", (12, 0)) is None and unsupported_reason("triton", (8, 0)) is None
