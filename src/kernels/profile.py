"""One kernel call for a profiler to look at: warm up, then run the call between
cudaProfilerStart and cudaProfilerStop, so that Nsight Compute sees only that launch.

    ncu --profile-from-start off --set full -o prof \\
        python -m sm120_workbook.kernels.profile --heads 8 --q-len 16 --ctx 65536
    ncu --import prof.ncu-rep --page source --csv --print-source sass > sass.csv

The source page gives the warp-stall samples of every SASS instruction (NOTES.md reads
them); a define (e.g. --define PREFETCH_AHEAD=8) profiles a build variant, and --cta-rows 64
the wide kernel (then `sass_profile --kernel wide_kernel`).
"""
from __future__ import annotations

import argparse

import torch

from .bench import Inputs, add_shape_args, build_sm120_mla, shape_from_args
from .verify_attention import CTA_ROWS, TILE_KEYS, tile_keys_of


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(ap)
    ap.add_argument("--tile-keys", type=int, choices=TILE_KEYS, default=None,
                    help="fix the tile (32 keys: the 32-row kernel only); default: the workspace's")
    ap.add_argument("--cta-rows", type=int, choices=CTA_ROWS, default=None,
                    help="fix the kernel: 32 (split) or 64 (wide); default: the workspace's choice for the shape")
    ap.add_argument("--define", action="append", default=[], help="a build define, e.g. PREFETCH_AHEAD=8")
    a = ap.parse_args(argv)
    if a.cta_rows is not None and a.tile_keys is not None and a.tile_keys not in tile_keys_of(a.cta_rows):
        ap.error("--tile-keys: the 64-row kernel has 16-key tiles only")
    if not torch.cuda.is_available():
        raise SystemExit("profiling needs a CUDA GPU; none is visible to torch")
    x = Inputs(shape_from_args(a))
    fn = build_sm120_mla(x, tile_keys=a.tile_keys, kernel_defines=tuple(a.define), cta_rows=a.cta_rows)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one call: b{a.batch} h{a.heads} q{a.q_len} ctx {a.ctx}, "
          f"{fn.cta_rows}-row kernel, {fn.num_splits} splits, {fn.tile_keys}-key tiles, defines {a.define or 'none'}")


if __name__ == "__main__":
    main()
