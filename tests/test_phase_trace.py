"""phase_trace.phase_table: the wide kernel's clock64() stamps turned into phase lengths."""
import numpy as np
import pytest

from sm120_workbook.kernels.phase_trace import phase_table


def synthetic(rounds=10, pingpong=True, steps_in_order=(10, 100, 20, 200, 30, 90), steps_lagging=(15, 210, 25, 95, 105),
              reached=None):
    """Stamps of 8 warps whose phases take the given cycles every round (+ a warp offset)."""
    clocks = np.zeros((8, 64, 7), dtype=np.int64)
    for w in range(8):
        lag = pingpong and w >= 4
        steps = steps_lagging if lag else steps_in_order
        t = 1000 + w
        for r in range(reached or rounds):
            clocks[w, r, 0] = t
            for i, d in enumerate(steps):
                clocks[w, r, i + 1] = clocks[w, r, i] + d
            t += 500   # the round, arrive A to arrive A
    return clocks


def test_phase_lengths_and_round_per_row_pair():
    t = phase_table(synthetic()).set_index("row pair")
    assert t.loc[0, "schedule"] == "in order" and t.loc[1, "schedule"] == "a phase behind"
    assert t.loc[0, ["A wait", "QK", "B wait", "softmax", "C wait", "P.V"]].tolist() == [10, 100, 20, 200, 30, 90]
    assert t.loc[1, ["A wait", "softmax(t-1)", "C wait", "P.V(t-1)", "QK"]].tolist() == [15, 210, 25, 95, 105]
    assert np.isnan(t.loc[1, "B wait"])          # the lagging pair has no B barrier
    assert t["round"].tolist() == [500, 500]
    # rounds used: complete ones, minus 2 of ring fill and the last; the lagging pair also drops round 0
    assert t["rounds"].tolist() == [7, 6]


def test_in_step_build_labels_both_pairs_in_order():
    t = phase_table(synthetic(pingpong=False), pingpong=False)
    assert t["schedule"].tolist() == ["in order", "in order"] and t["QK"].tolist() == [100, 100]


def test_rounds_never_reached_are_left_out():
    short = synthetic(reached=6)
    assert phase_table(short)["round"].tolist() == [500, 500]


def test_too_few_rounds_or_a_wrong_shape_raise():
    with pytest.raises(ValueError, match="fewer than 2 complete rounds"):
        phase_table(synthetic(reached=3))
    with pytest.raises(ValueError, match="clocks"):
        phase_table(np.zeros((7, 64, 7)))


def test_recorded_table_keeps_the_newest_trace_of_each_build():
    import pandas as pd

    from sm120_workbook.kernels.phase_trace import recorded_table

    base = dict(heads=8, q_len=16, ctx=65536, schedule="in order", QK=800.0, round=2150.0, untraced_us=90.7, gpu="NVIDIA H200")
    rows = [dict(base, defines=[], date="2026-01-01", **{"row pair": 0}),
            dict(base, defines=[], date="2026-01-02", QK=700.0, **{"row pair": 0}),
            dict(base, defines=["ABLATE_NO_LOADS"], date="2026-01-01", **{"row pair": 0}),
            dict(base, defines=[], date="2026-01-02", heads=16, **{"row pair": 0}),
            dict(base, defines=[], date="2026-01-03", QK=1500.0, gpu="NVIDIA RTX PRO 6000 Blackwell Workstation Edition", **{"row pair": 0})]
    t = recorded_table(pd.DataFrame(rows))
    assert t["build"].tolist() == ["(shipped build)", "ABLATE_NO_LOADS"]
    assert t["QK"].tolist() == [700.0, 800.0]   # cycles at another GPU's clock stay apart
    assert t.attrs["source"] == "recorded: NVIDIA H200; 2026-01-01..2026-01-02"
    assert recorded_table(pd.DataFrame(rows), gpu="RTX PRO 6000")["QK"].tolist() == [1500.0]
    assert recorded_table(pd.DataFrame()).empty


def test_cli_without_a_gpu_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CLI would run the traced kernel (the GPU machine's scripts do)")
    from sm120_workbook.kernels.phase_trace import main

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--heads", "16", "--no-record"])


def test_fused_build_names_the_merged_phase():
    clocks = synthetic(steps_in_order=(10, 300, 20, 200, 30), steps_lagging=(15, 210, 25, 310))
    t = phase_table(clocks, fused=True).set_index("row pair")
    assert t.loc[0, ["A wait", "QK+P.V(t-1)", "B wait", "softmax", "C wait"]].tolist() == [10, 300, 20, 200, 30]
    assert t.loc[1, ["A wait", "softmax(t-1)", "C wait", "QK+P.V(t-1)"]].tolist() == [15, 210, 25, 310]
    assert "P.V" not in t.columns and "QK" not in t.columns


def test_build_schedule_reads_the_source_defaults_and_the_defines():
    from sm120_workbook.kernels.phase_trace import build_schedule

    default = build_schedule()
    assert set(default) == {"pingpong", "fused"}
    assert build_schedule(["WIDE_PINGPONG=0", "WIDE_FUSED=1"]) == {"pingpong": False, "fused": True}
    assert build_schedule(["WIDE_FUSED=0"])["pingpong"] == default["pingpong"]


def test_cli_command_names_the_module_and_its_arguments():
    from sm120_workbook.results import cli_command

    assert cli_command("sm120_workbook.kernels.phase_trace", ["--ctx", "4096"]) == \
        "python -m sm120_workbook.kernels.phase_trace --ctx 4096"


def test_cli_records_take_the_tools_command_and_its_out(tmp_path):
    import json

    from sm120_workbook.results import append_cli_records

    out = tmp_path / "x.jsonl"
    path = append_cli_records("kernel_phase_trace", [{"a": 1}], "sm120_workbook.kernels.phase_trace",
                              ["--ctx", "4096"], str(out))
    rec = json.loads(out.read_text())
    assert path == out and rec["a"] == 1
    assert rec["command"] == "python -m sm120_workbook.kernels.phase_trace --ctx 4096"


def test_record_args_are_every_tools_out_tag_and_no_record():
    import argparse

    from sm120_workbook.results import add_record_args

    ap = argparse.ArgumentParser()
    add_record_args(ap, "kernel_phase_trace")
    a = ap.parse_args(["--out", "x.jsonl", "--tag", "v21", "--no-record"])   # x.jsonl: probed in the cwd, not made
    assert (a.out, a.tag, a.no_record) == ("x.jsonl", "v21", True)
    assert "data/results/kernel_phase_trace.jsonl" in ap.format_help()
    assert vars(ap.parse_args([])) == {"out": None, "tag": None, "no_record": False}
