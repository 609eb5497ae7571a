"""Reading kernel benchmark records: comparisons, the issue's targets, and sm_120 projections.

Works on recorded data (data/results/kernel_bench.jsonl), so a machine without a GPU shows
the measured results, and on the records of a live `bench.run` alike.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..charts import chart_title
from ..results import date_span, load_records, on_gpu, short_commit
from ..roofline import TARGET_GPUS, roofline_time_us, verify_cost

IMPL_ORDER = ["sm120_mla", "flashmla", "flashinfer_mla", "flashinfer_mla_fa2", "triton_verify", "triton_decode"]
RTX = "RTX PRO 6000 Blackwell"


LEGACY_TRITON_DECODE = "triton_decode_8splits"


def with_legacy_names(df: pd.DataFrame) -> pd.DataFrame:
    """Records of SGLang's Triton decode from before session 22 ran it with 8 KV splits and
    without its MLA path, where an SGLang 0.5.17 server raises the splits to 256 on an H200
    and takes the MLA path (bench.triton_decode_cap): 1.7-18x slower than a server's decode at
    batch 1. They carry no `max_kv_splits`; renamed LEGACY_TRITON_DECODE, they stay on record, and no target
    or ratio against `triton_decode` reads them."""
    if df.empty or "impl" not in df:
        return df
    legacy = df["impl"].eq("triton_decode")
    if "max_kv_splits" in df:
        legacy &= df["max_kv_splits"].isna()
    return df.assign(impl=df["impl"].where(~legacy, LEGACY_TRITON_DECODE))


def load_bench(path=None, skewed: bool = False) -> pd.DataFrame:
    """The benchmark's ok records: by default the batches whose requests share one context,
    which every table here but `skewed_batch_table` compares; skewed=True: the skewed batches
    (one request at ctx, the others at short_ctx) alone. Old Triton decode records are renamed
    (with_legacy_names)."""
    return bench_records(path)[1 if skewed else 0]


def bench_records(path=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The benchmark's ok records read once: (uniform batches, skewed batches), as load_bench."""
    df = load_records("kernel_bench", path=path)
    if len(df) and "status" in df:
        df = df[df["status"] == "ok"]
    return uniform_and_skewed(with_legacy_names(df))


def load_targets(path=None) -> pd.DataFrame:
    """The records of `python -m sm120_workbook.kernels.targets`, old Triton decode renamed."""
    return with_legacy_names(load_records("kernel_targets", path=path))


def short_ctx_of(df: pd.DataFrame) -> pd.Series:
    """Each record's short_ctx: 0 for a batch whose requests share one context, including
    records from before skewed batches were timed (no such column)."""
    return df["short_ctx"].fillna(0) if "short_ctx" in df else pd.Series(0, index=df.index)


def uniform_and_skewed(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(records of batches whose requests share one context, records of skewed batches)."""
    short = short_ctx_of(df)
    return df[short == 0], df[short > 0]


# bench's default flush (bench.L2_FLUSH before any --l2-flush): the one the tables show unless asked
DEFAULT_L2_FLUSH = "read"


def latest_run(df: pd.DataFrame) -> pd.DataFrame:
    """The records of the newest benchmark run (one run = one GPU, one set of ceilings)."""
    if df.empty:
        return df
    return df[df["run_id"] == sorted(df["run_id"].unique())[-1]].copy()


def comparison_run(df: pd.DataFrame, run_id: str = "") -> pd.DataFrame:
    """The records of run `run_id`, or by default of the newest run that timed other
    implementations beside sm120_mla. Kernel-only runs (`--impls sm120_mla`, made to check a
    kernel change) are left out of the default, since the notebook's tables compare."""
    if df.empty:
        return df
    if run_id:
        if run_id not in set(df["run_id"]):
            raise ValueError(f"bench_run: no run {run_id!r} recorded; newest: {sorted(set(df['run_id']))[-3:]}")
        return df[df["run_id"] == run_id].copy()
    compared = df.groupby("run_id")["impl"].agg(lambda s: (s != "sm120_mla").any())
    ids = sorted(compared[compared].index)
    # a run timed after another flush than the default (`--l2-flush write`, for a side-by-side) is
    # shown only when asked for by id, or where no run of the default flush compared
    default = set(df.loc[l2_flush_of(df) == DEFAULT_L2_FLUSH, "run_id"])
    ids = [i for i in ids if i in default] or ids
    return latest_run(df) if not ids else df[df["run_id"] == ids[-1]].copy()


def l2_flush_of(df: pd.DataFrame) -> pd.Series:
    """Each record's L2 flush before its timings (bench.L2_FLUSH): records from before the field
    (session 51) were timed after a written flush."""
    if "l2_flush" not in df:
        return pd.Series("write", index=df.index)
    flush = df["l2_flush"].astype(object)
    return flush.where(flush.notna(), "write")


def with_missing_baselines(run: pd.DataFrame, all_runs: pd.DataFrame) -> pd.DataFrame:
    """`run` plus, for each baseline impl it lacks (e.g. a run made without SGLang's Triton
    kernels installed), that impl's rows from the newest run on the same GPU that has it and is
    not newer than `run` (a newer one where none is older: an older `run` asked for by id).
    Their `run_id` says where they come from; ratios against them are across runs
    (baselines_from). An impl that cannot run on that GPU (FlashMLA on an RTX PRO 6000) stays
    missing: another GPU's times are no baseline."""
    if run.empty:
        return run
    if "gpu" in run and "gpu" in all_runs:
        all_runs = all_runs[all_runs["gpu"].isin(set(run["gpu"]))]
    # nor are times taken after another L2 flush (bench.L2_FLUSH: a written one inflated memory-bound times)
    all_runs = all_runs[l2_flush_of(all_runs).isin(set(l2_flush_of(run)))]
    parts = [run]
    for impl in IMPL_ORDER:
        if impl == "sm120_mla" or (run["impl"] == impl).any():
            continue
        other = all_runs[all_runs["impl"] == impl]
        older = other[other["run_id"] <= run["run_id"].max()] if "run_id" in other and "run_id" in run else other
        if len(older):
            parts.append(latest_run(older))
        elif len(other):
            parts.append(other[other["run_id"] == other["run_id"].min()].copy())
    return pd.concat(parts, ignore_index=True)


def shown_runs(bench_run: str = "", path=None) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """What notebook 03 shows without a live run: the recorded run `bench_run` (default: the
    newest that compared, comparison_run), with SGLang's Triton baselines from the newest run
    that has them where it lacks them (with_missing_baselines); the skewed batches (of
    `bench_run` only, where one is asked for); and a provenance line for the run."""
    from ..results import describe_provenance

    all_runs, skewed = bench_records(path)
    shown = comparison_run(all_runs, bench_run)
    if bench_run and len(skewed):
        skewed = skewed[skewed["run_id"] == bench_run]
    return with_missing_baselines(shown, all_runs), skewed, "RECORDED: " + describe_provenance(shown)


def live_runs(records: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """The same three for a benchmark just run here (bench.run's records; failed ones left out)."""
    runs = pd.DataFrame([r for r in records if r.get("status") == "ok"])
    if runs.empty:
        return runs, runs, "measured in this run (no record ok)"
    uniform, skewed = uniform_and_skewed(runs)
    first = runs.iloc[0]
    return uniform, skewed, f"measured in this run on {first['gpu']}, commit {short_commit(first['commit'], 12)}"


def ceilings_line(runs: pd.DataFrame) -> str:
    """The run's measured ceilings and kernel version, as notebook 03 prints them above its tables."""
    if runs.empty:
        return "no run to show"
    r = runs.iloc[0]
    mma = r.get("mma_sync_tflops", float("nan"))
    tagged = runs["kernel_version"].dropna() if "kernel_version" in runs else pd.Series(dtype=object)
    version = str(tagged.iloc[0]) if len(tagged) and tagged.iloc[0] else None
    return (f"ceilings: copy {r['copy_gbps']:,.0f} GB/s, bf16 matmul {r['matmul_tflops']:,.0f} TFLOP/s"
            + (f", mma.sync {mma:,.0f} TFLOP/s" if mma == mma else "")
            + f"; kernel version {version or 'untagged (a live build)'}")


def baselines_from(table: pd.DataFrame) -> dict[str, str]:
    """impl -> run_id for the impls whose rows come from another run than sm120_mla's."""
    if table.empty or not (table["impl"] == "sm120_mla").any():
        return {}
    ours = set(table.loc[table["impl"] == "sm120_mla", "run_id"])
    other = table[~table["run_id"].isin(ours)]
    return {impl: ", ".join(sorted(g["run_id"].unique())) for impl, g in other.groupby("impl")}


def default_rows(df: pd.DataFrame, tile_keys: int | None = None) -> pd.DataFrame:
    """One row per (impl, shape): sm120_mla as the workspace runs it by default (its kernel and
    split count chosen from the shape; in runs before v17d, the 32-row kernel) at the given (or,
    when None, the faster) tile size; other impls as they are."""
    if df.empty:
        return df
    sm = df[df["impl"] == "sm120_mla"]
    # The kernel the workspace runs by default: since v17d (runs whose records carry
    # `kernel_forced`) the one the run's own default row (kernel_forced False) used, which is
    # what choose_cta_rows picked then; a shape timed only with the kernel fixed takes today's
    # choose_cta_rows. Before v17d, the 32-row one. Where a run timed that configuration twice
    # (the default row and a row fixing it), the default row is kept.
    if "cta_rows" in sm:
        from .verify_attention import choose_cta_rows

        policy = sm["kernel_forced"].notna() if "kernel_forced" in sm else pd.Series(False, index=sm.index)
        shape_key = [c for c in ("run_id", "batch", "heads", "q_len", "ctx") if c in sm]
        ran = {}
        if "kernel_forced" in sm:
            defaults = sm[sm["kernel_forced"].notna() & ~sm["kernel_forced"].fillna(True).astype(bool)]
            ran = {tuple(k): int(c) for k, c in zip(defaults[shape_key].itertuples(index=False), defaults["cta_rows"])}
        picked = [ran.get(tuple(k), choose_cta_rows(b, h, q)) if new else 32
                  for k, b, h, q, new in zip(sm[shape_key].itertuples(index=False), sm["batch"], sm["heads"],
                                             sm["q_len"], policy)]
        sm = sm[sm["cta_rows"].fillna(32).to_numpy() == picked]
        if "kernel_forced" in sm:
            key = [c for c in ("run_id", "batch", "heads", "q_len", "ctx", "tile_keys", "num_splits",
                               "num_splits_forced") if c in sm]
            sm = (sm.assign(_forced=sm["kernel_forced"].fillna(False).astype(bool)).sort_values("_forced", kind="stable")
                  .drop_duplicates(key).drop(columns="_forced"))
    if "num_splits_forced" in sm and sm["num_splits_forced"].notna().all():
        auto = sm[~sm["num_splits_forced"].astype(bool)]
    else:  # early records: the automatic row of a shape came first, the sweep after it
        auto = sm[~sm.duplicated(["batch", "heads", "q_len", "ctx", "tile_keys"], keep="first")]
    if tile_keys is not None:
        auto = auto[auto["tile_keys"] == tile_keys]
    else:
        auto = auto.sort_values("time_us").drop_duplicates(["batch", "heads", "q_len", "ctx"])
    return pd.concat([auto, df[df["impl"] != "sm120_mla"]], ignore_index=True)


def comparison_table(df: pd.DataFrame, batch=1, heads=8, q_len=16) -> pd.DataFrame:
    """time_us per context (rows) and impl (columns) for one batch/heads/q_len."""
    sel = df[(df["batch"] == batch) & (df["heads"] == heads) & (df["q_len"] == q_len)]
    t = sel.pivot_table(index="ctx", columns="impl", values="time_us", aggfunc="min")
    return t[[c for c in IMPL_ORDER if c in t.columns]].round(1)


def batched_decode_table(df: pd.DataFrame) -> pd.DataFrame:
    """time_us of decode (q_len 1) at batch > 1, one row per (batch, heads, ctx), impls as
    columns: a busy server's step, where every SM has work whatever the split count."""
    sel = df[(df["q_len"] == 1) & (df["batch"] > 1)]
    if not len(sel):
        return pd.DataFrame()
    t = sel.pivot_table(index=["batch", "heads", "ctx"], columns="impl", values="time_us", aggfunc="min")
    return t[[c for c in IMPL_ORDER if c in t.columns]].round(1)


def skewed_batch_table(df: pd.DataFrame) -> pd.DataFrame:
    """time_us of skewed batches (`load_bench(skewed=True)`): one row per (batch, heads, q_len,
    ctx, short_ctx), impls as columns; the run comparison_run picks (the newest that has them, of the
    default flush where there is one)."""
    if df.empty:
        return pd.DataFrame()
    run = comparison_run(df)
    run = run.assign(short_ctx=run["short_ctx"].astype(int))
    t = run.pivot_table(index=["batch", "heads", "q_len", "ctx", "short_ctx"], columns="impl",
                        values="time_us", aggfunc="min")
    return t[[c for c in IMPL_ORDER if c in t.columns]].round(1)


def pool_balance_table(shapes) -> pd.DataFrame:
    """The most keys one CTA walks in each batch (bench.Shape, skewed by short_ctx), on each
    TARGET_GPUS GPU at the workspace's split count: with v19's rule (one CTA a request, the spare
    ones by keys), with v20's min-max pool (POOL_MIN_MAX), and in an even split of every key over
    every CTA, which no schedule beats. Computed, not measured: `pool_first_ctas` is the kernels'
    schedule step for step."""
    from .verify_attention import choose_cta_rows, choose_num_splits, most_keys_a_cta, pool_first_ctas

    rows = []
    for s in shapes:
        keys = s.keys
        for gpu, spec in TARGET_GPUS.items():
            splits = choose_num_splits(s.batch, s.heads, s.q_len, spec["sms"], choose_cta_rows(s.batch, s.heads, s.q_len))
            rows.append({"batch": s.batch, "heads": s.heads, "q_len": s.q_len, "ctx": s.ctx, "short_ctx": s.short_ctx,
                         "gpu": gpu, "num_splits": splits, "even_split": sum(keys) / (s.batch * splits),
                         "v19_rule": most_keys_a_cta(keys, pool_first_ctas(keys, splits, min_max=False)),
                         "v20_min_max": most_keys_a_cta(keys, pool_first_ctas(keys, splits))})
    t = pd.DataFrame(rows)
    t["v20_gain"] = 1 - t["v20_min_max"] / t["v19_rule"]
    return t.round({"even_split": 0, "v19_rule": 0, "v20_min_max": 0, "v20_gain": 3})


def versus_table(df: pd.DataFrame, other: str) -> pd.DataFrame:
    """sm120_mla against `other` at every shape where both were timed, from `default_rows`' table
    (one sm120_mla row a shape: the kernel the workspace picks): µs of each and `speedup` =
    other's time / sm120_mla's (above 1: sm120_mla is faster)."""
    keys = ["batch", "heads", "q_len", "ctx"]
    ours = df[df["impl"] == "sm120_mla"].groupby(keys)["time_us"].min().rename("sm120_mla")
    theirs = df[df["impl"] == other].groupby(keys)["time_us"].min().rename(other)
    t = pd.concat([ours, theirs], axis=1, join="inner").reset_index()
    t["speedup"] = (t[other] / t["sm120_mla"]).round(2)
    return t.round({"sm120_mla": 1, other: 1})


def bandwidth_table(df: pd.DataFrame, batch=1, heads=8, q_len=16) -> pd.DataFrame:
    """Achieved KV GB/s per context and impl, and sm120_mla's share of the copy bandwidth
    measured in the same run."""
    sel = df[(df["batch"] == batch) & (df["heads"] == heads) & (df["q_len"] == q_len)]
    t = sel.pivot_table(index="ctx", columns="impl", values="gbps", aggfunc="max")
    t = t[[c for c in IMPL_ORDER if c in t.columns]].round(0)
    ours = sel[sel["impl"] == "sm120_mla"]
    if "sm120_mla" in t and len(ours):
        t["sm120_mla % of copy"] = (100 * t["sm120_mla"] / ours["copy_gbps"].iloc[0]).round(1)
    return t


def on_rtx(df: pd.DataFrame) -> pd.Series:
    """Which records were measured on an RTX PRO 6000 (the GPU the projection is for)."""
    return on_gpu(df, "RTX PRO 6000")


def projection_runs(table: pd.DataFrame, all_runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(the default rows to project from, the default rows of an RTX PRO 6000 run to set beside
    the projection, or None). `table` is what the notebook shows (default_rows of a run). A run
    on an RTX PRO 6000 is not projected but measured: the projection then comes from the newest
    recorded comparison run on another GPU. Otherwise the measured side is the newest recorded
    RTX PRO 6000 run, if any."""
    if on_rtx(table).any():
        others = all_runs[~on_rtx(all_runs)]
        source = default_rows(comparison_run(others), tile_keys=_tile_keys(table)) if len(others) else others
        return source, table[on_rtx(table)]
    rtx_runs = all_runs[on_rtx(all_runs)]
    return table, default_rows(comparison_run(rtx_runs), tile_keys=_tile_keys(table)) if len(rtx_runs) else None


def run_label(df: pd.DataFrame | None) -> str:
    """'NVIDIA H200 (run 20261130T103353Z, commit 84fe64d, 2026-11-30)' for each GPU and run of the
    records (a chart's provenance: the commits and dates where the records have them); "" for none."""
    if df is None or df.empty or "run_id" not in df:
        return ""
    df = df.assign(_gpu=df["gpu"].fillna("unknown GPU") if "gpu" in df else "unknown GPU")
    labels = []
    for (gpu, run), rows in df.groupby(["_gpu", "run_id"], sort=True):
        parts = [f"run {run}"]
        if "commit" in rows:
            commits = sorted({short_commit(c) for c in rows["commit"].dropna()})
            parts += [f"commit {'/'.join(commits)}"] if commits else []
        span = date_span(rows)
        labels.append(f"{gpu} ({', '.join(parts + [span] if span else parts)})")
    return ", ".join(labels)


def _tile_keys(table: pd.DataFrame) -> int | None:
    tiles = table.loc[table["impl"] == "sm120_mla", "tile_keys"].dropna().unique() if "tile_keys" in table else []
    return int(tiles[0]) if len(tiles) == 1 else None


def rtx_projection(df: pd.DataFrame, rtx_tflops: float | None = None,
                   measured: pd.DataFrame | None = None) -> pd.DataFrame:
    """sm120_mla's projected time on an RTX PRO 6000, as a range (projections, not measurements),
    from its records `df` on another GPU (`source_gpu`, the H200 here).

    `rtx_projected_us`, the high end: its roofline there, divided by the fraction of the
    roofline the kernel reached on the measured GPU (same code, same efficiency assumed).
    Where the run measured the mma.sync rate, the fraction is taken against that GPU's
    mma.sync roofline (`source_mma_roofline_us`): the kernel may use no faster instruction, and
    mma.sync is the RTX PRO 6000's native tensor path, so that is the like-for-like fraction.
    Without it, the cuBLAS-rate roofline is used (which makes the projection pessimistic). The
    RTX roofline takes that GPU's spec bandwidth (1,792 GB/s) where the measured GPU's is its
    copy rate measured in the run: an RTX PRO 6000 whose copy falls short of its spec runs a
    memory-bound shape that much slower than projected (q16 h8 64k is only just compute-bound
    there: 45.6 us of mma against 42.1 us of DRAM).

    `rtx_bound_us`, the low end: the fixed part of the kernel's time on the measured GPU (a
    least-squares line over the shape's contexts, `_fixed_and_per_key`) plus the RTX roofline,
    i.e. the per-key part running at the RTX PRO 6000's roofline. It is what the kernel takes
    there if its rounds are bound by that GPU's tensor pipe or DRAM rather than by the
    per-warp latency chains that bind them on the H200 (NOTES.md, session 9: an sm_120 SMSP
    issues an mma.sync about every 20 cycles against the H200's ~6, so the same round's 136
    mma.sync an SMSP take longer than its chains). None where the shape has fewer than three
    contexts.

    `measured`: records of a run on an RTX PRO 6000 (projection_runs finds one). Its sm120_mla
    time of each shape joins the row as `rtx_measured_us`, and `in_range` says whether it falls
    in [rtx_bound_us, rtx_projected_us] (where a shape has no bound, from its roofline up)."""
    if on_rtx(df).any():
        raise ValueError("df: records measured on an RTX PRO 6000 are not projected; pass them as `measured`, "
                         "beside a projection from another GPU's run (projection_runs)")
    g = TARGET_GPUS[RTX]
    tflops = rtx_tflops or g["bf16_tflops"]
    ours = df[df["impl"] == "sm120_mla"]
    fixed = {}
    for key, sel in ours.groupby(["batch", "heads", "q_len"]):
        if sel["ctx"].nunique() >= 3:
            fixed[key] = _fixed_and_per_key(sel)[0]
    rtx_us = {}
    if measured is not None and len(measured):
        m = measured[measured["impl"] == "sm120_mla"]
        rtx_us = {k: t for k, t in zip(zip(m["batch"], m["heads"], m["q_len"], m["ctx"]), m["time_us"])}
    rows = []
    for r in ours.itertuples():
        cost = verify_cost(int(r.heads), int(r.q_len), int(r.ctx) + int(r.q_len), batch=int(r.batch))
        rtx_roof = roofline_time_us(cost, g["mem_gbps"], tflops)
        mma_roof = getattr(r, "roofline_mma_us", float("nan"))
        has_mma = mma_roof == mma_roof   # not NaN
        eff = (mma_roof if has_mma else r.roofline_us) / r.time_us
        f = fixed.get((r.batch, r.heads, r.q_len))
        row = {"batch": r.batch, "heads": r.heads, "q_len": r.q_len, "ctx": r.ctx,
               "source_gpu": getattr(r, "gpu", None), "source_us": round(r.time_us, 1),
               "source_roofline_us": round(r.roofline_us, 1),
               "source_mma_roofline_us": round(mma_roof, 1) if has_mma else None,
               "efficiency": round(eff, 3), "efficiency_vs": "mma.sync" if has_mma else "cuBLAS",
               "rtx_roofline_us": round(rtx_roof, 1),
               "rtx_bound_us": round(max(f, 0.0) + rtx_roof, 1) if f is not None else None,
               "rtx_projected_us": round(rtx_roof / eff, 1)}
        if rtx_us:
            t = rtx_us.get((r.batch, r.heads, r.q_len, r.ctx))
            row["rtx_measured_us"] = round(t, 1) if t is not None else None
            low = row["rtx_bound_us"] if row["rtx_bound_us"] is not None else row["rtx_roofline_us"]
            row["in_range"] = None if t is None else bool(low <= t <= row["rtx_projected_us"])
        rows.append(row)
    return pd.DataFrame(rows)


def _select(df: pd.DataFrame, impl: str, **shape) -> pd.DataFrame:
    """The rows of one impl at one shape (batch, heads, q_len, ctx, ...)."""
    sel = df[df["impl"] == impl]
    for k, v in shape.items():
        sel = sel[sel[k] == v]
    return sel


def _mma_share_note(df: pd.DataFrame, allowed_us: float, baseline: tuple[str, float] | None = None,
                    **shape) -> str:
    """What a target that allows `allowed_us` asks of an mma.sync kernel: the share of the run's
    own mma.sync ceiling (the FLOPs over the measured mma.sync rate, `roofline_mma_us`) that it
    leaves, with no fixed part at all (launch, prologue, combine). Above ~90% no mma.sync kernel
    gets there, softmax and loads included. `baseline` (name, time in us), an impl that ceiling
    does not bind (FlashMLA: wgmma on Hopper), adds the share it runs at."""
    if "roofline_mma_us" not in df or allowed_us != allowed_us:
        return ""
    mma_us = _select(df, "sm120_mla", **shape)["roofline_mma_us"].dropna()
    if len(mma_us) == 0:
        return ""
    floor = float(mma_us.iloc[0])
    note = f"needs {floor / allowed_us:.0%} of this run's mma.sync ceiling ({floor:.0f} us)"
    if baseline is not None:
        name, base_us = baseline
        note += f"; {name} runs at {floor / base_us:.0%} of it"
    return note


def targets_table(df: pd.DataFrame) -> pd.DataFrame:
    """The kernel issue's targets, each with the measured value and whether it is met (and,
    for the batch-32 and 1.3x-roofline targets, what they ask of the mma.sync ceiling). `ratio_is` says which way
    each ratio reads: a baseline over ours (higher is better) or ours over a bound (lower is)."""
    if df.empty:
        return pd.DataFrame(columns=["target", "measured", "ratio", "ratio_is", "met", "note"])
    rows = []

    def t(impl, **shape):
        sel = _select(df, impl, **shape)
        return float(sel["time_us"].min()) if len(sel) else float("nan")

    for heads in (8, 16):
        for ctx in sorted(df[(df["q_len"] == 16) & (df["batch"] == 1)]["ctx"].unique()):
            if ctx < 16384:
                continue
            ours, fm = t("sm120_mla", batch=1, heads=heads, q_len=16, ctx=ctx), t("flashmla", batch=1, heads=heads, q_len=16, ctx=ctx)
            rows.append({"target": f"q16 h{heads} {ctx // 1024}k: <= FlashMLA", "measured": f"{ours:.1f} vs {fm:.1f} us",
                         "ratio": round(fm / ours, 2), "ratio_is": "FlashMLA / ours", "met": bool(ours <= fm)})
        ours, tv = t("sm120_mla", batch=1, heads=heads, q_len=16, ctx=65536), t("triton_verify", batch=1, heads=heads, q_len=16, ctx=65536)
        rows.append({"target": f"q16 h{heads} 64k: >= 100x Triton verify", "measured": f"{ours:.1f} vs {tv:.1f} us",
                     "ratio": round(tv / ours, 1), "ratio_is": "Triton / ours", "met": bool(tv / ours >= 100)})
        sel = df[(df["impl"] == "sm120_mla") & (df["batch"] == 1) & (df["heads"] == heads) & (df["q_len"] == 16) & (df["ctx"] >= 65536)]
        for r in sel.sort_values("time_us").drop_duplicates("ctx").itertuples():
            rows.append({"target": f"q16 h{heads} {r.ctx // 1024}k: within 1.3x roofline",
                         "measured": f"{r.time_us:.1f} vs {r.roofline_us:.1f} us",
                         "ratio": round(r.time_us / r.roofline_us, 2), "ratio_is": "ours / roofline",
                         "met": bool(r.time_us <= 1.3 * r.roofline_us),
                         # the roofline takes cuBLAS's (wgmma) rate: what 1.3x of it leaves mma.sync
                         "note": _mma_share_note(df, 1.3 * r.roofline_us, batch=1, heads=heads, q_len=16, ctx=r.ctx)})
        ours, fm = t("sm120_mla", batch=32, heads=heads, q_len=16, ctx=16384), t("flashmla", batch=32, heads=heads, q_len=16, ctx=16384)
        rows.append({"target": f"b32 q16 h{heads} 16k: within 10% of FlashMLA", "measured": f"{ours:.1f} vs {fm:.1f} us",
                     "ratio": round(ours / fm, 2), "ratio_is": "ours / FlashMLA", "met": bool(ours <= 1.1 * fm),
                     "note": _mma_share_note(df, 1.1 * fm, ("FlashMLA", fm), batch=32, heads=heads, q_len=16, ctx=16384)})
    dec = df[(df["q_len"] == 1) & (df["batch"] == 1)]
    for heads in sorted(dec["heads"].unique()):
        for ctx in sorted(dec["ctx"].unique()):
            ours, td = t("sm120_mla", batch=1, heads=heads, q_len=1, ctx=ctx), t("triton_decode", batch=1, heads=heads, q_len=1, ctx=ctx)
            need = 3.0 if ctx == 65536 else 1.0
            rows.append({"target": f"decode h{heads} {ctx // 1024}k: >= {need:g}x Triton decode",
                         "measured": f"{ours:.1f} vs {td:.1f} us", "ratio": round(td / ours, 2), "ratio_is": "Triton / ours",
                         "met": bool(td / ours >= need)})
    out = pd.DataFrame(rows)
    out["note"] = out["note"].fillna("") if "note" in out else ""
    # A missing time (an impl or shape not in the records) is "not measured", never "missed".
    unknown = out["ratio"].isna()
    out["met"] = out["met"].astype(object)
    out.loc[unknown, "met"] = None
    out.loc[unknown, "measured"] = out.loc[unknown, "measured"].str.replace("nan", "not measured")
    return out


def _newest_kernel_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The runs of the newest run's kernel on its GPU, whatever their L2 flush: the same kernel
    version (its `--tag`), else, untagged, the same commit; an untagged run from a dirty tree alone."""
    if df.empty:
        return df
    newest = df[df["run_id"] == df["run_id"].max()].iloc[0]
    tagged = "kernel_version" in df and pd.notna(newest["kernel_version"])
    if not tagged and str(newest["commit"]).endswith("+dirty"):
        return df[df["run_id"] == newest["run_id"]]
    key = "kernel_version" if tagged else "commit"
    return df[(df[key] == newest[key]) & (df["gpu"] == newest["gpu"])]


def latest_rounds(df: pd.DataFrame) -> pd.DataFrame:
    """Of the records of `python -m sm120_workbook.kernels.targets` (kernel_targets.jsonl), the
    runs of the newest run's kernel on its GPU and with one L2 flush (l2_flush_of: the default,
    DEFAULT_L2_FLUSH, where that kernel has runs of it, else the newest run's), pooled: the same
    kernel version (its `--tag`; commits that change no device code keep it), else, untagged, the
    same commit. An untagged run from a dirty tree stands alone: two such runs of one commit may
    have timed different code."""
    runs = _newest_kernel_runs(df)
    if runs.empty:   # no records, or the newest run names no GPU (or, untagged, no commit): nothing pools
        return runs.copy()
    flush = l2_flush_of(runs)   # a written flush inflated memory-bound times: never pooled with a read one
    # the default flush's runs where the kernel has any (a later `--l2-flush write` run is a side-by-side)
    newest = flush[runs["run_id"] == runs["run_id"].max()].iloc[0]
    chosen = DEFAULT_L2_FLUSH if (flush == DEFAULT_L2_FLUSH).any() else newest
    return runs[flush == chosen].copy()


def targets_by_flush(df: pd.DataFrame) -> pd.DataFrame:
    """The newest kernel's targets on its GPU (as latest_rounds picks them) under each L2 flush its
    runs were timed after, side by side: per flush the pooled ratio, its range and verdict
    (targets_over_rounds), and whether the verdicts differ in kind (met, missed, mixed; a target a
    flush did not measure differs from nothing). FlashMLA's batch-1 times depend on the kernels
    that ran before them (NOTES.md, session 52), so such a verdict is the harness's, not the
    kernel's. The default flush (DEFAULT_L2_FLUSH) comes first, then the newest run's."""
    runs = _newest_kernel_runs(df)
    if runs.empty:
        return pd.DataFrame(columns=["target", "ratio_is", "verdicts differ"])
    flush = l2_flush_of(runs)
    by_run = pd.DataFrame({"run_id": runs["run_id"].to_numpy(), "flush": flush.to_numpy()})
    order = list(dict.fromkeys(by_run.sort_values("run_id", ascending=False, kind="stable")["flush"]))
    order.sort(key=lambda f: f != DEFAULT_L2_FLUSH)   # the default flush first, then the newest first
    tables, kinds = [], {}
    for f in order:
        t = targets_over_rounds(runs[flush == f], with_counts=True)
        t = t.assign(range=[f"{lo:.2f}-{hi:.2f}" if pd.notna(lo) else "" for lo, hi in zip(t["ratio_min"], t["ratio_max"])])
        # met, missed or mixed, whatever the counts; a target a flush did not measure differs from nothing
        kinds[f] = pd.Series([_verdict_kind(m, n) for m, n in zip(t["met_rounds"], t["rounds"])], index=t["target"])
        tables.append(t[["target", "ratio_is", "runs", "ratio", "range", "verdict"]].rename(
            columns={c: f"{f}: {c}" for c in ("runs", "ratio", "range", "verdict")}).set_index("target"))
    targets = list(dict.fromkeys(t for table in tables for t in table.index))   # the newest flush's order first
    ratio_is = pd.concat([table["ratio_is"] for table in tables]).groupby(level=0).first()
    out = pd.concat([table.drop(columns="ratio_is") for table in tables], axis=1).loc[targets]
    out.insert(0, "ratio_is", ratio_is.loc[targets])
    kinds = pd.DataFrame({f: k.reindex(targets) for f, k in kinds.items()})
    out["verdicts differ"] = kinds.nunique(axis=1) > 1
    return out.reset_index().rename(columns={"index": "target"})


def _verdict_kind(met_rounds, rounds) -> str | None:
    """met, missed or mixed from the rounds that met a target; None where no round measured it."""
    if not rounds or pd.isna(rounds):
        return None
    return "met" if met_rounds == rounds else "missed" if met_rounds == 0 else "mixed"


def _verdict(met_rounds, rounds) -> str:
    kind = _verdict_kind(met_rounds, rounds)
    return f"mixed: met in {met_rounds} of {rounds} rounds" if kind == "mixed" else f"{kind} in every round"


def targets_over_rounds(df: pd.DataFrame, with_counts: bool = False) -> pd.DataFrame:
    """The targets of runs timed in rounds (`python -m sm120_workbook.kernels.targets`): each
    round's `targets_table`, then per target the runs (processes) and rounds that measured it,
    the median ratio and its range over the rounds, and a verdict. A target met in some rounds
    and missed in others is within the noise of this GPU, not met. with_counts: also the rounds
    that met it (`met_rounds`)."""
    cols = ["target", "runs", "rounds", "ratio", "ratio_min", "ratio_max", "ratio_is", "verdict", "note"]
    if with_counts:
        cols.append("met_rounds")
    if df.empty:
        return pd.DataFrame(columns=cols)
    if "round" not in df:
        raise ValueError("df: records without a `round` column; targets_over_rounds reads the records of "
                         "`python -m sm120_workbook.kernels.targets` (kernel_targets.jsonl)")
    if "run_id" not in df:
        df = df.assign(run_id="")
    per_round = pd.concat([targets_table(g).assign(run_id=run, round=f"{run}/{r}")
                           for (run, r), g in df.groupby(["run_id", "round"])], ignore_index=True)
    # newest run first, so that a target's note (what it asks of the ceiling) is the newest run's
    per_round = per_round.sort_values("run_id", ascending=False, kind="stable")
    measured = per_round[per_round["met"].notna()].astype({"met": bool})
    out = (measured.groupby("target", sort=False)
           .agg(runs=("run_id", "nunique"), rounds=("round", "nunique"), ratio=("ratio", "median"),
                ratio_min=("ratio", "min"), ratio_max=("ratio", "max"), ratio_is=("ratio_is", "first"),
                met_rounds=("met", "sum"), note=("note", "first"), note_run=("run_id", "first"))
           .reset_index())
    several = (out["runs"] > 1) & (out["note"] != "")
    out.loc[several, "note"] = out.loc[several, "note"] + " (newest run, " + out.loc[several, "note_run"] + ")"
    out["verdict"] = [_verdict(met, n) for met, n in zip(out["met_rounds"], out["rounds"])]
    # a target no round could measure (its baseline failed or was not timed) stays in the table
    unmeasured = [{"target": t, "runs": g["run_id"].nunique(), "rounds": 0, "ratio_is": g["ratio_is"].iloc[0],
                   "verdict": "not measured", "note": g["note"].iloc[0]}
                  for t, g in per_round[~per_round["target"].isin(out["target"])].groupby("target", sort=False)]
    if unmeasured:
        out = pd.concat([out, pd.DataFrame(unmeasured)], ignore_index=True)
    # in the newest run's order (a target added since, such as decode at 8k, sits by its
    # neighbours, not after every target the older runs had); a target only older runs had follows
    order = list(dict.fromkeys(per_round["target"]))
    return out.set_index("target").loc[order].reset_index()[cols]


def _fixed_and_per_key(sel: pd.DataFrame, col: str = "time_us") -> tuple[float, float, float]:
    """Least squares over the contexts of one shape: `col` = fixed + per_64k × (ctx / 65,536).
    Returns (fixed, per_64k, worst miss in % of the time)."""
    g = sel.groupby("ctx")[col].min()
    x = g.index.to_numpy(dtype=float) / 65536
    per_64k, fixed = np.polyfit(x, g.to_numpy(dtype=float), 1)
    miss = float(np.max(np.abs(g.to_numpy() - (fixed + per_64k * x)) / g.to_numpy()) * 100)
    return float(fixed), float(per_64k), miss


def flashmla_reach(df: pd.DataFrame, batch: int = 1, q_len: int = 16, min_ctx: int = 16384,
                   efficiencies=(1.0, 0.7)) -> pd.DataFrame:
    """What the "at least as fast as FlashMLA" targets ask of any mma.sync kernel, per head count.

    Each impl's time over the run's contexts (from `min_ctx`) splits by least squares into a
    fixed part and a part per 64k keys; the mma.sync ceiling's own time (`roofline_mma_us`, the
    FLOPs over the rate measured in the same run) is all per-key. Where FlashMLA's per-key time
    is below the ceiling's (its wgmma path outruns mma.sync), a kernel that runs at a fraction
    `e` of the ceiling, with sm120_mla's measured fixed part, falls behind FlashMLA beyond
    ctx = 64k × (fixed_fm - fixed_ours) / (ceiling / e - per_key_fm): the `matches FlashMLA up
    to` columns. A fit, not a measurement: `fit miss %` is its worst residual."""
    need = {"impl", "batch", "heads", "q_len", "ctx", "time_us", "roofline_mma_us"}
    missing = need - set(df.columns)
    if missing:
        raise ValueError(f"df: missing columns {sorted(missing)} (a run that measured the mma.sync rate is needed)")
    rows = []
    for heads in sorted(df["heads"].unique()):
        shape = dict(batch=batch, heads=heads, q_len=q_len)
        ours = _select(df, "sm120_mla", **shape)
        fm = _select(df, "flashmla", **shape)
        ours, fm = ours[ours["ctx"] >= min_ctx], fm[fm["ctx"] >= min_ctx]
        if ours["ctx"].nunique() < 3 or fm["ctx"].nunique() < 3 or ours["roofline_mma_us"].isna().all():
            continue
        f_ours, k_ours, miss_ours = _fixed_and_per_key(ours)
        f_fm, k_fm, miss_fm = _fixed_and_per_key(fm)
        _, k_mma, _ = _fixed_and_per_key(ours.dropna(subset=["roofline_mma_us"]), "roofline_mma_us")
        row = {"heads": int(heads), "contexts": "/".join(f"{c // 1024}k" for c in sorted(ours["ctx"].unique())),
               "sm120_mla fixed us": round(f_ours, 1), "sm120_mla us per 64k keys": round(k_ours, 1),
               "FlashMLA fixed us": round(f_fm, 1), "FlashMLA us per 64k keys": round(k_fm, 1),
               "mma.sync ceiling us per 64k keys": round(k_mma, 1),
               "sm120_mla per-key rate / ceiling": round(k_mma / k_ours, 2),
               "FlashMLA per-key rate / ceiling": round(k_mma / k_fm, 2)}
        for e in efficiencies:
            # at share e, ours minus FlashMLA's time is (f_ours - f_fm) + x gap, x = ctx / 64k: it is
            # <= 0 up to some context where gap > 0, and from some context on where gap < 0
            gap = 0.0 if math.isclose(k_mma / e, k_fm, rel_tol=1e-9) else k_mma / e - k_fm   # a fit's rounding
            if gap > 0:
                reach = 65536 * (f_fm - f_ours) / gap
                text = "no context" if reach <= 0 else f"{reach / 1024:.0f}k"
            elif f_ours <= f_fm:
                text = "every context"
            else:
                text = "no context" if gap == 0 else f"from {65536 * (f_ours - f_fm) / -gap / 1024:.0f}k on"
            row[f"at {e:.0%} of the ceiling, matches FlashMLA up to"] = text
        # the share e of the ceiling at which a kernel with our fixed part ties FlashMLA at the
        # longest context: fixed_ours + x k_mma / e = fixed_fm + x k_fm, x = ctx / 64k
        x = ours["ctx"].max() / 65536
        need = k_fm + (f_fm - f_ours) / x
        row[f"share of the ceiling that ties FlashMLA at {ours['ctx'].max() // 1024}k"] = (
            "no share (FlashMLA's fixed part is smaller)" if need <= 0 else f"{k_mma / need:.0%}")
        row["fit miss %"] = round(max(miss_ours, miss_fm), 1)
        rows.append(row)
    return pd.DataFrame(rows)


def time_vs_ctx_chart(df: pd.DataFrame, heads: int = 8, q_len: int = 16, batch: int = 1, source: str = ""):
    import altair as alt

    sel = df[(df["batch"] == batch) & (df["heads"] == heads) & (df["q_len"] == q_len)]
    sel = sel.groupby(["impl", "ctx"], as_index=False)["time_us"].min()
    return alt.Chart(sel).mark_line(point=True).encode(
        x=alt.X("ctx:Q", scale=alt.Scale(type="log", base=2), title="context (tokens)"),
        y=alt.Y("time_us:Q", scale=alt.Scale(type="log"), title="time per layer call (µs)"),
        color=alt.Color("impl:N", sort=IMPL_ORDER),
        tooltip=["impl", "ctx", alt.Tooltip("time_us:Q", format=".1f")],
    ).properties(title=chart_title(f"MLA attention, batch {batch}, {heads} heads, q_len {q_len}", source),
                 width=420, height=280)


def speedup_chart(df: pd.DataFrame, baseline: str, heads: int = 8, q_len: int = 16, source: str = ""):
    import altair as alt

    sel = df[(df["batch"] == 1) & (df["heads"] == heads) & (df["q_len"] == q_len)]
    piv = sel.pivot_table(index="ctx", columns="impl", values="time_us", aggfunc="min")
    if baseline not in piv or "sm120_mla" not in piv:
        return alt.Chart(pd.DataFrame({"x": []})).mark_point().properties(title=f"no {baseline} records")
    sp = (piv[baseline] / piv["sm120_mla"]).rename("speedup").reset_index().dropna()
    return alt.Chart(sp).mark_bar().encode(
        x=alt.X("ctx:O", title="context (tokens)"), y=alt.Y("speedup:Q", title=f"{baseline} time / sm120_mla time"),
        tooltip=["ctx", alt.Tooltip("speedup:Q", format=".1f")],
    ).properties(title=chart_title(f"sm120_mla speed-up over {baseline} ({heads} heads, q_len {q_len})", source),
                 width=420, height=240)


def nsplit_chart(df: pd.DataFrame, source: str = ""):
    """The NSPLIT sweep at q16 h8 64k: one line per kernel and tile, from the rows that fixed the
    split count (the workspace's own choice is another kernel at that shape in older runs)."""
    import altair as alt

    sel = df[(df["impl"] == "sm120_mla") & (df["batch"] == 1) & (df["heads"] == 8) & (df["q_len"] == 16)
             & (df["ctx"] == 65536)]
    forced = sel["num_splits_forced"].fillna(False).astype(bool) if "num_splits_forced" in sel else None
    if forced is not None and forced.any():
        sel = sel[forced]
    rows = sel["cta_rows"].fillna(32).astype(int) if "cta_rows" in sel else pd.Series(32, index=sel.index)
    sel = sel.assign(kernel=[f"{r}-row kernel, {t}-key tiles" for r, t in zip(rows, sel["tile_keys"].astype(int))])
    sel = sel.groupby(["num_splits", "kernel"], as_index=False)["time_us"].min()
    return alt.Chart(sel).mark_line(point=True).encode(
        x=alt.X("num_splits:Q", scale=alt.Scale(type="log", base=2), title="KV splits per request"),
        y=alt.Y("time_us:Q", title="time (µs)"), color="kernel:N",
        tooltip=["num_splits", "kernel", alt.Tooltip("time_us:Q", format=".1f")],
    ).properties(title=chart_title("NSPLIT at batch 1, 8 heads, q_len 16, 64k context", source), width=420, height=240)


def version_history(df: pd.DataFrame, batch=1, heads=8, q_len=16, ctx=65536, gpu: str | None = None) -> pd.DataFrame:
    """One row per recorded benchmark run at one shape: the kernel version, the L2 flush its
    timings had (l2_flush_of: FlashMLA's time moves with it, so ratios compare within a flush),
    its time and FlashMLA's time in the same run (so runs on different days compare through the
    ratio). `gpu` keeps the runs on GPUs whose name contains it (a history is one GPU's: an RTX
    PRO 6000 run has no FlashMLA to compare through)."""
    if gpu is not None:
        df = df[on_gpu(df, gpu)]
    rows = []
    for run_id, run in df.groupby("run_id"):
        sel = default_rows(run)
        sel = sel[(sel["batch"] == batch) & (sel["heads"] == heads) & (sel["q_len"] == q_len) & (sel["ctx"] == ctx)]
        ours, ref = sel[sel["impl"] == "sm120_mla"], sel[sel["impl"] == "flashmla"]
        if ours.empty:
            continue
        t, r = float(ours["time_us"].iloc[0]), float(ref["time_us"].iloc[0]) if len(ref) else float("nan")
        rows.append({"kernel_version": ours["kernel_version"].iloc[0] if "kernel_version" in ours else None,
                     "run_id": run_id, "commit": short_commit(ours["commit"].iloc[0]),
                     "l2_flush": l2_flush_of(ours).iloc[0], "sm120_mla_us": round(t, 1),
                     "flashmla_us": round(r, 1), "flashmla / sm120_mla": round(r / t, 2)})
    return pd.DataFrame(rows).sort_values("run_id").reset_index(drop=True) if rows else pd.DataFrame()


def version_history_chart(hist: pd.DataFrame, title: str):
    import altair as alt

    long = hist.melt(id_vars=["run_id", "kernel_version", "l2_flush"], value_vars=["sm120_mla_us", "flashmla_us"],
                     var_name="impl", value_name="time_us")
    long["impl"] = long["impl"].str.removesuffix("_us")
    # the flush in the label where it is not the default: a step in the line there is the harness's
    flush = np.where(long["l2_flush"] == DEFAULT_L2_FLUSH, "", ", " + long["l2_flush"])
    long["run"] = long["kernel_version"].fillna("?") + " (" + long["run_id"].str[9:13] + flush + ")"
    return alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("run:N", sort=None, title="kernel version (run time, UTC)"),
        y=alt.Y("time_us:Q", title="time (µs)", scale=alt.Scale(zero=True)),
        color=alt.Color("impl:N", sort=IMPL_ORDER),
        tooltip=["run", "impl", "l2_flush", alt.Tooltip("time_us:Q", format=".1f")],
    ).properties(width=420, height=240, title=title)


def cta_rows_table(df: pd.DataFrame, tile_keys=16) -> pd.DataFrame:
    """The two kernels side by side from the same run(s): µs of the 32-row split kernel and the
    64-row wide kernel at each recorded (batch, heads, q_len, ctx), at the automatic split count,
    their ratio, and which one the workspace picks there (`choose_cta_rows`). Records from before
    v17 have no `cta_rows` and no wide rows."""
    from .verify_attention import choose_cta_rows

    sm = df[df["impl"] == "sm120_mla"]
    if "cta_rows" not in sm or sm.empty:
        return pd.DataFrame()
    sm = sm[sm["tile_keys"] == tile_keys]
    if "num_splits_forced" in sm:
        sm = sm[~sm["num_splits_forced"].fillna(False).astype(bool)]
    if "kernel_forced" in sm:   # a configuration timed twice (default row and fixed row): the fixed one
        sm = (sm.assign(_default=~sm["kernel_forced"].fillna(True).astype(bool)).sort_values("_default")
              .drop_duplicates([c for c in ("run_id", "batch", "heads", "q_len", "ctx", "cta_rows") if c in sm]))
    t = sm.pivot_table(index=["batch", "heads", "q_len", "ctx"], columns="cta_rows", values="time_us", aggfunc="min")
    if 64 not in t.columns or 32 not in t.columns:
        return pd.DataFrame()
    t = t.dropna().rename(columns={32: "split_32_rows_us", 64: "wide_64_rows_us"})
    t["wide / split"] = t["wide_64_rows_us"] / t["split_32_rows_us"]
    t.columns.name = None
    t = t.round(2).reset_index()
    t["picked"] = [choose_cta_rows(b, h, q) for b, h, q in zip(t["batch"], t["heads"], t["q_len"])]
    return t
