"""Reading benchmark records: default rows, targets and the version history (no GPU needed)."""
from __future__ import annotations

import pandas as pd
import pytest

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
    dirty = br.version_history(df.assign(commit="4d14ecc9ab+dirty"))
    assert set(dirty["commit"]) == {"4d14ecc+dirty"}   # a dirty tree's run says so
    assert br.version_history(df, q_len=1)["flashmla_us"].isna().all()   # no FlashMLA decode row: NaN, not 0
    assert br.version_history(df, ctx=4096).empty
    chart = br.version_history_chart(hist, "t").to_dict()
    # each run says its L2 flush (records without the field had the written one); the chart names a
    # flush other than the default in the run's label
    assert list(hist["l2_flush"]) == ["write", "write"]
    flushed = br.version_history(df.assign(l2_flush=["read"] * 3 + ["layer"] * 4))
    assert list(flushed["l2_flush"]) == ["read", "layer"]
    runs = {r["run"] for r in br.version_history_chart(flushed, "t").to_dict()["datasets"].popitem()[1]}
    assert runs == {"v1 (1200)", "v2 (1300, layer)"} and "v1 (1200, write)" in str(chart)


def test_targets_table_says_missed_when_missed():
    df = pd.DataFrame([_rec("r", "v", "sm120_mla", 126.8), _rec("r", "v", "flashmla", 57.1),
                       _rec("r", "v", "triton_verify", 12238.2)])
    t = br.targets_table(df).set_index("target")
    assert not t.loc["q16 h8 64k: <= FlashMLA", "met"]
    assert not t.loc["q16 h8 64k: >= 100x Triton verify", "met"] and t.loc["q16 h8 64k: >= 100x Triton verify", "ratio"] == 96.5


def test_baselines_missing_from_the_latest_run_come_from_the_newest_run_that_has_them():
    df = pd.DataFrame([
        _rec("20261129T120000Z", "v9", "sm120_mla", 126.8), _rec("20261129T120000Z", "v9", "triton_verify", 12238.2),
        _rec("20261129T130000Z", "v14", "sm120_mla", 107.8), _rec("20261129T130000Z", "v14", "flashmla", 56.7),
    ])
    latest = br.latest_run(df)
    table = br.with_missing_baselines(latest, df)
    assert sorted(table["impl"]) == ["flashmla", "sm120_mla", "triton_verify"]   # v9's sm120_mla row stays out
    assert br.baselines_from(table) == {"triton_verify": "20261129T120000Z"}
    assert br.baselines_from(latest) == {}
    t = br.targets_table(table).set_index("target")
    assert t.loc["q16 h8 64k: >= 100x Triton verify", "met"]   # 12238.2 / 107.8 = 113.5
    # an older run asked for by id takes a baseline it lacks from the newest run not newer than it,
    # and from the oldest newer run only where no older run has it
    df = pd.concat([df, pd.DataFrame([_rec("20261129T110000Z", "v8", "flashmla", 58.0),
                                      _rec("20261129T140000Z", "v15", "triton_verify", 12000.0),
                                      _rec("20261129T150000Z", "v16", "triton_verify", 11000.0)])])
    v9 = br.with_missing_baselines(df[df.run_id == "20261129T120000Z"], df)
    assert br.baselines_from(v9) == {"flashmla": "20261129T110000Z"}
    v14 = br.with_missing_baselines(df[df.run_id == "20261129T130000Z"], df)
    assert br.baselines_from(v14) == {"triton_verify": "20261129T120000Z"}
    first = br.with_missing_baselines(df[df.run_id == "20261129T110000Z"], df)
    assert br.baselines_from(first) == {}   # a flashmla-only run: no sm120_mla rows to compare against
    early = pd.DataFrame([_rec("20261129T100000Z", "v7", "sm120_mla", 130.0)])
    assert br.baselines_from(br.with_missing_baselines(early, pd.concat([early, df]))) == {
        "flashmla": "20261129T110000Z", "triton_verify": "20261129T120000Z"}


H200, RTX_GPU = "NVIDIA H200", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"


def test_missing_baselines_come_only_from_runs_on_the_same_gpu():
    """An RTX PRO 6000 run has no FlashMLA (Hopper-only): the H200's FlashMLA times are no
    baseline for it, while an older RTX run's Triton times are."""
    df = pd.DataFrame([
        dict(_rec("20261129T120000Z", "v20", "flashmla", 57.0), gpu=H200),
        dict(_rec("20261129T120000Z", "v20", "triton_verify", 12000.0), gpu=H200),
        dict(_rec("20261201T090000Z", "v21", "triton_verify", 30000.0), gpu=RTX_GPU),
        dict(_rec("20261201T100000Z", "v21", "sm120_mla", 70.0), gpu=RTX_GPU),
    ])
    table = br.with_missing_baselines(br.latest_run(df), df)
    assert sorted(table["impl"]) == ["sm120_mla", "triton_verify"]
    assert table.loc[table.impl == "triton_verify", "time_us"].tolist() == [30000.0]


def test_missing_baselines_and_pooled_rounds_keep_to_one_l2_flush():
    """Times after a written flush (records without `l2_flush`, before session 51) carry the dirty
    lines' write-back: a run timed after a read flush takes no baseline from them, and its rounds
    are not pooled with theirs, even under the same kernel tag."""
    df = pd.DataFrame([
        dict(_rec("20261203T100000Z", "v31", "flashmla", 57.0), gpu=H200),
        dict(_rec("20261204T100000Z", "v31", "triton_verify", 12000.0), gpu=H200, l2_flush="read"),
        dict(_rec("20261204T110000Z", "v31", "sm120_mla", 30.0), gpu=H200, l2_flush="read"),
    ])
    table = br.with_missing_baselines(br.latest_run(df), df)
    assert sorted(table["impl"]) == ["sm120_mla", "triton_verify"]
    assert br.l2_flush_of(df).tolist() == ["write", "read", "read"]
    rounds = pd.DataFrame([{"run_id": "20261203T1", "commit": "a", "gpu": H200, "kernel_version": "v31"},
                           {"run_id": "20261204T1", "commit": "b", "gpu": H200, "kernel_version": "v31", "l2_flush": "read"},
                           {"run_id": "20261204T2", "commit": "b", "gpu": H200, "kernel_version": "v31", "l2_flush": "read"}])
    assert list(br.latest_rounds(rounds)["run_id"]) == ["20261204T1", "20261204T2"]
    assert list(br.latest_rounds(rounds.iloc[:1])["run_id"]) == ["20261203T1"]
    # a later run after the written flush (`--l2-flush write`, a side-by-side) takes over neither the
    # pooled rounds nor the run the notebook shows; asked for by id, it is shown
    later = {"run_id": "20261204T3", "commit": "b", "gpu": H200, "kernel_version": "v31", "l2_flush": "write"}
    assert list(br.latest_rounds(pd.concat([rounds, pd.DataFrame([later])]))["run_id"]) == ["20261204T1", "20261204T2"]
    bench_runs = pd.concat([df, pd.DataFrame([dict(_rec("20261205T100000Z", "v31", "flashmla", 50.0), gpu=H200,
                                                   l2_flush="write")])])
    assert set(br.comparison_run(bench_runs)["run_id"]) == {"20261204T100000Z"}
    assert set(br.comparison_run(bench_runs, "20261205T100000Z")["run_id"]) == {"20261205T100000Z"}
    from sm120_workbook.kernels import bench

    assert br.DEFAULT_L2_FLUSH == bench.L2_FLUSH == bench.L2_FLUSHES[0]   # the tools' default is the tables'


def test_version_history_is_one_gpus():
    df = pd.DataFrame([dict(_rec("a", "v20", "sm120_mla", 85.0), gpu=H200), dict(_rec("a", "v20", "flashmla", 57.0), gpu=H200),
                       dict(_rec("b", "v21", "sm120_mla", 110.0), gpu=RTX_GPU)])
    assert br.version_history(df, gpu="H200")["run_id"].tolist() == ["a"]
    assert br.version_history(df, gpu="RTX PRO 6000")["flashmla_us"].isna().all()
    assert len(br.version_history(df)) == 2


def test_an_rtx_run_is_measured_beside_the_projection_not_projected():
    import pytest

    h200 = _linear_run().assign(roofline_us=lambda d: d["roofline_mma_us"] * 0.8, gpu=H200, run_id="a", tile_keys=16)
    source = br.rtx_projection(h200)
    assert set(source["source_gpu"]) == {H200} and "rtx_measured_us" not in source
    ours = source.set_index("ctx")
    # measured on an RTX PRO 6000: 16k and 32k inside the range, 64k above it, 128k not timed
    times = {16384: (ours.loc[16384, "rtx_bound_us"] + ours.loc[16384, "rtx_projected_us"]) / 2,
             32768: ours.loc[32768, "rtx_bound_us"] + 0.1, 65536: ours.loc[65536, "rtx_projected_us"] * 1.5}
    rtx = pd.DataFrame([dict(impl="sm120_mla", batch=1, heads=8, q_len=16, ctx=c, time_us=t, roofline_us=1.0,
                             gpu=RTX_GPU, run_id="b", tile_keys=16) for c, t in times.items()]
                       + [dict(impl="triton_verify", batch=1, heads=8, q_len=16, ctx=16384, time_us=9e3,
                               roofline_us=1.0, gpu=RTX_GPU, run_id="b")])
    with pytest.raises(ValueError, match="df: records measured on an RTX PRO 6000"):
        br.rtx_projection(rtx)
    p = br.rtx_projection(h200, measured=rtx).set_index("ctx")
    assert p["in_range"].tolist() == [True, True, False, None]
    assert pd.isna(p.loc[131072, "rtx_measured_us"])
    # the notebook's pairing: from whichever side it starts, project the H200 run, measure the RTX one
    all_runs = pd.concat([h200, rtx], ignore_index=True)
    for table in (br.default_rows(rtx), br.default_rows(h200)):
        src, measured = br.projection_runs(table, all_runs)
        assert set(src.loc[src.impl == "sm120_mla", "gpu"]) == {H200}
        assert set(measured["gpu"]) == {RTX_GPU} and (measured.impl == "sm120_mla").sum() == 3
    assert br.projection_runs(br.default_rows(h200), h200)[1] is None
    assert br.run_label(rtx) == f"{RTX_GPU} (run b)" and br.run_label(None) == ""
    # a chart's provenance: the run's commit and date where the records have them
    dated = rtx.assign(commit="abc1234def", date="2026-12-04T10:30:18+00:00")
    assert br.run_label(dated) == f"{RTX_GPU} (run b, commit abc1234, 2026-12-04)"
    assert br.run_label(pd.concat([dated, h200.assign(commit=None)])) == f"{H200} (run a), {RTX_GPU} (run b, commit abc1234, 2026-12-04)"


def test_a_target_without_a_baseline_is_not_measured_rather_than_missed():
    df = pd.DataFrame([_rec("r", "v", "sm120_mla", 50.0, q_len=1, ctx=32768)])
    row = br.targets_table(df).set_index("target").loc["decode h8 32k: >= 1x Triton decode"]
    assert row["met"] is None and "not measured" in row["measured"]


def test_the_batch32_target_says_what_it_asks_of_the_mma_sync_ceiling():
    def b32(impl, t):
        return dict(_rec("r", "v", impl, t, ctx=16384), batch=32, roofline_mma_us=232.4)

    t = br.targets_table(pd.DataFrame([b32("sm120_mla", 775.5), b32("flashmla", 236.9)])).set_index("target")
    row = t.loc["b32 q16 h8 16k: within 10% of FlashMLA"]
    assert not row["met"] and row["note"] == ("needs 89% of this run's mma.sync ceiling (232 us); "
                                              "FlashMLA runs at 98% of it")
    assert (t.drop(index="b32 q16 h8 16k: within 10% of FlashMLA")["note"] == "").all()


def test_the_roofline_targets_say_what_they_ask_of_the_mma_sync_ceiling():
    # The roofline takes cuBLAS's (wgmma) rate, 1.24x mma.sync's on the H200: 1.3x of it leaves an
    # mma.sync kernel 29.9 of 31.4 us, 95% of its ceiling with no fixed part at all.
    rec = dict(_rec("r", "v", "sm120_mla", 85.2), roofline_us=24.14, roofline_mma_us=29.87)
    row = br.targets_table(pd.DataFrame([rec])).set_index("target").loc["q16 h8 64k: within 1.3x roofline"]
    assert not row["met"] and row["note"] == "needs 95% of this run's mma.sync ceiling (30 us)"
    # a run that did not measure the mma.sync rate says nothing rather than a wrong share
    row = br.targets_table(pd.DataFrame([_rec("r", "v", "sm120_mla", 85.2)])).set_index("target")
    assert row.loc["q16 h8 64k: within 1.3x roofline", "note"] == ""


def test_cta_rows_table_pairs_the_two_kernels():
    import pandas as pd

    from sm120_workbook.kernels.bench_report import cta_rows_table

    rows = [dict(impl="sm120_mla", batch=1, heads=8, q_len=16, ctx=65536, tile_keys=16, cta_rows=c, time_us=t,
                 num_splits_forced=False) for c, t in ((32, 100.0), (64, 150.0))]
    rows.append(dict(impl="sm120_mla", batch=1, heads=8, q_len=16, ctx=65536, tile_keys=16, cta_rows=64,
                     time_us=500.0, num_splits_forced=True))   # a sweep point: left out
    t = cta_rows_table(pd.DataFrame(rows))
    assert t.to_dict("records") == [{"batch": 1, "heads": 8, "q_len": 16, "ctx": 65536, "split_32_rows_us": 100.0,
                                     "wide_64_rows_us": 150.0, "wide / split": 1.5, "picked": 64}]
    assert cta_rows_table(pd.DataFrame(rows).drop(columns="cta_rows")).empty


def test_default_rows_follow_the_kernel_the_workspace_picks():
    import pandas as pd

    from sm120_workbook.kernels.bench_report import default_rows

    base = dict(impl="sm120_mla", batch=1, heads=16, q_len=16, ctx=65536, tile_keys=16, num_splits_forced=False)
    new_run = [dict(base, run_id="b", cta_rows=64, kernel_forced=False, time_us=186.0),   # the default (by shape)
               dict(base, run_id="b", cta_rows=32, kernel_forced=True, time_us=202.0),
               dict(base, run_id="b", cta_rows=64, kernel_forced=True, time_us=185.0)]
    old_run = [dict(base, run_id="a", cta_rows=32, time_us=201.0), dict(base, run_id="a", cta_rows=64, time_us=255.0)]
    # a decode shape timed only with its tile size fixed: the 16-key row is still the default
    dec = dict(base, q_len=1, heads=8, run_id="c", cta_rows=32, kernel_forced=True)
    decode_run = [dict(dec, tile_keys=16, time_us=52.0), dict(dec, tile_keys=32, time_us=72.0)]
    # a run whose default row used the split kernel, as the policy of its day picked: that row
    then = dict(base, heads=8, run_id="d")
    policy_then = [dict(then, cta_rows=32, kernel_forced=False, time_us=108.0),
                   dict(then, cta_rows=64, kernel_forced=True, time_us=109.0)]
    for rows, want in ((new_run, 186.0), (old_run, 201.0), (decode_run, 52.0), (policy_then, 108.0)):
        t = default_rows(pd.DataFrame(rows))
        assert t["time_us"].tolist() == [want]


def test_comparison_run_skips_kernel_only_runs():
    import pandas as pd
    import pytest

    from sm120_workbook.kernels.bench_report import comparison_run

    rows = [dict(run_id="a", impl="sm120_mla"), dict(run_id="a", impl="flashmla"),
            dict(run_id="b", impl="sm120_mla")]            # newer, kernel-only
    df = pd.DataFrame(rows)
    assert set(comparison_run(df)["run_id"]) == {"a"}
    assert set(comparison_run(df, "b")["run_id"]) == {"b"}
    assert set(comparison_run(df[df.run_id == "b"])["run_id"]) == {"b"}   # nothing compares: the newest
    with pytest.raises(ValueError, match="bench_run"):
        comparison_run(df, "zzz")


def _linear_run(heads=8, ours=(20.0, 70.0), fm=(40.0, 20.0), mma_per_64k=30.0, ctxs=(16384, 32768, 65536, 131072)):
    """Times exactly fixed + per_64k x ctx/64k for sm120_mla and flashmla, and the mma.sync ceiling."""
    rows = []
    for c in ctxs:
        x = c / 65536
        rows.append(dict(impl="sm120_mla", batch=1, heads=heads, q_len=16, ctx=c, time_us=ours[0] + ours[1] * x,
                         roofline_mma_us=mma_per_64k * x))
        rows.append(dict(impl="flashmla", batch=1, heads=heads, q_len=16, ctx=c, time_us=fm[0] + fm[1] * x,
                         roofline_mma_us=float("nan")))
    return pd.DataFrame(rows)


def test_flashmla_reach_splits_fixed_and_per_key_time_and_bounds_any_mma_sync_kernel():
    import pytest

    r = br.flashmla_reach(_linear_run()).iloc[0]
    assert (r["sm120_mla fixed us"], r["sm120_mla us per 64k keys"]) == (pytest.approx(20.0), pytest.approx(70.0))
    assert (r["FlashMLA fixed us"], r["FlashMLA us per 64k keys"]) == (pytest.approx(40.0), pytest.approx(20.0))
    assert r["mma.sync ceiling us per 64k keys"] == pytest.approx(30.0)
    assert r["FlashMLA per-key rate / ceiling"] == 1.5 and r["sm120_mla per-key rate / ceiling"] == 0.43
    # at 100%: 20 + 30x = 40 + 20x -> x = 2 (128k); at 70%: 20 + 42.86x = 40 + 20x -> x = 0.875 (56k)
    assert r["at 100% of the ceiling, matches FlashMLA up to"] == "128k"
    assert r["at 70% of the ceiling, matches FlashMLA up to"] == "56k"
    # a tie at 128k (x = 2) at exactly 100%: 30 / (20 + (40 - 20) / 2) = 1.0
    assert r["share of the ceiling that ties FlashMLA at 128k"] == "100%"
    assert r["fit miss %"] == 0.0
    # off the line: the fit's largest miss, in % of the time measured there
    off = _linear_run()
    off.loc[(off["impl"] == "sm120_mla") & (off["ctx"] == 32768), "time_us"] += 5.0
    assert br.flashmla_reach(off).iloc[0]["fit miss %"] > 0.5


def test_flashmla_reach_when_flashmla_is_slower_per_key_than_the_ceiling():
    r = br.flashmla_reach(_linear_run(fm=(40.0, 40.0)), efficiencies=(1.0,)).iloc[0]
    assert r["at 100% of the ceiling, matches FlashMLA up to"] == "every context"
    # slower per key than the ceiling but with the smaller fixed part: a kernel at the ceiling with
    # our larger fixed part catches up only from a context on: 40 + 30x = 20 + 70x -> x = 0.5 (32k)
    r = br.flashmla_reach(_linear_run(ours=(40.0, 30.0), fm=(20.0, 70.0)), efficiencies=(1.0,)).iloc[0]
    assert r["at 100% of the ceiling, matches FlashMLA up to"] == "from 32k on"
    r = br.flashmla_reach(_linear_run(ours=(40.0, 30.0), fm=(20.0, 30.0)), efficiencies=(1.0,)).iloc[0]
    assert r["at 100% of the ceiling, matches FlashMLA up to"] == "no context"   # parallel lines, ours above


def test_flashmla_reach_needs_three_contexts_and_the_mma_sync_rate():
    import pytest

    assert br.flashmla_reach(_linear_run(ctxs=(16384, 65536))).empty
    with pytest.raises(ValueError, match="roofline_mma_us"):
        br.flashmla_reach(_linear_run().drop(columns="roofline_mma_us"))


def test_rtx_projection_is_a_range_from_the_fixed_part_plus_the_rtx_roofline_to_the_same_efficiency():
    import pytest

    df = _linear_run().assign(roofline_us=lambda d: d["roofline_mma_us"] * 0.8)
    p = br.rtx_projection(df)
    assert len(p) == 4 and p["rtx_bound_us"].notna().all()
    assert (p["rtx_bound_us"] - p["rtx_roofline_us"]).tolist() == pytest.approx([20.0] * 4, abs=0.15)
    assert (p["rtx_bound_us"] <= p["rtx_projected_us"]).all()
    # the high end: the RTX roofline over the fraction of the mma.sync roofline reached here
    # (30 us of mma.sync a 64k keys against 20 + 70 x ctx/64k), not of the cuBLAS one (x 0.8)
    assert (p["efficiency_vs"] == "mma.sync").all()
    x = p["ctx"] / 65536
    assert p["efficiency"].tolist() == pytest.approx((30 * x / (20 + 70 * x)).tolist(), abs=5e-4)
    # (rtx_roofline_us is rounded to 0.1 us, the efficiency ~0.4: 0.25 us of slack)
    assert p["rtx_projected_us"].tolist() == pytest.approx(
        (p["rtx_roofline_us"] * (20 + 70 * x) / (30 * x)).tolist(), abs=0.25)
    # q16 h8 at 64k (65,552 keys with the drafts'): 18.25 GFLOP at 400 TFLOP/s is 45.6 us, over
    # 75.5 MB at 1,792 GB/s (42.1 us)
    assert p.loc[p["ctx"] == 65536, "rtx_roofline_us"].item() == 45.6
    cublas = br.rtx_projection(df.drop(columns="roofline_mma_us"))
    assert (cublas["efficiency_vs"] == "cuBLAS").all()
    assert cublas["efficiency"].tolist() == pytest.approx((24 * x / (20 + 70 * x)).tolist(), abs=5e-4)
    few = br.rtx_projection(_linear_run(ctxs=(16384, 65536)).assign(roofline_us=1.0))
    assert few["rtx_bound_us"].isna().all() and few["rtx_projected_us"].notna().all()


def test_comparison_and_bandwidth_tables_show_each_impls_own_numbers():
    """The notebook's headline tables, by hand: time_us (the fastest of repeats) and gbps of the
    asked shape only, impls in IMPL_ORDER, sm120_mla's share of its run's copy rate."""
    def rec(impl, ctx, t, gbps, **kw):
        return {"impl": impl, "batch": 1, "heads": 8, "q_len": 16, "ctx": ctx, "time_us": t, "gbps": gbps,
                "copy_gbps": 4000.0, "roofline_us": 0.5, **kw}

    df = pd.DataFrame([rec("flashmla", 1024, 30.04, 100.0), rec("sm120_mla", 1024, 20.06, 150.0),
                       rec("sm120_mla", 1024, 22.0, 140.0), rec("sm120_mla", 65536, 84.0, 1000.0),
                       rec("flashmla", 65536, 60.0, 1400.0),
                       rec("sm120_mla", 1024, 5.0, 900.0, heads=16), rec("sm120_mla", 1024, 6.0, 900.0, q_len=1)])
    t = br.comparison_table(df)
    assert list(t.columns) == ["sm120_mla", "flashmla"] and list(t.index) == [1024, 65536]
    assert t.loc[1024].tolist() == [20.1, 30.0] and t.loc[65536].tolist() == [84.0, 60.0]
    b = br.bandwidth_table(df)
    assert b.loc[1024, "sm120_mla"] == 150 and b.loc[65536, "flashmla"] == 1400
    assert b["sm120_mla % of copy"].tolist() == [3.8, 25.0]   # 150 and 1,000 of 4,000 GB/s


def test_versus_table_pairs_the_default_kernel_with_another_impl_shape_by_shape():
    df = br.default_rows(pd.DataFrame([
        _rec("r", "v", "sm120_mla", 80.0), _rec("r", "v", "sm120_mla", 70.0, forced=True),   # a sweep row: not used
        _rec("r", "v", "flashinfer_mla_fa2", 100.0),
        _rec("r", "v", "sm120_mla", 20.0, ctx=4096), _rec("r", "v", "flashinfer_mla_fa2", 15.0, ctx=4096),
        _rec("r", "v", "sm120_mla", 40.0, q_len=1),                                           # fa2 not timed here
    ]))
    t = br.versus_table(df, "flashinfer_mla_fa2")
    assert list(t["ctx"]) == [4096, 65536] and list(t["sm120_mla"]) == [20.0, 80.0]
    assert list(t["speedup"]) == [0.75, 1.25]
    assert br.versus_table(df, "flashmla").empty


def test_flashinfer_fa2_is_timed_beside_flashinfers_own_choice(monkeypatch):
    """The benchmark times FlashInfer's MLA twice at every verify shape: with its own choice of
    kernel (fa3 on the H200) and with fa2, the mma.sync kernel it runs on an RTX PRO 6000; fa2
    at the decode and small-batch shapes too, and both at b32."""
    import sys
    import types

    import torch

    from sm120_workbook.kernels import bench

    grid = bench.default_grid(quick=True)
    verify = {s for impl, s, _ in grid if impl == "flashinfer_mla"}
    fa2 = {s for impl, s, _ in grid if impl == "flashinfer_mla_fa2"}
    decode = {s for impl, s, _ in grid if impl == "triton_decode"}
    small_batches = {s for impl, s, _ in grid if impl == "flashmla" and 1 < s.batch < 32}
    assert any(s.batch == 32 for s in verify) and small_batches
    assert verify and fa2 == verify | decode | small_batches
    assert "flashinfer_mla_fa2" in bench.BUILDERS

    backends = []

    class Wrapper:
        def __init__(self, workspace, backend):
            backends.append(backend)

        def plan(self, *args):
            pass

        def run(self, *args, out):
            return out

    fake = types.ModuleType("flashinfer")
    fake.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    s = bench.Shape(1, 2, 3, 10)
    x = types.SimpleNamespace(shape=s, q=torch.zeros(3, 2, 576), qo_indptr=None, kv_indptr_full=None, keys=[13],
                              kv_indices_full=torch.zeros(13, dtype=torch.int64), pool=torch.zeros(13, 1, 576))
    for impl in ("flashinfer_mla", "flashinfer_mla_fa2"):
        bench.BUILDERS[impl](x)()
    assert backends == ["auto", "fa2"]


def test_nsplit_sweep_places_one_wave_of_each_kernel_on_the_gpu():
    """The benchmark's forced split counts at q16 h8 64k include one wave of the 32-row kernel
    (4 row CTAs a split) and of the 64-row kernel (2) on the GPU at hand, within kMaxSplits."""
    from sm120_workbook.kernels import bench

    def swept(num_sms):
        return sorted({kw["num_splits"] for impl, _, kw in bench.default_grid(quick=True, num_sms=num_sms)
                       if "num_splits" in kw})

    assert swept(132) == [8, 16, 33, 66, 128]    # the H200: the counts every recorded run swept
    assert swept(188) == [8, 16, 47, 94, 128]    # an RTX PRO 6000
    assert swept(300) == [8, 16, 75, 128]        # past kMaxSplits: capped, once


def test_batched_decode_is_timed_and_tabled_apart_from_batch_one():
    """A busy server's decode step (8 and 32 requests, at 8 and 16 heads) is in the grid for
    sm120_mla and the decode kernels a user has, and its table keeps it apart from batch 1 and from verify shapes."""
    from sm120_workbook.kernels import bench

    grid = bench.default_grid()
    decode_libs = ("sm120_mla", "triton_decode", "flashmla", "flashinfer_mla_fa2")
    batched = {(impl, s.batch, s.heads, s.ctx, s.short_ctx) for impl, s, _ in grid if s.q_len == 1 and s.batch > 1}
    assert batched == ({(impl, b, h, c, 0) for impl in decode_libs for b, c in ((8, 65536), (32, 16384)) for h in (8, 16)}
                       | {(impl, b, 8, 65536, short) for impl in decode_libs for b, short in ((8, 1024), (32, 2048))})
    skewed_verify = {(impl, s.batch, s.q_len) for impl, s, _ in grid if s.short_ctx and s.q_len > 1}
    assert skewed_verify == {(impl, 8, 16) for impl in ("sm120_mla", "flashmla", "flashinfer_mla_fa2")}
    df = pd.DataFrame([dict(_rec("r", "v", "sm120_mla", 40.0, q_len=1)),
                       dict(_rec("r", "v", "sm120_mla", 300.0, q_len=1, ctx=16384), batch=32),
                       dict(_rec("r", "v", "flashmla", 450.0, q_len=1, ctx=16384), batch=32),
                       dict(_rec("r", "v", "sm120_mla", 500.0, ctx=16384), batch=32)])   # verify: not decode
    t = br.batched_decode_table(df)
    assert t.index.tolist() == [(32, 8, 16384)]
    assert t.columns.tolist() == ["sm120_mla", "flashmla"] and t.loc[(32, 8, 16384)].tolist() == [300.0, 450.0]
    assert br.batched_decode_table(df[df["batch"] == 1]).empty


def test_skewed_batch_inputs_give_each_request_its_own_length():
    """Shape.short_ctx: request 0 at ctx and the rest at short_ctx, in every index, indptr and
    mask the builders read (a mixed-length batch, as a server's is)."""
    import torch

    from sm120_workbook.kernels.bench import Inputs, Shape

    s = Shape(3, 2, 2, 10, short_ctx=4)
    assert s.contexts == [10, 4, 4] and Shape(3, 2, 2, 10).contexts == [10, 10, 10]
    x = Inputs(s, device="cpu")
    assert x.keys == [12, 6, 6] and x.kv_bytes == 24 * 576 * 2
    assert x.kv_indptr.tolist() == [0, 10, 14, 18] and x.kv_indptr_full.tolist() == [0, 12, 18, 24]
    assert x.qo_indptr.tolist() == [0, 2, 4, 6] and x.mask_indptr.tolist() == [0, 24, 36, 48]
    # request 1's prefix rows, then its two draft rows, follow request 0's 12 rows in the pool
    assert x.prefix_indices.tolist()[10:14] == [12, 13, 14, 15]
    assert torch.equal(x.k_extend[2:4], x.pool[[16, 17]])


def test_skewed_batches_are_tabled_apart_from_uniform_ones():
    """A skewed batch (short_ctx > 0) shares batch, q_len and ctx with a uniform one, so every
    table but skewed_batch_table sees only uniform records, and that one only skewed records."""
    uniform = [dict(_rec("r", "v", impl, t, q_len=1), batch=8) for impl, t in (("sm120_mla", 177.0), ("flashmla", 170.0))]
    skewed = [dict(r, short_ctx=1024, time_us=r["time_us"] / 4) for r in uniform]
    old = _rec("r0", "v0", "sm120_mla", 300.0)   # a record from before short_ctx existed
    df = pd.DataFrame([old, *uniform, *skewed])
    flat, skew = br.uniform_and_skewed(df)
    assert len(flat) == 3 and len(skew) == 2 and (skew["short_ctx"] == 1024).all()
    assert list(br.batched_decode_table(flat).loc[(8, 8, 65536)]) == [177.0, 170.0]
    t = br.skewed_batch_table(skew)
    assert list(t.index) == [(8, 8, 1, 65536, 1024)] and list(t.loc[(8, 8, 1, 65536, 1024)]) == [44.2, 42.5]
    assert br.skewed_batch_table(skew.iloc[:0]).empty


def test_pool_balance_table_reads_the_kernels_schedule():
    """pool_balance_table: the most keys a CTA walks under v19's rule and v20's min-max pool, at
    the workspace's split count on each target GPU, never below the even split."""
    from sm120_workbook.kernels.bench import Shape

    t = br.pool_balance_table([Shape(32, 8, 1, 65536, 2048), Shape(4, 8, 1, 4096)])
    h200 = t[(t["gpu"] == "H200") & (t["batch"] == 32)].iloc[0]
    assert h200["num_splits"] == 4 and h200["v19_rule"] == 1337 and h200["v20_min_max"] == 1024   # 65,537 keys / 49 and / 64 CTAs
    assert (t["v20_min_max"] >= t["even_split"]).all() and (t["v20_min_max"] <= t["v19_rule"]).all()
    equal = t[t["batch"] == 4]
    assert (equal["v20_gain"] == 0).all() and (equal["v19_rule"] == equal["even_split"]).all()
    assert set(t["gpu"]) == {"H200", "RTX PRO 6000 Blackwell"}


def _round_records(rounds_fm, ours=50.0, ctx=32768):
    """q16 h8 at ctx: sm120_mla at `ours` µs beside FlashMLA's time in each round."""
    return [dict(_rec("r", "v", impl, t, ctx=ctx), round=i)
            for i, fm in enumerate(rounds_fm) for impl, t in (("sm120_mla", ours), ("flashmla", fm))]


def test_the_target_grid_measures_every_target_once_a_round():
    from sm120_workbook.kernels.targets import target_grid

    grid = target_grid()
    assert all(kw == {} for _, _, kw in grid)   # sm120_mla as the workspace runs it by default
    assert len(set((impl, s) for impl, s, _ in grid)) == len(grid)
    df = pd.DataFrame([{"impl": impl, **s.__dict__, "time_us": 1.0 if impl == "sm120_mla" else 2.0,
                        "roofline_us": 1.0, "run_id": "r", "round": 0} for impl, s, _ in grid])
    t = br.targets_table(df)
    # per head count: 4 contexts against FlashMLA, Triton verify, 2 rooflines, batch 32; decode at 8 contexts
    assert len(t) == 2 * (4 + 1 + 2 + 1) + 2 * 8 and t["met"].notna().all()


def test_targets_over_rounds_gives_the_spread_and_calls_a_split_verdict_mixed():
    df = pd.DataFrame(_round_records([49.0, 51.0, 50.5]) + _round_records([57.0, 57.5, 56.8], ours=85.0, ctx=65536)
                      + _round_records([43.0, 43.5, 44.0], ours=33.5, ctx=16384))
    t = br.targets_over_rounds(df).set_index("target")
    row = t.loc["q16 h8 32k: <= FlashMLA"]
    assert (row["runs"], row["rounds"]) == (1, 3) and row["verdict"] == "mixed: met in 2 of 3 rounds"
    assert (row["ratio_min"], row["ratio"], row["ratio_max"]) == (0.98, 1.01, 1.02)
    assert t.loc["q16 h8 64k: <= FlashMLA", "verdict"] == "missed in every round"
    assert t.loc["q16 h8 16k: <= FlashMLA", "verdict"] == "met in every round"
    assert br.targets_over_rounds(df.drop(columns="run_id")).equals(br.targets_over_rounds(df))   # one unnamed run
    counted = br.targets_over_rounds(df, with_counts=True).set_index("target")   # the rounds that met each, on request
    assert "met_rounds" not in t and counted.loc["q16 h8 32k: <= FlashMLA", "met_rounds"] == 2
    assert counted.drop(columns="met_rounds").equals(t)
    # not timed in any round: kept, as "not measured", never "missed" (and never dropped)
    untimed = t.loc["q16 h8 64k: >= 100x Triton verify"]
    assert (untimed["rounds"], untimed["verdict"]) == (0, "not measured") and untimed["ratio"] != untimed["ratio"]
    # two processes (runs) pool their rounds; round numbers repeat from run to run
    second = pd.DataFrame(_round_records([50.2, 49.5], ctx=32768)).assign(run_id="r2")
    row = br.targets_over_rounds(pd.concat([df, second])).set_index("target").loc["q16 h8 32k: <= FlashMLA"]
    assert (row["runs"], row["rounds"], row["verdict"]) == (2, 5, "mixed: met in 3 of 5 rounds")
    # a target only the newer run times sits in that run's order, by its neighbours, not last
    older = pd.DataFrame(_round_records([43.0, 43.5], ours=33.5, ctx=16384)
                         + _round_records([57.0, 57.5], ours=85.0, ctx=65536)).assign(run_id="20261201T000000Z")
    newer = pd.DataFrame(_round_records([43.0], ours=33.5, ctx=16384) + _round_records([49.0], ctx=32768)
                         + _round_records([57.0], ours=85.0, ctx=65536)).assign(run_id="20261203T000000Z")
    assert list(br.targets_over_rounds(pd.concat([older, newer]))["target"][:3]) == [
        f"q16 h8 {k}: <= FlashMLA" for k in ("16k", "32k", "64k")]
    pooled = br.targets_over_rounds(pd.concat([older, newer])).set_index("target")
    assert pooled.loc["q16 h8 16k: <= FlashMLA", "ratio_is"] == "FlashMLA / ours"
    # a note (b32's share of the ceiling) comes from the newest run, and says so where runs pool
    b32 = lambda run, fm: [{**r, "run_id": run, "round": 0} for r in (
        {**_rec(run, "v", "sm120_mla", 700.0, ctx=16384), "batch": 32, "roofline_mma_us": 200.0},
        {**_rec(run, "v", "flashmla", fm, ctx=16384), "batch": 32, "roofline_mma_us": float("nan")})]
    note = br.targets_over_rounds(pd.DataFrame(b32("20261201T0", 230.0) + b32("20261203T0", 236.0))).set_index(
        "target").loc["b32 q16 h8 16k: within 10% of FlashMLA", "note"]
    assert "FlashMLA runs at 85% of it" in note and note.endswith("(newest run, 20261203T0)"), note   # 200 / 236
    assert br.targets_over_rounds(pd.DataFrame()).empty and br.targets_table(pd.DataFrame()).empty
    with pytest.raises(ValueError, match="df: records without a `round`"):
        br.targets_over_rounds(pd.DataFrame([_rec("r", "v", "sm120_mla", 50.0)]))


def test_targets_by_flush_puts_each_flushs_verdict_side_by_side():
    """The newest kernel's rounds under each flush, newest flush first: a verdict that the flush
    changes (FlashMLA's batch-1 times depend on the kernels before them) is marked; a target one
    flush lacks is not; another kernel version's rounds stay out."""
    def run(run_id, flush, fm_32k, tag="v31"):
        recs = _round_records(fm_32k) + _round_records([57.0] * len(fm_32k), ours=85.0, ctx=65536)
        return pd.DataFrame(recs).assign(run_id=run_id, kernel_version=tag, commit="c", gpu=H200,
                                         **({"l2_flush": flush} if flush else {}))
    written = run("20261203T1", None, [49.5, 49.0])              # records from before the field: written
    read = run("20261204T1", "read", [55.0, 55.5, 56.0])
    old_kernel = run("20261202T1", None, [60.0, 60.0], tag="v30")
    t = br.targets_by_flush(pd.concat([old_kernel, written, read])).set_index("target")
    assert [c for c in t.columns if c.endswith("verdict")] == ["read: verdict", "write: verdict"]
    row = t.loc["q16 h8 32k: <= FlashMLA"]
    assert (row["read: verdict"], row["write: verdict"], row["verdicts differ"]) == (
        "met in every round", "missed in every round", True)
    assert (row["read: runs"], row["write: runs"], row["write: range"]) == (1, 1, "0.98-0.99")   # v30's run left out
    assert not t.loc["q16 h8 64k: <= FlashMLA", "verdicts differ"]
    assert t.loc["q16 h8 64k: >= 100x Triton verify", "read: verdict"] == "not measured"
    # a mixed verdict against another mixed one is the same kind; "not measured" differs from nothing
    mixed = pd.concat([run("20261203T1", None, [49.5, 51.0]), run("20261204T1", "read", [49.0, 51.0, 52.0])])
    assert br.targets_by_flush(mixed).set_index("target").loc["q16 h8 32k: <= FlashMLA", "read: verdict"].startswith(
        "mixed") and not br.targets_by_flush(mixed)["verdicts differ"].any()
    unmeasured = read[~((read["impl"] == "flashmla") & (read["ctx"] == 65536))]
    t = br.targets_by_flush(pd.concat([written, unmeasured])).set_index("target")
    assert t.loc["q16 h8 64k: <= FlashMLA", "read: verdict"] == "not measured"
    assert not t.loc["q16 h8 64k: <= FlashMLA", "verdicts differ"]
    # a target only the older flush's runs have keeps its ratio_is and sits after the newest flush's
    only_written = read[read["ctx"] != 65536]
    t = br.targets_by_flush(pd.concat([written, only_written]))
    targets = list(t["target"])
    assert targets.index("q16 h8 64k: <= FlashMLA") > targets.index("b32 q16 h16 16k: within 10% of FlashMLA")
    row = t.set_index("target").loc["q16 h8 64k: <= FlashMLA"]
    assert row["ratio_is"] == "FlashMLA / ours" and row["read: verdict"] != row["read: verdict"]   # NaN: not timed
    # the newest run naming no GPU pools with nothing (as latest_rounds)
    no_gpu = read.assign(gpu=float("nan"))
    assert br.targets_by_flush(pd.concat([written, no_gpu])).empty and br.latest_rounds(pd.concat([written, no_gpu])).empty
    one_flush = br.targets_by_flush(read)
    assert list(one_flush.columns[-2:]) == ["read: verdict", "verdicts differ"] and not one_flush["verdicts differ"].any()
    assert br.targets_by_flush(pd.DataFrame()).empty


def test_targets_cli_asks_for_two_rounds_and_a_gpu(capsys):
    from sm120_workbook.kernels.targets import main

    with pytest.raises(SystemExit) as e:
        main(["--rounds", "1", "--no-record"])
    assert e.value.code == 2 and "--rounds: 1; a spread needs at least 2 rounds" in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CLI would time the targets (the GPU machine's scripts do)")
    with pytest.raises(SystemExit, match="need a CUDA GPU"):
        main(["--rounds", "2", "--no-record"])


def test_latest_rounds_are_the_newest_commits_runs_on_its_gpu():
    rec = lambda run, commit, gpu: {"run_id": run, "commit": commit, "gpu": gpu, "round": 0}
    df = pd.DataFrame([rec("20261130T1", "aaa", "NVIDIA H200"), rec("20261130T2", "bbb", "NVIDIA H200"),
                       rec("20261130T3", "bbb", "NVIDIA H200"), rec("20261130T4", "bbb", "NVIDIA RTX PRO 6000"),
                       rec("20261130T5", "bbb", "NVIDIA H200")])
    assert list(br.latest_rounds(df)["run_id"]) == ["20261130T2", "20261130T3", "20261130T5"]
    assert br.latest_rounds(pd.DataFrame()).empty
    dirty = pd.DataFrame([rec("20261130T6", "ccc+dirty", "NVIDIA H200"), rec("20261130T7", "ccc+dirty", "NVIDIA H200")])
    assert list(br.latest_rounds(pd.concat([df, dirty]))["run_id"]) == ["20261130T7"]   # maybe other code: alone


def test_latest_rounds_pool_a_kernel_version_across_commits():
    """Two processes of one tagged kernel made at two commits (a change outside the device code
    between them) are one kernel's rounds; an untagged newest run falls back to its commit."""
    rec = lambda run, commit, tag: {"run_id": run, "commit": commit, "gpu": "NVIDIA H200", "kernel_version": tag}
    df = pd.DataFrame([rec("20261130T1", "aaa", "v20"), rec("20261130T2", "bbb", "v21"),
                       rec("20261130T3", "ccc", "v21")])
    assert list(br.latest_rounds(df)["run_id"]) == ["20261130T2", "20261130T3"]
    untagged = pd.concat([df, pd.DataFrame([rec("20261130T4", "ccc", None)])], ignore_index=True)
    assert list(br.latest_rounds(untagged)["run_id"]) == ["20261130T3", "20261130T4"]


def test_triton_decode_records_from_before_sglangs_mla_splits_are_renamed():
    import pandas as pd

    from sm120_workbook.kernels.bench_report import LEGACY_TRITON_DECODE, with_legacy_names

    df = pd.DataFrame({"impl": ["triton_decode", "triton_decode", "sm120_mla", "flashmla"],
                       "max_kv_splits": [None, 256, None, None]})
    assert with_legacy_names(df)["impl"].tolist() == [LEGACY_TRITON_DECODE, "triton_decode", "sm120_mla", "flashmla"]
    old = pd.DataFrame({"impl": ["triton_decode", "triton_verify"]})   # a file with no new record yet
    assert with_legacy_names(old)["impl"].tolist() == [LEGACY_TRITON_DECODE, "triton_verify"]


def test_triton_decode_cap_is_sglangs():
    """SGLang 0.5.17 raises the Triton backend's 8 KV splits for MLA decode to the SM count's
    and the context's power of two; the benchmark sizes its baseline the same way."""
    from sglang.srt.layers.attention.triton_backend import _mla_decode_kv_splits_cap

    from sm120_workbook.kernels.bench import triton_decode_cap

    assert triton_decode_cap([65552], 132) == 256 == _mla_decode_kv_splits_cap(8, 132, 65552)
    assert triton_decode_cap([1040], 132) == 64       # ceil(1040 / 32) = 33 -> 64
    assert triton_decode_cap([100, 130], 188) == 8    # short contexts keep the server default


def test_bench_run_reports_a_library_with_no_kernel_for_the_gpu_without_calling_it(monkeypatch):
    """On an RTX PRO 6000 (12.0) a FlashMLA entry of the grid becomes an `unsupported` record
    with the reason: neither its builder nor its reference check is called."""
    from sm120_workbook import hardware
    from sm120_workbook.kernels import bench

    monkeypatch.setattr(hardware, "measure_copy_bandwidth", lambda n: {"copy_gbps": 1792.0})
    monkeypatch.setattr(hardware, "measure_bf16_matmul_tflops", lambda n: {"bf16_tflops": 400.0})
    monkeypatch.setattr(bench, "measure_mma_sync_tflops", lambda **kw: 380.0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_capability", lambda *a: (12, 0))
    monkeypatch.setitem(bench.BUILDERS, "flashmla", lambda *a, **k: pytest.fail("FlashMLA was called"))
    monkeypatch.setattr(bench, "check_against_reference", lambda *a, **k: pytest.fail("FlashMLA was checked"))
    records, ceilings = bench.run([("flashmla", bench.Shape(1, 8, 16, 4096), {})], progress=False)
    assert [r["status"] for r in records] == ["unsupported"]
    assert records[0]["error"].startswith("flashmla has no kernel for this GPU (sm_120)")
    assert "no kernel for this GPU (sm_120), only for compute capability 9.x or 10.x" in bench.summary_table(records)
    assert ceilings["copy_gbps"] == 1792.0


def test_bench_run_records_gbps_and_both_rooflines_by_hand(monkeypatch):
    """The numbers every record carries, against hand arithmetic: q16 h8 at 4,096 + 16 keys, 10 us.
    KV 4,112 x 576 x 2 B; Q 16 x 8 x 576 x 2, O 16 x 8 x 512 x 2; FLOPs 2 x 8 x 16 x 4,112 x
    (576 + 512). A unit or formula slip in run(), step_cost or the roofline fails here (no GPU:
    the inputs are built on the CPU and the timing is a stand-in)."""
    from sm120_workbook import hardware, provenance
    from sm120_workbook.kernels import bench

    # rates that make the cuBLAS roofline memory-bound and the mma.sync one compute-bound: each
    # term of the max decides one of them
    monkeypatch.setattr(hardware, "measure_copy_bandwidth", lambda n: {"copy_gbps": 1000.0})
    monkeypatch.setattr(hardware, "measure_bf16_matmul_tflops", lambda n: {"bf16_tflops": 800.0})
    monkeypatch.setattr(bench, "measure_mma_sync_tflops", lambda **kw: 100.0)
    monkeypatch.setattr(provenance, "provenance", lambda *a: {"gpu": "stand-in", "command": "x"})
    monkeypatch.setattr(bench.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    real_inputs = bench.Inputs
    monkeypatch.setattr(bench, "Inputs", lambda s: real_inputs(s, device="cpu"))
    monkeypatch.setitem(bench.BUILDERS, "sm120_mla", lambda x, **kw: (lambda: None))
    monkeypatch.setattr(bench, "time_graph_us", lambda fn, reps: {"time_us": 10.0, "reps": reps})
    (rec,), ceilings = bench.run([("sm120_mla", bench.Shape(1, 8, 16, 4096), {})], progress=False)
    assert rec["status"] == "ok", rec.get("error")
    kv = 4112 * 576 * 2
    total = kv + 16 * 8 * 576 * 2 + 16 * 8 * 512 * 2
    flops = 2 * 8 * 16 * 4112 * (576 + 512)
    assert rec["gbps"] == pytest.approx(kv / 10.0 / 1e3)                      # bytes / ns = GB/s
    assert rec["roofline_us"] == pytest.approx(total / 1000e3) and total / 1000e3 > flops / 800e6
    assert rec["roofline_mma_us"] == pytest.approx(flops / 100e6) and flops / 100e6 > total / 1000e3


def test_each_replay_is_timed_after_its_flush_and_nothing_else(monkeypatch):
    """The flush runs before the start event of every replay, and only the replay sits between
    the two events (a stand-in for torch's events and graph records the order)."""
    from sm120_workbook.kernels import bench

    log = []

    class Event:   # replay_times_us makes every start event, then every end event
        made = 0

        def __init__(self, enable_timing):
            self.kind = "start" if Event.made < 3 else "end"
            Event.made += 1

        def record(self):
            log.append(self.kind)

        def elapsed_time(self, end):
            return 0.002

    class Graph:
        def replay(self):
            log.append("replay")

    monkeypatch.setattr(bench.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: log.append("sync"))
    times = bench.replay_times_us(Graph(), lambda: log.append("flush"), 3)
    assert log == ["flush", "start", "replay", "end"] * 3 + ["sync"]
    assert times == pytest.approx([2.0] * 3)


@pytest.mark.parametrize("heads", [8, 16])
def test_each_target_is_judged_at_its_own_threshold(heads):
    """Each target just met and just missed: <= FlashMLA, >= 100x Triton verify, within 1.3x of
    the roofline, b32 within 10% of FlashMLA, decode >= 3x Triton at 64k and >= 1x elsewhere."""
    def rec(impl, time_us, batch=1, q_len=16, ctx=65536, roofline_us=100.0):
        return {"run_id": "r", "kernel_version": "v", "commit": "c", "impl": impl, "batch": batch, "heads": heads,
                "q_len": q_len, "ctx": ctx, "time_us": time_us, "num_splits_forced": False, "tile_keys": 16,
                "roofline_us": roofline_us}

    def verdicts(ours, fm, tv, b32_ours, b32_fm, dec64, td64, dec16, td16):
        t = br.targets_table(pd.DataFrame([
            rec("sm120_mla", ours), rec("flashmla", fm), rec("triton_verify", tv),
            rec("sm120_mla", b32_ours, batch=32, ctx=16384), rec("flashmla", b32_fm, batch=32, ctx=16384),
            rec("sm120_mla", dec64, q_len=1), rec("triton_decode", td64, q_len=1),
            rec("sm120_mla", dec16, q_len=1, ctx=16384), rec("triton_decode", td16, q_len=1, ctx=16384),
        ])).set_index("target")["met"]
        h = f"h{heads}"
        return [t[f"q16 {h} 64k: <= FlashMLA"], t[f"q16 {h} 64k: >= 100x Triton verify"],
                t[f"q16 {h} 64k: within 1.3x roofline"], t[f"b32 q16 {h} 16k: within 10% of FlashMLA"],
                t[f"decode {h} 64k: >= 3x Triton decode"], t[f"decode {h} 16k: >= 1x Triton decode"]]

    # on the line: met (the roofline's 100 us x 1.3 = 130; FlashMLA's 100 x 1.1, which in floats is
    # a hair over 110, so the b32 time is that product itself: a `<` in place of `<=` fails here)
    assert verdicts(130.0, 130.0, 13000.0, 1.1 * 100.0, 100.0, 40.0, 120.0, 20.0, 20.0) == [True] * 6
    # just past it: missed
    assert verdicts(130.2, 130.1, 13010.0, 110.2, 100.0, 40.1, 120.0, 20.1, 20.0) == [False] * 6


def test_notebook_03s_runs_live_or_recorded_with_their_provenance_and_ceilings(tmp_path):
    import json

    recs = [dict(_rec("20261204T075719Z", "v31", "sm120_mla", 85.0), status="ok", gpu=H200, copy_gbps=4216.6,
                 matmul_tflops=777.2, mma_sync_tflops=629.0, date="2026-12-04T07:57:19+00:00", l2_flush="read"),
            dict(_rec("20261204T075719Z", "v31", "flashmla", 69.0), status="ok", gpu=H200, copy_gbps=4216.6,
                 matmul_tflops=777.2, mma_sync_tflops=629.0, date="2026-12-04T07:57:19+00:00", l2_flush="read"),
            dict(_rec("20261204T075719Z", "v31", "sm120_mla", 40.0), status="ok", gpu=H200, short_ctx=1024,
                 copy_gbps=4216.6, matmul_tflops=777.2, date="2026-12-04T07:57:19+00:00", l2_flush="read"),
            dict(_rec("20261204T075719Z", "v31", "triton_verify", 0.0), status="error", gpu=H200)]
    path = tmp_path / "kernel_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    runs, skewed, source = br.shown_runs(path=path)
    assert sorted(runs["impl"]) == ["flashmla", "sm120_mla"] and len(skewed) == 1   # failed records left out
    assert source.startswith("RECORDED: recorded results: gpu=NVIDIA H200") and "commit=abc1234def" in source
    assert br.ceilings_line(runs) == ("ceilings: copy 4,217 GB/s, bf16 matmul 777 TFLOP/s, mma.sync 629 TFLOP/s; "
                                      "kernel version v31")
    with pytest.raises(ValueError, match="^bench_run: no run 'x' recorded"):
        br.shown_runs("x", path=path)
    live, live_skewed, live_source = br.live_runs(recs)
    assert len(live) == 2 and len(live_skewed) == 1
    assert live_source == f"measured in this run on {H200}, commit abc1234def"
    untagged = live.assign(kernel_version=None).drop(columns="mma_sync_tflops")
    assert br.ceilings_line(untagged).endswith("TFLOP/s; kernel version untagged (a live build)")
    assert br.live_runs([recs[-1]])[2] == "measured in this run (no record ok)" and br.ceilings_line(untagged[:0]) == "no run to show"
