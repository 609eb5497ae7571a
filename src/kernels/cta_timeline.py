"""Where a call's fixed part goes, CTA by CTA, from %globaltimer stamps.

    python -m sm120_workbook.kernels.cta_timeline --heads 8 --q-len 16 --ctx 4096

builds the kernels with CTA_TIMELINE (one thread of every CTA of the attention kernel, the
64-row kernel or with --cta-rows 32 the split kernel that serves decode, and of the combine step
stamps its milestones; mla_verify.cuh), replays one call's CUDA graph after an L2
flush several times, and prints when the milestones fall (the first, median and last CTA, in
us after the first attention CTA started) and how long each CTA spends between them (median
and slowest CTA), each the median over the replays. The phase trace (phase_trace.py) says
what a round of the loop costs; this says what the call costs around the loop: the launch
ramp, the prologue's dependent loads, the first tiles after a flush, the epilogue, the gap
to the combine step and the combine step's own chain.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from ..results import NotRecorded, add_record_args

TIMELINE_DEFINE = "CTA_TIMELINE"
# Event slots (TimelineEvent in mla_verify.cuh) and what each kernel stamps in them.
# In the order they fall. Slots 6 and 7 split the prologue (session 12; absent from older records).
MILESTONES = {
    "attention": {0: "entry", 6: "indptr read", 7: "Q requested", 1: "indices staged", 2: "tile 0 landed",
                  3: "tile 1 landed", 4: "loop end", 5: "exit"},
    "combine": {0: "entry", 1: "weights ready", 5: "exit"},
}
# Spans of one CTA: (kernel, name, from slot, to slot). The names are v17e's, as recorded: since
# v18 (WIDE_Q_SMEM) Q arrives with the indices, so "indices staged" and the prologue include
# Q, and the first tile no longer waits for it. In the split kernel since v24 (SPLIT_Q_SMEM) "Q
# requested" is stamped once the fragments are in registers: Q's arrival, not its request.
SPANS = (
    ("attention", "prologue (indptr, indices)", 0, 1),
    ("attention", "indptr reads", 0, 6),
    ("attention", "Q and indices arrive", 7, 1),
    ("attention", "first tile (copies, Q)", 1, 2),
    ("attention", "round 0", 2, 3),
    ("attention", "loop", 2, 4),
    ("attention", "epilogue", 4, 5),
    ("combine", "LSE pass", 0, 1),
    ("combine", "merge", 1, 5),
)
KERNELS = ("attention", "combine")


def _check(stamps: np.ndarray) -> np.ndarray:
    stamps = np.asarray(stamps, dtype=np.int64)
    if stamps.ndim != 3 or stamps.shape[0] != 2 or stamps.shape[2] < 6:
        raise ValueError(f"stamps: expected [2 kernels, CTAs, at least 6 events], got shape {stamps.shape}")
    if not (stamps[0, :, 0] > 0).any():
        raise ValueError("stamps: no attention CTA stamped its entry (was the build made with CTA_TIMELINE?)")
    return stamps


def milestone_table(stamps) -> pd.DataFrame:
    """When each milestone falls, in us after the first attention CTA's entry: the first, median
    and last CTA to reach it, and how many CTAs did. A CTA that exits early (an empty split, a
    request shorter than max_q_len) reaches only its entry and exit."""
    stamps = _check(stamps)
    t0 = stamps[0, :, 0][stamps[0, :, 0] > 0].min()
    rows = []
    for k, kernel in enumerate(KERNELS):
        for slot, name in MILESTONES[kernel].items():
            if slot >= stamps.shape[2]:
                continue
            t = stamps[k, :, slot]
            t = (t[t > 0] - t0) / 1e3
            if len(t):
                rows.append({"kernel": kernel, "milestone": name, "ctas": len(t), "first_us": float(t.min()),
                             "median_us": float(np.median(t)), "last_us": float(t.max())})
    return pd.DataFrame(rows)


def span_table(stamps) -> pd.DataFrame:
    """How long each CTA spends between two milestones (us): the median and the slowest CTA,
    over the CTAs that reached both."""
    stamps = _check(stamps)
    rows = []
    for kernel, name, a, b in SPANS:
        s = stamps[KERNELS.index(kernel)]
        if max(a, b) >= s.shape[1]:
            continue
        ok = (s[:, a] > 0) & (s[:, b] > 0)
        if ok.any():
            d = (s[ok, b] - s[ok, a]) / 1e3
            rows.append({"kernel": kernel, "span": name, "ctas": int(ok.sum()), "median_us": float(np.median(d)),
                         "max_us": float(d.max())})
    return pd.DataFrame(rows)


def resolution_ns(stamps) -> int:
    """The timer's step: the smallest nonzero gap between any two stamps (%globaltimer ticks
    in 32 ns on recent GPUs, 1 us on some older drivers; a table finer than that means nothing)."""
    t = np.unique(np.asarray(stamps, dtype=np.int64).ravel())
    t = t[t > 0]
    return int(np.diff(t).min()) if len(t) > 1 else 0


def median_over(tables: list[pd.DataFrame], keys: list[str]) -> pd.DataFrame:
    """The median of each numeric column over tables of the same rows (one per replay)."""
    if not tables:
        raise ValueError("tables: none to take a median of")
    cat = pd.concat(tables)
    return cat.groupby(keys, sort=False).median(numeric_only=True).reset_index()


def recorded_table(df=None, heads: int = 8, q_len: int = 16, ctx: int = 4096, versions=None,
                   kind: str = "milestone", cta_rows: int = 64, gpu: str = "H200") -> pd.DataFrame:
    """Recorded timelines of one shape side by side (data/results/kernel_timeline.jsonl): one row
    per milestone (kind="milestone": when the median CTA reaches it, us after the first attention
    CTA's entry) or per span (kind="span": the median CTA's us between two milestones), one
    column per kernel version (default: every version recorded for the shape, oldest first),
    from the newest record of each. Only builds without extra defines are compared, and only
    timelines of one attention kernel (`cta_rows`: 64, or 32 for the split kernel), on a GPU
    whose name contains `gpu`."""
    from ..results import load_records, on_gpu, source_label

    df = load_records("kernel_timeline") if df is None else df
    if len(df) == 0:
        return pd.DataFrame()
    if kind not in ("milestone", "span"):
        raise ValueError(f"kind: 'milestone' or 'span', got {kind!r}")
    rows = df["cta_rows"].fillna(64) if "cta_rows" in df else pd.Series(64, index=df.index)
    df = df[(df["heads"] == heads) & (df["q_len"] == q_len) & (df["ctx"] == ctx) & (df["kind"] == kind)
            & (df["defines"].map(len) == 0) & (rows == cta_rows) & on_gpu(df, gpu)].sort_values("date")
    if versions is None:
        versions = list(dict.fromkeys(df["kernel_version"]))
    missing = [v for v in versions if v not in set(df["kernel_version"])]
    if missing:
        raise NotRecorded(f"versions: no {kind} timeline recorded as {missing[0]!r} for h{heads} q{q_len} ctx {ctx} on {gpu}")
    newest = df[df["kernel_version"].isin(versions)].groupby(["kernel_version", "kernel", kind]).tail(1)
    # the kind column holds the milestone or span name; known ones in the order they fall
    known = ([(k, m) for k in KERNELS for m in MILESTONES[k].values()] if kind == "milestone"
             else [(k, name) for k, name, _, _ in SPANS])
    order = sorted(dict.fromkeys(zip(df["kernel"], df[kind])), key=lambda o: known.index(o) if o in known else len(known))
    t = newest.pivot_table(index=["kernel", kind], columns="kernel_version", values="median_us", sort=False)
    t = t.reindex(index=[o for o in order if o in t.index], columns=versions)
    t.columns.name = None
    t = t.reset_index()
    # the chart's provenance (GPU, commits, dates of the records shown); attrs, so that the
    # table's columns stay one per version
    t.attrs["source"] = source_label(newest, live=False)
    return t


# Consecutive milestones of the median CTA, as the segments of a call (timeline_chart).
SEGMENTS = (
    ("attention", "entry", "attention", "indices staged", "prologue (indices; Q from v18)"),
    ("attention", "indices staged", "attention", "tile 0 landed", "first tile"),
    ("attention", "tile 0 landed", "attention", "tile 1 landed", "round 0"),
    ("attention", "tile 1 landed", "attention", "loop end", "rest of the loop"),
    ("attention", "loop end", "attention", "exit", "epilogue"),
    ("attention", "exit", "combine", "weights ready", "combine: wait, LSE pass"),
    ("combine", "weights ready", "combine", "exit", "combine: merge"),
)


def timeline_chart(milestones: pd.DataFrame, title: str = "q16 h8 4k", gpu: str = "H200"):
    """The median CTA's call as bars, one row per version, from a `recorded_table` of milestones
    (columns kernel, milestone, then one per version) recorded on `gpu`; the table's provenance
    (`attrs["source"]`, from recorded_table) is the subtitle."""
    import altair as alt

    from ..charts import chart_title

    versions = [c for c in milestones.columns if c not in ("kernel", "milestone")]
    at = milestones.set_index(["kernel", "milestone"])
    rows = []
    for v in versions:
        for ka, ma, kb, mb, name in SEGMENTS:
            if (ka, ma) in at.index and (kb, mb) in at.index:
                rows.append({"version": v, "segment": name, "start_us": float(at.loc[(ka, ma), v]),
                             "end_us": float(at.loc[(kb, mb), v])})
    data = pd.DataFrame(rows)
    order = [seg[-1] for seg in SEGMENTS]
    return alt.Chart(data).mark_bar().encode(
        x=alt.X("start_us:Q", title="µs after the first attention CTA starts (median CTA)"), x2="end_us:Q",
        y=alt.Y("version:N", sort=versions, title=None),
        color=alt.Color("segment:N", sort=order, scale=alt.Scale(domain=order), title=None),
        tooltip=["version", "segment", alt.Tooltip("start_us:Q", format=".2f"), alt.Tooltip("end_us:Q", format=".2f")],
    ).properties(title=chart_title(f"Where a call goes, CTA timeline, {title} (recorded, {gpu})",
                              milestones.attrs.get("source", "")), width=460, height=28 * len(versions))


def main(argv=None) -> None:
    from .bench import add_shape_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(ap)
    ap.add_argument("--define", action="append", default=[], help="another build define, e.g. COMBINE_PDL=0")
    ap.add_argument("--cta-rows", type=int, choices=(32, 64), default=64,
                    help="the attention kernel: 64 (the 64-row kernel, default) or 32 (the split kernel, decode's)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays, each after an L2 flush (default 20)")
    add_record_args(ap, "kernel_timeline")
    a = ap.parse_args(argv)
    if a.replays < 1:
        ap.error("--replays must be at least 1")
    import torch

    if not torch.cuda.is_available():
        sys.exit("the CTA timeline needs a CUDA GPU; none is visible to torch")
    from .bench import L2_FLUSH, Inputs, L2Flush, diagnostic_and_shipped, shape_from_args
    from .build import load_kernel_module

    defines = tuple(a.define) + (TIMELINE_DEFINE,)
    shape = shape_from_args(a)
    stamped, stamped_us, untraced_us = diagnostic_and_shipped(Inputs(shape), a.define, TIMELINE_DEFINE,
                                                              cta_rows=a.cta_rows)
    times = {"stamped_us": stamped_us, "untraced_us": untraced_us}
    module = load_kernel_module(defines=defines)
    flush = L2Flush()
    stamped()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stamped()
    module.cta_timeline()   # clear what the eager call and the capture left
    milestones, spans, steps = [], [], []
    for _ in range(a.replays):
        flush()
        graph.replay()
        torch.cuda.synchronize()
        stamps = module.cta_timeline().numpy()
        milestones.append(milestone_table(stamps))
        spans.append(span_table(stamps))
        steps.append(resolution_ns(stamps))
    m = median_over(milestones, ["kernel", "milestone"])
    s = median_over(spans, ["kernel", "span"])
    res = int(np.median(steps))
    kernel = "64-row kernel" if a.cta_rows == 64 else "32-row split kernel"
    print(f"b{a.batch} h{a.heads} q{a.q_len} ctx {a.ctx}, {kernel}, defines {list(a.define) or 'none'}: "
          f"{times['stamped_us']:.1f} us stamped, {times['untraced_us']:.1f} us without the stamps; "
          f"timer step {res} ns; medians over {a.replays} replays")
    print(m.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(s.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if a.no_record:
        return
    from ..results import append_cli_records

    common = {"impl": "sm120_mla", **shape.__dict__, "cta_rows": a.cta_rows, "defines": list(a.define), **times,
              "timer_step_ns": res, "replays": a.replays, "kernel_version": a.tag, "l2_flush": L2_FLUSH}
    records = ([dict(common, kind="milestone", **r) for r in m.to_dict("records")]
               + [dict(common, kind="span", **r) for r in s.to_dict("records")])
    path = append_cli_records("kernel_timeline", records, "sm120_workbook.kernels.cta_timeline", argv, a.out)
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
