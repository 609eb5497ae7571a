"""Where a round of the 64-row kernel goes, phase by phase, from clock64() stamps.

    python -m sm120_workbook.kernels.phase_trace --heads 8 --q-len 16 --ctx 65536

builds the wide kernel with WIDE_TRACE (lane 0 of every warp of CTA (0, 0, 0) stamps each phase
boundary of its first 64 rounds; mla_verify_wide.cuh), runs one call and prints, per row pair,
the median cycles of each phase of a round: the wait for barrier A, QK, the pair barriers, the
softmax and P.V. Nsight Compute's stall samples say what the warps wait on; this says when,
and whether the two row pairs' phases overlap as the schedule intends. The stamps cost a few
instructions a phase, so the traced call is a little slower than the shipped build (the
record carries both times).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from ..results import add_record_args

TRACE_DEFINE = "WIDE_TRACE"
# Phase names of each event slot after "arrive A" (slot 0), in program order (mla_verify_wide.cuh).
IN_STEP_PHASES = ("A wait", "QK", "B wait", "softmax", "C wait", "P.V")
LAGGING_PHASES = ("A wait", "softmax(t-1)", "C wait", "P.V(t-1)", "QK")
# WIDE_FUSED: QK(t) and P.V(t-1) are one phase of each warp.
FUSED_PHASES = ("A wait", "QK+P.V(t-1)", "B wait", "softmax", "C wait")
FUSED_LAGGING_PHASES = ("A wait", "softmax(t-1)", "C wait", "QK+P.V(t-1)")
ALL_PHASES = tuple(dict.fromkeys(IN_STEP_PHASES + LAGGING_PHASES + FUSED_PHASES + FUSED_LAGGING_PHASES))


def build_schedule(defines=()) -> dict[str, bool]:
    """The wide kernel's schedule switches (WIDE_PINGPONG, WIDE_FUSED) in a build with these
    defines: the source's defaults, overridden by any `NAME=value` among them."""
    import re

    from .build import KERNEL_DIR

    src = (KERNEL_DIR / "mla_verify_wide.cuh").read_text()
    out = {}
    for name in ("WIDE_PINGPONG", "WIDE_FUSED"):
        m = re.search(rf"#define {name} (\d+)", src)
        out[name] = bool(int(m.group(1))) if m else False
        for d in defines:
            if d.startswith(name + "="):
                out[name] = bool(int(d.split("=", 1)[1]))
    return {"pingpong": out["WIDE_PINGPONG"], "fused": out["WIDE_FUSED"]}


def phase_table(clocks: np.ndarray, warps_per_pair: int = 4, pingpong: bool = True, skip: int = 2,
                fused: bool = False) -> pd.DataFrame:
    """Median cycles of each phase and of the whole round, per row pair, from stamps shaped
    [warps, rounds, events] (0 where a round was not reached). Rounds with every stamp set
    are used, leaving out the first `skip` (the ring filling) and the last (the tail).
    `pingpong` and `fused` name the build's schedule (`build_schedule`)."""
    clocks = np.asarray(clocks, dtype=np.int64)
    if clocks.ndim != 3 or clocks.shape[0] % warps_per_pair:
        raise ValueError(f"clocks: expected [warps, rounds, events] with warps a multiple of {warps_per_pair}, "
                         f"got shape {clocks.shape}")
    rows = []
    for pair in range(clocks.shape[0] // warps_per_pair):
        lagging = pingpong and pair == 1
        if fused:
            names = FUSED_LAGGING_PHASES if lagging else FUSED_PHASES
        else:
            names = LAGGING_PHASES if lagging else IN_STEP_PHASES
        c = clocks[pair * warps_per_pair:(pair + 1) * warps_per_pair, :, :len(names) + 1]
        done = (c > 0).all(axis=(0, 2))
        rounds = np.flatnonzero(done)
        if lagging:
            rounds = rounds[rounds >= 1]   # round 0 of the lagging pair has no softmax or P.V
        rounds = rounds[skip:-1] if len(rounds) > skip + 1 else rounds[:0]
        if len(rounds) < 2:
            raise ValueError(f"clocks: row pair {pair} has fewer than 2 complete rounds to measure")
        steps = np.diff(c[:, rounds, :], axis=2)                          # [warps, rounds, phases]
        period = c[:, rounds[1:], 0] - c[:, rounds[:-1], 0]                # arrive A to arrive A
        row = {"row pair": pair, "schedule": "a phase behind" if lagging else "in order", "rounds": len(rounds)}
        row.update({n: float(np.median(steps[:, :, i])) for i, n in enumerate(names)})
        row["round"] = float(np.median(period))
        rows.append(row)
    used = [n for n in ALL_PHASES if any(n in r for r in rows)]
    return pd.DataFrame(rows).reindex(columns=["row pair", "schedule", "rounds", *used, "round"])


def recorded_table(df=None, heads: int = 8, q_len: int = 16, ctx: int = 65536, gpu: str = "H200") -> pd.DataFrame:
    """The recorded phase traces of one shape on a GPU whose name contains `gpu` (cycles at its
    clock: another GPU's traces are not comparable), from data/results/kernel_phase_trace.jsonl:
    the newest of each build and row pair, the shipped build first; cycles of each phase and the round."""
    from ..results import load_records, on_gpu, source_label

    df = load_records("kernel_phase_trace") if df is None else df
    if len(df) == 0:
        return pd.DataFrame()
    df = df[(df["heads"] == heads) & (df["q_len"] == q_len) & (df["ctx"] == ctx) & on_gpu(df, gpu)].copy()
    df["build"] = [", ".join(d) if len(d) else "(shipped build)" for d in df["defines"]]
    df = df.sort_values("date").groupby(["build", "row pair"]).tail(1)
    # each build's newest trace, whatever version it was taken at: the column says which
    df["version"] = df["kernel_version"] if "kernel_version" in df else None
    cols = ["build", "version", "row pair", "schedule", *[n for n in ALL_PHASES if n in df.columns], "round",
            "untraced_us"]
    builds = list(df.drop_duplicates("build")["build"])   # the shipped build first, the others as recorded
    order = {b: (b != "(shipped build)", i) for i, b in enumerate(builds)}
    t = (df.assign(_o=df["build"].map(order)).sort_values(["_o", "row pair"]).reindex(columns=cols)
         .rename(columns={"untraced_us": "us untraced"}).reset_index(drop=True))
    t.attrs["source"] = source_label(df, live=False)   # printed by results.table_text
    return t


def main(argv=None) -> None:
    from .bench import add_shape_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(ap)
    ap.add_argument("--define", action="append", default=[], help="another build define, e.g. WIDE_PINGPONG=0")
    add_record_args(ap, "kernel_phase_trace")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("the phase trace needs a CUDA GPU; none is visible to torch")
    from .bench import L2_FLUSH, Inputs, diagnostic_and_shipped, shape_from_args
    from .build import load_kernel_module

    defines = tuple(a.define) + (TRACE_DEFINE,)
    shape = shape_from_args(a)
    traced, traced_us, untraced_us = diagnostic_and_shipped(Inputs(shape), a.define, TRACE_DEFINE)
    times = {"traced_us": traced_us, "untraced_us": untraced_us}
    traced()
    torch.cuda.synchronize()
    clocks = load_kernel_module(defines=defines).wide_phase_trace().numpy()
    table = phase_table(clocks, **build_schedule(a.define))
    print(f"b{a.batch} h{a.heads} q{a.q_len} ctx {a.ctx}, 64-row kernel, defines {list(a.define) or 'none'}: "
          f"{times['traced_us']:.1f} us traced, {times['untraced_us']:.1f} us without the stamps; "
          f"median cycles per 16-key round of CTA (0, 0, 0):")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.0f}"))
    if a.no_record:
        return
    from ..results import append_cli_records

    records = [{k: v for k, v in r.items() if not (isinstance(v, float) and np.isnan(v))}
               | {"impl": "sm120_mla", **shape.__dict__, "cta_rows": 64, "defines": list(a.define), **times,
                  "kernel_version": a.tag, "l2_flush": L2_FLUSH}
               for r in table.to_dict("records")]
    path = append_cli_records("kernel_phase_trace", records, "sm120_workbook.kernels.phase_trace", argv, a.out)
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
