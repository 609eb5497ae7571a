"""step_profile: kernel categories, the busy union and the per-step table, on synthetic traces."""
from __future__ import annotations

import gzip
import json

import pytest

from sm120_workbook.step_profile import categorize, load_trace, profile_frame, summarize_trace


@pytest.mark.parametrize("name,cat", [
    ("void sm120_mla::mla_verify_split_kernel<16>(sm120_mla::Params)", "attention: sm120_mla"),
    ("void sm120_mla::mla_verify_combine_kernel<16>(sm120_mla::Params)", "attention: sm120_mla"),
    ("sm120_mla::wide::mla_verify_wide_kernel(sm120_mla::Params)", "attention: sm120_mla"),
    ("_fwd_kernel", "attention: triton"),
    ("_fwd_grouped_kernel_stage1", "attention: triton"),
    ("void flash::flash_fwd_splitkv_mla_kernel<...>", "attention: flashmla"),
    ("fused_moe_kernel", "moe"),
    ("nvjet_tst_128x64_64x4_1x2_h_bz_TNN", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "copy / fill / elementwise"),
    ("rms_norm_kernel", "norm / rope / activation"),
    ("mystery", "other"),
])
def test_categorize(name, cat):
    assert categorize(name) == cat


def test_overlapping_kernels_count_once_in_busy_time(tmp_path):
    ev = [{"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 0, "dur": 100},
          {"ph": "X", "cat": "kernel", "name": "gemm_b", "ts": 50, "dur": 100},   # overlaps a
          {"ph": "X", "cat": "kernel", "name": "_fwd_kernel", "ts": 400, "dur": 100},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = summarize_trace(load_trace(path), steps=2)
    assert s["window_ms"] == 0.5 and s["busy_ms"] == 0.25 and s["busy_share"] == 0.5
    assert s["per_step_ms"] == 0.25
    assert s["gpu_ms_per_step"] == {"gemm": 0.1, "attention: triton": 0.05}
    assert s["top_kernels"][0][0] == "gemm_a" and s["kernels"] == 3
    df = profile_frame([{"backend": "triton", "spec": "ngram", "ctx": 4096, **s}])
    assert set(df["category"]) == {"gemm", "attention: triton", "host / idle (no kernel running)"}
    assert df.loc[df["category"].str.startswith("host"), "ms"].item() == pytest.approx(0.125)


def test_chart_and_table_from_records(tmp_path):
    from sm120_workbook.charts import save_chart
    from sm120_workbook.step_profile import profile_table, step_profile_chart

    recs = [{"backend": b, "spec": "ngram", "ctx": c, "per_step_ms": ms, "busy_share": bs,
             "gpu_ms_per_step": {"attention: " + b: att, "gemm": 0.7}}
            for b, c, ms, bs, att in (("triton", 65536, 56.0, 0.92, 50.4), ("sm120_mla", 65536, 6.9, 0.21, 0.25))]
    t = profile_table(recs)
    assert list(t["attention_ms"]) == [50.4, 0.25] and list(t["host_idle_ms"]) == [4.48, 5.45]
    assert list(t["config"]) == ["triton", "sm120_mla"]
    assert list(profile_table([dict(recs[1], config="sm120_mla TP2")])["config"]) == ["sm120_mla TP2"]
    save_chart(step_profile_chart(recs), "profile", str(tmp_path))
    assert any(tmp_path.iterdir())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="steps"):
        summarize_trace({"traceEvents": []}, steps=0)
    with pytest.raises(ValueError, match="no GPU kernel events"):
        summarize_trace({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}, steps=1)
