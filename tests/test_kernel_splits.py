"""The split-count sweep (kernels/splits.py) without a GPU: its grid, its table, its refusals."""
from __future__ import annotations

import pytest

from sm120_workbook.kernels import splits
from sm120_workbook.kernels.bench import Shape
from sm120_workbook.results import NotRecorded


def test_sweep_grid_puts_each_shapes_configurations_together():
    a, b = Shape(32, 16, 1, 16384), Shape(8, 16, 1, 65536)
    grid = splits.sweep_grid([a, b], [2, 4], [16, 32])
    assert [g[1] for g in grid] == [a] * 6 + [b] * 6
    assert grid[0] == ("sm120_mla", a, {}) and grid[5] == ("flashmla", a, {})
    assert [g[2] for g in grid[1:5]] == [{"num_splits": n, "tile_keys": k} for k in (16, 32) for n in (2, 4)]


def _rec(impl, rnd, t, splits_=None, tile=16, forced=True):
    return {"impl": impl, "round": rnd, "time_us": t, "batch": 32, "heads": 16, "q_len": 1, "ctx": 16384,
            "num_splits": splits_, "tile_keys": tile, "num_splits_forced": forced, "status": "ok"}


def test_sweep_table_reads_each_count_against_the_default_of_its_round():
    recs = []
    for rnd, (d, f, s8) in enumerate([(100.0, 95.0, 98.0), (102.0, 97.0, 102.0), (101.0, 99.0, 99.0)]):
        recs += [_rec("sm120_mla", rnd, d, 4, forced=False), _rec("sm120_mla", rnd, s8, 8),
                 _rec("flashmla", rnd, f)]
    recs.append(dict(_rec("sm120_mla", 3, 1.0, 2), status="error"))   # failed: left out
    t = splits.sweep_table(recs)
    assert t["config"].tolist() == ["default (splits 4, tile 16)", "splits 8, tile 16"]
    row = t.iloc[1]
    assert row["time_us"] == 99.0 and row["rounds"] == 3
    assert row["over_default"] == round(99 / 101, 4) and row["min"] == round(98 / 100, 4) and row["max"] == 1.0
    assert row["flashmla_over"] == round(95 / 98, 3)   # the median of 95/98, 97/102, 99/99
    assert t.iloc[0]["over_default"] == 1.0 and t.iloc[0]["shape"] == "b32 h16 q1 16k"


def test_sweep_refuses_bad_arguments_by_name(capsys):
    for argv, msg in ((["--shape", "32,16,1", "--splits", "2"], "--shape: '32,16,1'"),
                      (["--shape", "32,16,1,16384", "--splits", "2,x"], "--splits: '2,x'"),
                      (["--shape", "32,16,1,16384", "--splits", "0,2"], "--splits: '0,2'; each must be in 1..128"),
                      (["--shape", "32,16,1,16384", "--splits", "2", "--tile-keys", "64"], "--tile-keys: '64'"),
                      (["--shape", "32,16,1,16384", "--splits", "2", "--rounds", "1"], "--rounds must be")):
        with pytest.raises(SystemExit):
            splits.main(argv)
        assert msg in capsys.readouterr().err


def test_recorded_sweep_table_takes_the_newest_run_of_a_version():
    import pandas as pd

    recs = []
    for run_id, t in (("20261201T120000Z", 200.0), ("20261201T130000Z", 100.0)):
        for rnd in range(2):
            recs += [dict(_rec("sm120_mla", rnd, t, 4, forced=False), run_id=run_id, kernel_version="v29",
                          gpu="NVIDIA H200"),
                     dict(_rec("sm120_mla", rnd, t * 0.97, 8), run_id=run_id, kernel_version="v29", gpu="NVIDIA H200")]
    df = pd.DataFrame(recs)
    table = splits.recorded_sweep_table("v29", df)
    assert table["time_us"].tolist() == [100.0, 97.0] and table.iloc[1]["over_default"] == 0.97
    with pytest.raises(NotRecorded, match="version: no split sweep of 'v30' on H200 recorded; recorded on any GPU: \\['v29'\\]"):
        splits.recorded_sweep_table("v30", df)
    assert len(splits.recorded_sweep_table("v29")) > 0   # the recorded sweeps (data/results)


def test_sweep_table_sorts_counts_as_numbers_and_names_short_contexts():
    recs = [dict(_rec("sm120_mla", 0, 100.0, 4, forced=False), ctx=1000)]
    recs += [dict(_rec("sm120_mla", 0, 100.0 + n, n), ctx=1000) for n in (12, 2, 8)]
    recs += [dict(_rec("sm120_mla", 0, 1.0, 16), ctx=1000, status="error")]
    t = splits.sweep_table(recs)
    assert t["config"].tolist() == ["default (splits 4, tile 16)", "splits 2, tile 16", "splits 8, tile 16",
                                    "splits 12, tile 16"]
    assert set(t["shape"]) == {"b32 h16 q1 1000"}


def test_a_failed_build_is_named_without_its_tile():
    """bench.run records tile_keys only once the builder succeeds: the "not timed" line still
    names the configuration."""
    failed = {k: v for k, v in _rec("sm120_mla", 0, 0.0, 8).items() if k != "tile_keys"}
    assert splits._label(splits._config(dict(failed, status="error"))) == "splits 8, tile ?"
    assert splits._label(splits._config(_rec("flashmla", 0, 1.0))) == "flashmla"
