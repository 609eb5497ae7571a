"""service_charts: pairing within a run, a target row for every configuration, the point keys,
commits, chart sources and the small summaries notebook 05 prints (synthetic records).
(The older tests of the same module are in test_service.py.)"""
from __future__ import annotations

import pandas as pd
import pytest

from sm120_workbook import service_charts as sc

BASE = {"gpu": "H200", "model": "k2_tp8_slice", "layers": 4, "tp": 1, "weights": "bf16", "spec": "ngram",
        "draft_tokens": 8, "accept_len": 6.5, "verify_step_ms": 1.0, "expert_record": True, "ngram_tail": True,
        "ep_size": 1, "decode_tokens": 128, "cuda_graph": True}


def _rec(backend, ctx, tok_s, commit, date, **kw):
    return {**BASE, "backend": backend, "ctx": ctx, "tok_s": tok_s, "commit": commit, "date": date, **kw}


def _two_runs():
    """Run "aaaaaaa" measured both backends; the newer run "bbbbbbb" only sm120_mla (faster)."""
    recs = []
    for ctx, ours, base in ((4096, 1600.0, 1100.0), (16384, 1700.0, 400.0)):
        recs += [_rec("sm120_mla", ctx, ours, "aaaaaaa111", "2026-11-29T17:00"),
                 _rec("triton", ctx, base, "aaaaaaa111", "2026-11-29T17:02"),
                 _rec("sm120_mla", ctx, 1.3 * ours, "bbbbbbb222", "2026-11-30T15:00")]
    return pd.DataFrame(recs)


def test_a_pair_within_one_commit_wins_over_a_newer_one_across_commits():
    runs = sc.decode_points(_two_runs(), every_run=True)
    assert len(runs) == 6 and len(sc.decode_points(_two_runs())) == 4   # the newest run only, by default
    t = sc.service_targets(runs).set_index("target")
    row = t.loc["ngram 16k: sm120_mla >= 4.3x triton"]
    assert row["ratio"] == pytest.approx(1700 / 400, abs=0.01) and row["met"] is False   # 4.25: missed
    # records without an invocation: one commit, but nothing says one machine or session
    assert row["pairing"] == "same commit" and row["commits"] == "aaaaaaa / aaaaaaa"
    sp = sc.speedup_over(runs).set_index(["backend", "ctx"])
    assert sp.loc[("sm120_mla", 16384), "commit"] == "aaaaaaa"
    assert sp.loc[("sm120_mla", 16384), "speedup"] == pytest.approx(1700 / 400)
    # with the newest points only there is no same-run pair: the newer run's, flagged
    t = sc.service_targets(sc.decode_points(_two_runs())).set_index("target")
    row = t.loc["ngram 16k: sm120_mla >= 4.3x triton"]
    assert row["pairing"] == "separate runs" and row["commits"] == "bbbbbbb / aaaaaaa"
    assert row["ratio"] == pytest.approx(1.3 * 1700 / 400, abs=0.01) and row["met"] is True


def test_without_a_same_run_pair_the_newest_of_each_side_is_paired_and_flagged():
    df = _two_runs()
    df = df[~((df["backend"] == "sm120_mla") & (df["commit"] == "aaaaaaa111"))]
    sp = sc.speedup_over(sc.decode_points(df, every_run=True))
    ours = sp[sp["backend"] == "sm120_mla"]
    assert set(ours["commit"]) == {"bbbbbbb"} and set(ours["base_commit"]) == {"aaaaaaa"}
    assert not ours["same_commit"].any() and sp[sp["backend"] == "triton"]["same_commit"].all()
    assert set(ours["pairing"]) == {"separate runs"} and not sp["same_run"].any()


def test_every_configuration_of_ours_gets_a_row():
    df = pd.concat([_two_runs(),
                    # recorder off, measured at 64k only, with no triton run of its kind
                    pd.DataFrame([_rec("sm120_mla", 65536, 800.0, "ccccccc", "2026-11-29T18:00",
                                       expert_record=False)])])
    t = sc.service_targets(sc.decode_points(df, every_run=True))
    off = t[t["config"] == "sm120_mla (recorder off) + ngram_tail"].set_index("target")
    assert list(off.index[:3]) == ["ngram 4k: sm120_mla >= 3x triton", "ngram 16k: sm120_mla >= 4.3x triton",
                                   "ngram 64k: sm120_mla >= 6.1x triton"]
    assert (off["measured"] == "not measured").all() and off["met"].isna().all()
    assert list(off["pairing"]) == ["no sm120_mla point", "no sm120_mla point", "no triton point",
                                    "no plain-decode point"]
    # the configuration that was measured keeps its rows, and at 64k neither was: named, not dropped
    usual = t[t["config"] == "sm120_mla + ngram_tail"].set_index("target")
    assert usual.loc["ngram 64k: sm120_mla >= 6.1x triton", "pairing"] == "no sm120_mla point"
    assert usual.loc["ngram 4k: sm120_mla >= 3x triton", "met"] is False
    assert list(t.columns) == sc.TARGET_COLUMNS + sc.TARGET_KEYS
    # the keys say what the printed name says
    assert off[sc.TARGET_KEYS].to_dict("records") == [
        {"spec": "ngram", "ctx": 4096, "against": "triton"}, {"spec": "ngram", "ctx": 16384, "against": "triton"},
        {"spec": "ngram", "ctx": 65536, "against": "triton"}, {"spec": "ngram", "ctx": 65536, "against": "plain decode"}]


def test_ep_size_decode_tokens_and_cuda_graph_are_point_keys():
    assert {"ep_size", "decode_tokens", "cuda_graph"} <= set(sc.POINT_KEYS)
    old = {k: v for k, v in BASE.items() if k not in ("ep_size", "decode_tokens", "cuda_graph")}
    df = pd.DataFrame([
        {**old, "backend": "triton", "ctx": 4096, "tok_s": 100.0, "decode_tokens": 256},   # the rest absent
        {**BASE, "backend": "triton", "ctx": 4096, "tok_s": 200.0, "ep_size": float("nan"), "decode_tokens": 256},
        {**BASE, "backend": "triton", "ctx": 4096, "tok_s": 300.0, "ep_size": 2, "tp": 2, "decode_tokens": 256},
        {**BASE, "backend": "triton", "ctx": 4096, "tok_s": 400.0, "cuda_graph": False, "decode_tokens": 256},
        {**BASE, "backend": "triton", "ctx": 4096, "tok_s": 500.0}])
    pts = sc.decode_points(df).set_index("config")
    # absent and NaN keys take their defaults, so the first two records are one point
    assert pts.loc["triton, 256 decode tokens + ngram_tail", "requests"] == 2
    assert pts.loc["triton, 256 decode tokens + ngram_tail", "n_runs"] == 1   # no run_id: one server
    assert sorted(pts.index) == ["triton TP2 EP2, 256 decode tokens + ngram_tail",
                                 "triton, 128 decode tokens + ngram_tail",
                                 "triton, 256 decode tokens (no CUDA graph) + ngram_tail",
                                 "triton, 256 decode tokens + ngram_tail"]
    # one decode-token count in the records: not in the label
    assert set(sc.decode_points(df[df["tok_s"] < 500]).loc[lambda p: p["tp"] == 1, "config"]) == {
        "triton + ngram_tail", "triton (no CUDA graph) + ngram_tail"}
    assert sc.config_label("sm120_mla", ep_size=8.0, tp="8") == "sm120_mla TP8 EP8"
    # a prefill on another backend is its own point; records before the key had none
    split = pd.DataFrame([dict(df.iloc[0], tok_s=900.0, prefill_attention_backend="flashinfer")])
    both = sc.decode_points(pd.concat([df.iloc[[0]], split]))
    assert sorted(both["config"]) == ["triton + ngram_tail", "triton + ngram_tail + flashinfer prefill"]


def test_commits_keep_a_dirty_suffix():
    assert sc.short_commit("d26e3f18ca7c9f3644a799b2c1c62b8f3edfd8c5") == "d26e3f1"
    assert sc.short_commit("3b7ef98b9aba+dirty") == "3b7ef98+dirty"
    assert sc.short_commit(None) == sc.short_commit(float("nan")) == "?"
    df = _two_runs().assign(commit=lambda d: d["commit"] + "+dirty")
    assert set(sc.decode_points(df)["commit"]) == {"aaaaaaa+dirty", "bbbbbbb+dirty"}


def test_pick_point_says_when_it_falls_back():
    recs = pd.DataFrame([
        {"run_id": "a", "backend": "triton", "spec": "ngram", "ctx": 65536, "tp": 2},
        {"run_id": "b", "backend": "sm120_mla", "spec": "dflash", "ctx": 65536, "tp": 1}])
    said = []
    p = sc.pick_point(recs, backend="triton", spec="dflash", most_gpus=True, log=said.append)
    assert p["run_id"] == "a" and said == ["no records of spec 'dflash' of the TP2 runs; any spec shown instead"]
    said.clear()
    assert sc.pick_point(recs, backend="sm120_mla", spec="dflash", log=said.append)["run_id"] == "b" and not said


def test_charts_say_where_their_numbers_come_from():
    pts = sc.decode_points(_two_runs(), every_run=True)
    src = sc.source_label(_two_runs(), live=False)
    assert src == "recorded: H200; 2 commits, newest bbbbbbb; 2026-11-29..2026-11-30"
    assert sc.source_label(_two_runs().head(1), live=True) == "measured here: H200; commit aaaaaaa; 2026-11-29"
    for chart in (sc.decode_speed_chart(pts, source=src), sc.speedup_chart(sc.speedup_over(pts), source=src)):
        title = chart.to_dict()["title"]
        assert title["subtitle"] == src and title["text"]
    assert isinstance(sc.decode_speed_chart(pts).to_dict()["title"], str)


def test_ngram_fix_gain_compares_adjacent_runs():
    recs = []
    for commit, date, tail, speed in (("old", "2026-11-29T12:00", False, 1.0),       # an older unpatched run
                                      ("unp", "2026-11-29T16:05", False, 1.1),       # the newest unpatched
                                      ("fix", "2026-11-29T16:29", True, 2.0),        # the next run, patched
                                      ("new", "2026-11-30T15:40", True, 1.7)):       # a later kernel, patched
        recs += [_rec("sm120_mla", ctx, speed * 1000, commit, date, ngram_tail=tail) for ctx in (4096, 65536)]
    runs = sc.decode_points(pd.DataFrame(recs), every_run=True)
    g = sc.ngram_fix_gain(runs)
    assert list(g["ctx_label"]) == ["4k", "64k"] and set(g["commits"]) == {"unp -> fix"}
    assert list(g["unpatched_tok_s"]) == [1100.0, 1100.0] and list(g["gain"]) == [1.82, 1.82]
    assert sc.ngram_fix_gain(runs, layers=16).empty
    assert sc.ngram_fix_gain(runs[~runs["ngram_tail"]]).empty
    # a later unpatched run that prefills on another backend is another configuration: not the pair's
    hybrid = [_rec("sm120_mla", ctx, 900.0, "hyb", "2026-12-01T15:30", prefill_attention_backend="flashinfer")
              for ctx in (4096, 65536)]
    again = sc.ngram_fix_gain(sc.decode_points(pd.DataFrame(recs + hybrid), every_run=True))
    assert set(again["commits"]) == {"unp -> fix"} and list(again["gain"]) == [1.82, 1.82]


def test_recorder_cost_pairs_on_and_off_at_one_commit():
    recs = []
    for backend, on, off in (("sm120_mla", 1300.0, 1400.0), ("flashmla", 1200.0, 1500.0)):
        for rep in (0, 1):   # two repeats a point: the median of each side
            recs += [_rec(backend, 4096, on + 10 * rep, "same", "2026-12-01T04:48", layers=16, verify_step_ms=5.0),
                     _rec(backend, 4096, off + 10 * rep, "same", "2026-12-01T04:51", layers=16,
                          expert_record=False, verify_step_ms=4.0)]
    recs += [_rec("sm120_mla", 65536, 900.0, "older", "2026-11-30T15:00", layers=16),          # on only
             _rec("sm120_mla", 65536, 990.0, "other", "2026-11-30T16:00", layers=16, expert_record=False)]
    runs = sc.decode_points(pd.DataFrame(recs), every_run=True)
    c = sc.recorder_cost(runs)
    assert list(c["config"]) == ["flashmla, 16 layers + ngram_tail", "sm120_mla, 16 layers + ngram_tail"]
    assert list(c["on_tok_s"]) == [1205.0, 1305.0] and list(c["off_tok_s"]) == [1505.0, 1405.0]
    assert list(c["recorder_off_gain"]) == [1.25, 1.08] and set(c["ctx_label"]) == {"4k"}
    assert list(c["on_step_ms"]) == [5.0, 5.0] and list(c["off_step_ms"]) == [4.0, 4.0]
    # runs of two commits are never paired: the code differs; nor records without a commit
    assert sc.recorder_cost(runs[runs["commit"] != "same"]).empty
    unknown = [dict(r, commit=None) for r in recs[:4]]
    assert sc.recorder_cost(sc.decode_points(pd.DataFrame(unknown), every_run=True)).empty


def test_recorder_cost_pairs_within_one_invocation_first():
    """One commit, two decode_bench calls: the first measured the recorder on and off, a later one
    on alone. The pair is the first call's (one machine, one session), not the newest of each side."""
    recs = [_rec("sm120_mla", 4096, 1000.0, "same", "2026-12-01T04:48", layers=16, invocation="i1"),
            _rec("sm120_mla", 4096, 1100.0, "same", "2026-12-01T04:51", layers=16, invocation="i1",
                 expert_record=False),
            _rec("sm120_mla", 4096, 700.0, "same", "2026-12-01T09:00", layers=16, invocation="i2")]
    c = sc.recorder_cost(sc.decode_points(pd.DataFrame(recs), every_run=True))
    assert list(c["on_tok_s"]) == [1000.0] and list(c["recorder_off_gain"]) == [1.1]


def test_startup_summary_counts_each_server_once():
    recs = pd.DataFrame({"run_id": ["a", "a", "a", "b", "c"], "startup_s": [46.2, 46.2, 46.2, 98.3, 259.8]})
    assert sc.startup_summary(recs) == "3 server starts: 46-260 s (median 98 s)"
    with pytest.raises(ValueError, match="records: missing columns"):
        sc.startup_summary(recs.drop(columns="startup_s"))


def test_first_token_points_take_the_fastest_repeat_and_name_the_prefill_kernels():
    def req(backend, ctx, ttft, rep, commit="ccccccc333", date="2026-12-01T16:30", **kw):
        return _rec(backend, ctx, 1000.0, commit, date, ttft_s=ttft, repeat=rep, **kw)

    recs = [req("sm120_mla", 65536, 19.0, 0), req("sm120_mla", 65536, 10.3, 1),     # first request waits
            req("sm120_mla", 65536, 1.5, 0, prefill_attention_backend="flashinfer"),  # a first request: not counted
            req("sm120_mla", 65536, 1.6, 1, prefill_attention_backend="flashinfer"),
            req("sm120_mla", 65536, 1.7, 2, prefill_attention_backend="flashinfer"),
            req("triton", 65536, 10.2, 0), req("triton", 65536, 10.4, 1),
            # two servers' first requests (repeats 1 each): no repeat, so left out
            req("flashmla", 65536, 0.9, 0), req("flashmla", 65536, 0.8, 0, date="2026-12-01T17:00"),
            # an older run of another configuration (spec "none") of the same prefill: the newer stands
            req("sm120_mla", 65536, 12.0, 0, commit="aaaaaaa111", date="2026-11-29T10:00", spec="none"),
            req("sm120_mla", 65536, 12.0, 1, commit="aaaaaaa111", date="2026-11-29T10:00", spec="none"),
            # DFlash's draft prefills too: its newer point stays apart
            req("sm120_mla", 65536, 14.0, 0, date="2026-12-01T18:00", spec="dflash", draft_attention_backend="flashinfer"),
            req("sm120_mla", 65536, 13.0, "1", date="2026-12-01T18:00", spec="dflash",   # repeat as text
                draft_attention_backend="flashinfer"),
            # EAGLE3 heads of the two layouts prefill different drafts: two points
            req("sm120_mla", 65536, 11.0, 1, date="2026-12-02T06:00", spec="eagle3"),
            req("sm120_mla", 65536, 11.5, 1, date="2026-12-02T07:00", spec="eagle3", draft_head="llama"),
            # a draft on another backend than its usual one prefills on it: a point of its own
            req("sm120_mla", 65536, 11.8, 1, date="2026-12-02T08:00", spec="eagle3", draft_head="llama",
                draft_attention_backend="triton")]
    tt = sc.first_token_points(sc.decode_points(pd.DataFrame(recs)))
    assert dict(zip(tt["prefill"], tt["ttft_s"])) == {
        "sm120_mla (prefill: flashinfer)": 1.6, "sm120_mla (prefill: triton)": 10.3, "triton": 10.4,
        "sm120_mla (prefill: triton), DFlash draft": 13.0, "sm120_mla (prefill: triton), EAGLE3 draft": 11.0,
        "sm120_mla (prefill: triton), Llama EAGLE3 draft": 11.5,
        "sm120_mla (prefill: triton), Llama EAGLE3 draft on triton": 11.8}
    tt = tt[~tt["prefill"].str.endswith("draft")]
    table = sc.first_token_table(tt)
    assert list(table.columns) == ["layers", "prefill", "64k"]
    assert sc.first_token_chart(tt, source="recorded").to_dict()["title"]["subtitle"] == "recorded"
    with pytest.raises(ValueError, match="more than one tp"):
        sc.first_token_table(pd.concat([tt, tt.assign(tp=2)]))
    with pytest.raises(ValueError, match="ttft_s"):
        sc.first_token_points(sc.decode_points(pd.DataFrame([_rec("triton", 4096, 1.0, "a", "d")])))


def test_a_newer_run_without_a_repeat_leaves_the_older_repeated_point_standing():
    """Every run's points (decode_points(every_run=True)): eef2095's warm-up servers measured 16k
    once each (no repeat), and must not hide 3486e7d's repeated 16k point."""
    def req(ctx, ttft, rep, commit, date, run_id):
        return _rec("sm120_mla", ctx, 1000.0, commit, date, ttft_s=ttft, repeat=rep, run_id=run_id)

    recs = [req(16384, 30.0, 0, "3486e7d", "2026-12-01T23:26", "F"), req(16384, 0.18, 1, "3486e7d", "2026-12-01T23:27", "F"),
            req(16384, 0.17, 0, "eef2095", "2026-12-01T23:54", "G"), req(16384, 0.18, 0, "eef2095", "2026-12-01T23:56", "H")]
    tt = sc.first_token_points(sc.decode_points(pd.DataFrame(recs), every_run=True))
    assert list(zip(tt["ttft_s"], tt["commit"])) == [(0.18, "3486e7d")]


def test_prefill_label():
    assert sc.prefill_label("sm120_mla", "flashinfer", as_base=True) == "sm120_mla (prefill: flashinfer as base)"
    assert sc.config_label("sm120_mla", prefill_backend="flashinfer", prefill_as_base=True) == (
        "sm120_mla + flashinfer prefill as base")
    assert sc.prefill_label("sm120_mla") == "sm120_mla (prefill: triton)"
    assert sc.prefill_label("sm120_mla", "flashinfer") == "sm120_mla (prefill: flashinfer)"
    assert sc.prefill_label("flashmla") == "flashmla"


def test_the_dflash_host_plan_is_a_point_of_its_own():
    """DFlash servers under the host-plan timing probe are points of their own beside SGLang's plan,
    labelled so; records from before the key read "off"."""
    d = dict(spec="dflash", draft_tokens=16, prefill_attention_backend="flashinfer", prefill_as_base=True,
             draft_attention_backend="flashinfer", ngram_tail=False)
    recs = pd.DataFrame([
        _rec("sm120_mla", 65536, 134.0, "ccccccc333", "2026-12-02T16:00", **d),
        _rec("sm120_mla", 65536, 160.0, "ccccccc333", "2026-12-02T16:05", dflash_host_plan="probe", **d),
        _rec("sm120_mla", 16384, 188.0, "ccccccc333", "2026-12-02T16:06", dflash_host_plan="on", **d),
        _rec("sm120_mla", 65536, 133.0, "ccccccc333", "2026-12-02T16:12", dflash_host_plan="off", **d)])
    pts = sc.decode_points(recs)
    assert sorted(zip(pts["dflash_host_plan"], pts["tok_s"])) == [("off", 133.5), ("on", 188.0), ("probe", 160.0)]
    labels = dict(zip(pts["dflash_host_plan"], pts["config"]))
    assert labels["on"] == labels["probe"]   # session 39's name for the probe (data/results/probes/)
    assert labels["probe"].endswith("+ flashinfer prefill as base + dflash_host_plan probe")
    assert "dflash_host_plan" not in labels["off"]


def test_host_plan_cost_pairs_the_probe_with_sglangs_plan_in_one_commit():
    d = dict(spec="dflash", draft_tokens=16, prefill_attention_backend="flashinfer", prefill_as_base=True,
             draft_attention_backend="flashinfer", ngram_tail=False)
    recs = pd.DataFrame([
        _rec("sm120_mla", 4096, 161.0, "ccccccc333", "2026-12-02T15:18", verify_step_ms=6.21, **d),
        _rec("sm120_mla", 4096, 199.0, "ccccccc333", "2026-12-02T15:11", verify_step_ms=5.03,
             dflash_host_plan="on", **d),
        _rec("sm120_mla", 65536, 133.0, "ccccccc333", "2026-12-02T15:19", verify_step_ms=7.50, **d),
        _rec("sm120_mla", 65536, 163.0, "ccccccc333", "2026-12-02T15:12", verify_step_ms=6.13,
             dflash_host_plan="probe", **d),
        _rec("sm120_mla", 16384, 160.0, "ddddddd444", "2026-12-02T16:00", verify_step_ms=5.30,
             dflash_host_plan="probe", **d),                      # no usual point in its commit
        _rec("sm120_mla", 65536, 120.0, "ccccccc333", "2026-12-02T15:05", verify_step_ms=7.26,
             dflash_host_plan="check", **d),                      # synced anyway: not the probe
        _rec("sm120_mla", 131072, 114.0, None, "2026-12-02T15:20", verify_step_ms=8.79, **d),
        _rec("sm120_mla", 131072, 134.0, None, "2026-12-02T15:13", verify_step_ms=7.45,
             dflash_host_plan="probe", **d)])                     # no commit: never paired
    t = sc.host_plan_cost(sc.decode_points(recs, every_run=True))
    assert list(t["ctx_label"]) == ["4k", "64k"] and list(t["saved_ms"]) == [1.18, 1.37]
    assert list(t["saved"]) == ["19%", "18%"] and set(t["commit"]) == {"ccccccc"}
    assert list(sc.host_plan_cost(sc.decode_points(recs.iloc[:1], every_run=True)).columns) == [
        "ctx_label", "sglang_plan_ms", "probe_ms", "saved_ms", "saved", "commit"]


def test_an_eagle_draft_off_the_decode_backend_is_a_point_of_its_own():
    """EAGLE's MTP draft on the decode backend (recorded as None in the first runs, or by name) is
    the usual point; the same server with the draft kept on Triton is another, labelled so, and is
    neither paired with triton's EAGLE point nor mistaken for the newest run of the first."""
    e = dict(spec="eagle", draft_tokens=4, ngram_tail=False)
    recs = pd.DataFrame([
        _rec("sm120_mla", 65536, 162.0, "ccccccc333", "2026-12-02T02:05", draft_attention_backend=None, **e),
        _rec("sm120_mla", 16384, 177.0, "ccccccc333", "2026-12-02T02:05", draft_attention_backend="sm120_mla", **e),
        _rec("sm120_mla", 65536, 59.8, "ccccccc333", "2026-12-02T02:09", draft_attention_backend="triton", **e),
        _rec("triton", 65536, 4.5, "ccccccc333", "2026-12-02T02:11", draft_attention_backend="triton", **e),
        _rec("sm120_mla", 65536, 40.0, "ccccccc333", "2026-12-02T02:12", spec="none", draft_tokens=0,
             ngram_tail=False),
        _rec("sm120_mla", 65536, 30.0, "ccccccc333", "2026-12-02T02:12", spec="dflash", draft_tokens=16,
             draft_attention_backend="flashinfer", ngram_tail=False)])
    assert [sc.draft_backend_of(s, b, n) for s, b, n in zip(recs["spec"], recs["backend"],
                                                            recs["draft_attention_backend"])] == [
        "", "", "triton", "", "", ""]
    points = sc.decode_points(recs).set_index(["backend", "spec", "ctx", "draft_backend"])
    assert points.loc[("sm120_mla", "eagle", 65536, ""), "tok_s"] == 162.0
    assert points.loc[("sm120_mla", "eagle", 65536, "triton"), "config"] == "sm120_mla + triton draft"
    assert points.loc[("sm120_mla", "eagle", 65536, ""), "config"] == "sm120_mla"
    sp = sc.speedup_over(sc.decode_points(recs, every_run=True)).set_index(["backend", "spec", "ctx", "draft_backend"])
    assert sp.loc[("sm120_mla", "eagle", 65536, ""), "speedup"] == pytest.approx(162.0 / 4.5)
    # the draft kept on Triton pairs with triton's own, which drafts on Triton too
    assert sp.loc[("sm120_mla", "eagle", 65536, "triton"), "speedup"] == pytest.approx(59.8 / 4.5)
    t = sc.service_targets(sc.decode_points(recs, every_run=True)).set_index(["target", "config"])
    assert t.loc[("eagle 64k: sm120_mla >= 6.1x triton", "sm120_mla"), "met"] is True
    assert t.loc[("eagle 64k: sm120_mla speculation >= plain decode", "sm120_mla + triton draft"), "ratio"] == \
        pytest.approx(59.8 / 40.0, abs=0.01)
    assert sc.label_of({"backend": "sm120_mla", "spec": "eagle", "draft_attention_backend": "triton",
                        "expert_record": True}) == \
        "sm120_mla + triton draft"
    # DFlash's usual draft backend is SGLang's: its prefill backend where it runs a DFlash draft,
    # else flashinfer (sm120_mla); another is keyed and named (the Triton drafts before session 38)
    assert sc.draft_backend_of("dflash", "sm120_mla", "flashinfer") == ""
    assert sc.draft_backend_of("dflash", "sm120_mla", "flashinfer", None, "flashinfer") == ""
    assert sc.draft_backend_of("dflash", "sm120_mla", "triton") == "triton"
    assert sc.draft_backend_of("dflash", "sm120_mla", "triton", None, "triton") == ""
    assert sc.draft_backend_of("dflash", "triton", "triton") == sc.draft_backend_of("ngram", "triton", "x") == ""
    assert sc.draft_backend_of("dflash", "triton", "triton", None, float("nan")) == ""
    # through with_defaults, the usual depends on the record's prefill backend
    d = sc.with_defaults(pd.DataFrame([
        {"spec": "dflash", "backend": "sm120_mla", "draft_attention_backend": "triton",
         "prefill_attention_backend": "triton"},
        {"spec": "dflash", "backend": "sm120_mla", "draft_attention_backend": "triton",
         "prefill_attention_backend": float("nan")},
        {"spec": "dflash", "backend": "sm120_mla", "draft_attention_backend": "flashinfer",
         "prefill_attention_backend": "flashinfer"}]))
    assert list(d["draft_backend"]) == ["", "triton", ""]
    # DFlash records naming no draft backend ran the launcher's default of their day, triton
    assert sc.draft_backend_of("dflash", "sm120_mla", float("nan")) == "triton"
    assert sc.draft_backend_of("dflash", "triton", None) == ""
    assert sc.label_of({"backend": "sm120_mla", "spec": "dflash", "draft_attention_backend": "triton",
                        "prefill_attention_backend": "flashinfer"}).endswith("+ triton draft")
    # EAGLE3's usual draft backend is the decode backend, as EAGLE's
    assert sc.draft_backend_of("eagle3", "sm120_mla", "triton") == "triton"
    assert sc.draft_backend_of("eagle3", "sm120_mla", "sm120_mla") == sc.draft_backend_of("eagle3", "sm120_mla", None) == ""
    # an EAGLE3 Llama head (MHA) usually drafts on flashinfer under sm120_mla (the plugin's step),
    # on the decode backend elsewhere; a Triton draft under sm120_mla is named
    assert sc.draft_backend_of("eagle3", "sm120_mla", "flashinfer", "llama") == ""
    assert sc.draft_backend_of("eagle3", "sm120_mla", "triton", "llama") == "triton"
    assert sc.draft_backend_of("eagle3", "triton", "triton", "llama") == ""
    assert [sc.draft_head_of(s, h) for s, h in (("eagle3", None), ("eagle3", float("nan")), ("eagle3", "llama"),
                                                ("eagle", "llama"), ("none", None))] == ["mla", "mla", "llama", "", ""]
    heads = pd.DataFrame([_rec("sm120_mla", 65536, 167.0, "ccccccc333", "2026-12-02T05:00", spec="eagle3",
                               draft_tokens=4, ngram_tail=False),
                          _rec("sm120_mla", 65536, 120.0, "ccccccc333", "2026-12-02T05:00", spec="eagle3",
                               draft_tokens=4, ngram_tail=False, draft_head="llama", draft_attention_backend="flashinfer")])
    pts = sc.decode_points(heads).set_index("draft_head")
    assert pts.loc["mla", "config"] == "sm120_mla" and pts.loc["llama", "config"] == "sm120_mla, Llama EAGLE3 head"
    assert pts.loc["llama", "tok_s"] == 120.0   # never pooled with the MLA head's
    # an EAGLE tree is a point of its own, named by its width
    tree = pd.DataFrame([_rec("sm120_mla", 65536, 150.0, "ccccccc333", "2026-12-02T05:00", spec="eagle3",
                              draft_tokens=8, ngram_tail=False, eagle_topk=4),
                         _rec("sm120_mla", 65536, 160.0, "ccccccc333", "2026-12-02T05:00", spec="eagle3",
                              draft_tokens=4, ngram_tail=False)])
    pts = sc.decode_points(tree).set_index(["eagle_topk"])
    assert pts.loc[4, "config"] == "sm120_mla, EAGLE topk 4" and pts.loc[1, "config"] == "sm120_mla"
    plain = _rec("sm120_mla", 65536, 140.0, "ccccccc333", "2026-12-02T05:00", spec="none", draft_tokens=0,
                 ngram_tail=False)
    t = sc.service_targets(sc.decode_points(pd.concat([tree, pd.DataFrame([plain])]), every_run=True))
    vs_plain = t[t["target"] == "eagle3 64k: sm120_mla speculation >= plain decode"].set_index("config")
    assert vs_plain.loc["sm120_mla, EAGLE topk 4", "pairing"] == "same commit"   # a tree pairs with plain decode too
    assert vs_plain.loc["sm120_mla", "ratio"] == pytest.approx(160.0 / 140.0, abs=0.01)


def test_target_gaps_fold_the_unmeasured_rows_by_configuration_and_missing_side():
    df = pd.concat([_two_runs(),
                    pd.DataFrame([_rec("sm120_mla", 65536, 800.0, "ccccccc", "2026-11-29T18:00",
                                       expert_record=False)])])
    t = sc.service_targets(sc.decode_points(df, every_run=True))
    gaps = sc.target_gaps(t)
    assert list(gaps.columns) == sc.GAP_COLUMNS
    # every unmeasured row is in exactly one gap row, and no measured row is
    assert len(t[t["met"].isna()]) == sum(g.count("/") + g.count(";") + 1 for g in gaps["open targets"])
    # measured at 64k only: the other contexts lack its own point, 64k the baseline's
    off = gaps.set_index(["config", "missing"]).loc["sm120_mla (recorder off) + ngram_tail", "open targets"]
    assert off.to_dict() == {"sm120_mla point": "ngram 4k/16k vs triton", "triton point": "ngram 64k vs triton",
                             "plain-decode point": "ngram 64k vs plain decode"}
    assert sc.target_gaps(t[t["met"].notna()]).empty


def test_targets_say_whether_every_same_run_pair_agrees():
    # run "aaaaaaa" paired both backends at 16k (4.25x, missed); a newer run "ccccccc" did too (5.0x, met)
    newer = [_rec("sm120_mla", 16384, 2000.0, "ccccccc333", "2026-11-30T18:00"),
             _rec("triton", 16384, 400.0, "ccccccc333", "2026-11-30T18:02")]
    t = sc.service_targets(sc.decode_points(pd.concat([_two_runs(), pd.DataFrame(newer)]), every_run=True))
    row = t.set_index("target").loc["ngram 16k: sm120_mla >= 4.3x triton"]
    assert row["met"] is True and row["commits"] == "ccccccc / ccccccc"    # the verdict: the newest pair's
    assert row["runs"] == "2 same-commit pairs, 4.25-5.00x: mixed"        # and the older pair disagrees
    at_4k = t.set_index("target").loc["ngram 4k: sm120_mla >= 3x triton"]
    assert at_4k["runs"] == "1 same-commit pair"
    pts = sc.decode_points(pd.concat([_two_runs(), pd.DataFrame(newer)]), every_run=True)
    ratios = sc.same_commit_ratios(pts[pts["backend"] == "sm120_mla"], pts[pts["backend"] == "triton"],
                                   [k for k in sc.POINT_KEYS if k != "backend"]).set_index("ctx")
    assert ratios.loc[16384, "same_commits"] == 2 and ratios.loc[4096, "same_commits"] == 1
    assert (ratios["same_runs"] == 0).all()
    assert ratios.loc[16384, "ratio_min"] == pytest.approx(4.25) and ratios.loc[16384, "ratio_max"] == pytest.approx(5.0)


def _setups():
    """Two setups: 16 layers with three lines in the EAGLE panel (a draft kept on triton among them),
    4 layers with one line in each of two panels."""
    recs = [_rec(b, ctx, 100.0, "eeeeeee", "2026-12-02T10:00", layers=16, spec="eagle", ngram_tail=False,
                 prefill_attention_backend="flashinfer", prefill_as_base=True, **kw)
            for ctx in (4096, 65536)
            for b, kw in (("sm120_mla", {}), ("sm120_mla", {"draft_attention_backend": "triton"}), ("triton", {}))]
    recs += [_rec("sm120_mla", 4096, 900.0, "fffffff", "2026-12-03T10:00", spec=s) for s in ("ngram", "none")]
    return sc.decode_points(pd.DataFrame(recs))


def test_a_point_is_its_setup_and_its_line():
    pts = _setups()
    eagle = pts[pts["spec"] == "eagle"]
    assert set(eagle["setup"]) == {"16 layers, 128 decode tokens + flashinfer prefill as base"}
    assert sorted(set(eagle["line"])) == ["sm120_mla", "sm120_mla + triton draft", "triton"]
    assert set(pts.loc[pts["layers"] == 4, "setup"]) == {"4 layers, 128 decode tokens + ngram_tail"}
    assert sc.setup_label({**BASE, "tp": 2, "ep_size": 2, "expert_record": False}) == \
        "TP2 EP2, 4 layers, 128 decode tokens (recorder off) + ngram_tail"


def test_the_default_setup_has_the_most_lines_and_a_wrong_name_is_refused():
    pts = _setups()
    table = sc.setup_table(pts)
    assert list(table["setup"]) == ["16 layers, 128 decode tokens + flashinfer prefill as base",
                                    "4 layers, 128 decode tokens + ngram_tail"]
    assert list(table["lines"]) == [3, 2] and list(table["backends"]) == [2, 1] and list(table["points"]) == [6, 2]
    assert list(table["newest"]) == ["2026-12-02", "2026-12-03"]
    assert sc.pick_setup(pts) == table["setup"][0]
    assert sc.pick_setup(pts, "4 layers, 128 decode tokens + ngram_tail") == table["setup"][1]
    with pytest.raises(ValueError, match="setup: '24 layers' is not a setup of these points"):
        sc.pick_setup(pts, "24 layers")
    with pytest.raises(ValueError, match="points: no rows"):
        sc.pick_setup(pts.head(0))
    # on equal lines the deeper setup comes first (its steps are the least host-bound)
    same = sc.setup_table(pts[pts["line"] != "sm120_mla + triton draft"])   # two lines each
    assert list(same["lines"]) == [2, 2] and list(same["setup"]) == [
        "16 layers, 128 decode tokens + flashinfer prefill as base", "4 layers, 128 decode tokens + ngram_tail"]


def test_the_decode_chart_of_one_setup_has_a_color_a_line():
    pts = _setups()
    spec = sc.decode_speed_chart(pts, setup="", source="recorded").to_dict()
    assert spec["title"]["text"] == "Decode speed against context length: " + sc.pick_setup(pts)
    data = next(iter(spec["datasets"].values()))
    assert {r["setup"] for r in data} == {sc.pick_setup(pts)} and len(data) == 6
    color = spec["spec"]["layer"][0]["encoding"]["color"]
    assert color["field"] == "line" and color["scale"]["scheme"] == "tableau10"
    # every configuration in one chart: refused past the 20 colors a palette has
    for n, scheme in ((10, "tableau10"), (11, "tableau20")):
        lines = pd.Series([f"line {i}" for i in range(n)], name="config")
        assert sc.series_colors(lines, "x").to_dict()["scale"]["scheme"] == scheme
    many = pd.concat([pts.head(1).assign(config=f"configuration {i}") for i in range(21)])
    assert sc.decode_speed_chart(many.head(20))   # 20 configurations: one chart still tells them apart
    with pytest.raises(ValueError, match="21 configurations, more lines than a chart has colors; pass setup"):
        sc.decode_speed_chart(many)


def test_the_decode_explorer_charts_the_setup_picked(monkeypatch):
    pts = _setups()
    drawn = []
    monkeypatch.setattr(sc, "decode_speed_chart", lambda p, setup, source: drawn.append((setup, source)))
    ui = sc.decode_speed_explorer(pts)
    pick = ui.children[0]
    assert list(pick.options) == list(sc.setup_table(pts)["setup"]) and pick.value == pick.options[0]
    pick.value = pick.options[1]
    assert drawn == [(pick.options[0], "recorded: H200; commit eeeeeee; 2026-12-02"),
                     (pick.options[1], "recorded: H200; commit fffffff; 2026-12-03")]
    with pytest.raises(ValueError, match="setup: 'nope'"):
        sc.decode_speed_explorer(pts, "nope")


def test_draft_tokens_name_a_point_only_where_they_tell_two_apart():
    """Two EAGLE3 configurations that differ only in draft tokens are two labels and two lines;
    draft tokens that differ only between spec modes (or not at all) leave the labels as they were."""
    eagle3 = {"spec": "eagle3", "ngram_tail": False}
    alike = [_rec("sm120_mla", ctx, 900.0, "ddddddd", "2026-12-04", draft_tokens=n, **eagle3)
             for ctx in (4096, 65536) for n in (4, 8)]
    pts = sc.decode_points(pd.DataFrame(alike))
    assert sorted(set(pts["config"])) == ["sm120_mla, 4 draft tokens", "sm120_mla, 8 draft tokens"]
    assert sorted(set(pts["line"])) == ["sm120_mla, 4 draft tokens", "sm120_mla, 8 draft tokens"]
    assert pts.groupby("config")["ctx"].nunique().to_dict() == {c: 2 for c in set(pts["config"])}   # whole lines
    assert sc.setup_table(pts)["lines"].to_list() == [2]
    # one draft-token count per mode: the labels of today
    modes = [_rec("sm120_mla", 4096, 900.0, "ddddddd", "2026-12-04", spec="ngram"),
             _rec("sm120_mla", 4096, 900.0, "ddddddd", "2026-12-04", spec="none", draft_tokens=0, ngram_tail=False),
             _rec("sm120_mla", 4096, 900.0, "ddddddd", "2026-12-04", draft_tokens=4, **eagle3),
             _rec("sm120_mla", 4096, 900.0, "ddddddd", "2026-12-04", draft_tokens=8, eagle_topk=4, **eagle3)]
    pts = sc.decode_points(pd.DataFrame(modes))
    assert sorted(pts["config"]) == ["sm120_mla", "sm120_mla", "sm120_mla + ngram_tail",
                                     "sm120_mla, EAGLE topk 4"]
    assert "draft tokens" not in "".join(pts["line"])
    assert sc.config_label("triton", draft_tokens=None) == "triton"
    assert sc.label_of(_rec("triton", 4096, 1.0, "c", "d"), draft_tokens=True) == "triton + ngram_tail, 8 draft tokens"


def test_the_host_plan_probe_is_read_apart_and_kept_to_one_model_and_gpu(tmp_path):
    import json

    path = tmp_path / "probe.jsonl"
    rows = [dict(model="k2_tp8_slice", gpu="NVIDIA H200", ctx=4096), dict(model="k2_tp8_slice", gpu="NVIDIA H100", ctx=4096),
            dict(model="dsv3_tp8_slice", gpu="NVIDIA H200", ctx=4096)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    probe = sc.host_plan_probe("k2_tp8_slice", "H200", path=path)
    assert probe[["model", "gpu"]].to_dict("records") == [{"model": "k2_tp8_slice", "gpu": "NVIDIA H200"}]
    assert sc.host_plan_probe("k2_tp8_slice", "H200", path=tmp_path / "none.jsonl").empty
    from sm120_workbook.results import results_dir

    assert (results_dir() / sc.HOST_PLAN_PROBE_RECORDS).exists()   # the committed probe records


def _line(commit, date, ctxs, speed=1.0, backend="sm120_mla", **kw):
    return [_rec(backend, ctx, speed * 1000.0, commit, date, **kw) for ctx in ctxs]


def test_a_line_is_one_runs_where_one_run_measured_all_of_it():
    """A newer run that measured part of a line again does not split the line between runs (the H200
    DFlash line of sm120_mla took 4k from d19974a, 16k/64k from bf912d3, 128k from 89f64db): the
    newest run that measured every context keeps it; where none did, each point's newest, marked."""
    recs = (_line("aaaaaaa", "2026-12-01T10:00", (4096, 16384, 65536))
            + _line("bbbbbbb", "2026-12-02T10:00", (16384,), speed=1.5)
            + _line("bbbbbbb", "2026-12-02T10:00", (4096, 16384), backend="triton"))
    pts = sc.decode_points(pd.DataFrame(recs))
    ours = pts[pts["backend"] == "sm120_mla"]
    assert list(ours["commit"]) == ["aaaaaaa"] * 3 and list(ours["tok_s"]) == [1000.0] * 3
    assert not pts["other_run"].any() and set(pts.loc[pts["backend"] == "triton", "commit"]) == {"bbbbbbb"}
    # with every run's points, both runs stay
    assert len(sc.decode_points(pd.DataFrame(recs), every_run=True)) == 6
    # no run measured all three: each point's newest, those off the line's main run marked
    split = _line("aaaaaaa", "2026-12-01T10:00", (4096, 16384)) + _line("bbbbbbb", "2026-12-02T10:00", (16384, 65536))
    pts = sc.decode_points(pd.DataFrame(split)).set_index("ctx")
    assert pts["commit"].to_dict() == {4096: "aaaaaaa", 16384: "bbbbbbb", 65536: "bbbbbbb"}
    assert pts["other_run"].to_dict() == {4096: True, 16384: False, 65536: False}
    assert sc.decode_table(pts.reset_index())["other_run"].tolist() == [True, False, False]
    # two invocations at one commit are two runs: the one that measured the whole line keeps it
    inv = ([dict(r, invocation="i1") for r in _line("ccccccc", "2026-12-03T10:00", (4096, 16384, 65536))]
           + [dict(r, invocation="i2") for r in _line("ccccccc", "2026-12-03T11:00", (16384,), speed=1.5)])
    assert list(sc.decode_points(pd.DataFrame(inv))["tok_s"]) == [1000.0] * 3
    # the chart names each point's commit, and whether it is off its line's run
    tooltip = sc.decode_speed_chart(pts.reset_index()).to_dict()["spec"]["layer"][0]["encoding"]["tooltip"]
    assert {"commit", "other_run"} <= {t["field"] for t in tooltip}


def test_kv_sort_and_allreduce_fusion_are_point_keys():
    """b888adc's servers with SM120_KV_SORT=1 (2483-2642 tok/s) and without (2034-2349) are two
    points, named apart, and the override is never paired with an ordinary run."""
    assert {"kv_sort", "allreduce_fusion"} <= set(sc.POINT_KEYS)
    assert sc.KEY_DEFAULTS["kv_sort"] is False and sc.KEY_DEFAULTS["allreduce_fusion"] is False
    recs = ([_rec("sm120_mla", 4096, s, "b888adc", "2026-12-04T15:49", kv_sort=False, run_id="off", repeat=i)
             for i, s in enumerate((2318.6, 2348.1, 2034.5))]
            + [_rec("sm120_mla", 4096, s, "b888adc", "2026-12-04T15:51", kv_sort=True, run_id="on", repeat=i)
               for i, s in enumerate((2568.2, 2642.1, 2482.9))]
            + [_rec("triton", 4096, 1000.0, "b888adc", "2026-12-04T15:40")]                 # no key: off
            + [_rec(b, 4096, 900.0, "b888adc", "2026-12-04T16:00", tp=2, allreduce_fusion=True)
               for b in ("sm120_mla", "triton")])
    pts = sc.decode_points(pd.DataFrame(recs)).set_index("config")
    assert pts.loc["sm120_mla + ngram_tail", "tok_s"] == pytest.approx((2348.1 + 2034.5) / 2)
    assert pts.loc["sm120_mla + ngram_tail + kv_sort", "tok_s"] == pytest.approx((2642.1 + 2482.9) / 2)
    assert "sm120_mla TP2 + ngram_tail + allreduce_fusion" in pts.index
    assert pts.loc["sm120_mla + ngram_tail + kv_sort", "setup"].endswith("+ ngram_tail + kv_sort")
    sp = sc.speedup_over(sc.decode_points(pd.DataFrame(recs), every_run=True)).set_index("config")
    assert "sm120_mla + ngram_tail + kv_sort" not in sp.index                        # no triton with it
    assert sp.loc["sm120_mla + ngram_tail", "speedup"] == pytest.approx(2191.3 / 1000)
    assert sp.loc["sm120_mla TP2 + ngram_tail + allreduce_fusion", "speedup"] == pytest.approx(1.0)


def test_a_pair_within_one_invocation_is_the_same_run_and_wins_over_a_newer_one_of_its_commit():
    """Only records of one decode_bench call (its invocation) are "the same run"; records of one
    commit may come from two machines or sessions, and say "same commit"."""
    recs = ([_rec(b, 16384, s, "ccccccc", "2026-12-05T10:00", invocation="i1", run_id=f"i1-{b}")
             for b, s in (("sm120_mla", 1000.0), ("triton", 100.0))]
            + [_rec("sm120_mla", 16384, 1200.0, "ccccccc", "2026-12-05T12:00", invocation="i2", run_id="i2-a")]
            + [_rec("triton", 16384, 150.0, "ccccccc", "2026-12-05T13:00", invocation="i3", run_id="i3-a")])
    runs = sc.decode_points(pd.DataFrame(recs), every_run=True)
    assert len(runs) == 4   # a row per point and invocation
    sp = sc.speedup_over(runs).set_index("backend")
    assert sp.loc["sm120_mla", "speedup"] == pytest.approx(10.0) and sp.loc["sm120_mla", "pairing"] == "same run"
    row = sc.service_targets(runs).set_index("target").loc["ngram 16k: sm120_mla >= 4.3x triton"]
    assert row["pairing"] == "same run" and row["runs"] == "1 same-run pair"
    # without the invocation key: one commit, one pair, named so
    old = sc.decode_points(pd.DataFrame(recs).drop(columns="invocation"), every_run=True)
    row = sc.service_targets(old).set_index("target").loc["ngram 16k: sm120_mla >= 4.3x triton"]
    assert row["pairing"] == "same commit" and row["runs"] == "1 same-commit pair"
    assert "same run" not in set(sc.speedup_over(old)["pairing"])


def test_a_draft_pairs_with_triton_on_the_backend_it_ran_on():
    """b7c06f0 measured sm120_mla with its EAGLE draft kept on Triton (120.3 / 59.8 tok/s at 16k /
    64k) and triton (16.8 / 4.54), whose own draft runs on Triton: one pair, not "no triton point"."""
    e = dict(spec="eagle", draft_tokens=4, ngram_tail=False, layers=16, prefill_attention_backend="flashinfer",
             prefill_as_base=True)
    recs = pd.DataFrame(
        [_rec("sm120_mla", ctx, s, "b7c06f0", "2026-12-02T02:09", draft_attention_backend="triton", **e)
         for ctx, s in ((16384, 120.3), (65536, 59.8))]
        + [_rec("sm120_mla", ctx, s, "b7c06f0", "2026-12-02T02:05", **e) for ctx, s in ((16384, 177.0), (65536, 162.0))]
        + [_rec("triton", ctx, s, "b7c06f0", "2026-12-02T02:11", draft_attention_backend="triton", **e)
           for ctx, s in ((16384, 16.8), (65536, 4.54))]
        + [_rec("sm120_mla", 65536, 150.0, "b7c06f0", "2026-12-02T02:20", draft_attention_backend="flashinfer", **e)])
    t = sc.service_targets(sc.decode_points(recs, every_run=True))
    t = t[t["against"] == "triton"].set_index(["config", "ctx"])
    kept = "sm120_mla + flashinfer prefill as base + triton draft"
    assert t.loc[(kept, 16384), "measured"] == "120 vs 17 tok/s" and t.loc[(kept, 16384), "met"] is True
    assert t.loc[(kept, 65536), "ratio"] == pytest.approx(59.8 / 4.54, abs=0.01)
    assert t.loc[(kept.replace(" + triton draft", ""), 65536), "ratio"] == pytest.approx(162.0 / 4.54, abs=0.01)
    # a draft on a backend no triton point drafted on: the gap says which triton point is missing
    other = kept.replace("triton draft", "flashinfer draft")
    assert t.loc[(other, 65536), "pairing"] == "no triton point with a flashinfer draft"
    gaps = sc.target_gaps(t.reset_index()).set_index(["config", "missing"])["open targets"].to_dict()
    assert gaps == {(kept, "sm120_mla point"): "eagle 4k vs triton",
                    (kept.replace(" + triton draft", ""), "sm120_mla point"): "eagle 4k vs triton",
                    (other, "sm120_mla point"): "eagle 4k/16k vs triton",
                    (other, "triton point with a flashinfer draft"): "eagle 64k vs triton"}


def test_medians_leave_out_a_repeated_servers_first_request_and_take_each_server_first():
    """A server that repeated a request leaves its first out (repeat 0: at times 7-9% slower); the
    point is the median of its servers' medians, so a server with more requests does not outvote
    another; `requests` counts the requests the medians are over, `n_runs` the servers."""
    def req(ctx, tok_s, server, rep, step=1.0):
        return _rec("sm120_mla", ctx, tok_s, "ddddddd", "2026-12-05T10:00", run_id=server, repeat=rep,
                    verify_step_ms=step)

    recs = ([req(4096, s, "A", i) for i, s in enumerate((500.0, 90.0, 100.0, 100.0, 180.0))]   # median 100
            + [req(4096, s, "B", i) for i, s in enumerate((20.0, 300.0))]                      # 300
            + [req(4096, 310.0, "C", 0)]                                                        # one request: kept
            # one server: the median of its repeats 1-3 (1.0), not their mean (2.0) nor with repeat 0 (2.5)
            + [req(16384, 100.0, "D", i, step=s) for i, s in enumerate((9.0, 1.0, 1.0, 4.0))])
    pts = sc.decode_points(pd.DataFrame(recs)).set_index("ctx")
    # servers' medians 100 / 300 / 310: 300 (their mean: 237; all requests pooled: 140)
    assert pts.loc[4096, "tok_s"] == 300.0
    assert pts.loc[16384, "verify_step_ms"] == 1.0
    assert pts.loc[4096, ["requests", "n_runs"]].tolist() == [6, 3]
    assert pts.loc[16384, ["requests", "n_runs"]].tolist() == [3, 1]
    assert "runs" not in pts and list(sc.decode_table(pts.reset_index()).columns) == [
        "config", "spec", "ctx_label", "tok_s", "accept_len", "verify_step_ms", "requests", "n_runs", "commit",
        "other_run"]


def test_the_newest_commit_is_the_newest_by_date():
    """Commit aaaaaaa at t1 and t3, bbbbbbb at t2: the newest is aaaaaaa, whatever the order in which
    each first appears, and dates spelt with and without an offset compare."""
    df = pd.DataFrame([_rec("triton", 4096, 1.0, "aaaaaaa111", "2026-12-01T10:00:00+00:00"),
                       _rec("triton", 4096, 1.0, "bbbbbbb222", "2026-12-02T10:00"),
                       _rec("triton", 4096, 1.0, "aaaaaaa111", "2026-12-03T10:00:00+00:00")])
    assert sc.source_label(df, live=False) == "recorded: H200; 2 commits, newest aaaaaaa; 2026-12-01..2026-12-03"
    assert sc.source_label(df.iloc[[1, 0]], live=False).startswith("recorded: H200; 2 commits, newest bbbbbbb")
    from sm120_workbook.results import describe_provenance

    many = pd.concat([df, pd.DataFrame([_rec("triton", 4096, 1.0, c, "2026-11-30T10:00") for c in ("ccc", "ddd")])])
    assert "commits=4 (newest aaaaaaa111)" in describe_provenance(many)


def test_speedups_set_the_step_time_ratio_beside_the_tok_s_ratio():
    """NGRAM's acceptance differs between backends on one prompt, so tok/s ratios move with it; the
    verify step's time ratio does not."""
    recs = pd.DataFrame([_rec("sm120_mla", 16384, 1000.0, "eeeeeee", "2026-12-05T10:00", verify_step_ms=1.0,
                              accept_len=6.0),
                         _rec("triton", 16384, 500.0, "eeeeeee", "2026-12-05T10:00", verify_step_ms=1.5,
                              accept_len=4.0)])
    sp = sc.speedup_over(sc.decode_points(recs, every_run=True))
    t = sc.speedup_table(sp[sp["backend"] != "triton"])
    assert list(t.columns) == ["config", "spec", "ctx_label", "tok_s", "base_tok_s", "speedup", "step_speedup",
                               "commit", "base_commit"]
    assert t[["speedup", "step_speedup"]].values.tolist() == [[2.0, 1.5]]
    tooltip = sc.speedup_chart(sp).to_dict()["spec"]["layer"][0]["layer"][0]["encoding"]["tooltip"]
    assert "step_speedup" in {t["field"] for t in tooltip}
