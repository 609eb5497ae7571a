"""Reading benchmark records: default rows, targets and the version history (no GPU needed)."""
from __future__ import annotations

import pandas as pd

from sm120_workbook.kernels import bench_report as br


def _rec(run_id, version, impl, time_us, q_len=16, ctx=65536, forced=False, tile_keys=16):
    return {"run_id": run_id, "kernel_version": version if impl == "sm120_mla" else None, "commit": "abc1234def",
            "impl": impl, "batch": 1, "heads": 8, "q_len": q_len, "ctx": ctx, "time_us": time_us,
            "num_splits_forced": forced, "tile_keys": tile_keys if impl == "sm120_mla" else None,
            "roofline_us": 23.0}


def test_version_history_compares_runs_through_flashmla_in_the_same_run():
    df = pd.DataFrame([
        _rec("20261129T120000Z", "v1", "sm120_mla", 300.0), _rec("20261129T120000Z", "v1", "flashmla", 60.0),
        _rec("20261129T120000Z", "v1", "sm120_mla", 250.0, forced=True),      # an NSPLIT sweep row: not the default
        _rec("20261129T130000Z", "v2", "sm120_mla", 120.0), _rec("20261129T130000Z", "v2", "flashmla", 57.0),
        _rec("20261129T130000Z", "v2", "sm120_mla", 130.0, tile_keys=32),     # the slower tile variant
        _rec("20261129T130000Z", "v2", "sm120_mla", 50.0, q_len=1),           # another shape
    ])
    hist = br.version_history(df)
    assert list(hist["kernel_version"]) == ["v1", "v2"]
    assert list(hist["sm120_mla_us"]) == [300.0, 120.0] and list(hist["flashmla_us"]) == [60.0, 57.0]
    assert list(hist["flashmla / sm120_mla"]) == [0.2, 0.47]
    assert br.version_history(df, q_len=1)["flashmla_us"].isna().all()   # no FlashMLA decode row: NaN, not 0
    assert br.version_history(df, ctx=4096).empty
    br.version_history_chart(hist, "t").to_dict()


def test_targets_table_says_missed_when_missed():
    df = pd.DataFrame([_rec("r", "v", "sm120_mla", 126.8), _rec("r", "v", "flashmla", 57.1),
                       _rec("r", "v", "triton_verify", 12238.2)])
    t = br.targets_table(df).set_index("target")
    assert not t.loc["q16 h8 64k: <= FlashMLA", "met"]
    assert not t.loc["q16 h8 64k: >= 100x Triton verify", "met"] and t.loc["q16 h8 64k: >= 100x Triton verify", "ratio"] == 96.5
