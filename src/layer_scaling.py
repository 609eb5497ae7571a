"""Step time against layer count: what a few-layer dummy model says about K2's 61 layers.

A decode or verify step of SGLang is work that does not depend on the model's depth (the
scheduler, sampling, NGRAM's draft search, the LM head) plus one forward pass of each
decoder layer. The same configuration measured at two or more layer counts splits the two
by least squares, step_ms = fixed_ms + per_layer_ms * layers, and the fit's step at K2's 61
layers is a projection: labelled so wherever it is shown, never mixed with measured points.
Tokens per step are taken as measured (dummy weights: they do not depend on depth here), as
tok/s x step time: the decode tokens a step adds, which is SGLang's accept length less the
first token's share (accept_len counts the token the prefill made; tok/s does not).

    from sm120_workbook.layer_scaling import fit_layer_scaling, holdout_check, line_points, projected_speedup
    lines = line_points(decode_points(records, every_run=True))   # one run's line where one run has it
    fit = fit_layer_scaling(lines)
    holdout_check(lines, held_out=24)   # does the line predict a depth it never saw?
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .dummy_models import K2_LAYERS
from .service_charts import POINT_KEYS, chart_title, ctx_label, draft_tokens_differ, label_of, one_run_per_line

# A configuration is a point less its layer count.
CONFIG_KEYS = [k for k in POINT_KEYS if k != "layers"]


def line_points(run_points: pd.DataFrame) -> pd.DataFrame:
    """The points each configuration's line is fitted on, from decode_points(..., every_run=True):
    service_charts.one_run_per_line along the layer count. Where one run (commit, and invocation
    where recorded) measured the configuration at every layer count the records hold, the newest
    such run's points, so that the line joins points of one kernel, machine and session: a newer
    run at one layer count does not displace them, since a line through two sessions reads their
    difference in load as a per-layer cost. Otherwise each layer count's newest run (`other_run`
    marks the points off the line's main run), and the fit's `commits` column names the runs."""
    need = set(CONFIG_KEYS) | {"layers", "commit", "date"}
    missing = need - set(run_points.columns)
    if missing:
        raise ValueError(f"run_points: missing columns {sorted(missing)}")
    return one_run_per_line(run_points, CONFIG_KEYS, "layers")


def fit_layer_scaling(points: pd.DataFrame, project_to: int = K2_LAYERS) -> pd.DataFrame:
    """One row per configuration measured at two or more layer counts: the least-squares
    fixed and per-layer step time, and the projected step and tok/s at `project_to` layers.
    `config` names the decode tokens where the fitted configurations hold more than one, and
    the draft tokens where configurations otherwise alike differ in them (as decode_points)."""
    need = set(CONFIG_KEYS) | {"layers", "verify_step_ms", "accept_len", "tok_s"}
    missing = need - set(points.columns)
    if missing:
        raise ValueError(f"points: missing columns {sorted(missing)}")
    if project_to < 1:
        raise ValueError(f"project_to: must be a positive layer count, got {project_to}")
    rows = []
    for key, g in points.groupby(CONFIG_KEYS, dropna=False):
        layers = g["layers"].astype(float).to_numpy()
        if len(np.unique(layers)) < 2:
            continue
        steps = g["verify_step_ms"].astype(float).to_numpy()
        per_layer, fixed = np.polyfit(layers, steps, 1)
        # With three or more layer counts the line can miss: its worst miss, in % of the step.
        residual = (np.abs(steps - (fixed + per_layer * layers)) / steps).max() * 100 \
            if len(np.unique(layers)) > 2 else float("nan")
        accept = float(g["accept_len"].median())
        tokens_per_step = float((g["tok_s"].astype(float) * steps / 1e3).median())
        step = fixed + per_layer * project_to
        r = dict(zip(CONFIG_KEYS, key))
        # The commits behind the line: points re-measured with newer code replace older ones
        # (decode_points), so one line can span two kernel versions; the table says so.
        commits = "/".join(sorted(set(g["commit"].astype(str)))) if "commit" in g else "?"
        rows.append({**r, "ctx_label": ctx_label(int(r["ctx"])), "layers_measured": sorted(int(x) for x in set(layers)),
                     "commits": commits,
                     "fixed_ms": fixed, "per_layer_ms": per_layer, "max_residual_pct": residual,
                     "accept_len": accept,
                     "projected_layers": project_to, "projected_step_ms": step,
                     "projected_tok_s": 1e3 * tokens_per_step / step if step > 0 else float("nan")})
    fit = pd.DataFrame(rows)
    if len(fit) == 0:
        return fit
    decode_tokens = fit["decode_tokens"].nunique() > 1
    drafts = draft_tokens_differ(fit, CONFIG_KEYS)
    fit.insert(len(CONFIG_KEYS), "config", [label_of(r, decode_tokens=decode_tokens, draft_tokens=d)
                                            for r, d in zip(fit.to_dict("records"), drafts)])
    return fit


def holdout_check(points: pd.DataFrame, held_out: int) -> pd.DataFrame:
    """How well the line predicts a layer count it was not fitted on: for each configuration
    measured at `held_out` layers and at two or more others, the step fitted without the
    held-out points against the one measured there (error in % of the measured step)."""
    if "layers" not in points.columns:
        raise ValueError("points: missing column 'layers'")
    held = points[points["layers"] == held_out]
    if len(held) == 0:
        raise ValueError(f"held_out: no point was measured at {held_out} layers")
    fit = fit_layer_scaling(points[points["layers"] != held_out], project_to=held_out)
    if len(fit) == 0:
        return pd.DataFrame(columns=["config", "spec", "ctx_label", "fitted_on", "predicted_ms", "measured_ms",
                                     "error_pct"])
    m = fit.merge(held[CONFIG_KEYS + ["verify_step_ms"]], on=CONFIG_KEYS, how="inner")
    out = pd.DataFrame({"config": m["config"], "spec": m["spec"], "ctx_label": m["ctx_label"], "ctx": m["ctx"],
                        "fitted_on": m["layers_measured"].map(lambda ls: "/".join(map(str, ls))),
                        "predicted_ms": m["projected_step_ms"], "measured_ms": m["verify_step_ms"]})
    out["error_pct"] = 100 * (out["predicted_ms"] - out["measured_ms"]) / out["measured_ms"]
    return (out.sort_values(["spec", "config", "ctx"]).drop(columns="ctx")
            .round({"predicted_ms": 2, "measured_ms": 2, "error_pct": 1}).reset_index(drop=True))


def projected_speedup(fit: pd.DataFrame, baseline: str = "triton") -> pd.DataFrame:
    """Projected tok/s of each backend over the baseline's, matched on every other key."""
    if len(fit) == 0:
        raise ValueError("fit: no configuration was measured at two layer counts")
    keys = [k for k in CONFIG_KEYS if k != "backend"]
    base = fit[fit["backend"] == baseline][keys + ["projected_tok_s"]].rename(
        columns={"projected_tok_s": "base_projected_tok_s"})
    if len(base) == 0:
        raise ValueError(f"fit: no rows of the baseline backend {baseline!r}")
    m = fit[fit["backend"] != baseline].merge(base, on=keys, how="inner")
    m["projected_speedup"] = m["projected_tok_s"] / m["base_projected_tok_s"]
    return m


def scaling_table(fit: pd.DataFrame) -> pd.DataFrame:
    """The compact table a notebook prints (rounded, deterministic order)."""
    cols = ["config", "spec", "ctx_label", "layers_measured", "commits", "fixed_ms", "per_layer_ms", "max_residual_pct",
            "projected_step_ms", "projected_tok_s"]
    t = fit.sort_values(["spec", "backend", "ctx"])[cols].copy()
    t["layers_measured"] = t["layers_measured"].map(lambda ls: "/".join(map(str, ls)))
    return t.round({"fixed_ms": 2, "per_layer_ms": 3, "max_residual_pct": 1, "projected_step_ms": 1,
                    "projected_tok_s": 1}).reset_index(drop=True)


def fitted_points(points: pd.DataFrame, fit: pd.DataFrame, spec: str = "ngram") -> pd.DataFrame:
    """The measured points layer_scaling_chart draws for `spec`: those of the fitted
    configurations, named as the fit names them, at every context a panel shows (a
    configuration's label does not depend on its context). Their provenance is the chart's."""
    f = fit[fit["spec"] == spec]
    same = [k for k in CONFIG_KEYS if k != "ctx"]
    return (points[(points["spec"] == spec) & points["ctx"].isin(f["ctx"])].drop(columns="config", errors="ignore")
            .merge(f[same + ["config"]].drop_duplicates(), on=same))


def layer_scaling_chart(points: pd.DataFrame, fit: pd.DataFrame, spec: str = "ngram", title: str = "",
                        source: str = ""):
    """Step ms against layer count for one spec mode: measured points, and the fitted line
    out to the projected layer count (dashed), one panel per context; `source`
    (service_charts.source_label) says whether the points are recorded or live."""
    import altair as alt

    f = fit[fit["spec"] == spec]
    if len(f) == 0:
        raise ValueError(f"fit: no configuration of spec {spec!r} was measured at two layer counts")
    top = int(f["projected_layers"].max())
    lines = pd.DataFrame([{"config": r.config, "ctx_label": r.ctx_label, "ctx": r.ctx, "layers": n,
                           "step_ms": r.fixed_ms + r.per_layer_ms * n}
                          for r in f.itertuples() for n in range(1, top + 1)])   # curved on a log axis
    p = fitted_points(points, fit, spec).rename(columns={"verify_step_ms": "step_ms"})
    data = pd.concat([lines.assign(kind="fit"),
                      p[["config", "ctx_label", "ctx", "layers", "step_ms"]].assign(kind="measured")])
    color = alt.Color("config:N", title="attention backend", legend=alt.Legend(labelLimit=360))
    x = alt.X("layers:Q", title="decoder layers", scale=alt.Scale(domain=[1, top]))
    y = alt.Y("step_ms:Q", title="step (ms)", scale=alt.Scale(type="log"))
    base = alt.Chart().encode(x=x, y=y, color=color)
    fitted = base.mark_line(strokeDash=[5, 3]).transform_filter(alt.datum.kind == "fit")
    measured = base.mark_point(filled=True, size=50).transform_filter(alt.datum.kind == "measured").encode(
        tooltip=["config", "ctx_label", "layers", alt.Tooltip("step_ms:Q", format=".2f")])
    order = [ctx_label(c) for c in sorted(f["ctx"].unique())]
    return (alt.layer(fitted, measured, data=data).properties(width=200, height=200)
            .facet(column=alt.Column("ctx_label:N", title=None, sort=order))
            .properties(title=chart_title(title or f"Step time against layer count ({spec}): measured, and the "
                                                   f"fitted line out to {top} layers (a projection)", source)))
