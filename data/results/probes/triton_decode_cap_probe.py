"""Session 56 probe (triton_decode_cap.jsonl beside it holds what it wrote). bench.py builds SGLang's
Triton decode with max_kv_splits from `_mla_decode_kv_splits_cap(8, SMs, max(keys))`, as a server
whose context length is the step's longest request would. A server launched without
--context-length takes the model's (K2: 131,072), and the cap then is 256 at every context: 61
against 205 splits a request at 1k, 121 against 228 at 2k, the same from 4k. Which way that moves
Triton decode's time is the question; the target "decode never slower than Triton decode" (met at
1.74-2.44x at 1k and 2k) would flip only if the server's cap made Triton 1.7x faster.
Predicted: within 15% either way at 1k and 2k, unchanged from 4k.

    python3 data/results/probes/triton_decode_cap_probe.py OUT.jsonl
"""
import statistics
import sys

import torch

from sm120_workbook.kernels import bench
from sm120_workbook.results import append_records

SERVER_CONTEXT = 131072   # Kimi K2's context_length: a server launched without --context-length
SHAPES = [(h, ctx) for h in (8, 16) for ctx in (1024, 2048, 4096, 16384)]
ROUNDS = 3


def triton_decode_with_context(x, context_len):
    """bench.build_triton_decode with the cap of a server whose context length is context_len."""
    own = bench.triton_decode_cap
    bench.triton_decode_cap = lambda keys, sms: own([max(max(keys), context_len)], sms)
    try:
        return bench.build_triton_decode(x)
    finally:
        bench.triton_decode_cap = own


def main(out_path):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for h, ctx in SHAPES:
        x = bench.Inputs(bench.Shape(1, h, 1, ctx))
        fns = {"sm120_mla": bench.build_sm120_mla(x),
               "triton_decode (cap from the step)": bench.build_triton_decode(x),
               "triton_decode (cap from a 128k server)": triton_decode_with_context(x, SERVER_CONTEXT)}
        times = {k: [] for k in fns}
        for r in range(ROUNDS):   # the order turns each round
            names = list(fns)[r % 3:] + list(fns)[:r % 3]
            for k in names:
                times[k].append(bench.time_graph_us(fns[k], reps=50)["time_us"])
        caps = {"step": bench.triton_decode_cap(x.keys, sms),
                "server": bench.triton_decode_cap([max(max(x.keys), SERVER_CONTEXT)], sms)}
        for k, v in times.items():
            rows.append({"probe": "triton_decode_cap", "impl": k, "heads": h, "ctx": ctx, "q_len": 1,
                         "batch": 1, "time_us": round(statistics.median(v), 2), "rounds_us": [round(t, 2) for t in v],
                         "cap_step": caps["step"], "cap_server": caps["server"]})
        a, b, m = (statistics.median(times[k]) for k in list(fns)[1:] + list(fns)[:1])
        print(f"h{h:<3d} {ctx:6d}: sm120_mla {m:7.1f} us | triton cap {caps['step']:3d}: {a:7.1f} us "
              f"({a / m:.2f}x) | cap {caps['server']:3d}: {b:7.1f} us ({b / m:.2f}x) | server/step {b / a:.2f}",
              flush=True)
    # each record stamped with its provenance (GPU, driver, versions, commit, date, this command)
    append_records("probe", rows, command=" ".join(["python3"] + sys.argv), path=out_path)


if __name__ == "__main__":
    main(sys.argv[1])
