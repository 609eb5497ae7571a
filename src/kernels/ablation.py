"""Where a tile's time goes: the split kernel timed with parts of its work compiled out.

Each variant builds mla_verify.cuh with ABLATE_* switches that drop the KV loads, the QK
product, the softmax or the P.V product (its output is then meaningless; only the time is
kept). If removing a part leaves the time unchanged, that part is not on the critical path.
Timed like the benchmark (CUDA-graph replay, L2 flushed, median), in one run.

    python -m sm120_workbook.kernels.ablation [--out data/results/kernel_ablation.jsonl]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from .bench import Inputs, Shape, build_sm120_mla, time_graph_us

VARIANTS = {
    "full": (),
    "no_loads": ("ABLATE_NO_LOADS",),
    "no_qk": ("ABLATE_NO_QK",),
    "no_softmax": ("ABLATE_NO_SOFTMAX",),
    "no_pv": ("ABLATE_NO_PV",),
    "loads_only": ("ABLATE_NO_QK", "ABLATE_NO_SOFTMAX", "ABLATE_NO_PV"),
}
SHAPES = (Shape(1, 8, 16, 65536), Shape(1, 8, 1, 65536), Shape(1, 16, 16, 65536))


def build_all(variants=VARIANTS) -> None:
    """Compile every variant at once, one process each (nvcc is single-threaded)."""
    procs = [subprocess.Popen([sys.executable, "-c",
                               "from sm120_workbook.kernels.build import load_kernel_module as l; "
                               f"l(defines={defines!r})"]) for defines in variants.values()]
    failed = [name for name, p in zip(variants, procs) if p.wait() != 0]
    if failed:
        raise RuntimeError(f"variant build failed: {failed}")


def run(shapes=SHAPES, variants=VARIANTS, tile_keys: int = 16, reps: int = 30) -> list[dict]:
    records = []
    for shape in shapes:
        x = Inputs(shape)
        for name, defines in variants.items():
            t = time_graph_us(build_sm120_mla(x, tile_keys=tile_keys, kernel_defines=defines), reps=reps)
            records.append({"impl": "sm120_mla", "variant": name, "defines": list(defines), **shape.__dict__,
                            "tile_keys": tile_keys, **t})
            print(f"b{shape.batch} h{shape.heads:<3d} q{shape.q_len:<2d} ctx {shape.ctx:6d}  {name:11s} "
                  f"{t['time_us']:8.1f} us", flush=True)
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="jsonl to append to (default data/results/kernel_ablation.jsonl)")
    ap.add_argument("--tag", default=None, help="kernel version label (see NOTES.md)")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the ablation needs a CUDA GPU; none is visible to torch")
    build_all()
    records = [dict(r, kernel_version=args.tag) for r in run(reps=args.reps)]
    from ..results import append_records

    path = append_records("kernel_ablation", records,
                          command="python -m sm120_workbook.kernels.ablation " + " ".join(argv or sys.argv[1:]),
                          path=Path(args.out) if args.out else None)
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
