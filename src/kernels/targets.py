"""The kernel issue's targets, timed in interleaved rounds.

A target such as "at least as fast as FlashMLA" is a ratio of two medians, and one benchmark
run gives one ratio. From run to run FlashMLA's own time moves: at q16 h8 32k it measured 43.7
to 50.7 µs over 28 H200 benchmark runs (11 between 49.3 and 50.7, 17 between 43.7 and 46.8),
while this kernel's stayed within 50.4-51.3 µs over the last ten. So a ratio within a few
percent of 1 says little on its own (METHOD.md: a difference smaller than the spread of repeated
timings is noise).

This tool times only the shapes the targets read: sm120_mla as the workspace runs it by
default (the kernel, tile and split count it picks), each beside its target's baseline. It
repeats the whole set `--rounds` times in one process, round 1 of every shape, then round 2,
and so on. Each round's ratio pairs two timings taken seconds apart, on fresh graphs, and the
ceilings are measured once for the run. `bench_report.targets_over_rounds` gives each target
its median ratio, the range over the rounds, and a verdict: met in every round, missed in every
round, or mixed.

    python -m sm120_workbook.kernels.targets [--rounds 5] [--out data/results/kernel_targets.jsonl]
"""
from __future__ import annotations

import argparse
import sys

from ..results import add_record_args
from .bench import Shape, add_l2_flush_arg, replays, use_l2_flush

VERIFY_CTXS = (16384, 32768, 65536, 131072)   # "at least as fast as FlashMLA at every context from 16k to 128k"
TRITON_VERIFY_CTX = 65536                     # "at least 100x faster than SGLang's Triton verify path at 65k"
DECODE_CTXS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)   # "never slower at any context"


def target_grid() -> list[tuple[str, Shape, dict]]:
    """(impl, shape, builder kwargs) for one round: every shape `bench_report.targets_table`
    reads, sm120_mla at its default beside each baseline, a shape's impls next to each other."""
    grid = []
    for heads in (8, 16):   # Kimi K2 and the DeepSeek-V3 family under TP8
        for ctx in VERIFY_CTXS:
            v = Shape(1, heads, 16, ctx)
            grid += [("sm120_mla", v, {}), ("flashmla", v, {})]
            if ctx == TRITON_VERIFY_CTX:
                grid.append(("triton_verify", v, {}))
        b32 = Shape(32, heads, 16, 16384)
        grid += [("sm120_mla", b32, {}), ("flashmla", b32, {})]
        for ctx in DECODE_CTXS:
            d = Shape(1, heads, 1, ctx)
            grid += [("sm120_mla", d, {}), ("triton_decode", d, {})]
    return grid


def run_rounds(rounds: int, reps: int = 50, grid=None) -> tuple[list[dict], dict]:
    """Time `grid` (default: target_grid) `rounds` times over; each record says its `round`."""
    from .bench import run

    grid = grid or target_grid()
    records, ceilings = run(list(grid) * rounds, reps=reps)
    for i, rec in enumerate(records):
        rec["round"] = i // len(grid)
    return records, ceilings


def main(argv=None):
    ap = argparse.ArgumentParser(description="Time the kernel issue's target shapes in interleaved rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=replays, default=50, help="graph replays a timing (Triton verify: a fifth)")
    add_l2_flush_arg(ap)
    add_record_args(ap, "kernel_targets")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error(f"--rounds: {args.rounds}; a spread needs at least 2 rounds")
    import torch

    if not torch.cuda.is_available():
        sys.exit("the targets' rounds need a CUDA GPU; none is visible to torch")
    from .bench_report import targets_over_rounds

    use_l2_flush(args.l2_flush)
    records, _ = run_rounds(args.rounds, reps=args.reps)
    import pandas as pd

    ok = [dict(r, kernel_version=args.tag) for r in records if r["status"] == "ok"]
    failed = sorted({(r["impl"], r.get("error", "")[:120]) for r in records if r["status"] != "ok"})
    for impl, err in failed:
        print(f"not timed: {impl}: {err}")
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(targets_over_rounds(pd.DataFrame(ok)).to_string())
    if not args.no_record:
        from ..results import append_cli_records

        path = append_cli_records("kernel_targets", ok, "sm120_workbook.kernels.targets", argv, args.out)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
