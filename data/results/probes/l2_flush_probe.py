"""Session 51 probe (l2_flush.jsonl beside it holds its printed lines, transcribed).
Does the L2 flush's write (zero_) put a write-back of dirty lines inside the timed replay?
Modes, interleaved in rounds on the same graph: zero (the bench's until session 51), read (a 256 MiB read: clean
lines), zero_read (zero_, then the read, which evicts the dirty lines before the timing)."""
import torch
from sm120_workbook.kernels.bench import Shape, Inputs, build_sm120_mla, L2_FLUSH_BYTES, captured_graph, interleaved_medians_us

flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
sink = torch.empty((), dtype=torch.int64, device="cuda")
def f_zero(): flush.zero_()
def f_read(): torch.sum(flush.view(torch.int64), dim=0, out=sink)
def f_zero_read(): flush.zero_(); torch.sum(flush.view(torch.int64), dim=0, out=sink)
MODES = {"zero": f_zero, "read": f_read, "zero_read": f_zero_read}

cases = {}
x = torch.randn(75_497_472 // 2, device="cuda").bfloat16()   # 75.5 MB, the KV of 65,536 keys
out = torch.empty((), device="cuda", dtype=torch.float32)
cases["torch sum 75.5 MB"] = lambda: torch.sum(x, dim=0, dtype=torch.float32, out=out)
for sh in (Shape(1, 8, 1, 65536), Shape(1, 8, 16, 65536), Shape(32, 8, 1, 16384)):
    cases[f"sm120_mla {sh.label}"] = build_sm120_mla(Inputs(sh))
print("case | " + " | ".join(MODES) + " | zero/read  (median of 5 rounds, each a median of 50 replays, us)")
for name, fn in cases.items():
    med = interleaved_medians_us(captured_graph(fn), MODES)
    print(f"{name} | " + " | ".join(f"{med[m]:.1f}" for m in MODES) + f" | {med['zero']/med['read']:.3f}", flush=True)
