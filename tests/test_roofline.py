"""Roofline numbers against hand calculations."""
from __future__ import annotations

import pytest

from sm120_workbook import roofline
from sm120_workbook.roofline import (TARGET_GPUS, explorer_summary, intensity_chart, roofline_chart,
                                     roofline_explorer, roofline_frame, roofline_point, roofline_time_us,
                                     verify_cost)


def test_verify_cost_by_hand():
    # 16 heads, 16 drafts, 32k keys, bf16: KV 32768 * 1152 B; Q 16*16*576*2; O 16*16*512*2
    c = verify_cost(16, 16, 32768)
    assert c["kv_bytes"] == 37_748_736
    assert c["q_bytes"] == 294_912
    assert c["out_bytes"] == 262_144
    assert c["total_bytes"] == 38_305_792
    # 2 * 16 * 16 * 32768 * (576 + 512)
    assert c["flops"] == 18_253_611_008
    assert c["intensity"] == pytest.approx(18_253_611_008 / 38_305_792)


def test_verify_cost_scales_with_batch_and_kv_width():
    one = verify_cost(8, 4, 1000)
    four = verify_cost(8, 4, 1000, batch=4)
    for k in ("kv_bytes", "q_bytes", "out_bytes", "total_bytes", "flops"):
        assert four[k] == 4 * one[k]
    fp8 = verify_cost(8, 4, 1000, kv_bytes_per_token=656)   # e.g. an fp8 latent + bf16 rope row
    assert fp8["kv_bytes"] == 656_000 and fp8["flops"] == one["flops"]
    # per request: 2 * 8 * 4 * 1000 * 1088
    assert one["flops"] == 69_632_000


def test_roofline_time_is_the_max_of_the_two_bounds():
    mem_only = {"kv_bytes": 10**9, "q_bytes": 0, "out_bytes": 0, "flops": 0}
    # 1 GB at 1000 GB/s = 1 ms
    assert roofline_time_us(mem_only, mem_gbps=1000, matmul_tflops=1) == pytest.approx(1e3)
    flop_only = {"kv_bytes": 0, "q_bytes": 0, "out_bytes": 0, "flops": 10**12}
    # 1 TFLOP at 500 TFLOP/s = 2 ms
    assert roofline_time_us(flop_only, mem_gbps=1, matmul_tflops=500) == pytest.approx(2e3)
    c = verify_cost(16, 16, 32768)
    # RTX PRO 6000: memory 38,305,792 B / 1792 GB/s = 21.376 us; compute 18.2536 GFLOP / 400 TFLOP/s = 45.634 us
    assert roofline_time_us(c, 1792, 400) == pytest.approx(45.634027520, rel=1e-9)
    with pytest.raises(ValueError, match="mem_gbps"):
        roofline_time_us(c, 0, 400)
    with pytest.raises(ValueError, match="matmul_tflops"):
        roofline_time_us(c, 1792, -1)


def test_roofline_point_bounds():
    rtx = "RTX PRO 6000 Blackwell"
    verify = roofline_point(verify_cost(16, 16, 32768), rtx)
    assert verify["bound"] == "compute"
    assert verify["mem_time_us"] == pytest.approx(38_305_792 / 1792e3)
    assert verify["compute_time_us"] == pytest.approx(18_253_611_008 / 400e6)
    decode = roofline_point(verify_cost(16, 1, 32768), rtx)
    assert decode["bound"] == "memory"
    assert decode["floor_us"] == pytest.approx((37_748_736 + 18_432 + 16_384) / 1792e3)
    assert verify["ridge_intensity"] == pytest.approx(400e12 / 1792e9)
    h200 = roofline_point(verify_cost(16, 16, 32768), "H200")
    assert h200["mem_time_us"] == pytest.approx(38_305_792 / 4180e3)
    with pytest.raises(ValueError, match="gpu"):
        roofline_point(verify_cost(1, 1, 1), "A100")


def test_target_gpus_table():
    rtx, h200 = TARGET_GPUS["RTX PRO 6000 Blackwell"], TARGET_GPUS["H200"]
    assert (rtx["sm_arch"], rtx["sms"], rtx["mem_gbps_spec"], rtx["smem_per_block_optin"], rtx["wgmma"]) == \
        ("sm_120", 188, 1792.0, 101376, False)
    assert (h200["sm_arch"], h200["sms"], h200["mem_gbps_spec"], h200["wgmma"]) == ("sm_90", 132, 4800.0, True)
    assert rtx["bf16_tflops"] == 400.0


def test_h200_ceilings_are_the_recorded_medians():
    """The H200's roofline ceilings are what this workplace measured, not the spec: each within
    1% of the median of the recorded ceilings runs."""
    from sm120_workbook.results import load_records

    h200 = TARGET_GPUS["H200"]
    rec = load_records("ceilings")
    rec = rec[rec["gpu"].str.contains("H200")]
    assert len(rec) >= 10
    assert h200["mem_gbps"] == pytest.approx(rec["copy_gbps"].median(), rel=0.01)
    assert h200["bf16_tflops"] == pytest.approx(rec["bf16_tflops"].median(), rel=0.01)


@pytest.mark.parametrize("kw, name", [
    (dict(heads=0), "heads"), (dict(q_len=1.5), "q_len"), (dict(ctx=-3), "ctx"),
    (dict(batch=0), "batch"), (dict(kv_bytes_per_token=0), "kv_bytes_per_token"),
])
def test_verify_cost_bad_inputs(kw, name):
    args = {"heads": 16, "q_len": 4, "ctx": 1024, **kw}
    with pytest.raises(ValueError, match=name):
        verify_cost(**args)


def test_roofline_frame_is_tidy():
    df = roofline_frame([8, 128], [1, 16], [1024, 65536])
    assert len(df) == 2 * 2 * 2 * len(TARGET_GPUS)
    assert {"gpu", "heads", "q_len", "ctx", "kv_bytes", "flops", "floor_us", "bound", "intensity"} <= set(df)
    row = df[(df.gpu == "H200") & (df.heads == 128) & (df.q_len == 16) & (df.ctx == 65536)].iloc[0]
    assert row["flops"] == 2 * 128 * 16 * 65536 * 1088
    assert row["bound"] == "compute"


def test_explorer_summary_and_widget():
    s = explorer_summary(16, 16, 32768, "RTX PRO 6000 Blackwell")
    assert s["bound"] == "compute" and s["flops"] == 18_253_611_008
    ui = roofline_explorer()
    html = ui.children[-1]
    before = html.value
    assert "RTX PRO 6000 Blackwell" in before and "bound" in before
    heads_slider = ui.children[0].children[0]
    assert (heads_slider.min, heads_slider.max) == (1, 128)
    heads_slider.value = 1
    assert html.value != before and "heads=1," in html.value
    gpu = ui.children[1].children[1]
    gpu.value = "H200"
    assert "<b>H200</b>" in html.value


def test_charts_build_and_save(tmp_path):
    from sm120_workbook.charts import save_chart

    df = roofline_frame([16], [1, 4, 16], [1024, 8192, 65536])
    chart = roofline_chart(df)
    spec = chart.to_dict()
    assert spec["facet"]["column"]["field"] == "gpu"
    # the saved chart says which ceilings are recorded medians and which a spec
    assert "H200: 4,180 GB/s and 780 TFLOP/s, median of the first 36 runs" in spec["title"]["subtitle"]
    assert "RTX PRO 6000 Blackwell: 1,792 GB/s (spec)" in spec["title"]["subtitle"]
    with pytest.raises(ValueError, match="heads"):
        roofline_chart(roofline_frame([1, 2], [1], [1024]))
    paths = save_chart(intensity_chart(roofline_frame([1, 16, 128], [1, 16], [4096])), "intensity", tmp_path)
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    assert roofline.HEAD_DIM == 576 and roofline.KV_BYTES_PER_TOKEN == 1152


@pytest.mark.parametrize("kw, name", [(dict(heads=256), "heads"), (dict(q_len=32), "q_len"),
                                      (dict(ctx=2 ** 20), "ctx"), (dict(gpu="A100"), "gpu")])
def test_roofline_explorer_refuses_what_its_sliders_would_clamp(kw, name):
    from sm120_workbook.roofline import roofline_explorer

    with pytest.raises(ValueError, match=name):
        roofline_explorer(**kw)


def test_roofline_frame_wants_lists():
    from sm120_workbook.roofline import roofline_frame

    with pytest.raises(ValueError, match="heads: a list of values, got 16"):
        roofline_frame(16, [1], [1024])
    assert len(roofline_frame([16], [1], [1024])) == 2
