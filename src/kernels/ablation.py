"""Where a tile's time goes: the split kernel timed with parts of its work compiled out.

Each variant builds mla_verify.cuh with ABLATE_* switches that drop the KV loads, the QK
product, the softmax or the P.V product (its output is then meaningless; only the time is
kept). If removing a part leaves the time unchanged, that part is not on the critical path.
Other variants change a tuning define (PREFETCH_AHEAD) or the tile shape; those stay correct.
Timed like the benchmark (CUDA-graph replay, L2 flushed, median), in one run.

    python -m sm120_workbook.kernels.ablation [--out data/results/kernel_ablation.jsonl]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from ..results import NotRecorded, add_record_args
from .bench import Inputs, Shape, build_sm120_mla, replays, time_graph_us
from .build import build_in_parallel


@dataclass(frozen=True)
class Variant:
    defines: tuple[str, ...] = ()
    tile_keys: int = 16
    num_splits: int | None = None   # None: the workspace's own choice (one wave of CTAs)
    cta_rows: int = 32              # 32: the split kernel (mla_verify.cuh); 64: the wide kernel (v17)


_MATH = ("ABLATE_NO_QK", "ABLATE_NO_SOFTMAX", "ABLATE_NO_PV")
VARIANTS = {
    "full": Variant(),
    "no_loads": Variant(("ABLATE_NO_LOADS",)),
    "no_qk": Variant(("ABLATE_NO_QK",)),
    "no_softmax": Variant(("ABLATE_NO_SOFTMAX",)),
    "no_pv": Variant(("ABLATE_NO_PV",)),
    "loads_only": Variant(_MATH),
    # with the loads gone too: which part of the math is on the critical path
    "no_loads_no_qk": Variant(("ABLATE_NO_LOADS", "ABLATE_NO_QK")),
    "no_loads_no_softmax": Variant(("ABLATE_NO_LOADS", "ABLATE_NO_SOFTMAX")),
    "no_loads_no_pv": Variant(("ABLATE_NO_LOADS", "ABLATE_NO_PV")),
    "handovers_only": Variant(("ABLATE_NO_LOADS",) + _MATH),
    # the skeleton without its staged-index copies: barriers and loop bookkeeping only
    "barriers_only": Variant(("ABLATE_NO_LOADS", "ABLATE_NO_INDEX") + _MATH),
    # L2 prefetch of the rows PREFETCH_AHEAD tiles ahead (default 0: none), the stage
    # refill after the hand-over (LATE_REFILL) and 32-key tiles
    "prefetch1": Variant(("PREFETCH_AHEAD=1",)),
    "prefetch4": Variant(("PREFETCH_AHEAD=4",)),
    "prefetch8": Variant(("PREFETCH_AHEAD=8",)),
    "late_refill": Variant(("GROUP_BARRIERS=1", "LATE_REFILL=1")),
    "late_refill_handovers_only": Variant(("GROUP_BARRIERS=1", "LATE_REFILL=1", "ABLATE_NO_LOADS") + _MATH),
    "tk32": Variant(tile_keys=32),
    # one 16-key tile in flight instead of two (STAGES_16=3): latency-bound loads slow down
    "stages3": Variant(("STAGES_16=3",)),
    "stages3_loads_only": Variant(("STAGES_16=3",) + _MATH),
    "stages3_handovers_only": Variant(("STAGES_16=3", "ABLATE_NO_LOADS") + _MATH),
    # the loads alone on fewer CTAs (q16 h8: 4 row CTAs a split; 16 and 8 splits are about half
    # and a quarter of the H200's 33, a third and a sixth of an RTX PRO 6000's 47): if they are
    # bound by an aggregate rate (L2 -> SMs), fewer CTAs take about as long; if each SM is its
    # own limit, half the CTAs take twice as long
    "loads_only_splits16": Variant(_MATH, num_splits=16),
    "loads_only_splits8": Variant(_MATH, num_splits=8),
    # the row CTAs of a split start their walk over its tiles 1 or 8 tiles apart (TILE_STAGGER)
    "stagger1": Variant(("TILE_STAGGER=1",)),
    "stagger8": Variant(("TILE_STAGGER=8",)),
    "stagger8_loads_only": Variant(("TILE_STAGGER=8",) + _MATH),
    # the score warps issue 4 of each thread's 9 refill copies (SPLIT_LOADS), off the value
    # warps' critical path (correct output)
    "split_loads": Variant(("SPLIT_LOADS=1",)),
    "split_loads_loads_only": Variant(("SPLIT_LOADS=1",) + _MATH),
    # P.V(t) beside the softmax(t+1) instead of beside QK(t+1): the tensor pipe is shared by
    # one group at a time (PV_LAG in mla_verify.cuh; correct output)
    "pv_lag": Variant(("PV_LAG=1",)),
    "pv_lag_no_loads": Variant(("PV_LAG=1", "ABLATE_NO_LOADS")),
    "pv_lag_stages3": Variant(("PV_LAG=1", "STAGES_16=3")),
    # no __syncwarp before the hand-over barrier (redundant since v14's non-.aligned barrier)
    "no_syncwarp": Variant(("HANDOVER_SYNCWARP=0",)),
    # v14's group barriers: each group's mid-tile wait on its own named barrier, so the
    # groups' mid-tile work overlaps (correct output; not racecheck clean)
    "group_barriers": Variant(("GROUP_BARRIERS=1",)),
    # v17, the 64-row wide kernel (mla_verify_wide.cuh; the same ABLATE_* switches): half the
    # re-read at q16 h8, each warp holding Q and O for its rows. Its row pairs run a phase
    # apart (the default; `wide_pingpong` names it explicitly) or in step (`wide_lockstep`);
    # `wide_refill_first` issues a round's refill copies before QK instead of between its
    # k-steps (v17e)
    "wide": Variant(cta_rows=64),
    "wide_lockstep": Variant(("WIDE_PINGPONG=0",), cta_rows=64),
    "wide_pingpong": Variant(("WIDE_PINGPONG=1",), cta_rows=64),
    "wide_refill_first": Variant(("WIDE_REFILL_IN_QK=0",), cta_rows=64),
    "wide_no_loads": Variant(("ABLATE_NO_LOADS",), cta_rows=64),
    "wide_loads_only": Variant(_MATH, cta_rows=64),
    "wide_no_softmax": Variant(("ABLATE_NO_SOFTMAX",), cta_rows=64),
    "wide_handovers_only": Variant(("ABLATE_NO_LOADS",) + _MATH, cta_rows=64),
    "wide_stages3": Variant(("WIDE_STAGES=3",), cta_rows=64),
    # v17f: each warp's QK(t) and P.V(t-1) as one instruction stream (WIDE_FUSED), so P.V's
    # independent mma.sync fill the gaps in QK's four accumulator chains
    "wide_fused": Variant(("WIDE_FUSED=1",), cta_rows=64),
    "wide_fused_lockstep": Variant(("WIDE_FUSED=1", "WIDE_PINGPONG=0"), cta_rows=64),
    "wide_fused_no_loads": Variant(("WIDE_FUSED=1", "ABLATE_NO_LOADS"), cta_rows=64),
    "wide_fused_stages3": Variant(("WIDE_FUSED=1", "WIDE_STAGES=3"), cta_rows=64),
    # the combine step launched in order after the attention kernel instead of as its
    # programmatic dependent (COMBINE_PDL=0, as before session 10; `pdl` / `wide_pdl` in older
    # records are the dependent launch when it was off by default)
    "no_pdl": Variant(("COMBINE_PDL=0",)),
    "wide_no_pdl": Variant(("COMBINE_PDL=0",), cta_rows=64),
    # how the 64-row kernel's Q reaches the registers (through shared memory by default, v18),
    # and its partial outputs (bf16 staged through shared memory by default, v18b); v17e's
    # way of both (fp32 partials from the accumulators), and all three changes undone
    "wide_q_regs": Variant(("WIDE_Q_SMEM=0",), cta_rows=64),
    "wide_fp32_partials": Variant(("WIDE_BF16_PARTIALS=0",), cta_rows=64),
    "wide_v17e_io": Variant(("WIDE_Q_SMEM=0", "WIDE_BF16_PARTIALS=0", "COMBINE_PDL=0"), cta_rows=64),
    # without the L2 prefetch of the first tiles' key rows while Q arrives (v18e)
    "wide_no_tile_prefetch": Variant(("WIDE_PREFETCH_FIRST_TILES=0",), cta_rows=64),
    # the combine step without its partials loaded beside the LSE pass (COMBINE_PRELOAD, v18f)
    "no_preload": Variant(("COMBINE_PRELOAD=0",)),
    "wide_no_preload": Variant(("COMBINE_PRELOAD=0",), cta_rows=64),
    # every split of a row group copying its Q rows in the same order (WIDE_Q_STAGGER=0, as up to v18f)
    "wide_no_q_stagger": Variant(("WIDE_Q_STAGGER=0",), cta_rows=64),
    # Q into the ring by cp.async, as up to v18h, instead of plain 16-byte loads (WIDE_Q_LDG=0;
    # `wide_q_ldg` in session 12's records is the plain loads when they were off by default)
    "wide_q_cp_async": Variant(("WIDE_Q_LDG=0",), cta_rows=64),
    # v1's floor of 64 keys a split, as up to v18j, or 32, instead of 16 (MIN_KEYS_PER_SPLIT: fewer
    # splits of more tiles at short contexts); the split kernel serves decode. (`min_keys16` in
    # session 13's records is the floor of 16 when 64 was the default.)
    "min_keys64": Variant(("MIN_KEYS_PER_SPLIT=64",)),
    "min_keys32": Variant(("MIN_KEYS_PER_SPLIT=32",)),
    "wide_min_keys64": Variant(("MIN_KEYS_PER_SPLIT=64",), cta_rows=64),
    # the split kernel's first tiles each waiting for their own index load, as up to v18k,
    # instead of one batch of index loads (STAGED_PROLOGUE=0)
    "unstaged_prologue": Variant(("STAGED_PROLOGUE=0",)),
    # only the first one or two of the ring's tiles copied before tile 0's hand-over, the rest
    # right after it (PROLOGUE_EARLY_STAGES: 2 is the default since v18n), or all of them, as up
    # to v18m
    "early_stages1": Variant(("PROLOGUE_EARLY_STAGES=1",)),
    "early_stages2": Variant(("PROLOGUE_EARLY_STAGES=2",)),
    "all_stages_first": Variant(("PROLOGUE_EARLY_STAGES=0",)),
    # decode (max_q_len * heads <= 16) on the split kernel's two m16 tiles, as up to v18l
    # (DECODE_ONE_MTILE=0), with and without its loads
    "two_mtiles": Variant(("DECODE_ONE_MTILE=0",)),
    "two_mtiles_no_loads": Variant(("DECODE_ONE_MTILE=0", "ABLATE_NO_LOADS")),
    # decode at up to 8 heads on the one-tile build with the rows as the mma's M, padded to 16, as
    # up to v20 (DECODE_ROWS_AS_N=0), with and without its loads
    "rows_as_m": Variant(("DECODE_ROWS_AS_N=0",)),
    "rows_as_m_no_loads": Variant(("DECODE_ROWS_AS_N=0", "ABLATE_NO_LOADS")),
    # each value warp refills its own columns of a stage right after its P.V (EARLY_REFILL, a
    # candidate: session 14), instead of after the next mid-tile round
    "early_refill": Variant(("EARLY_REFILL=1",)),
    # the split kernel's partials as fp32 stored straight from the accumulators, as up to v22
    # (SPLIT_BF16_PARTIALS, v23: bf16 rows staged through the ring, 16-byte stores)
    "fp32_partials": Variant(("SPLIT_BF16_PARTIALS=0",)),
    # the split kernel's Q fragments as 4-byte loads straight into registers, as up to v23
    # (SPLIT_Q_SMEM, v24: 16-byte loads through a free ring stage, then ldmatrix)
    "q_regs": Variant(("SPLIT_Q_SMEM=0",)),
    # every request num_splits CTAs whatever its length, as up to v18n (v19 shares a row tile's
    # CTAs out by keys: BALANCED_SPLITS); differs only on a batch of mixed lengths (--short-ctx)
    "unbalanced": Variant(("BALANCED_SPLITS=0",)),
    "wide_unbalanced": Variant(("BALANCED_SPLITS=0",), cta_rows=64),
    # the combine step's split groups from num_splits alone, as up to v19 (COMBINE_POOL_GROUPS, v20,
    # sizes them for the most splits a pooled batch gives one row); differs where no preload fits
    "row_groups": Variant(("COMBINE_POOL_GROUPS=0",)),
    "wide_row_groups": Variant(("COMBINE_POOL_GROUPS=0",), cta_rows=64),
    # a batch's pool shared out by v19's rule, one CTA each and the spare ones by keys
    # (POOL_MIN_MAX, v20, minimises the most keys a CTA walks); differs on mixed lengths only
    "linear_pool": Variant(("POOL_MIN_MAX=0",)),
    "wide_linear_pool": Variant(("POOL_MIN_MAX=0",), cta_rows=64),
}
# verify (q16) and decode (q1) at 8 and 16 heads; decode at 16 heads runs another build (16 rows a
# CTA: the rows as the mma's M) than at 8 (DECODE_ROWS_AS_N)
SHAPES = (Shape(1, 8, 16, 65536), Shape(1, 8, 1, 65536), Shape(1, 16, 16, 65536), Shape(1, 16, 1, 65536))


def shapes_at(contexts, batch: int = 1, short_ctx: int = 0) -> tuple[Shape, ...]:
    """The ablation's shapes (SHAPES) at each of these contexts, `batch` requests each; short
    contexts show the fixed part, larger batches a step with every SM at work. short_ctx > 0
    makes a skewed batch: one request at the context, the others at short_ctx."""
    return tuple(Shape(batch, s.heads, s.q_len, c, short_ctx) for c in contexts for s in SHAPES)


SHAPE_ORDER = ("q16 h8", "q1 h8", "q16 h16", "q1 h16")


def recorded_table(df=None, version: str | None = None, ctx: int = 65536, variants=None, batch: int = 1,
                   short_ctx: int = 0, gpu: str = "H200"):
    """One recorded ablation run as a table: µs of each variant (rows, in VARIANTS order) at
    each shape (columns), from data/results/kernel_ablation.jsonl, at one context and batch
    (short_ctx > 0: the skewed batch with its other requests at short_ctx), on a GPU whose name
    contains `gpu` (a tag reused on another GPU is another run).
    `version` is a kernel_version tag or a list of them (default: the newest recorded);
    `variants` keeps only those rows. The newest record of each variant and shape is kept, and
    the build defines (and a fixed split count) say what the variant changed."""
    import pandas as pd

    from ..results import load_records, on_gpu, source_label
    from .bench_report import short_ctx_of

    df = load_records("kernel_ablation") if df is None else df
    if "baseline" in df:   # A/B runs of two revisions (ab.py): ab.recorded_ab_table reads them
        df = df[df["baseline"].isna()]
    if len(df):
        df = df[on_gpu(df, gpu)]
    if len(df) == 0:
        if version is not None:   # as the other readers: a named run that is not there is an error
            raise NotRecorded(f"version: no ablation recorded as {version!r} on {gpu}")
        return df
    df = df[(df["ctx"] == ctx) & (df["batch"] == batch) & (short_ctx_of(df) == short_ctx)].sort_values("date").copy()
    if "kernel_version" in df:
        tags = df["kernel_version"].dropna()
        if version is None and len(tags):
            version = tags.iloc[-1]
        if version is not None:
            wanted = [version] if isinstance(version, str) else list(version)
            missing = [v for v in wanted if v not in set(tags)]
            if missing:
                raise NotRecorded(f"version: no ablation recorded as {missing[0]!r} on {gpu}; recorded: {sorted(set(tags))}")
            df = df[df["kernel_version"].isin(wanted)]
    if variants is not None:
        df = df[df["variant"].isin(variants)]
    df["shape"] = [f"q{q} h{h}" for q, h in zip(df["q_len"], df["heads"])]
    newest = df.groupby(["variant", "shape"]).tail(1)
    t = newest.pivot(index="variant", columns="shape", values="time_us")
    rows = [n for n in VARIANTS if n in t.index] + sorted(set(t.index) - set(VARIANTS))
    cols = [c for c in SHAPE_ORDER if c in t.columns] + sorted(set(t.columns) - set(SHAPE_ORDER))
    t = t.loc[rows, cols].round(1)

    def changes(r):
        d = ", ".join(x for x in r["defines"] if x) if isinstance(r["defines"], list) else ""
        v = VARIANTS.get(r.name)
        if v is not None and v.num_splits:
            d = (d + ", " if d else "") + f"{v.num_splits} splits"
        rows = v.cta_rows if v is not None else r.get("cta_rows")   # a removed variant: as recorded
        if pd.notna(rows) and rows != 32:
            d = (d + ", " if d else "") + f"{int(rows)}-row kernel"
        return d or "(shipped build)"

    what = newest.drop_duplicates("variant").set_index("variant").apply(changes, axis=1)
    t.insert(0, "changes", what.reindex(rows))
    t.columns.name = None
    t = pd.DataFrame(t).reset_index()
    t.attrs["source"] = source_label(newest, live=False)   # printed by results.table_text
    return t


def recorded_tables_by_run(versions, df=None, gpu: str = "H200", **kw) -> list[tuple[str, object]]:
    """`recorded_table` of each run (one commit) of the tags in `versions` on a GPU whose name
    contains `gpu`, labelled "tag at commit, date": a tag re-run after a fix holds several runs,
    and each variant compares only with the `full` of its own run."""
    from ..results import load_records, on_gpu

    df = load_records("kernel_ablation") if df is None else df
    df = df[on_gpu(df, gpu)] if len(df) else df
    out = []
    for tag in [versions] if isinstance(versions, str) else versions:
        runs = df[df["kernel_version"] == tag].sort_values("date")
        if runs.empty:
            raise NotRecorded(f"versions: no ablation recorded as {tag!r} on {gpu}")
        for commit, run in runs.groupby("commit", sort=False):
            out.append((f"{tag} at {str(commit)[:7]}, {str(run['date'].iloc[0])[:16]}",
                        recorded_table(run, version=tag, gpu=gpu, **kw)))
    return out


def recorded_tables_by_context(versions, df=None, batch: int = 1, gpu: str = "H200") -> list[tuple[str, object]]:
    """`recorded_table` of each tag in `versions` at every context it was recorded at (batch
    `batch`, no skewed batches, on a GPU whose name contains `gpu`), labelled "ctx C, µs (one
    run, tag)", or by commit where the tag holds several runs: the contexts come from the
    records, not from a list beside them."""
    from ..results import load_records, on_gpu
    from .bench_report import short_ctx_of

    df = load_records("kernel_ablation") if df is None else df
    df = df[on_gpu(df, gpu)] if len(df) else df
    out = []
    for tag in [versions] if isinstance(versions, str) else versions:
        runs = df[(df["kernel_version"] == tag) & (df["batch"] == batch) & (short_ctx_of(df) == 0)]
        if runs.empty:
            raise NotRecorded(f"versions: no ablation recorded as {tag!r} at batch {batch} on {gpu}")
        commits = list(runs.sort_values("date")["commit"].unique())
        for commit in commits:   # a tag re-run at another commit: each run on its own
            run = runs[runs["commit"] == commit]
            name = f"one run, {tag}" if len(commits) == 1 else f"{tag} at {str(commit)[:7]}"
            for ctx in sorted(run["ctx"].unique()):
                table = recorded_table(run, version=tag, ctx=int(ctx), batch=batch, gpu=gpu)
                out.append((f"ctx {int(ctx)}, µs ({name})", table))
    return out


def build_all(variants=VARIANTS) -> None:
    """Compile every variant's build before timing any (build_in_parallel)."""
    build_in_parallel(v.defines for v in variants.values())


def run(shapes=SHAPES, variants=VARIANTS, reps: int = 30) -> list[dict]:
    records = []
    for shape in shapes:
        x = Inputs(shape)
        for name, v in variants.items():
            fn = build_sm120_mla(x, num_splits=v.num_splits, tile_keys=v.tile_keys, kernel_defines=v.defines,
                                 cta_rows=v.cta_rows)
            t = time_graph_us(fn, reps=reps)
            records.append({"impl": "sm120_mla", "variant": name, "defines": list(v.defines), **shape.__dict__,
                            "tile_keys": v.tile_keys, "cta_rows": v.cta_rows, "num_splits": fn.num_splits, **t})
            skew = f"+{shape.batch - 1}x{shape.short_ctx}" if shape.short_ctx else ""
            print(f"b{shape.batch} h{shape.heads:<3d} q{shape.q_len:<2d} ctx {shape.ctx:6d}{skew}  {name:20s} "
                  f"{t['time_us']:8.1f} us", flush=True)
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_args(ap, "kernel_ablation")
    ap.add_argument("--reps", type=replays, default=30)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=None,
                    help="run only these (default: all)")
    ap.add_argument("--ctx", type=int, nargs="+", default=[65536],
                    help="contexts to time each shape at (default 65536)")
    ap.add_argument("--batch", type=int, default=1, help="requests a step, each at that context (default 1)")
    ap.add_argument("--short-ctx", type=int, default=0,
                    help="a skewed batch: every request but the first at this context (default 0: none)")
    args = ap.parse_args(argv)
    if min(args.ctx) < 1:
        ap.error("--ctx: contexts must be positive")
    if args.batch < 1:
        ap.error("--batch: must be positive")
    if args.short_ctx < 0 or (args.short_ctx and args.batch < 2):
        ap.error("--short-ctx: needs --batch 2 or more, and a positive context")
    if not torch.cuda.is_available():
        sys.exit("the ablation needs a CUDA GPU; none is visible to torch")
    variants = {n: VARIANTS[n] for n in (args.variants or VARIANTS)}
    build_all(variants)
    records = [dict(r, kernel_version=args.tag)
               for r in run(shapes=shapes_at(args.ctx, args.batch, args.short_ctx), variants=variants,
                            reps=args.reps)]
    if args.no_record:
        return
    from ..results import append_cli_records

    path = append_cli_records("kernel_ablation", records, "sm120_workbook.kernels.ablation", argv, args.out)
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
