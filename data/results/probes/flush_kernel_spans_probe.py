"""Session 53 probe (flush_kernel_spans.jsonl beside it holds its printed lines, transcribed).
Session 52 found FlashMLA's batch-1 times 8-24% higher after bench's read flush than after the
written one, fa2's 1k-8k times up to 30% higher, and no change in L2's lines to explain either
(l2_flush_baselines_probe.py). Nsight Systems does not run on the GPU machine; torch's profiler
(CUPTI) does, and it reports each kernel of a graph replay with its device start and end. So: is
the extra time inside the attention kernels, or before the first one starts (a gap after the
flush, which CUDA events count)? Per case and flush (bench.L2Flush: write, read, layer), 40
replays each after its flush, their kernels split by position: the flush's, then the graph's.
Printed per case and flush: the event time (as bench times it), the gap from the flush's last
kernel's end to the graph's first kernel's start, each graph kernel's median duration, and the
span from the first graph kernel's start to the last one's end (all medians, us). The first run
(commit 441862d) launched the layer flush's kernels one by one, and its gaps (42-111 us under the
profiler: the GPU outran the CPU's launches; the events counted 11-33 us of them) showed that timing
broken; the layer flush is one graph since."""
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from sm120_workbook.kernels.bench import BUILDERS, Inputs, L2Flush, Shape, captured_graph

CASES = [("flashmla", Shape(1, 8, 16, 65536)), ("flashmla", Shape(1, 8, 16, 16384)),
         ("sm120_mla", Shape(1, 8, 16, 65536)), ("flashinfer_mla_fa2", Shape(1, 8, 16, 1024)),
         ("flashinfer_mla_fa2", Shape(1, 8, 1, 1024)), ("flashinfer_mla_fa2", Shape(1, 8, 16, 65536))]
FLUSHES = ("write", "read", "layer")
REPS = 40


def kernels(prof):
    """The device kernels a profile saw, in start order: (name, start us, end us)."""
    out = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
           and "memset" not in e.name.lower()]
    return sorted(out, key=lambda k: k[1])


def count_kernels(work):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return len(kernels(prof))


print("case | flush | event us | gap us | graph kernels' durations us | span us")
for impl, shape in CASES:
    x = Inputs(shape)
    fn = BUILDERS[impl](x)   # kept alive with x while the graph replays
    g = captured_graph(fn)
    n_graph = count_kernels(g.replay)
    for kind in FLUSHES:
        flush = L2Flush(kind)
        n_flush = count_kernels(flush)
        st = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
        for _ in range(3):
            flush(); g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(REPS):
                flush(); st[i].record(); g.replay(); en[i].record()
            torch.cuda.synchronize()
        ks = kernels(prof)
        per = n_flush + n_graph
        if len(ks) != per * REPS:
            print(f"{impl} {shape.label} | {kind} | {len(ks)} kernels seen, expected {REPS} x ({n_flush} + {n_graph})")
            continue
        gaps, spans, durs = [], [], [[] for _ in range(n_graph)]
        for i in range(REPS):
            it = ks[i * per:(i + 1) * per]
            fl, gr = it[:n_flush], it[n_flush:]
            gaps.append(gr[0][1] - max(k[2] for k in fl))
            spans.append(max(k[2] for k in gr) - gr[0][1])
            for j, k in enumerate(gr):
                durs[j].append(k[2] - k[1])
        names = [k[0][:40] for k in ks[n_flush:per]]
        ev = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(st, en))
        print(f"{impl} {shape.label} | {kind} | {ev:.1f} | {statistics.median(gaps):.1f} | "
              + ", ".join(f"{n} {statistics.median(d):.1f}" for n, d in zip(names, durs))
              + f" | {statistics.median(spans):.1f}", flush=True)
        del flush
