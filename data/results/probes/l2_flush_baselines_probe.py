"""Session 52 probe (l2_flush_baselines.jsonl beside it holds its printed lines, transcribed).
Session 52's targets, the first with the read flush, found FlashMLA's q16 batch-1 times 5-12 us
higher than sessions 48-49's written-flush runs (other machines), while every memory-bound time
of the other impls fell. Is that the flush, or the machine? The same graph of each case timed in
one process under each flush, the modes interleaved over 5 rounds (as l2_flush_probe.py): none
(L2 warm from the replay before), zero (the bench's flush until session 51), read (bench.L2Flush),
zero_read (zero_, then the read). Runs B-G (the arguments in RUNS) asked what about the flush
does it: the lines' values (ones, a random buffer, a copy), a write after the read (8 B to 256 MiB),
a GEMM (a served layer's projection) before the timing, and a tiny kernel of each kind after the
written flush (a reduction, an elementwise add, a GEMM)."""
import sys
import torch
from sm120_workbook.kernels.bench import BUILDERS, L2_FLUSH_BYTES, Inputs, Shape, captured_graph, interleaved_medians_us

flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
sink = torch.empty((), dtype=torch.int64, device="cuda")
def f_none(): pass
def f_zero(): flush.zero_()
def f_read(): torch.sum(flush.view(torch.int64), dim=0, out=sink)
def f_zero_read(): flush.zero_(); torch.sum(flush.view(torch.int64), dim=0, out=sink)
# what a flush leaves in L2 apart from clean/dirty: zero-valued lines (zero_, and bench.L2Flush's buffer is
# zeros), or others (ones, a random buffer)
rand = torch.randint(0, 2**62, (L2_FLUSH_BYTES // 8,), device="cuda")
half = L2_FLUSH_BYTES // 16
def f_ones(): flush.fill_(1)
def f_read_rand(): torch.sum(rand, dim=0, out=sink)
def f_copy(): rand[:half].copy_(rand[half:])
MODES = {"none": f_none, "zero": f_zero, "read": f_read, "zero_read": f_zero_read, "ones": f_ones,
         "read_rand": f_read_rand, "copy": f_copy}
# the read, then a small write: does the kernel just before the timing matter, or L2's lines?
small = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
def f_read_w8(): f_read(); small[:8].zero_()
def f_read_w1m(): f_read(); small[:1 << 20].zero_()
def f_read_w64m(): f_read(); small.zero_()
flush2 = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
def f_read_w256m(): f_read(); flush2.zero_()
# what precedes attention in a served layer: a projection's GEMM reading its weights (66 MB of bf16,
# K2's q_b_proj-sized), writing a small output
w = torch.randn(7168, 8 * 576, device="cuda", dtype=torch.bfloat16)
a = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16)
y = torch.empty(16, 8 * 576, device="cuda", dtype=torch.bfloat16)
def f_gemm(): f_read(); torch.mm(a, w, out=y)
def f_gemm_only(): torch.mm(a, w, out=y)   # its 66 MB read evicts L2 by itself, leaving clean lines
tiny = torch.zeros(8, dtype=torch.int64, device="cuda")
def f_zero_sum8(): f_zero(); torch.sum(tiny, dim=0, out=sink)   # the written flush, then a reduction of 8 values
small_a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
small_y = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
def f_zero_add8(): f_zero(); tiny.add_(1)                       # then a tiny elementwise kernel (no shared memory)
def f_zero_mm64(): f_zero(); torch.mm(small_a, small_a, out=small_y)   # then a tiny GEMM (shared memory)
def f_read_add8(): f_read(); tiny.add_(1)   # the read flush, then a tiny elementwise kernel (as a KV write)
MODES.update(read_w8=f_read_w8, read_w1m=f_read_w1m, read_w64m=f_read_w64m, read_w256m=f_read_w256m, gemm=f_gemm,
             gemm_only=f_gemm_only, zero_sum8=f_zero_sum8, zero_add8=f_zero_add8, zero_mm64=f_zero_mm64,
             read_add8=f_read_add8)

# each run's argument: (its modes, its cases); the docstring says what each run asked
FLASHMLA_64K_128K = [("flashmla", Shape(1, 8, 16, 65536)), ("flashmla", Shape(1, 8, 16, 131072)),
                     ("triton_decode", Shape(1, 8, 1, 65536))]
RUNS = {
    "": (("none", "zero", "read", "zero_read"),
         [("flashmla", Shape(1, 8, 16, c)) for c in (16384, 65536, 131072)]
         + [("flashmla", Shape(1, 16, 16, 65536)), ("flashmla", Shape(32, 8, 16, 16384)),
            ("sm120_mla", Shape(1, 8, 16, 65536)), ("sm120_mla", Shape(1, 8, 1, 65536)),
            ("triton_decode", Shape(1, 8, 1, 65536))]),
    "--more": (("zero", "read", "ones", "read_rand", "copy"), FLASHMLA_64K_128K),       # zero lines or dirty lines?
    "--small": (("zero", "read", "read_w8", "read_w1m", "read_w64m"), FLASHMLA_64K_128K),  # a write after the read
    "--large": (("zero", "read", "read_w64m", "read_w256m", "gemm"), FLASHMLA_64K_128K),   # a large one; a GEMM
    "--gemm": (("zero", "read", "gemm_only", "zero_sum8"), FLASHMLA_64K_128K),            # a GEMM alone; a tiny sum
    "--tiny": (("zero", "read", "zero_sum8", "zero_add8", "zero_mm64"), FLASHMLA_64K_128K),  # each kind of tiny kernel
    "--read-add": (("zero", "read", "read_add8", "zero_add8"), FLASHMLA_64K_128K + [
        ("flashmla", Shape(1, 8, 16, 16384)), ("flashmla", Shape(1, 8, 16, 32768)),
        ("flashmla", Shape(1, 16, 16, 65536)), ("flashmla", Shape(32, 8, 16, 16384)),
        ("flashinfer_mla", Shape(1, 8, 16, 65536)), ("flashinfer_mla", Shape(1, 8, 1, 65536))]),
}
mode_names, cases = RUNS[" ".join(sys.argv[1:])]
MODES = {m: MODES[m] for m in mode_names}
print("case | " + " | ".join(MODES) + " | read/zero  (median of 5 rounds, each a median of 50 replays, us)")
for impl, sh in cases:
    x = Inputs(sh)
    fn = BUILDERS[impl](x)   # both kept alive while the graph replays: it holds no reference to their tensors
    med = interleaved_medians_us(captured_graph(fn), MODES)
    print(f"{impl} {sh.label} | " + " | ".join(f"{med[m]:.1f}" for m in MODES)
          + f" | {med['read'] / med['zero']:.3f}", flush=True)
