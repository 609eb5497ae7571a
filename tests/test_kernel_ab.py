"""The A/B tool (kernels/ab.py) without a GPU: its table and its refusals."""
from __future__ import annotations

import shutil

import pytest

from sm120_workbook.kernels import ab
from sm120_workbook.kernels.build import KERNEL_DIR, SOURCES


def _rec(variant, rnd, t, ctx=65536, diff=None):
    r = {"variant": variant, "round": rnd, "time_us": t, "batch": 1, "heads": 8, "q_len": 16, "ctx": ctx,
         "short_ctx": 0}
    return r if diff is None else dict(r, max_abs_diff=diff)


def test_ab_table_pairs_each_round():
    """Each round's ratio pairs that round's two timings; the medians are over the rounds, and a
    round with only one build timed is left out."""
    recs = [_rec("full", 0, 100.0, diff=0.0), _rec("src_v25", 0, 101.0, diff=0.0),
            _rec("full", 1, 99.0), _rec("src_v25", 1, 100.0),
            _rec("full", 2, 105.0), _rec("src_v25", 2, 100.0),
            _rec("full", 3, 90.0)]   # its pair is missing
    t = ab.ab_table(recs, "src_v25")
    assert t["shape"].tolist() == ["b1 h8 q16 64k"]
    row = t.iloc[0]
    assert row["rounds"] == 3 and row["shipped_us"] == 100.0 and row["baseline_us"] == 100.0
    assert row["ratio"] == round(100 / 101, 4) and row["ratio_min"] == round(99 / 100, 4)
    assert row["ratio_max"] == 1.05 and row["max_abs_diff"] == 0.0


def test_ab_refuses_a_baseline_that_is_not_another_revision(tmp_path, capsys):
    """--baseline must hold every kernel source, and must not be the shipped folder itself (the
    A/B would time one build twice)."""
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--baseline:" in err and "lacks mla_verify.cuh" in err
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(KERNEL_DIR)])
    assert "shipped sources' own folder" in capsys.readouterr().err
    for name in SOURCES:
        shutil.copy(KERNEL_DIR / name, tmp_path / name)
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(tmp_path), "--rounds", "0"])
    assert "--rounds and --reps must be positive" in capsys.readouterr().err


def test_ab_times_the_target_shapes():
    shapes = ab.target_shapes()
    assert len(shapes) == len(set(shapes)) == 24   # 2 head counts x (4 verify + b32 + 7 decode)
    assert {s.q_len for s in shapes} == {1, 16} and {s.batch for s in shapes} == {1, 32}
