"""The split count swept at given shapes, beside FlashMLA, in interleaved rounds.

`choose_num_splits` takes as many KV splits a request as fill one wave of CTAs, from static
shapes only (a captured graph replays for any lengths). This tool says whether another count
is faster at a shape: each round times the workspace's own choice, every count in --splits at
each --tile-keys, and FlashMLA, shape after shape, on fresh graphs (targets.run_rounds). The
table gives each count's median time over the rounds, its time over the workspace's choice
(the median of the rounds' ratios, and their range), and FlashMLA's time over it.

    python -m sm120_workbook.kernels.splits --shape 32,16,1,16384 --splits 2,3,4,6,8 [--tile-keys 16,32]

The records go to data/results/kernel_splits.jsonl (kernel_bench.jsonl's fields, with `round`),
apart from the benchmark runs that the notebooks' tables read; `recorded_sweep_table(tag)` gives
the newest sweep again (notebook 03).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from ..results import NotRecorded, add_record_args
from .bench import Shape, parse_shape, replays

DEFAULT = "default"   # the workspace's own split count and tile


def sweep_grid(shapes: list[Shape], splits: list[int], tile_keys: list[int]) -> list[tuple[str, Shape, dict]]:
    """One round: per shape, the workspace's choice, each (tile, count) forced, then FlashMLA."""
    grid = []
    for s in shapes:
        grid.append(("sm120_mla", s, {}))
        grid += [("sm120_mla", s, {"num_splits": n, "tile_keys": k}) for k in tile_keys for n in splits]
        grid.append(("flashmla", s, {}))
    return grid


def _config(rec: dict) -> tuple:
    """A record's configuration as a sortable key: the default first, then (tile, splits) in
    numbers, FlashMLA last. A failed build has no tile_keys (bench.run records it on success)."""
    if rec["impl"] != "sm120_mla":
        return (2, rec["impl"])
    if not rec["num_splits_forced"]:
        return (0, DEFAULT)
    tile = rec.get("tile_keys")
    # int(): records read back through pandas hold floats where FlashMLA's rows have no count
    return (1, None if tile is None or tile != tile else int(tile), int(rec["num_splits"]))


def _label(config: tuple, default: dict | None = None) -> str:
    if config[0] == 1:
        return f"splits {config[2]}, tile {'?' if config[1] is None else config[1]}"
    if config[0] == 0 and default is not None:
        return f"{DEFAULT} (splits {int(default['num_splits'])}, tile {int(default['tile_keys'])})"
    return str(config[1])


def sweep_table(records: list[dict]):
    """Per shape and configuration: median µs; over the workspace's choice (median of the rounds'
    ratios, min, max); FlashMLA's time over it (median). Failed records are left out."""
    import pandas as pd

    flash, default_key = (2, "flashmla"), (0, DEFAULT)
    by_shape: dict[tuple, dict[int, dict[tuple, dict]]] = {}
    for rec in records:
        if rec.get("status", "ok") != "ok":
            continue
        key = (rec["batch"], rec["heads"], rec["q_len"], rec["ctx"])
        by_shape.setdefault(key, {}).setdefault(rec["round"], {})[_config(rec)] = rec
    rows = []
    for (b, h, q, ctx), rounds in by_shape.items():
        default = next((r[default_key] for r in rounds.values() if default_key in r), None)
        for c in sorted({c for r in rounds.values() for c in r if c != flash}, key=lambda c: (c[0], c[1:])):
            t = [r[c]["time_us"] for r in rounds.values() if c in r]
            over_default = [r[c]["time_us"] / r[default_key]["time_us"]
                            for r in rounds.values() if c in r and default_key in r]
            vs_flash = [r[flash]["time_us"] / r[c]["time_us"] for r in rounds.values() if c in r and flash in r]
            rows.append({"shape": Shape(int(b), int(h), int(q), int(ctx)).label, "config": _label(c, default),
                         "time_us": statistics.median(t),
                         "over_default": statistics.median(over_default) if over_default else None,
                         "min": min(over_default, default=None), "max": max(over_default, default=None),
                         "flashmla_over": statistics.median(vs_flash) if vs_flash else None, "rounds": len(t)})
    return pd.DataFrame(rows).round({"time_us": 2, "over_default": 4, "min": 4, "max": 4, "flashmla_over": 3})


def recorded_sweep_table(version: str, df=None, gpu: str = "H200"):
    """The newest recorded sweep of kernel version `version` (its --tag) on a GPU whose name
    contains `gpu`, from data/results/kernel_splits.jsonl, as `sweep_table`."""
    from ..results import load_records, on_gpu

    df = load_records("kernel_splits") if df is None else df
    runs = df[(df["kernel_version"] == version) & on_gpu(df, gpu)] if len(df) else df
    if len(runs) == 0:
        recorded = sorted({str(v) for v in df.get("kernel_version", [])})
        raise NotRecorded(f"version: no split sweep of {version!r} on {gpu} recorded; recorded on any GPU: {recorded}")
    newest = runs[runs["run_id"] == runs["run_id"].max()]   # one process, one run_id
    return sweep_table(newest.to_dict("records"))


def parse_ints(arg: str, text: str, allowed=None) -> list[int]:
    """A comma-separated list of positive integers (each in `allowed`, if given)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{arg}: {text!r}; give comma-separated integers, e.g. 2,4,8") from None
    if any(v < 1 for v in values) or (allowed is not None and not set(values) <= set(allowed)):
        if isinstance(allowed, range):
            need = f"in {allowed.start}..{allowed.stop - 1}"
        else:
            need = f"one of {sorted(allowed)}" if allowed is not None else "positive"
        raise ValueError(f"{arg}: {text!r}; each must be {need}")
    return values


def main(argv=None):
    from .verify_attention import MAX_SPLITS, TILE_KEYS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", required=True, metavar="B,H,Q,CTX",
                    help="a shape to sweep (repeatable): batch,heads,q_len,ctx")
    ap.add_argument("--splits", required=True, help="split counts to force, e.g. 2,3,4,6,8")
    ap.add_argument("--tile-keys", default="16", help=f"key tiles to force them with, of {list(TILE_KEYS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=replays, default=50, help="graph replays a timing")
    add_record_args(ap, "kernel_splits")
    args = ap.parse_args(argv)
    try:
        shapes = [parse_shape(t) for t in args.shape]
        splits = parse_ints("--splits", args.splits, range(1, MAX_SPLITS + 1))
        tiles = parse_ints("--tile-keys", args.tile_keys, TILE_KEYS)
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (a range needs two)")
    import torch

    if not torch.cuda.is_available():
        sys.exit("the split sweep needs a CUDA GPU; none is visible to torch")
    from .targets import run_rounds

    records, _ = run_rounds(args.rounds, reps=args.reps, grid=sweep_grid(shapes, splits, tiles))
    for rec in records:
        if rec["status"] != "ok":
            print(f"not timed: {_label(_config(rec))} at b{rec['batch']} h{rec['heads']}: {rec.get('error', '')[:100]}")
    import pandas as pd

    with pd.option_context("display.width", 200):
        print(sweep_table(records).to_string(index=False))
    if not args.no_record:
        from ..results import append_cli_records

        ok = [dict(r, kernel_version=args.tag) for r in records if r["status"] == "ok"]
        path = append_cli_records("kernel_splits", ok, "sm120_workbook.kernels.splits", argv, args.out)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
