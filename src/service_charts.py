"""Tables and charts of live-service records: decode speed against context, speedup over the
Triton backend, and the NVML / expert-load records turned back into tidy frames.

The same functions serve a live run (records in memory) and recorded results (data/results/).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

# A point is one configuration: records differing in any of these are never pooled or paired.
# expert_record (the recorder costs time on every forward) and ngram_tail (the host-side NGRAM
# fix, patches/ngram_tail.py) change the step time without changing the kernel.
POINT_KEYS = ["gpu", "model", "layers", "tp", "weights", "backend", "spec", "draft_tokens", "ctx",
              "expert_record", "ngram_tail"]
_FLAG_KEYS = ("expert_record", "ngram_tail")   # booleans; absent in older records: False
SPEC_TITLES = {"none": "no speculation", "dflash": "DFlash (dummy draft)", "ngram": "NGRAM"}


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def _need(df, cols, name="df"):
    if df is None or len(df) == 0:
        raise ValueError(f"{name}: no rows")
    missing = set(cols) - set(df.columns)
    if missing:
        raise ValueError(f"{name}: missing columns {sorted(missing)}")


def decode_points(df):
    """One row per measured point: median over repeats of tok/s, accept length and step time,
    from the newest commit that measured the point."""
    _need(df, ["backend", "spec", "ctx", "tok_s", "accept_len", "verify_step_ms"])
    d = df.copy()
    for k in _FLAG_KEYS:
        d[k] = d[k].fillna(False).astype(bool) if k in d else False
    for k in POINT_KEYS:
        if k not in d.columns:
            d[k] = "?"
    d["draft_tokens"] = d["draft_tokens"].fillna(0).astype(int)
    # A point measured again with newer code (a faster kernel) is that code's: keep the newest
    # commit's records of each point, and repeats within it.
    if "commit" in d and "date" in d:
        d["commit"] = d["commit"].fillna("?").astype(str).str[:7]
        # (two runs on one machine append in turn, so the file is not in date order)
        newest = d.sort_values("date").groupby(POINT_KEYS, dropna=False)["commit"].transform("last")
        d = d[d["commit"] == newest.reindex(d.index)]
    else:
        d["commit"] = "?"
    agg = (d.groupby(POINT_KEYS, dropna=False)
             .agg(tok_s=("tok_s", "median"), accept_len=("accept_len", "median"),
                  verify_step_ms=("verify_step_ms", "median"), runs=("tok_s", "size"),
                  commit=("commit", "first"))
             .reset_index())
    agg["ctx_label"] = agg["ctx"].map(ctx_label)
    agg["spec_title"] = agg["spec"].map(lambda s: SPEC_TITLES.get(s, s))
    # the layer count joins the label only where the records hold more than one
    show_layers = agg["layers"].nunique() > 1
    agg["config"] = [config_label(r.backend, r.expert_record, r.ngram_tail, r.tp, r.layers if show_layers else None)
                     for r in agg.itertuples()]
    return agg.sort_values(["backend", "spec", "ctx"]).reset_index(drop=True)


def tp_of(value) -> int | None:
    """A record's tp as an int (records may hold 2, 2.0 or "2"); None where unknown."""
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def select_tp(df, tp: int = 1):
    """The rows of records or points measured with `tp` GPUs per server."""
    return df[df["tp"].map(tp_of) == tp]


def config_label(backend: str, expert_record: bool = True, ngram_tail: bool = False, tp=1, layers=None) -> str:
    """How charts and tables name a configuration: the backend, plus what differs from the
    usual run (one GPU, expert recorder on, SGLang's NGRAM draft prep unpatched), and the
    model's layer count when given."""
    n = tp_of(tp)
    return (backend + (f" TP{n}" if n not in (None, 1) else "") + (f", {int(layers)} layers" if layers is not None else "")
            + ("" if expert_record else " (recorder off)") + (" + ngram_tail" if ngram_tail else ""))


def speedup_over(points, baseline: str = "triton"):
    """tok/s of each backend divided by the baseline backend's at the same point."""
    _need(points, POINT_KEYS + ["tok_s"], "points")
    keys = [k for k in POINT_KEYS if k != "backend"]
    carry = ["tok_s"] + (["commit"] if "commit" in points else [])
    base = points[points["backend"] == baseline][keys + carry].rename(
        columns={"tok_s": "base_tok_s", "commit": "base_commit"})
    if len(base) == 0:
        raise ValueError(f"points: no rows of the baseline backend {baseline!r}")
    m = points.merge(base, on=keys, how="inner")
    m["speedup"] = m["tok_s"] / m["base_tok_s"]
    return m


def speedup_table(sp):
    """Speedups as a table, with the commit of each side: points of different commits come
    from separate server runs (e.g. a newer kernel against an older baseline run)."""
    cols = [c for c in ("config", "spec", "ctx_label", "tok_s", "base_tok_s", "speedup", "commit", "base_commit")
            if c in sp]
    t = sp[cols].copy()
    return t.round({"tok_s": 1, "base_tok_s": 1, "speedup": 2}).reset_index(drop=True)


# The live-service issue's targets at TP1 with speculation on: sm120_mla over triton.
SPEEDUP_TARGETS = {4096: 3.0, 16384: 4.3, 65536: 6.1}


def service_targets(points, ours: str = "sm120_mla", baseline: str = "triton", tp: int = 1) -> pd.DataFrame:
    """The service targets, measured at `tp` GPUs per server (the issue's are at TP1): `ours`
    over `baseline` with speculation at each target context (pairs matched on every point key,
    as speedup_over does), and `ours` with speculation against `ours` without it wherever both
    were measured on the same model and GPU. A target with a side missing reads "not measured"
    (met None), never "missed"; the commits say when the two sides come from separate runs."""
    _need(points, POINT_KEYS + ["tok_s"], "points")
    pts = select_tp(points, tp)
    pts = pts if "commit" in pts else pts.assign(commit="?")
    rows = []

    def row(target, a, b, ratio, met):
        return {"target": target, "config": a.config, "measured": f"{a.tok_s:.0f} vs {b:.0f} tok/s",
                "ratio": round(ratio, 2), "met": bool(met), "commits": f"{a.commit} / {a.base_commit}"}

    sp = speedup_over(pts, baseline) if (pts["backend"] == baseline).any() else None
    for spec in [s for s in pts["spec"].unique() if s != "none"]:
        for ctx, need in SPEEDUP_TARGETS.items():
            target = f"{spec} {ctx_label(ctx)}: {ours} >= {need:g}x {baseline}"
            pairs = [] if sp is None else list(
                sp[(sp["backend"] == ours) & (sp["spec"] == spec) & (sp["ctx"] == ctx)].itertuples())
            rows += [row(target, r, r.base_tok_s, r.speedup, r.speedup >= need) for r in pairs] or [
                {"target": target, "config": "", "measured": "not measured", "ratio": float("nan"), "met": None,
                 "commits": ""}]
        # speculation against plain decode: the same point but for spec and its draft tokens
        keys = [k for k in POINT_KEYS if k not in ("spec", "draft_tokens")]
        mine = pts[pts["backend"] == ours]
        plain = mine[mine["spec"] == "none"][keys + ["tok_s", "commit"]].rename(
            columns={"tok_s": "base_tok_s", "commit": "base_commit"})
        both = mine[mine["spec"] == spec].merge(plain, on=keys, how="inner").sort_values("ctx")
        for r in both.itertuples():
            rows.append(row(f"{spec} {ctx_label(r.ctx)}: {ours} speculation >= plain decode", r, r.base_tok_s,
                            r.tok_s / r.base_tok_s, r.tok_s >= r.base_tok_s))
    out = pd.DataFrame(rows, columns=["target", "config", "measured", "ratio", "met", "commits"])
    out["met"] = out["met"].astype(object)
    return out


def decode_table(points):
    """The compact table a notebook prints (rounded, deterministic order)."""
    cols = ["config", "spec", "ctx_label", "tok_s", "accept_len", "verify_step_ms", "runs", "commit"]
    t = points[cols].copy()
    return t.round({"tok_s": 1, "accept_len": 2, "verify_step_ms": 2})


def _spec_order(d) -> list[str]:
    present = set(d["spec_title"])
    return [t for t in SPEC_TITLES.values() if t in present] + sorted(present - set(SPEC_TITLES.values()))


def decode_speed_chart(points, title: str = ""):
    """Decode tok/s against context (log-log), one line per backend, one panel per spec mode."""
    import altair as alt

    _need(points, ["config", "spec_title", "ctx", "tok_s", "ctx_label"], "points")
    ticks = sorted(points["ctx"].unique().tolist())
    base = alt.Chart(points).encode(
        x=alt.X("ctx:Q", title="context (tokens)", scale=alt.Scale(type="log", base=2),
                axis=alt.Axis(values=ticks, labelExpr="datum.value >= 1024 ? datum.value / 1024 + 'k' : datum.value")),
        y=alt.Y("tok_s:Q", title="decode tok/s (batch 1)", scale=alt.Scale(type="log")),
        color=alt.Color("config:N", title="attention backend", scale=alt.Scale(scheme="tableau20"),
                        legend=alt.Legend(labelLimit=360)),
        tooltip=["config", "spec", "ctx_label", alt.Tooltip("tok_s:Q", format=".1f"),
                 alt.Tooltip("accept_len:Q", format=".2f"), alt.Tooltip("verify_step_ms:Q", format=".2f")])
    return ((base.mark_line() + base.mark_point(filled=True))
            .properties(width=260, height=220)
            .facet(column=alt.Column("spec_title:N", title=None, sort=_spec_order(points)))
            .properties(title=title or "Decode speed against context length"))


def speedup_chart(speedups, baseline: str = "triton", title: str = ""):
    """Speedup over the baseline backend against context, one panel per spec mode."""
    import altair as alt

    _need(speedups, ["config", "backend", "spec_title", "ctx", "speedup"], "speedups")
    d = speedups[speedups["backend"] != baseline]
    if len(d) == 0:
        raise ValueError(f"speedups: only the baseline backend {baseline!r} was measured")
    ticks = sorted(d["ctx"].unique().tolist())
    base = alt.Chart(d).encode(
        x=alt.X("ctx:Q", title="context (tokens)", scale=alt.Scale(type="log", base=2),
                axis=alt.Axis(values=ticks, labelExpr="datum.value >= 1024 ? datum.value / 1024 + 'k' : datum.value")),
        y=alt.Y("speedup:Q", title=f"tok/s ÷ {baseline} tok/s (log)", scale=alt.Scale(type="log")),
        color=alt.Color("config:N", title="attention backend", scale=alt.Scale(scheme="tableau20"),
                        legend=alt.Legend(labelLimit=360)),
        tooltip=["config", "spec", "ctx_label", alt.Tooltip("speedup:Q", format=".2f")])
    rule = alt.Chart().mark_rule(color="gray", strokeDash=[4, 3]).encode(y=alt.datum(1.0))
    return (alt.layer(base.mark_line() + base.mark_point(filled=True), rule, data=d)
            .properties(width=260, height=200)
            .facet(column=alt.Column("spec_title:N", title=None, sort=_spec_order(d)))
            .properties(title=title or f"Speedup over the {baseline} backend"))


def nvml_samples(records):
    """Tidy (t, gpu, metric, value, backend, spec, ctx, run_id) from NVML records (arrays per row)."""
    import pandas as pd

    _need(records, ["nvml_gpu", "metric", "t", "value"], "records")
    rows = []
    for r in records.itertuples(index=False):
        r = r._asdict()
        for t, v in zip(r["t"], r["value"]):
            rows.append((t, r["nvml_gpu"], r["metric"], v, r.get("backend"), r.get("spec"),
                         r.get("ctx"), r.get("run_id")))
    return pd.DataFrame(rows, columns=["t", "gpu", "metric", "value", "backend", "spec", "ctx", "run_id"])


def pick_point(df, backend: str | None = None, spec: str | None = None, ctx: int | None = None,
               most_gpus: bool = False) -> dict:
    """The (backend, spec, ctx, run_id) to show in single-point charts: the longest context of
    the given (or first) backend and spec, latest run; with `most_gpus`, among the runs of the
    largest recorded tp (per-GPU charts show most with most GPUs)."""
    _need(df, ["backend", "spec", "ctx", "run_id"])
    d = df
    if most_gpus and "tp" in d.columns:
        tp = d["tp"].map(tp_of)
        d = d[tp == tp.max()] if tp.notna().any() else d
    if backend is not None and (d["backend"] == backend).any():
        d = d[d["backend"] == backend]
    if spec is not None and (d["spec"] == spec).any():
        d = d[d["spec"] == spec]
    if ctx is not None and (d["ctx"] == ctx).any():
        d = d[d["ctx"] == ctx]
    d = d.sort_values(["ctx", "run_id"])
    last = d.iloc[-1]
    return {"backend": last["backend"], "spec": last["spec"], "ctx": int(last["ctx"]), "run_id": last["run_id"]}


def select_point(df, point: dict):
    m = np.ones(len(df), dtype=bool)
    for k, v in point.items():
        if k in df.columns:
            m &= (df[k] == v).to_numpy()
    return df[m]


def load_service_results(model: str | None = None, gpu: str | None = None) -> dict:
    """Recorded live-service results from data/results/ as DataFrames, filtered to `model` and
    to the GPUs whose name contains `gpu` (an H200 point and an RTX PRO 6000 one share a
    configuration label, so one view is one GPU's).

    Keys: decode, nvml, expert, failures, profiles (empty frames where nothing is recorded).
    """
    from .decode_bench import DECODE_RESULTS, EXPERT_RESULTS, FAILURE_RESULTS, NVML_RESULTS, PROFILE_RESULTS
    from .results import load_records, on_gpu

    out = {}
    for key, name in (("decode", DECODE_RESULTS), ("nvml", NVML_RESULTS), ("expert", EXPERT_RESULTS),
                      ("failures", FAILURE_RESULTS), ("profiles", PROFILE_RESULTS)):
        df = load_records(name)
        if model is not None and len(df) and "model" in df.columns:
            df = df[df["model"] == model].reset_index(drop=True)
        if gpu is not None:
            df = df[on_gpu(df, gpu)].reset_index(drop=True)
        out[key] = df
    return out


def live_results(result) -> dict:
    """The same dict of DataFrames from a live run_matrix result."""
    import pandas as pd

    return {"decode": pd.DataFrame(result.decode), "nvml": pd.DataFrame(result.nvml),
            "expert": pd.DataFrame(result.expert), "failures": pd.DataFrame(result.failures),
            "profiles": pd.DataFrame(result.profiles)}


def failure_cause(log_tail) -> str:
    """The line of a server's log tail that names why it failed: the last one that names an
    error (an OOM, a CUDA fault), else the last line; "" without a tail."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()] if isinstance(log_tail, str) else []
    named = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (named or lines or [""])[-1][:120]


def failures_table(failures):
    """Recorded configurations that did not run: backend, spec, status, the client's error and,
    where the server's log was kept, the line of it that names the cause."""
    cols = [c for c in ("backend", "spec", "layers", "status", "error") if c in failures.columns]
    t = failures[cols].copy()
    if "error" in t:   # the first line: the log path and tail follow in the record
        t["error"] = t["error"].astype(str).str.split("\n").str[0].str.replace(r" \(log: .*\)$", "", regex=True)
    t["cause in the server log"] = [failure_cause(x) for x in failures.get("log_tail", [None] * len(failures))]
    return t
