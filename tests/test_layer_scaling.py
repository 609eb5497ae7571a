"""The layer-count fit that turns few-layer service runs into a projection at K2's 61 layers."""
from __future__ import annotations

import pandas as pd
import pytest

from sm120_workbook.layer_scaling import (fit_layer_scaling, fitted_points, holdout_check, layer_scaling_chart,
                                          line_points, projected_speedup, scaling_table)
from sm120_workbook.service_charts import decode_points

# step_ms = fixed + per_layer * layers, per backend and context (triton's per-layer cost grows with ctx)
TRUTH = {("triton", 4096): (1.8, 1.0), ("triton", 65536): (2.7, 12.8),
         ("sm120_mla", 4096): (3.8, 0.07), ("sm120_mla", 65536): (2.1, 0.2)}


def _records(layer_counts=(4, 16), noise=0.0, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    recs = []
    for (backend, ctx), (fixed, per_layer) in TRUTH.items():
        for layers in layer_counts:
            step = (fixed + per_layer * layers) * (1 + noise * rng.standard_normal())
            recs.append({"backend": backend, "spec": "ngram", "draft_tokens": 8, "tp": 1, "gpu": "H200",
                         "model": "k2_tp8_slice", "layers": layers, "weights": "bf16", "ctx": ctx,
                         "accept_len": 6.5, "verify_step_ms": step, "tok_s": 1e3 * 6.45 / step,
                         "expert_record": True, "ngram_tail": True, "commit": "c", "date": "2026-11-29"})
    return recs


def test_fit_recovers_fixed_and_per_layer_and_projects():
    fit = fit_layer_scaling(decode_points(pd.DataFrame(_records()))).set_index(["backend", "ctx"])
    for key, (fixed, per_layer) in TRUTH.items():
        assert fit.loc[key, "fixed_ms"] == pytest.approx(fixed)
        assert fit.loc[key, "per_layer_ms"] == pytest.approx(per_layer)
        assert fit.loc[key, "projected_step_ms"] == pytest.approx(fixed + 61 * per_layer)
        # decode tokens a step adds (tok/s x step), not SGLang's accept length, which counts the
        # prefill's token: at a measured depth the projection is the measured tok/s
        assert fit.loc[key, "projected_tok_s"] == pytest.approx(6450 / (fixed + 61 * per_layer))
        assert fit.loc[key, "layers_measured"] == [4, 16]
    sp = projected_speedup(fit.reset_index()).set_index("ctx")
    assert sp.loc[65536, "projected_speedup"] == pytest.approx((2.7 + 61 * 12.8) / (2.1 + 61 * 0.2))
    assert list(scaling_table(fit.reset_index())["layers_measured"]) == ["4/16"] * 4


def test_three_layer_counts_are_least_squares():
    fit = fit_layer_scaling(decode_points(pd.DataFrame(_records((4, 8, 16), noise=0.02, seed=3))))
    t = fit.set_index(["backend", "ctx"])
    assert t.loc[("triton", 65536), "per_layer_ms"] == pytest.approx(12.8, rel=0.1)
    assert t.loc[("triton", 65536), "layers_measured"] == [4, 8, 16]


def test_one_layer_count_gives_no_fit_and_errors_name_the_argument():
    assert len(fit_layer_scaling(decode_points(pd.DataFrame(_records((4,)))))) == 0
    with pytest.raises(ValueError, match="two layer counts"):
        projected_speedup(fit_layer_scaling(decode_points(pd.DataFrame(_records((4,))))))
    with pytest.raises(ValueError, match="missing columns"):
        fit_layer_scaling(pd.DataFrame([{"backend": "triton"}]))
    with pytest.raises(ValueError, match="project_to"):
        fit_layer_scaling(decode_points(pd.DataFrame(_records())), project_to=0)
    fit = fit_layer_scaling(decode_points(pd.DataFrame(_records())))
    with pytest.raises(ValueError, match="baseline backend 'flashmla'"):
        projected_speedup(fit, "flashmla")
    with pytest.raises(ValueError, match="spec 'dflash'"):
        layer_scaling_chart(decode_points(pd.DataFrame(_records())), fit, spec="dflash")


def test_chart_has_measured_points_and_fitted_lines(tmp_path):
    from sm120_workbook.charts import save_chart

    pts = decode_points(pd.DataFrame(_records()))
    chart = layer_scaling_chart(pts, fit_layer_scaling(pts))
    spec = chart.to_dict()
    assert spec["facet"]["column"]["field"] == "ctx_label"
    kinds = {r["kind"] for r in spec["datasets"][next(iter(spec["datasets"]))]}
    assert kinds == {"fit", "measured"}
    assert all(p.stat().st_size > 0 for p in save_chart(chart, "layer_scaling_test", tmp_path))
    sourced = layer_scaling_chart(pts, fit_layer_scaling(pts), source="recorded: H200; commit c").to_dict()
    assert sourced["title"]["subtitle"] == "recorded: H200; commit c" and "projection" in sourced["title"]["text"]


def test_a_run_with_expert_parallelism_is_its_own_line():
    recs = _records() + [dict(r, ep_size=2, tp=2) for r in _records()]
    fit = fit_layer_scaling(decode_points(pd.DataFrame(recs)))
    assert sorted(set(fit["config"])) == ["sm120_mla + ngram_tail", "sm120_mla TP2 EP2 + ngram_tail",
                                          "triton + ngram_tail", "triton TP2 EP2 + ngram_tail"]
    assert len(fit) == 8


def test_holdout_predicts_the_layer_count_left_out():
    pts = decode_points(pd.DataFrame(_records((4, 16, 24))))
    h = holdout_check(pts, held_out=24)
    assert len(h) == 4 and set(h["fitted_on"]) == {"4/16"}
    assert h["error_pct"].abs().max() < 1e-6            # exact lines predict exactly
    row = h[(h["config"].str.startswith("triton")) & (h["ctx_label"] == "64k")].iloc[0]
    assert row["measured_ms"] == pytest.approx(2.7 + 24 * 12.8, abs=0.01)
    # a 24-layer point 10% slower than the line shows as a -9.1% prediction error
    recs = _records((4, 16, 24))
    for r in recs:
        if r["layers"] == 24:
            r["verify_step_ms"] *= 1.1
    h = holdout_check(decode_points(pd.DataFrame(recs)), held_out=24)
    assert h["error_pct"].to_list() == pytest.approx([-9.1] * 4, abs=0.05)
    fit = fit_layer_scaling(decode_points(pd.DataFrame(recs)))
    assert (fit["max_residual_pct"] > 1).all()           # three counts: the line's miss is reported


def test_holdout_needs_the_held_out_points():
    with pytest.raises(ValueError, match="held_out: no point was measured at 32 layers"):
        holdout_check(decode_points(pd.DataFrame(_records((4, 16)))), held_out=32)
    assert len(holdout_check(decode_points(pd.DataFrame(_records((4, 24)))), held_out=24)) == 0


def test_fit_names_the_commits_behind_each_line():
    recs = _records((4, 16))
    for r in recs:
        if r["layers"] == 16 and r["backend"] == "sm120_mla":
            r.update(commit="newer", date="2026-11-30")   # re-measured at one depth with newer code
    fit = fit_layer_scaling(decode_points(pd.DataFrame(recs))).set_index(["backend", "ctx"])
    assert fit.loc[("sm120_mla", 65536), "commits"] == "c/newer"
    assert fit.loc[("triton", 65536), "commits"] == "c"
    assert "commits" in scaling_table(fit.reset_index()).columns


def test_line_points_keep_a_line_within_the_run_that_measured_every_layer_count():
    one_session = _records((4, 16, 24))                                   # run "c": every layer count
    later = [dict(r, commit="d", date="2026-12-01", verify_step_ms=2 * r["verify_step_ms"])
             for r in _records((16,))]                                     # a newer run at 16 layers only
    runs = decode_points(pd.DataFrame(one_session + later), every_run=True)
    lines = line_points(runs)
    assert set(lines["commit"]) == {"c"} and sorted(set(lines["layers"])) == [4, 16, 24]
    fit = fit_layer_scaling(lines).set_index(["backend", "ctx"])
    assert fit.loc[("triton", 4096), "per_layer_ms"] == pytest.approx(1.0)
    assert set(fit["commits"]) == {"c"}
    # no run measured every layer count (here "e" has two of three): each layer count's newest run
    split = [dict(r, commit="e", date="2026-11-30") for r in _records((4, 16))] + \
            [dict(r, commit="f", date="2026-11-30T12") for r in _records((24,))]
    lines = line_points(decode_points(pd.DataFrame(split + later), every_run=True))
    assert lines.groupby("layers")["commit"].agg(set).to_dict() == {4: {"e"}, 16: {"d"}, 24: {"f"}}
    # the points off the line's main run (of one point each, the newest: "d") are marked
    assert lines.groupby("layers")["other_run"].all().to_dict() == {4: True, 16: False, 24: True}
    # of two whole runs the newer keeps the line; commit-less records never count as one run
    newer_whole = [dict(r, commit="g", date="2026-12-02") for r in _records((4, 16, 24))]
    lines = line_points(decode_points(pd.DataFrame(one_session + later + newer_whole), every_run=True))
    assert set(lines["commit"]) == {"g"}
    unknown = [dict(r, commit=None) for r in _records((4, 16, 24))]
    lines = line_points(decode_points(pd.DataFrame(unknown + later), every_run=True))
    assert lines.groupby("layers")["commit"].agg(set).to_dict() == {4: {"?"}, 16: {"d"}, 24: {"?"}}
    with pytest.raises(ValueError, match="run_points: missing columns"):
        line_points(runs.drop(columns="commit"))


def test_configurations_differing_only_in_decode_or_draft_tokens_are_lines_of_their_own():
    plain = ["sm120_mla + ngram_tail", "triton + ngram_tail"]
    assert sorted(set(fit_layer_scaling(decode_points(pd.DataFrame(_records())))["config"])) == plain   # as today
    # the records' own count (decode_tokens absent: decode_bench's default, 256) and another
    for key, own, other, label in (("decode_tokens", 256, 64, "{b}, {n} decode tokens + ngram_tail"),
                                   ("draft_tokens", 8, 16, "{b} + ngram_tail, {n} draft tokens")):
        recs = _records() + [dict(r, **{key: other}, verify_step_ms=2 * r["verify_step_ms"]) for r in _records()]
        pts = decode_points(pd.DataFrame(recs))
        fit = fit_layer_scaling(pts)
        assert sorted(fit["config"].unique()) == sorted(label.format(b=b, n=n) for b in ("sm120_mla", "triton")
                                                        for n in (own, other)), key
        assert fit.groupby("config").size().to_list() == [2] * 4              # a line per context each
        # the chart draws each measured point under its own configuration's label
        spec = layer_scaling_chart(pts, fit).to_dict()
        measured = [r for r in next(iter(spec["datasets"].values())) if r["kind"] == "measured"]
        assert len(measured) == len(pts) and {r["config"] for r in measured} == set(fit["config"])
        # fitted_points are those points (the chart's provenance): a configuration seen at one
        # layer count only, with no line, is not among them
        lone = pd.DataFrame([dict(_records()[0], backend="flashmla", layers=4, commit="lone")])
        drawn = fitted_points(pd.concat([pts, decode_points(lone)]), fit)
        assert len(drawn) == len(pts) and "lone" not in set(drawn["commit"])
        slower = label.format(b="triton", n=other)
        line = fit.set_index(["config", "ctx"]).loc[(slower, 4096)]
        point = next(r for r in measured if (r["config"], r["layers"], r["ctx"]) == (slower, 16, 4096))
        assert point["step_ms"] == pytest.approx(line["fixed_ms"] + 16 * line["per_layer_ms"])
