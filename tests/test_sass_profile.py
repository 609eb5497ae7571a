"""Reading an Nsight Compute source-page export (no GPU needed): a synthetic two-loop kernel."""
from __future__ import annotations

import pytest

from sm120_workbook.kernels import sass_profile as sp

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_barrier","stall_wait","stall_barrier (Not Issued)"')


def _csv(tmp_path, rows):
    lines = ['"Kernel Name","k"', HEADER]
    for addr, sass, samples, executed, barrier, wait in rows:
        lines.append(f'"{addr:#x}","{sass}","{samples}","0","{executed}","{barrier}","{wait}","0"')
    p = tmp_path / "prof_sass.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_loops_stalls_and_hot_instructions(tmp_path):
    base = 0x7f0000001000
    rows = [(base, "LDC R1, c[0x0][0x28]", 1, 100, 0, 1)]
    # loop A: 4 instructions (2 HMMA) taken 2000 times; loop B: 3 instructions taken 1000 times
    rows += [(base + 0x10, "HMMA.16816.F32.BF16 R0, R4, R8, R0", 30, 2000, 0, 30),
             (base + 0x20, "HMMA.16816.F32.BF16 R2, R4, R8, R2", 10, 2000, 0, 10),
             (base + 0x30, "BAR.SYNC.DEFER_BLOCKING 0x1, 0x80", 5, 2000, 5, 0),
             (base + 0x40, f"@!P0  BRA {base + 0x10:#x}", 50, 2000, 50, 0)]
    rows += [(base + 0x50, "FADD R1, R2, R3", 2, 1000, 0, 2),
             (base + 0x60, "FMUL R1, R1, R3", 2, 1000, 0, 2),
             (base + 0x70, f"@P1  BRA {base + 0x50:#x}", 0, 1000, 0, 0),
             (base + 0x80, f"BRA {base + 0x90:#x}", 0, 5000, 0, 0),    # forward: not a loop
             (base + 0x90, "EXIT", 0, 100, 0, 0)]
    df = sp.load(_csv(tmp_path, rows))
    assert len(df) == 10 and df["off"].iloc[0] == 0 and df["samples"].sum() == 100
    lp = sp.loops(df)
    assert list(lp["passes"]) == [2000, 1000]
    assert list(lp["instr_per_pass"]) == [4.0, 3.0] and list(lp["hmma_per_pass"]) == [2.0, 0.0]
    assert list(lp["samples"]) == [95, 4]
    shares = sp.stall_shares(df)
    assert shares.index[0] == "barrier" and shares["barrier"] == pytest.approx(55.0)
    top = sp.hottest(df, 2)
    assert list(top["off"]) == ["0x0040", "0x0010"] and top["reasons"].iloc[0] == "barrier 50"
    sp.main([str(_csv(tmp_path, rows))])


def test_a_file_without_samples_says_how_to_export(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text('"Kernel Name","k"\n"Address","Source","Instructions Executed"\n"0x10","NOP","1"\n')
    with pytest.raises(ValueError, match="warp-stall samples"):
        sp.load(p)
    p.write_text("nothing\n")
    with pytest.raises(ValueError, match="--page source"):
        sp.load(p)


def test_a_report_of_several_kernels_reads_the_one_asked_for(tmp_path):
    # newer ncu exports one section per profiled kernel (the split kernel, then the combine)
    split = ['"Kernel Name","void sm120_mla::mla_verify_split_kernel<(int)16>(sm120_mla::Params)",', HEADER,
             '"0x100","HMMA.16816.F32.BF16 R0, R4, R8, R0","7","0","10","0","7","0"']
    combine = ['"Kernel Name","sm120_mla::mla_verify_combine_kernel(sm120_mla::Params)",', HEADER,
               '"0x200","FADD R1, R2, R3","3","0","5","0","3","0"', '"0x210","EXIT","0","0","5","0","0","0"']
    p = tmp_path / "two.csv"
    p.write_text("\n".join(split + combine) + "\n")
    assert list(sp.load(p)["sass"]) == ["HMMA.16816.F32.BF16 R0, R4, R8, R0"]
    assert list(sp.load(p, "combine")["samples"]) == [3, 0]
    with pytest.raises(ValueError, match="no profiled kernel matches 'nope'"):
        sp.load(p, "nope")
