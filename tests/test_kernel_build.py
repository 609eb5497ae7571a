"""What CI can check of the kernel without a GPU: it compiles for sm_120a and sm_90 within
the sm_120 budget, and bad arguments are refused with errors that name them."""
from __future__ import annotations

import functools
import math
import os
import random
import re
from pathlib import Path

import pytest
import torch

from sm120_workbook.kernels import MlaVerifyWorkspace, choose_num_splits, mla_verify_attention
from sm120_workbook.kernels.verify_attention import POOL_KEY_CAP, choose_cta_rows, most_keys_a_cta, pool_first_ctas
from sm120_workbook.kernels.resources import ATTENTION_INSTANCES, ATTENTION_KERNELS, SM120_SMEM_LIMIT, resource_report

# nvcc's report for both archs, compiled once for the tests that read it
resource_report_once = functools.cache(resource_report)


# The mma.sync in each loop body, from the tile shapes (one mma.sync is m16 x n8 x k16):
# the split kernel's value warps run P.V, M row tiles x 16 n8 tiles of their 128 columns x KEYS/16
# k-steps (rows as N: 8 column pairs, one n8 tile of rows); its score warps QK, M x KEYS/8 x 9
# k-steps of their 144 dims. The 64-row kernel's body holds both of a round's paths (ping-pong:
# the pair that lags and the one that leads), each 2 x 2 x 9 QK + 2 x 16 P.V.
LOOP_MMA = {"mla_verify_split_kernel<16>": [32, 36], "mla_verify_split_kernel<16, 1>": [16, 18],
            "mla_verify_split_kernel<16, 1, true>": [8, 9], "mla_verify_split_kernel<32>": [64, 72],
            "mla_verify_wide_kernel": [136], "mla_verify_wide_kernel<batched>": [136]}


@pytest.mark.nvcc
def test_resource_budget_sm120a_and_sm90():
    rep = resource_report_once()
    for arch in ("sm_120a", "sm_90"):
        for variant in LOOP_MMA:   # every attention kernel the launcher may run
            k = rep["archs"][arch][variant]
            print(arch, variant, k)
            assert k["smem_bytes"] <= SM120_SMEM_LIMIT, f"{arch} {variant}: {k['smem_bytes']} B of shared memory"
            assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, f"{arch} {variant}: spills"
            assert k["stack_bytes"] == 0, f"{arch} {variant}: local-memory stack frame"
            # 8 warps x 255 registers is the hardware ceiling for one CTA per SM
            assert k["registers"] <= 255
        for variant, k in rep["archs"][arch].items():   # the combine step's instantiations too
            assert k["spill_store_bytes"] == 0 and k["stack_bytes"] == 0, f"{arch} {variant}: spills"


@pytest.mark.nvcc
def test_mma_loops_per_arch():
    """Each attention kernel's loops issue the mma.sync its tiles call for on sm_120a and sm_90
    alike, and no MOV feeds an mma.sync operand (v21: four MOVs before each mma.sync of a fragment
    in the wrong register order cost 3% of batched decode, NOTES.md session 17)."""
    from sm120_workbook.kernels.sass_loops import loop_table

    rep = resource_report_once()
    if rep["nvdisasm"] is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm, in the `test` extra): no loop counts")
    print(loop_table(rep).to_string(index=False))
    for arch in ("sm_120a", "sm_90"):
        for kernel, mma in LOOP_MMA.items():
            loops = rep["archs"][arch][kernel]["loops"]
            assert [loop["hmma"] for loop in loops] == mma, f"{arch} {kernel}"
            assert all(loop["movs_into_mma"] == 0 for loop in loops), f"{arch} {kernel}: MOVs feed mma.sync operands"


def test_sass_loop_counts_from_a_listing():
    """The reader on a hand-made nvdisasm listing: a loop (a conditional backward branch to a
    label) whose ldmatrix result is read at once, a MOV into an mma.sync's A operand, an
    unconditional backward jump, which is not a loop, and a loop closed by a uniform predicate."""
    from sm120_workbook.kernels.sass_loops import loop_stats, mma_loops, parse_sass

    listing = """
.text._Z6kernelv:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDSM.16.M88.4 R12, [R3+0x400] ;
        /*0020*/                   HMMA.16816.F32.BF16 R20, R12, R16, R20 ;
        /*0030*/                   MOV R9, R17 ;
        /*0040*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0050*/                   HMMA.16816.F32.BF16 R24, R8, R14, R24 ;
        /*0060*/                   NOP ;
        /*0070*/                   LDSM.16.MT88.2 R30, [R3] ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/                   LDGSTS.E.BYPASS.LTC128B.128 [R4], desc[UR6][R6.64] ;
        /*00a0*/                   ISETP.GE.AND P0, PT, R2, R5, PT ;
        /*00b0*/              @!P0 BRA `(.L_x_1) ;
        /*00c0*/                   BRA `(.L_x_1) ;
.L_x_2:
        /*00d0*/                   HMMA.16816.F32.BF16 R20, R12, R16, R20 ;
        /*00e0*/                   BRA.U !UP0, `(.L_x_2) ;
        /*00f0*/                   EXIT ;
"""
    instrs = parse_sass(listing)["_Z6kernelv"]
    assert len(instrs) == 16 and instrs[11].target == 0x10 and instrs[11].predicate == "@!P0"
    loops = mma_loops(instrs)
    assert [(b[0].address, b[-1].address) for b in loops] == [(0x10, 0xb0), (0xd0, 0xe0)]
    st = loop_stats(loops[0])
    assert (st.instructions, st.hmma, st.ldsm, st.ldgsts, st.barriers, st.nops) == (11, 2, 2, 1, 1, 1)
    assert st.ldsm_read_next == 1      # R12 at 0x20; R30 (0x70) is not read by the barrier
    assert st.movs_into_mma == 1       # R9 is the second register of the A operand R8..R11


def test_split_policy_fills_the_gpu_from_static_shapes():
    assert choose_num_splits(batch=1, heads=8, max_q_len=16, num_sms=132) == 33   # 4 row CTAs
    assert choose_num_splits(batch=1, heads=8, max_q_len=16, num_sms=188) == 47
    assert choose_num_splits(batch=32, heads=8, max_q_len=16, num_sms=132) == 1    # 128 row CTAs: one wave
    assert choose_num_splits(batch=1, heads=16, max_q_len=16, num_sms=132) == 16  # 8 x 17 would need 2 waves
    assert choose_num_splits(batch=256, heads=128, max_q_len=16, num_sms=132) == 1
    assert choose_num_splits(batch=1, heads=1, max_q_len=1, num_sms=10_000) == 128  # capped
    # decode at batch 1 is one row CTA a split, capped at 128 (a split an SM gained nothing on
    # the H200: NOTES.md, session 23)
    assert choose_num_splits(batch=1, heads=8, max_q_len=1, num_sms=132) == 128
    # the 64-row kernel: q16 h8 is 2 row CTAs a split, q8 h8 one
    assert choose_num_splits(batch=1, heads=8, max_q_len=16, num_sms=132, cta_rows=64) == 66
    assert choose_num_splits(batch=1, heads=8, max_q_len=8, num_sms=132, cta_rows=64) == 128


def test_split_bound_is_the_kernels():
    """MAX_SPLITS is the kernels' kMaxSplits, the combine step's bound."""
    from sm120_workbook.kernels.build import KERNEL_DIR
    from sm120_workbook.kernels.verify_attention import MAX_SPLITS

    src = (KERNEL_DIR / "mla_verify.cuh").read_text()
    assert int(re.search(r"constexpr int kMaxSplits = (\d+);", src).group(1)) == MAX_SPLITS


def test_pool_schedule_minimises_the_slowest_cta():
    """The pooled batch's schedule (pool_first_ctas, the kernels' POOL_MIN_MAX step for step):
    every request at least one CTA, the pool used exactly, equal lengths num_splits each, and
    the most keys a CTA walks within the search's 1/64 of the best load, never worse than v19's."""
    counts = lambda f: [b - a for a, b in zip(f, f[1:])]
    skewed = [65536] + [2048] * 31                       # b32 decode: v19's rule gave the long one 49 CTAs
    assert pool_first_ctas(skewed, 4, min_max=False)[1] == 49
    assert counts(pool_first_ctas(skewed, 4))[:2] == [64, 2] and most_keys_a_cta(skewed, pool_first_ctas(skewed, 4)) == 1024
    assert pool_first_ctas([1000] * 8, 16) == [16 * r for r in range(9)]
    # b8 decode, one 64k request, on 188 SMs (23 splits): handed 163 CTAs, it works on kMaxSplits
    rtx = [65537] + [1025] * 7
    assert counts(pool_first_ctas(rtx, 23))[0] == 163 and most_keys_a_cta(rtx, pool_first_ctas(rtx, 23)) == 65537 / 128
    assert pool_first_ctas([0, 0, 0], 4) == [0, 4, 8, 12]
    assert pool_first_ctas([7], 33) == [0, 33]
    assert counts(pool_first_ctas([5000, 1], 1)) == [1, 1]                          # no spare CTA
    assert pool_first_ctas([100] * 129 + [5000], 2) == pool_first_ctas([100] * 129 + [5000], 2, min_max=False)   # past 128
    # the search counts at most POOL_KEY_CAP keys a request, so no sum over 128 of them wraps
    assert pool_first_ctas([POOL_KEY_CAP * 4, 3, POOL_KEY_CAP], 8) == pool_first_ctas([POOL_KEY_CAP, 3, POOL_KEY_CAP], 8)
    assert counts(pool_first_ctas([POOL_KEY_CAP * 4, 3, POOL_KEY_CAP], 8)) == [11, 1, 12]
    rng = random.Random(0)
    for _ in range(300):
        batch, splits = rng.choice([(2, 33), (4, 16), (8, 16), (16, 8), (32, 4), (48, 2), (64, 2), (100, 1)])
        keys = [int(math.exp(rng.uniform(0, math.log(262144)))) for _ in range(batch)]
        first = pool_first_ctas(keys, splits)
        assert first[0] == 0 and first[-1] == batch * splits and min(counts(first)) >= 1, (keys, splits)
        pool = batch * splits
        fits = lambda load: sum(max(1, -(-k // load)) for k in keys) <= pool
        lo, best = 0, max(keys) + 1                      # the best integer load, by bisection
        while best - lo > 1:
            lo, best = (lo, (lo + best) // 2) if fits((lo + best) // 2) else ((lo + best) // 2, best)
        most = most_keys_a_cta(keys, first)
        assert most <= best * 64 / 63, (keys, splits, most, best)
        if splits > 1:
            assert most <= math.ceil(most_keys_a_cta(keys, pool_first_ctas(keys, splits, min_max=False))) * 64 / 63, (keys, splits)
    with pytest.raises(ValueError, match="keys"):
        pool_first_ctas([], 4)


def test_kernel_choice_by_static_shape():
    assert choose_cta_rows(batch=1, heads=8, max_q_len=16) == 64     # q16 h8: 0.84x at 64k since v17e
    assert choose_cta_rows(batch=1, heads=16, max_q_len=16) == 64    # 0.92x at 64k
    assert choose_cta_rows(batch=32, heads=8, max_q_len=16) == 64    # 0.90x at 16k
    assert choose_cta_rows(batch=1, heads=8, max_q_len=8) == 64      # q8 h8: 0.93x at 64k, 1.17x at 4k
    assert choose_cta_rows(batch=64, heads=4, max_q_len=8) == 32     # 32 rows a request
    assert choose_cta_rows(batch=4, heads=8, max_q_len=8) == 64
    assert choose_cta_rows(batch=64, heads=8, max_q_len=1) == 32     # decode: 8 rows would fill 1/8 of a CTA
    ws = MlaVerifyWorkspace(64, 16, "cpu")
    assert ws.cta_rows_for(1, 16) == 64 and ws.cta_rows_for(1, 1) == 32
    assert MlaVerifyWorkspace(64, 16, "cpu", cta_rows=32).cta_rows_for(1, 16) == 32
    assert MlaVerifyWorkspace(64, 16, "cpu", tile_keys=32).cta_rows_for(1, 16) == 32   # 32-key tiles: split kernel
    assert ws.capacity_rows >= 64 + 64 * 16


@pytest.mark.parametrize("kwargs,arg", [(dict(cta_rows=48), "cta_rows"), (dict(cta_rows=64, tile_keys=32), "tile_keys"),
                                        (dict(tile_keys=8), "tile_keys"), (dict(heads=0), "heads"),
                                        # 16.0 passed `in (16, 32)`, then failed in pybind unnamed
                                        (dict(tile_keys=16.0), "tile_keys"), (dict(cta_rows=64.0), "cta_rows"),
                                        (dict(tile_keys=True), "tile_keys"),
                                        # a str became one -D flag a character, and a failed build
                                        (dict(kernel_defines="PV_LAG=1"), "kernel_defines")])
def test_bad_workspace_options_name_themselves(kwargs, arg):
    kw = dict(max_tokens=16, heads=8, device="cpu")
    kw.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        MlaVerifyWorkspace(**kw)


def _cpu_case(T=4, H=8, ctx=16):
    q = torch.randn(T, H, 576).bfloat16()
    pool = torch.randn(64, 1, 576).bfloat16()
    return dict(q=q, pool=pool, qo=torch.tensor([0, T], dtype=torch.int32),
                kv=torch.tensor([0, ctx], dtype=torch.int32), idx=torch.arange(ctx),
                out=torch.empty(T, H, 512, dtype=torch.bfloat16), lse=torch.empty(T, H),
                ws=MlaVerifyWorkspace(T, H, "cpu"))


_shared = torch.tensor([0, 4] + [0] * 32, dtype=torch.int32)   # qo_indptr [0, 4], then room for an lse over its end


@pytest.mark.parametrize("arg,change", [
    ("q", lambda c: c.update(q=c["q"].float())),
    ("q", lambda c: c.update(q=c["q"][..., :512])),
    ("kv_pool", lambda c: c.update(pool=c["pool"].view(64, 576)[:, :512])),
    ("kv_pool", lambda c: c.update(pool=c["pool"].expand(64, 2, 576))),
    ("qo_indptr", lambda c: c.update(qo=c["qo"].long())),
    ("kv_indptr", lambda c: c.update(kv=torch.tensor([0, 4, 8], dtype=torch.int32))),
    ("kv_indices", lambda c: c.update(idx=c["idx"].float())),
    ("out", lambda c: c.update(out=c["out"][:2])),
    ("lse", lambda c: c.update(lse=c["lse"].double())),
    ("workspace", lambda c: c.update(ws=MlaVerifyWorkspace(4, 16, "cpu"))),
    ("qo_indptr", lambda c: c.update(qo=c["qo"][:1])),
    ("q", lambda c: c.update(q=torch.empty(4 * 8 * 576 + 1).bfloat16()[1:].view(4, 8, 576))),  # misaligned
    # outputs that share bytes with each other or with an input: the kernels would read what they wrote
    ("out", lambda c: c.update(lse=c["out"].view(-1).view(torch.float32)[:32].view(4, 8))),
    ("lse", lambda c: c.update(qo=_shared[:2], lse=_shared[1:33].view(torch.float32).view(4, 8))),
    ("out", lambda c: c.update(out=c["q"].view(-1)[:4 * 8 * 512].view(4, 8, 512))),
    # the kernels write the workspace too: the combine step would read partials it overwrites
    ("out", lambda c: c.update(out=c["ws"].partial_o[:4 * 8 * 256].view(torch.bfloat16).view(4, 8, 512))),
    ("lse", lambda c: c.update(lse=c["ws"].partial_lse[:32].view(4, 8))),
    ("q", lambda c: None),   # everything else valid: a CPU q is refused last, by name
])
def test_bad_arguments_name_themselves(arg, change):
    c = _cpu_case()
    change(c)
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        mla_verify_attention(c["q"], c["pool"], c["qo"], c["kv"], c["idx"], out=c["out"], lse=c["lse"],
                             workspace=c["ws"], sm_scale=0.07, max_q_len=4)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(max_q_len=0), "max_q_len"), (dict(max_q_len=17), "max_q_len"), (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(custom_mask=torch.ones(8, dtype=torch.bool)), "mask_indptr"),
    (dict(mask_indptr=torch.zeros(2, dtype=torch.int64)), "custom_mask"),
    (dict(k_extend=torch.randn(3, 576).bfloat16()), "k_extend"),
    # an empty mask's null pointer would read as no mask (a causal chain), not as the tree meant
    (dict(custom_mask=torch.ones(0, dtype=torch.bool), mask_indptr=torch.zeros(2, dtype=torch.int64)), "custom_mask"),
    # the kernel's scale is sm_scale x log2(e) in float32: inf above ~2.4e38, 0 (or subnormal) below ~8e-39
    (dict(sm_scale=1e39), "sm_scale"), (dict(sm_scale=1e-50), "sm_scale"), (dict(sm_scale=10 ** 400), "sm_scale"),
])
def test_bad_options_name_themselves(kwargs, arg):
    c = _cpu_case()
    kw = dict(out=c["out"], lse=c["lse"], workspace=c["ws"], sm_scale=0.07, max_q_len=4)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        mla_verify_attention(c["q"], c["pool"], c["qo"], c["kv"], c["idx"], **kw)


@pytest.mark.parametrize("arg,change", [
    ("kv_indices", lambda c: c.update(idx=torch.arange(16) + 60)),                  # rows 64.. past the pool
    ("kv_indices", lambda c: c.update(kv=torch.tensor([0, 20], dtype=torch.int32))),  # past kv_indices' end
    ("qo_indptr", lambda c: c.update(qo=torch.tensor([1, 4], dtype=torch.int32))),
    ("qo_indptr", lambda c: c.update(qo=torch.tensor([0, 5], dtype=torch.int32))),    # past q's 4 tokens
    ("qo_indptr", lambda c: c.update(qo=torch.tensor([0, 4, 4], dtype=torch.int32), max_q_len=2,
                                     kv=torch.tensor([0, 16, 16], dtype=torch.int32))),
    ("kv_indptr", lambda c: c.update(kv=torch.tensor([0, 2], dtype=torch.int32))),    # decode: fewer keys than queries
    ("custom_mask", lambda c: c.update(custom_mask=torch.ones(10, dtype=torch.bool),
                                       mask_indptr=torch.tensor([0, 0], dtype=torch.int32))),
])
def test_check_values_names_bad_index_values(arg, change):
    """Values the launch cannot see without a sync: refused by name with check_values=True (a
    CPU case: the value checks run before the CUDA check, so a valid one ends at that)."""
    c = dict(_cpu_case(), max_q_len=4, custom_mask=None, mask_indptr=None)
    change(c)
    kw = dict(out=c["out"], lse=c["lse"], workspace=c["ws"], sm_scale=0.07, max_q_len=c["max_q_len"],
              custom_mask=c["custom_mask"], mask_indptr=c["mask_indptr"])
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        mla_verify_attention(c["q"], c["pool"], c["qo"], c["kv"], c["idx"], check_values=True, **kw)


def test_check_values_passes_a_valid_case():
    c = _cpu_case()
    with pytest.raises(ValueError, match="^q: must be a CUDA tensor"):
        mla_verify_attention(c["q"], c["pool"], c["qo"], c["kv"], c["idx"], out=c["out"], lse=c["lse"],
                             workspace=c["ws"], sm_scale=0.07, max_q_len=4, check_values=True)


@pytest.mark.parametrize("kwargs,arg", [(dict(sm_scale=torch.tensor(0.07)), "sm_scale"),
                                        (dict(sm_scale="0.07"), "sm_scale"), (dict(sm_scale=True), "sm_scale"),
                                        (dict(max_q_len=True), "max_q_len")])
def test_scalar_options_of_the_wrong_type_name_themselves(kwargs, arg):
    c = _cpu_case()
    kw = {**dict(out=c["out"], lse=c["lse"], workspace=c["ws"], sm_scale=0.07, max_q_len=4), **kwargs}
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        mla_verify_attention(c["q"], c["pool"], c["qo"], c["kv"], c["idx"], **kw)


def test_the_workspace_holds_the_partials_as_the_build_stores_them():
    """Both default kernels store bf16 partials (SPLIT_BF16_PARTIALS, WIDE_BF16_PARTIALS with 4
    stages): the fp32-sized buffer left half of it unused (512 MiB for 256 at 16k tokens x 16
    heads). A define that may change that, or another revision's sources, keeps fp32's size;
    mla_verify.cu checks the bytes the launched kernel needs."""
    from sm120_workbook.kernels.verify_attention import partial_bytes

    ws = MlaVerifyWorkspace(64, 16, "cpu")
    assert ws.partial_bytes == 2 and ws.partial_o.numel() * 4 == ws.capacity_rows * 512 * 2
    assert ws.nbytes == ws.capacity_rows * (512 * 2 + 4)
    for defines in (("WIDE_STAGES=3",), ("SPLIT_BF16_PARTIALS=0",), ("WIDE_BF16_PARTIALS", "PV_LAG=1")):
        w = MlaVerifyWorkspace(64, 16, "cpu", kernel_defines=defines)
        assert w.partial_bytes == 4 and w.partial_o.numel() == w.capacity_rows * 512
    assert partial_bytes(("BALANCED_SPLITS=0", "POOL_TRACE")) == 2 and partial_bytes((), "/some/revision") == 4
    cu = (Path(__file__).parents[1] / "src" / "kernels" / "mla_verify.cu").read_text()
    assert "ws_o.numel() * 4 >= slots * kDimV * partial_bytes" in cu


def test_workspace_rejects_bad_sizes():
    for kw, arg in [(dict(max_tokens=0, heads=8), "max_tokens"), (dict(max_tokens=4, heads=129), "heads"),
                    (dict(max_tokens=4, heads=8, num_splits=0), "num_splits")]:
        with pytest.raises(ValueError, match=rf"^{arg}:"):
            MlaVerifyWorkspace(device="cpu", **kw)


def test_ablation_variants_build_apart_from_the_default():
    from sm120_workbook.kernels.ablation import VARIANTS
    from sm120_workbook.kernels.build import build_key

    defines = {v.defines for v in VARIANTS.values()}
    keys = {build_key((9, 0), d) for d in defines}
    assert len(keys) == len(defines)                     # each set of defines has its own cache
    assert build_key((9, 0)) == build_key((9, 0), ())
    # the order of the defines is not part of the build (the CTA timeline appends its own)
    assert build_key((9, 0), ("A", "B=1")) == build_key((9, 0), ("B=1", "A"))
    assert VARIANTS["full"].defines == () and VARIANTS["full"].tile_keys == 16


@pytest.mark.nvcc
def test_launcher_compiles_for_sm120a_without_a_gpu(tmp_path):
    """The launcher (mla_verify.cu: argument checks, layouts, launches) with torch's headers, as
    load_inline builds it, to PTX for sm_120a. It includes c10's CUDA headers only, so no cuBLAS,
    cuSPARSE or cuSOLVER headers are needed, which a bare nvcc lacks."""
    import subprocess

    from sm120_workbook.kernels.build import launcher_check_command

    proc = subprocess.run(launcher_check_command(tmp_path / "launcher.o"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "launcher.o").stat().st_size > 0


@pytest.mark.nvcc
def test_ablation_switches_compile_for_sm120a(tmp_path):
    import subprocess

    from sm120_workbook.kernels.ablation import VARIANTS
    from sm120_workbook.kernels.build import KERNEL_DIR

    src = tmp_path / "a.cu"
    for name, v in VARIANTS.items():   # the 64-row variants build the wide kernel (its header), the others the split kernel
        src.write_text(('#include "mla_verify_wide.cuh"\n' if v.cta_rows == 64 else
                        '#include "mla_verify.cuh"\n'
                        f"template __global__ void sm120_mla::mla_verify_split_kernel<{v.tile_keys}>"
                        "(const sm120_mla::Params, const sm120_mla::Bounds);\n"))
        proc = subprocess.run(["nvcc", "-cubin", "-std=c++17", "-arch=sm_120a", *[f"-D{d}" for d in v.defines],
                               f"-I{KERNEL_DIR}", "-o", str(tmp_path / "a.cubin"), str(src)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"


@pytest.mark.nvcc
@pytest.mark.parametrize("defines", [(), ("WIDE_TRACE",), ("CTA_TIMELINE",), ("POOL_TRACE",)],
                         ids=["default", "phase_trace", "cta_timeline", "pool_trace"])
@pytest.mark.parametrize("arch", ["sm_120a", "sm_90", "sm_86"])
def test_diagnostic_builds_compile_without_spills(tmp_path, arch, defines):
    """The default build (its combine step a programmatic dependent) and the diagnostic builds
    (phase_trace.py's stamps, cta_timeline.py's stamps, the pool's trace) keep every kernel's registers on sm_120a
    and sm_90; on sm_86 they build (griddepcontrol compiles to nothing there)."""
    import subprocess

    from sm120_workbook.kernels.build import KERNEL_DIR

    src = tmp_path / "t.cu"
    src.write_text('#include "mla_verify_wide.cuh"\n' + ATTENTION_INSTANCES
                   + "template __global__ void sm120_mla::mla_verify_combine_kernel<16>(const sm120_mla::Params);\n")
    proc = subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", f"-arch={arch}", "-Xptxas", "-v",
                           *[f"-D{d}" for d in defines], f"-I{KERNEL_DIR}", "-o", str(tmp_path / "t.cubin"),
                           str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for kernel in ("mla_verify_wide_kernel", "mla_verify_split_kernel", "mla_verify_combine_kernel"):
        assert kernel in proc.stderr
    if arch != "sm_86":   # the targets; sm_86 checks that the sm_90+ instructions compile away
        kernels = len(ATTENTION_KERNELS) + 1   # and the combine step
        assert proc.stderr.count("bytes spill stores") == kernels and "spill stores" not in proc.stderr.replace(
            " 0 bytes spill stores", "")


@pytest.mark.nvcc
def test_preloading_combine_fits_one_wave_on_an_rtx_pro_6000(tmp_path):
    """v18h's premise (NOTES.md, session 11): on an RTX PRO 6000 (188 SMs; 64K registers and
    1,536 threads an SM) q16 h8 has 94 splits, which the combine step takes in 8 groups with its
    partials preloaded (preload_groups_fit), and those 128 rows x 8 CTAs fit one wave at the
    registers ptxas gives that kernel on sm_120a. With 16 splits a thread it took 96 registers,
    5 CTAs an SM, and missed."""
    import subprocess

    from sm120_workbook.kernels.build import KERNEL_DIR
    from sm120_workbook.kernels.resources import combine_label

    sms, rows, groups = 188, 16 * 8, 8
    splits = choose_num_splits(1, 8, 16, sms, 64)
    src = tmp_path / "fit.cu"
    src.write_text('#include <cstdio>\n#include "mla_verify.cuh"\n'
                   f'int main() {{ std::printf("%d", (int)sm120_mla::preload_groups_fit({groups}, {splits})); }}\n')
    exe = tmp_path / "fit"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_80", f"-I{KERNEL_DIR}", "-o", str(exe), str(src)],
                   check=True, capture_output=True, text=True)
    assert splits == 94 and subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout == "1"
    regs = resource_report_once()["archs"]["sm_120a"][combine_label(groups, True, True)]["registers"]
    warps_by_registers = 65536 // (-(-regs * 32 // 256) * 256)   # registers are granted 256 a warp
    ctas_per_sm = min(warps_by_registers // 4, 1536 // 128)
    assert rows * groups <= ctas_per_sm * sms, f"{regs} registers: {ctas_per_sm} CTAs an SM"


@pytest.mark.nvcc
def test_mma_peak_kernel_compiles_without_spills(tmp_path):
    import subprocess

    from sm120_workbook.kernels.build import KERNEL_DIR, SOURCES

    assert "mma_peak.cuh" in SOURCES   # part of the build hash
    src = tmp_path / "p.cu"
    src.write_text('#include "mma_peak.cuh"\n')
    for arch in ("sm_120a", "sm_90a"):
        proc = subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", f"-arch={arch}", "-Xptxas", "-v",
                               f"-I{KERNEL_DIR}", "-o", str(tmp_path / "p.cubin"), str(src)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "mma_sync_peak_kernel" in proc.stderr and " 0 bytes spill stores" in proc.stderr


def test_gpu_check_sanitizer_job_runs_the_three_tools_on_the_shipped_build(tmp_path):
    from sm120_workbook.kernels.gpu_check import jobs

    san = {j[0]: j for j in jobs(tmp_path, "vX")}["sanitizer"]
    cmd = san[1]
    assert cmd[1:3] == ["-m", "sm120_workbook.kernels.sanitize"] and not san[2]
    assert {"memcheck", "racecheck", "synccheck"} <= set(cmd) and str(tmp_path / "kernel_sanitizer.jsonl") in cmd
    # every shelved build under three tools took ~8 minutes on an H200: the job runs the shipped one
    assert cmd[cmd.index("--builds") + 1:cmd.index("--builds") + 2] == ["default"] and "group_barriers" not in cmd


def test_gpu_check_profile_job_is_timed_and_reads_its_own_export(tmp_path):
    from sm120_workbook.kernels.gpu_check import jobs

    assert "profile" not in {j[0] for j in jobs(tmp_path, "vX")}
    prof = {j[0]: j for j in jobs(tmp_path, "vX", ncu="/usr/local/cuda/bin/ncu")}["profile"]
    assert prof[2] and prof[1][:2] == ["bash", "-c"]
    script = prof[1][2]
    assert "sm120_workbook.kernels.profile" in script and str(tmp_path) not in script   # its CSV stays in /tmp
    assert "sm120_workbook.kernels.sass_profile" in script
    assert "regex:wide_kernel" in script and "--kernel wide_kernel" in script   # the headline shape's kernel


def test_gpu_check_prebuilds_the_variants_of_the_jobs_named():
    from sm120_workbook.kernels.ablation import VARIANTS
    from sm120_workbook.kernels.checks import SCHEDULE_VARIANTS
    from sm120_workbook.kernels.gpu_check import TEST_BUILDS, prebuild_defines

    schedule = {tuple(sorted(d)) for d, _ in SCHEDULE_VARIANTS}
    ablation = {tuple(sorted(v.defines)) for v in VARIANTS.values()}
    for names, expected in ((["tests"], schedule | set(TEST_BUILDS)), (["ablation"], ablation),
                            (["tests", "bench", "ablation"], schedule | set(TEST_BUILDS) | ablation),
                            (["bench", "targets"], set())):
        builds = prebuild_defines(names)
        assert builds == sorted(expected), names
    assert len(prebuild_defines(["tests"])) < len(prebuild_defines(["tests", "ablation"]))   # the point of it
    # every define set the GPU tests build is prebuilt for them (a new one added there must be added here)
    gpu_tests = (Path(__file__).parent / "test_kernel_gpu.py").read_text()
    in_tests = set(re.findall(r"\(\"([A-Z_0-9]+=?[0-9]*)\",\)", gpu_tests))
    assert in_tests and {(d,) for d in in_tests} <= set(prebuild_defines(["tests"]))


def test_build_in_parallel_names_the_builds_that_failed(monkeypatch):
    import sys

    from sm120_workbook.kernels import build

    ran = []
    monkeypatch.setattr(build, "build_command", lambda d, src=None: ran.append((d, src)) or
                        [sys.executable, "-c", f"raise SystemExit({int('BAD=1' in d)})"])
    with pytest.raises(RuntimeError, match=r"variant build failed: \[\('BAD=1', 'X=1'\)\]"):
        build.build_in_parallel([("X=1", "BAD=1"), ("BAD=1", "X=1"), (), ("Y=1",)])
    # one build a set, whatever the order of its defines
    assert sorted(ran) == [((), None), (("BAD=1", "X=1"), None), (("Y=1",), None)]
    ran.clear()
    with pytest.raises(RuntimeError, match=r"variant build failed: \[\('BAD=1',\), \(\('BAD=1',\), '/old'\)\]"):
        build.build_in_parallel([(), ("BAD=1",)], source_dirs=(None, "/old"))   # each set from each source
    assert sorted(ran, key=repr) == sorted([((), None), (("BAD=1",), None), ((), "/old"), (("BAD=1",), "/old")], key=repr)


def test_a_build_of_other_sources_has_its_own_key(tmp_path):
    """An A/B run (ab.py) builds another revision's sources beside the shipped ones: the key
    hashes the folder and its sources, so the two builds never share a cache entry, and the
    shipped build's key is the same whether its folder is named or not. A folder without the
    sources is refused by name."""
    import shutil

    from sm120_workbook.kernels import build

    for name in build.SOURCES:
        shutil.copy(build.KERNEL_DIR / name, tmp_path / name)
    # a copy is another build (load_inline's include path differs), so it has its own key
    assert build.build_key((9, 0), (), tmp_path) != build.build_key((9, 0))
    assert build.build_key((9, 0), (), build.KERNEL_DIR) == build.build_key((9, 0))
    copy = build.build_key((9, 0), (), tmp_path)
    (tmp_path / "mla_verify.cuh").write_text((tmp_path / "mla_verify.cuh").read_text() + "\n// older\n")
    assert build.build_key((9, 0), (), tmp_path) not in (copy, build.build_key((9, 0)))
    assert "source_dir=" + repr(str(tmp_path)) in build.build_command((), tmp_path)[-1]
    (tmp_path / "mla_verify.cu").unlink()
    with pytest.raises(ValueError, match=r"^source_dir: .* lacks mla_verify\.cu"):
        build.build_key((9, 0), (), tmp_path)


def test_gpu_check_gives_timed_jobs_a_gpu_of_their_own(tmp_path):
    from sm120_workbook.kernels.gpu_check import assign, jobs

    js = jobs(tmp_path, "vX")
    names = {j[0] for j in js}
    assert {"tests", "sanitizer", "bench", "ablation", "phase_trace", "cta_timeline", "targets"} <= names
    assert all("--tag" in j[1] for j in js if j[0] in ("bench", "ablation", "phase_trace", "cta_timeline", "targets"))
    # the machine returns 8 files: the merged log, the bench's ceilings beside its records, the other records
    outs = {a for j in jobs(tmp_path, "vX", ncu="/usr/local/cuda/bin/ncu") for a in j[1] if str(tmp_path) in a}
    assert str(tmp_path / "kernel_bench.jsonl") in outs and len(outs) + 2 <= 8
    for gpus in (1, 2, 4, 8):
        queues = assign(js, gpus)
        assert sorted(j[0] for q in queues for j in q) == sorted(names)   # every job once
        for q in queues:   # a timed job runs last on its GPU, after any untimed job there
            timed = [i for i, j in enumerate(q) if j[2]]
            assert all(i >= len(q) - len(timed) for i in timed)
    timed = sum(j[2] for j in js)
    for gpus in (4, 8):   # timed jobs spread evenly: each alone wherever the GPUs allow
        per_gpu = [sum(j[2] for j in q) for q in assign(js, gpus)]
        assert max(per_gpu) == -(-timed // gpus) and min(per_gpu) >= timed // gpus


def test_gpu_check_runs_the_queues_and_merges_the_logs(tmp_path, monkeypatch):
    # main() with the GPU parts stubbed: two GPUs, one passing and one failing job.
    import subprocess

    from sm120_workbook.kernels import gpu_check as gc

    monkeypatch.setattr(gc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gc.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(gc, "load_kernel_module", lambda: None)
    monkeypatch.setattr(gc, "start_prebuild", lambda defines: subprocess.Popen(["true"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setattr(gc, "jobs", lambda out, tag, ncu=None: [
        ("ok", ["bash", "-c", "echo gpu $CUDA_VISIBLE_DEVICES; echo fine"], True),
        ("bad", ["bash", "-c", "echo gpu $CUDA_VISIBLE_DEVICES; echo broke; exit 3"], True)])
    assert gc.main(["--out", str(tmp_path), "--tag", "vX"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.log"]   # the job logs merged away
    log = (tmp_path / "gpu_check.log").read_text()
    assert re.search(r"PASS ok +\d+ s  fine", log) and re.search(r"FAIL bad +\d+ s  broke", log)   # with each job's time
    assert "===== ok (exit 0) =====\ngpu 5\nfine" in log and "===== bad (exit 3) =====\ngpu 7" in log


def test_gpu_check_runs_only_the_jobs_named(tmp_path, monkeypatch, capsys):
    # --jobs: the named jobs alone, without the variant prebuild unless a named job builds variants
    import subprocess

    from sm120_workbook.kernels import gpu_check as gc

    monkeypatch.setattr(gc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gc.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gc, "load_kernel_module", lambda: None)
    prebuilds = []
    monkeypatch.setattr(gc, "start_prebuild", lambda defines: prebuilds.append(defines) or subprocess.Popen(["true"]))
    monkeypatch.setattr(gc, "jobs", lambda out, tag, ncu=None: [
        (name, ["bash", "-c", f"echo {name} ran"], timed)
        for name, timed in (("tests", False), ("bench", True), ("targets", True))])
    assert gc.main(["--out", str(tmp_path / "a"), "--jobs", "targets"]) == 0
    log = (tmp_path / "a" / "gpu_check.log").read_text()
    assert "PASS targets" in log and "tests" not in log and "bench" not in log and not prebuilds
    assert gc.main(["--out", str(tmp_path / "b"), "--jobs", "targets", "tests"]) == 0
    assert prebuilds == [gc.prebuild_defines(["tests"])]   # the tests' builds, not the ablation's
    with pytest.raises(SystemExit):   # a misspelt name: an error naming it, before anything is built
        gc.main(["--out", str(tmp_path / "c"), "--jobs", "target"])
    assert "no job named target here (jobs: tests, bench, targets)" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_recorded_ablation_table_is_one_version_in_variant_order():
    import pandas as pd

    from sm120_workbook.kernels.ablation import recorded_table
    from sm120_workbook.results import table_text

    def rec(variant, defines, q_len, heads, t, version, date, batch=1):
        return {"variant": variant, "defines": defines, "q_len": q_len, "heads": heads, "ctx": 65536,
                "batch": batch, "time_us": t, "kernel_version": version, "date": date, "gpu": "NVIDIA H200"}

    df = pd.DataFrame([
        rec("full", [], 16, 8, 110.0, "v1", "2026-11-29T10:00"),
        rec("loads_only", ["ABLATE_NO_QK"], 16, 8, 80.0, "v2", "2026-11-29T11:00"),
        rec("full", [], 16, 8, 109.0, "v2", "2026-11-29T11:00"),
        rec("full", [], 1, 8, 52.0, "v2", "2026-11-29T11:00"),
        rec("loads_only_splits16", ["ABLATE_NO_QK"], 16, 8, 160.0, "v2", "2026-11-29T11:01"),
    ])
    t = recorded_table(df)   # the newest version, v2
    assert list(t["variant"]) == ["full", "loads_only", "loads_only_splits16"]
    # where the numbers come from, for the notebook's line under the table (v2's records only)
    assert t.attrs["source"] == "recorded: NVIDIA H200; 2026-11-29"
    assert table_text(t).splitlines()[-1] == "(recorded: NVIDIA H200; 2026-11-29)"
    assert table_text(recorded_table(df.assign(commit="abc1234def"))).endswith("commit abc1234; 2026-11-29)")
    assert list(t.columns) == ["variant", "changes", "q16 h8", "q1 h8"]
    assert t.loc[0, "q16 h8"] == 109.0 and t.loc[0, "changes"] == "(shipped build)"
    assert t.loc[2, "changes"] == "ABLATE_NO_QK, 16 splits"
    assert list(recorded_table(df, version="v1")["q16 h8"]) == [110.0]
    assert list(recorded_table(df, variants=["loads_only"])["variant"]) == ["loads_only"]
    both = recorded_table(df, version=["v1", "v2"])   # the newest record of each variant across both
    assert both.loc[both["variant"] == "full", "q16 h8"].item() == 109.0
    with pytest.raises(ValueError, match="version: no ablation recorded as 'v9' on H200"):
        recorded_table(df, version="v9")
    # a tag reused on another GPU is another run: each GPU's table holds its own
    rtx = pd.concat([df, pd.DataFrame([dict(rec("full", [], 16, 8, 70.0, "v2", "2026-11-30T10:00"),
                                            gpu="NVIDIA RTX PRO 6000 Blackwell Workstation Edition")])])
    assert recorded_table(rtx, version="v2").loc[0, "q16 h8"] == 109.0
    assert recorded_table(rtx, version="v2", gpu="RTX PRO 6000")["q16 h8"].tolist() == [70.0]
    with pytest.raises(ValueError, match="no ablation recorded as 'v2' on B200"):
        recorded_table(rtx, version="v2", gpu="B200")
    # a variant since removed from VARIANTS is described from its record
    gone = pd.DataFrame([dict(rec("wide_gone", ["X=1"], 16, 8, 90.0, "v3", "2026-11-30T10:00"), cta_rows=64)])
    assert recorded_table(gone).loc[0, "changes"] == "X=1, 64-row kernel"
    # a batched run of the same version stays apart from the batch-1 one
    batched = pd.concat([df, pd.DataFrame([rec("full", [], 1, 8, 300.0, "v2", "2026-11-29T12:00", batch=32)])])
    assert recorded_table(batched, version="v2")["q1 h8"].tolist()[0] == 52.0
    assert recorded_table(batched, version="v2", batch=32)["q1 h8"].tolist() == [300.0]


@pytest.mark.parametrize("args,message", [
    (["--variants", "wide", "--ctx", "4096", "0"], "--ctx: contexts must be positive"),
    (["--variants", "full", "--batch", "0"], "--batch: must be positive"),
], ids=["ctx", "batch"])
def test_ablation_rejects_a_bad_argument_before_any_build(capsys, monkeypatch, args, message):
    from sm120_workbook.kernels import ablation

    monkeypatch.setattr(ablation, "build_all", lambda v: pytest.fail(f"built before checking {args[2]}"))
    with pytest.raises(SystemExit) as e:
        ablation.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_recorded_resources_render_without_nvcc():
    """Notebook 02 on a machine without nvcc: the recorded report gives the same frame, budget
    verdicts and per-arch loop table that a live report gives."""
    from sm120_workbook.kernels.resources import budget_lines, recorded_report, resources_frame
    from sm120_workbook.kernels.sass_loops import loop_table, loops_by_arch

    rep = recorded_report()
    frame = resources_frame(rep)
    assert set(frame.arch) == {"sm_120a", "sm_90"} and (frame.registers > 0).all()
    lines = budget_lines(frame)
    attention = frame.kernel.str.startswith(("mla_verify_split", "mla_verify_wide"))
    assert len(lines) == len(frame) and all(line.endswith(": OK") for line in lines)   # the combine kernels too
    table = loops_by_arch(loop_table(rep), ["sm_120a"])
    assert "nops sm_120a" in table and not any(c.endswith("sm_90") for c in table.columns)
    over = frame.assign(smem_bytes=frame.smem_bytes.where(~attention, SM120_SMEM_LIMIT + 1))
    assert sum(line.endswith("OVER BUDGET") for line in budget_lines(over)) == attention.sum()
    loads = budget_lines(frame.assign(spill_load_bytes=frame.spill_load_bytes.where(attention, 8)))
    assert sum("spills 8 B" in line and line.endswith("OVER BUDGET") for line in loads) == (~attention).sum()


def test_ablation_tables_by_run_keep_each_runs_own_full():
    """A tag timed in two runs (two commits) gives two tables, each with the shipped build of its
    own run, not one table whose `full` comes from the newer run only."""
    import pandas as pd

    from sm120_workbook.kernels.ablation import recorded_tables_by_run

    rec = lambda commit, date, variant, t: {"kernel_version": "s6", "commit": commit, "date": date, "variant": variant,
                                            "ctx": 65536, "batch": 1, "q_len": 16, "heads": 8, "time_us": t,
                                            "defines": [], "short_ctx": 0, "gpu": "NVIDIA H200"}
    df = pd.DataFrame([rec("aaa1111", "2026-11-29T18:06", "full", 109.4), rec("aaa1111", "2026-11-29T18:06", "pv_lag", 120.1),
                       rec("bbb2222", "2026-11-29T18:23", "full", 109.1), rec("bbb2222", "2026-11-29T18:23", "stagger1", 111.7)])
    (l1, t1), (l2, t2) = recorded_tables_by_run("s6", df)
    assert l1 == "s6 at aaa1111, 2026-11-29T18:06" and l2.startswith("s6 at bbb2222")
    assert dict(zip(t1["variant"], t1["q16 h8"])) == {"full": 109.4, "pv_lag": 120.1}
    assert dict(zip(t2["variant"], t2["q16 h8"])) == {"full": 109.1, "stagger1": 111.7}
    with pytest.raises(ValueError, match="versions: no ablation recorded as 'zz'"):
        recorded_tables_by_run(["zz"], df)


@pytest.mark.parametrize("call, name", [
    (lambda: choose_num_splits(1, 16, 16, 132, cta_rows=48), "cta_rows"),
    (lambda: choose_num_splits(0, 8, 16, 132), "batch"),
    (lambda: choose_num_splits(1, 8, 0, 132), "max_q_len"),
    (lambda: choose_num_splits(True, 8, 16, 132), "batch"),
    (lambda: MlaVerifyWorkspace(16, True, device="cpu"), "heads"),
    (lambda: MlaVerifyWorkspace(16, 8, device="cpu", num_splits=True), "num_splits"),
    (lambda: MlaVerifyWorkspace(16, 8, device="cpu", num_splits=2.5), "num_splits"),
])
def test_shape_policy_and_workspace_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()


def test_ablation_tables_by_context_come_from_the_records():
    import pandas as pd

    from sm120_workbook.kernels.ablation import recorded_tables_by_context

    rec = lambda ctx, variant, t: {"kernel_version": "v9", "commit": "c", "date": "2026-11-30", "variant": variant,
                                   "ctx": ctx, "batch": 1, "q_len": 16, "heads": 8, "time_us": t, "defines": [],
                                   "short_ctx": 0, "gpu": "NVIDIA H200"}
    df = pd.DataFrame([rec(4096, "full", 20.0), rec(1024, "full", 15.0), rec(1024, "wide", 16.0)])
    (l1, t1), (l2, t2) = recorded_tables_by_context("v9", df)
    assert (l1, l2) == ("ctx 1024, µs (one run, v9)", "ctx 4096, µs (one run, v9)")
    assert list(t1["variant"]) == ["full", "wide"] and list(t2["q16 h8"]) == [20.0]
    with pytest.raises(ValueError, match="versions: no ablation recorded as 'v8'"):
        recorded_tables_by_context(["v8"], df)


def test_a_held_build_lock_is_named_after_the_timeout(tmp_path, monkeypatch):
    from filelock import FileLock

    from sm120_workbook.kernels import build

    monkeypatch.setenv("SM120_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(build.LOCK_TIMEOUT_ENV, "0.2")
    name = f"sm120_mla_{build.build_key((9, 0))}"
    with FileLock(str(tmp_path / name) + ".lock"):   # another process building the same key
        with pytest.raises(RuntimeError, match=rf"build lock {tmp_path / name}\.lock: a live process"):
            build._load_for.__wrapped__((9, 0), False, ())


@pytest.mark.parametrize("raw", ["30m", "0", "-1", "nan", "inf", ""])
def test_a_bad_lock_timeout_is_named_when_a_build_waits(monkeypatch, raw):
    """Read at build time, not import time (a typo must not break `import sm120_workbook.kernels`);
    filelock takes 0 as "fail at once" and a negative timeout as "wait forever"."""
    from sm120_workbook.kernels import build

    monkeypatch.setenv(build.LOCK_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=rf"{build.LOCK_TIMEOUT_ENV}='{raw}': must be a number of seconds above 0"):
        build.lock_timeout_s()
    monkeypatch.setenv(build.LOCK_TIMEOUT_ENV, "90")
    assert build.lock_timeout_s() == 90.0
    monkeypatch.delenv(build.LOCK_TIMEOUT_ENV)
    assert build.lock_timeout_s() == build.DEFAULT_LOCK_TIMEOUT_S


def test_a_killed_builders_torch_lock_is_cleared_under_ours(tmp_path, monkeypatch):
    """A builder killed inside load_inline can leave torch's lock file in the build folder (torch
    releases that lock with a FileBaton); the next builder, holding the key's lock, removes it
    before load_inline would wait on it forever."""
    from torch.utils import cpp_extension

    from sm120_workbook.kernels import build

    monkeypatch.setenv("SM120_KERNEL_CACHE", str(tmp_path))
    build_dir = tmp_path / f"sm120_mla_{build.build_key((9, 0))}"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")          # what the killed builder left
    seen = {}

    def fake_load_inline(**kw):
        seen["torch_lock_left"] = (Path(kw["build_directory"]) / "lock").exists()
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    assert build._load_for.__wrapped__((9, 0), False, ()) == "module"
    assert seen == {"torch_lock_left": False}


def test_the_build_key_names_the_toolchain(monkeypatch):
    from sm120_workbook.kernels import build

    key = build.build_key((9, 0))
    monkeypatch.setattr(build, "_toolchain", lambda: "torch 0.0 cuda 0 py3.0")
    assert build.build_key((9, 0)) != key


@pytest.mark.nvcc
def test_the_nvcc_identity_is_the_toolkits_version():
    from torch.utils import cpp_extension

    from sm120_workbook.kernels import build

    if not cpp_extension.CUDA_HOME or not os.path.isfile(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        pytest.skip(f"torch's CUDA toolkit ({cpp_extension.CUDA_HOME}) has no bin/nvcc to ask")
    assert "Cuda compilation tools" in build._nvcc_identity(cpp_extension.CUDA_HOME)


@pytest.mark.parametrize("var", ["NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "PYTORCH_NVCC", "NVCC_CCBIN"])
def test_the_build_key_names_what_nvcc_reads_from_the_environment(monkeypatch, var):
    """nvcc appends $NVCC_APPEND_FLAGS itself (and torch runs $PYTORCH_NVCC), so ninja's command
    line does not change: without them in the key, one process's `-G` build would be every later
    process's cached default."""
    from sm120_workbook.kernels import build

    for v in build._COMPILER_ENV:
        monkeypatch.delenv(v, raising=False)
    key = build.build_key((9, 0))
    monkeypatch.setenv(var, "-G")
    assert build.build_key((9, 0)) != key


def test_the_build_key_names_the_nvcc_load_inline_runs(monkeypatch):
    from torch.utils import cpp_extension

    from sm120_workbook.kernels import build

    key = build.build_key((9, 0))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/opt/another-cuda")
    assert build.build_key((9, 0)) != key
    assert build._nvcc_identity("/opt/another-cuda").startswith("/opt/another-cuda/bin/nvcc: FileNotFoundError")


def test_the_toolkit_is_checked_before_a_build():
    """load_inline checks neither the nvcc release nor its CUDA major against torch's: an nvcc
    without sm_120a fails deep in a build log, another major links a second CUDA runtime."""
    from sm120_workbook.kernels.build import check_toolkit, nvcc_release

    v = lambda r: f"nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release {r}, V{r}.88"
    assert nvcc_release(v("13.0")) == (13, 0) and nvcc_release("nvcc: FileNotFoundError: x") is None
    check_toolkit((12, 0), v("13.0"), "13.0")
    check_toolkit((12, 0), v("12.8"), "12.8")
    check_toolkit((8, 6), v("12.4"), "12.6")   # no arch-specific target: any 12.x
    with pytest.raises(RuntimeError, match=r"^nvcc 12.6 cannot build for sm_120a; it needs CUDA 12.8 or newer"):
        check_toolkit((12, 0), v("12.6"), "12.6")
    with pytest.raises(RuntimeError, match=r"^nvcc 12.9 and torch's CUDA 13.0 differ in major version"):
        check_toolkit((9, 0), v("12.9"), "13.0")
    with pytest.raises(RuntimeError, match=r"^no usable nvcc .*set CUDA_HOME.*FileNotFoundError"):
        check_toolkit((9, 0), "/usr/local/cuda/bin/nvcc: FileNotFoundError: [Errno 2] No such file", "13.0")
    # sm_121 (GB10) and sm_103 have no arch-specific target here, and need 12.9
    with pytest.raises(RuntimeError, match=r"^nvcc 12.8 cannot build for sm_121; it needs CUDA 12.9 or newer"):
        check_toolkit((12, 1), v("12.8"), "12.8")
    check_toolkit((10, 3), v("12.9"), "12.9")
    with pytest.raises(RuntimeError, match=r"^nvcc 12.9 cannot build for sm_110; it needs CUDA 13.0"):
        check_toolkit((11, 0), v("12.9"), "12.9")   # Thor


def test_an_nvcc_that_failed_once_is_asked_again(monkeypatch):
    """A timeout under eight workers' start-up was kept for the process's life: that worker then
    had no kernel, with advice to set CUDA_HOME. Only an answer is kept."""
    import subprocess

    from sm120_workbook.kernels import build

    answers = [subprocess.TimeoutExpired("nvcc", 60), "Cuda compilation tools, release 13.0, V13.0.88"]

    def run(*a, **kw):
        r = answers.pop(0)
        if isinstance(r, Exception):
            raise r
        return subprocess.CompletedProcess(a, 0, stdout=r)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(build, "_NVCC_IDENTITIES", {})
    assert "TimeoutExpired" in build._nvcc_identity("/opt/busy-cuda")
    assert build._nvcc_identity("/opt/busy-cuda").endswith("release 13.0, V13.0.88")
    assert build._nvcc_identity("/opt/busy-cuda").endswith("release 13.0, V13.0.88")   # kept: no third call
