"""Two revisions of the kernel timed side by side in one process: an A/B run.

Separate processes make a poor comparison: v24's two processes and v25's, whose sm_90 loops
were the same, differed by up to 1.3% at q16 h8 16k. This tool builds the shipped sources and
another revision's (`--baseline`, a folder holding build.SOURCES, whose launcher exports the
same functions with the same signatures: CPP_DECLS), then times every shape with
both builds in interleaved rounds, the order alternating from shape to shape and round to
round. Each timing is a CUDA-graph replay after an L2 flush (bench.time_graph_us). The
table gives, per shape, each build's median and the shipped build's time over the baseline's
(the median of the rounds' ratios, and their range). Round 0 also checks that the two builds
give the same output (`max_abs_diff`; `outputs_agree` False, and a warning, past AB_MAX_ABS_DIFF).

The records go to data/results/kernel_ablation.jsonl, as variant `full` (the shipped sources)
and `src_<name>` (the baseline), both under the run's --tag and with a `baseline` field;
`recorded_ab_table(tag, name)` gives the table again (notebook 03).

    mkdir -p .ab/REV && git archive REV src/kernels | tar -x -C .ab/REV   # the baseline's sources
    python -m sm120_workbook.kernels.ab --baseline .ab/REV/src/kernels --baseline-name v25 --tag v26

`--shape batch,heads,q_len,ctx` (repeatable) times more shapes after the targets' own, for
a change whose cost lies elsewhere (a batch past 128 requests takes v19's pool rule), and
`--masked-shape` (repeatable) a verify shape with SGLang's custom mask passed (the causal chain
written out, the path a tree verify takes), for a change to that path (v31's mask bound).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from ..results import NotRecorded, add_record_args
from .bench import Inputs, Shape, build_sm120_mla, parse_shape, replays, time_graph_us
from .build import build_in_parallel, source_dir_of, sources_sha256

SHIPPED = "full"
# Two builds of one computation agree to bf16 rounding of outputs of magnitude ~1 (the tests'
# tolerance is 1e-2 relative); past this, the A/B times two different computations.
AB_MAX_ABS_DIFF = 5e-2


def target_shapes() -> list[Shape]:
    """The shapes the kernel issue's targets read (targets.target_grid's sm120_mla rows)."""
    from .targets import target_grid

    return [s for impl, s, _ in target_grid() if impl == "sm120_mla"]


def run_ab(shapes, baseline: str, baseline_variant: str, rounds: int = 5, reps: int = 50,
           masked_shapes=()) -> list[dict]:
    """Time each shape with the shipped build and the baseline's, `rounds` times over; the
    masked shapes with SGLang's custom mask (records with `custom_mask` true)."""
    from tqdm.auto import tqdm

    cases = [(s, False) for s in shapes] + [(s, True) for s in masked_shapes]
    inputs = {s: Inputs(s) for s, _ in cases}
    builds = {SHIPPED: None, baseline_variant: baseline}
    records = []
    with tqdm(total=rounds * len(cases) * 2, desc="A/B") as bar:
        for r in range(rounds):
            for i, (s, masked) in enumerate(cases):
                order = list(builds) if (r + i) % 2 == 0 else list(builds)[::-1]
                outs = {}
                for name in order:
                    fn = build_sm120_mla(inputs[s], kernel_source=builds[name], custom_mask=masked)
                    if r == 0:
                        outs[name] = fn().float()   # a copy: the next build has its own buffers
                    t = time_graph_us(fn, reps=reps)
                    records.append({"impl": "sm120_mla", "variant": name, "defines": [], **s.__dict__,
                                    "custom_mask": masked,
                                    "tile_keys": fn.tile_keys, "cta_rows": fn.cta_rows,
                                    "num_splits": fn.num_splits, "round": r, **t})
                    bar.update()
                if r == 0:
                    diff = (outs[SHIPPED] - outs[baseline_variant]).abs().max().item()
                    agree = diff <= AB_MAX_ABS_DIFF   # False for NaN too
                    if not agree:
                        print(f"WARNING: {s.label}{' mask' if masked else ''}: the builds' outputs differ by "
                              f"{diff:.3g} (> {AB_MAX_ABS_DIFF}): their times are of different computations",
                              file=sys.stderr)
                    for rec in records[-2:]:
                        rec["max_abs_diff"], rec["outputs_agree"] = diff, agree
    return records


def ab_table(records, baseline_variant: str):
    """Per shape: each build's median µs, and shipped / baseline (median over rounds, range)."""
    import pandas as pd

    rows = []
    shape_keys = ("batch", "heads", "q_len", "ctx", "short_ctx")
    by_shape: dict[tuple, dict] = {}
    for rec in records:   # custom_mask: NaN in a table beside older records, bool or numpy's bool
        masked = rec.get("custom_mask") in (True,)
        key = (*(rec[k] for k in shape_keys), masked)
        by_shape.setdefault(key, {}).setdefault(rec["round"], {})[rec["variant"]] = rec
    for key, by_round in by_shape.items():
        pairs = [v for v in by_round.values() if SHIPPED in v and baseline_variant in v]
        if not pairs:
            continue
        ratios = [p[SHIPPED]["time_us"] / p[baseline_variant]["time_us"] for p in pairs]
        rows.append({"shape": Shape(*(int(v) for v in key[:-1])).label + (" mask" if key[-1] else ""),
                     "shipped_us": statistics.median(p[SHIPPED]["time_us"] for p in pairs),
                     "baseline_us": statistics.median(p[baseline_variant]["time_us"] for p in pairs),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "rounds": len(pairs), "max_abs_diff": pairs[0][SHIPPED].get("max_abs_diff"),
                     "outputs_agree": pairs[0][SHIPPED].get("outputs_agree")})
    df = pd.DataFrame(rows).round({"shipped_us": 2, "baseline_us": 2, "ratio": 4, "ratio_min": 4, "ratio_max": 4})
    if "outputs_agree" in df and df["outputs_agree"].isna().all():   # records from before the check
        df = df.drop(columns="outputs_agree")
    return df


def recorded_ab_table(version: str, baseline: str, df=None, gpu: str = "H200"):
    """A recorded A/B run as `ab_table`: the newest run in data/results/kernel_ablation.jsonl
    tagged `version` whose baseline is `baseline` (its --baseline-name), on a GPU whose name
    contains `gpu`."""
    from ..results import load_records, on_gpu, source_label

    df = load_records("kernel_ablation") if df is None else df
    variant = "src_" + baseline
    if len(df) == 0 or "baseline" not in df:
        raise NotRecorded("baseline: no A/B run recorded (kernel_ablation.jsonl has no baseline field)")
    runs = df[(df["kernel_version"] == version) & (df["baseline"] == variant) & on_gpu(df, gpu)]
    if len(runs) == 0:
        recorded = sorted({(str(v), b.removeprefix("src_")) for v, b in zip(df["kernel_version"], df["baseline"])
                           if isinstance(b, str)})
        raise NotRecorded(f"version, baseline: no A/B run of {version!r} against {baseline!r} on {gpu}; "
                          f"recorded on any GPU: {recorded}")
    newest = runs[runs["date"] == runs["date"].max()]   # one append, one date: the newest run
    table = ab_table(newest.to_dict("records"), variant)
    table.attrs["source"] = source_label(newest, live=False)   # printed by results.table_text
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_args(ap, "kernel_ablation")
    ap.add_argument("--baseline", required=True, help="a folder with the other revision's kernel sources")
    ap.add_argument("--baseline-name", required=True, help="its label, e.g. the version it is (v25)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=replays, default=50, help="graph replays a timing")
    ap.add_argument("--shape", action="append", default=[], metavar="B,H,Q,CTX",
                    help="a shape to time after the targets' (repeatable): batch,heads,q_len,ctx")
    ap.add_argument("--masked-shape", action="append", default=[], metavar="B,H,Q,CTX",
                    help="a verify shape (q_len > 1) to time with SGLang's custom mask passed (repeatable)")
    args = ap.parse_args(argv)
    try:
        extra = [parse_shape(t) for t in args.shape]
        masked = [parse_shape(t) for t in args.masked_shape]
    except ValueError as e:
        ap.error(str(e))
    if any(s.q_len == 1 for s in masked):
        ap.error("--masked-shape: decode (q_len 1) takes no mask; give a verify shape")
    try:
        baseline = str(source_dir_of(args.baseline, "--baseline"))
    except ValueError as e:
        ap.error(str(e))
    if baseline == str(source_dir_of()):
        ap.error("--baseline: that is the shipped sources' own folder; give another revision's")
    if not args.tag:
        ap.error("--tag: an A/B run's records need the shipped build's kernel version label")
    if args.rounds < 1:
        ap.error("--rounds must be positive")
    if not torch.cuda.is_available():
        sys.exit("the A/B run needs a CUDA GPU; none is visible to torch")
    variant = "src_" + args.baseline_name
    build_in_parallel([()], source_dirs=(None, baseline))
    # the baseline's folder is outside git (.ab/REV): its sources' digest names the revision it holds
    sources = {"sources_sha256": sources_sha256(), "baseline_sources_sha256": sources_sha256(baseline)}
    records = [dict(r, kernel_version=args.tag, baseline=variant, **sources)
               for r in run_ab(target_shapes() + extra, baseline, variant, rounds=args.rounds, reps=args.reps,
                               masked_shapes=masked)]
    print(ab_table(records, variant).to_string(index=False))
    if not args.no_record:
        from ..results import append_cli_records

        path = append_cli_records("kernel_ablation", records, "sm120_workbook.kernels.ab", argv, args.out)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
