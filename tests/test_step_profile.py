"""step_profile: kernel categories, the busy union and the per-step table, on synthetic traces."""
from __future__ import annotations

import gzip
import json
import math

import pytest

from sm120_workbook.step_profile import categorize, load_trace, profile_frame, summarize_trace


@pytest.mark.parametrize("name,cat", [
    ("void sm120_mla::mla_verify_split_kernel<16>(sm120_mla::Params)", "attention: sm120_mla"),
    ("void sm120_mla::mla_verify_combine_kernel<16>(sm120_mla::Params)", "attention: sm120_mla"),
    ("sm120_mla::wide::mla_verify_wide_kernel(sm120_mla::Params)", "attention: sm120_mla"),
    ("_fwd_kernel", "attention: triton"),
    ("_fwd_grouped_kernel_stage1", "attention: triton"),
    ("void flash::flash_fwd_splitkv_mla_kernel<...>", "attention: flashmla"),
    ("smxx::decode::get_mla_metadata_kernel(GetDecodeSchedMetaParams)", "attention: flashmla"),
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>(...)", "attention: flashinfer"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>(...)", "attention: flashinfer"),
    ("void flashinfer::PersistentVariableLengthMergeStatesKernel<...>(...)", "attention: flashinfer"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(...)", "norm / rope / activation"),
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<...>(...)", "sampling / speculative"),
    ("create_flashinfer_kv_indices_triton", "kv cache / indices"),
    ("void flashinfer::PrefillWithKVCacheKernel<...>(...)", "attention: flashinfer"),   # not "fill"
    ("void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<...>(...)", "attention: flashinfer"),
    ("void flashinfer::sampling::TopKRenormProbKernel<...>(...)", "sampling / speculative"),   # not "norm"
    ("void at::native::mbtopk::gatherTopK<c10::BFloat16, unsigned int, 2>(...)", "sampling / speculative"),
    ("_draft_topk1_kernel", "sampling / speculative"),
    ("topk_softmax_kernel", "moe"), ("grouped_topk_kernel", "moe"), ("biased_grouped_topk_kernel", "moe"),
    ("moe_fused_gate_kernel", "moe"), ("_router_triton_kernel", "moe"),
    ("void (anonymous namespace)::all_reduce_kernel<(anonymous namespace)::AllReducePushImpl<__nv_bfloat16, 2u, "
     "true>>(...)", "communication (all-reduce)"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication (all-reduce)"),
    ("void at::native::reduce_kernel<512, 1, ...>", "copy / fill / elementwise"),
    ("fused_moe_kernel", "moe"),
    ("nvjet_tst_128x64_64x4_1x2_h_bz_TNN", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "copy / fill / elementwise"),
    ("rms_norm_kernel", "norm / rope / activation"),
    ("mystery", "other"),
])
def test_categorize(name, cat):
    assert categorize(name) == cat


def test_overlapping_kernels_count_once_in_busy_time_and_in_their_category(tmp_path):
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
    assert s["gpu_ms_per_step"] == {"gemm": 0.075, "attention: triton": 0.05}   # a category: the union too
    assert s["top_kernels"][0][0] == "gemm_a" and s["kernels"] == 3
    df = profile_frame([{"backend": "triton", "spec": "ngram", "ctx": 4096, **s}])
    assert set(df["category"]) == {"gemm", "attention: triton", "host / idle (no kernel running)"}
    assert df.loc[df["category"].str.startswith("host"), "ms"].item() == pytest.approx(0.125)


def test_a_pdl_dependent_counts_once_in_its_category(tmp_path):
    """The combine step starts beside the attention kernel and waits for it (sm_90, COMBINE_PDL):
    the category holds the union of their spans (60 us), not their sum (110 us)."""
    ev = [{"ph": "X", "cat": "kernel", "name": "void sm120_mla::wide::mla_verify_wide_kernel<false>(sm120_mla::Params)",
           "ts": 0, "dur": 50},
          {"ph": "X", "cat": "kernel", "name": "void sm120_mla::mla_verify_combine_kernel<16, true, true>(...)",
           "ts": 1, "dur": 59},
          {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x64", "ts": 100, "dur": 40}]
    s = summarize_trace({"traceEvents": ev}, steps=1)
    assert s["gpu_ms_per_step"] == {"attention: sm120_mla": 0.06, "gemm": 0.04}
    assert s["category_time"] == "union" and s["busy_ms"] == 0.1
    assert [k[2] for k in s["top_kernels"][:2]] == [0.059, 0.05]   # each kernel's own span
    assert summarize_trace(ev, steps=1) == s   # a trace saved as its bare event list


def test_chart_and_table_from_records(tmp_path):
    from sm120_workbook.charts import save_chart
    from sm120_workbook.step_profile import profile_table, step_profile_chart

    recs = [{"backend": b, "spec": "ngram", "ctx": c, "per_step_ms": ms, "busy_share": bs, "expert_record": True,
             "layers": 4, "commit": "abcdef0123+dirty", "gpu_ms_per_step": {"attention: " + b: att, "gemm": 0.7}}
            for b, c, ms, bs, att in (("triton", 65536, 56.0, 0.92, 50.4), ("sm120_mla", 65536, 6.9, 0.21, 0.25))]
    t = profile_table(recs)
    assert list(t["attention_ms"]) == [50.4, 0.25] and list(t["host_idle_ms"]) == [4.48, 5.45]
    assert list(t["config"]) == ["triton", "sm120_mla"]
    assert list(profile_table([dict(recs[1], config="sm120_mla TP2")])["config"]) == ["sm120_mla TP2"]
    assert list(t["layers"]) == [4, 4] and list(t["commit"]) == ["abcdef0+dirty"] * 2
    # records before category_time summed overlapping spans; the table and chart say which
    assert list(t["categories"]) == ["summed spans"] * 2
    assert list(profile_table([dict(recs[1], category_time="union")])["categories"]) == ["union"]
    assert list(profile_table([dict(recs[0], tp=2, ngram_tail=True)])["config"]) == ["triton TP2 + ngram_tail"]
    assert "unprofiled_ms" not in t
    # beside each profile, the step its own server measured unprofiled at that context (the median)
    decode = [{"run_id": "r1", "ctx": 65536, "verify_step_ms": ms} for ms in (5.0, 5.1, 6.2)] + [
        {"run_id": "r1", "ctx": 4096, "verify_step_ms": 3.0}, {"run_id": "r2", "ctx": 65536, "verify_step_ms": 50.0}]
    u = profile_table([dict(recs[1], run_id="r1"), dict(recs[1], run_id="r3")], decode=decode)
    assert list(u.columns[:6]) == ["config", "layers", "spec", "ctx", "step_ms", "unprofiled_ms"]
    assert u["unprofiled_ms"].iloc[0] == 5.1 and math.isnan(u["unprofiled_ms"].iloc[1])
    assert "unprofiled_ms" in profile_table(recs, decode=[])   # no records: the column, empty
    import pandas as pd   # a frame, as notebook 05 passes; a record without a run_id matches nothing
    u = profile_table([dict(recs[1], run_id="r1"), dict(recs[1], run_id=float("nan"))], decode=pd.DataFrame(decode))
    assert u["unprofiled_ms"].iloc[0] == 5.1 and math.isnan(u["unprofiled_ms"].iloc[1])
    save_chart(step_profile_chart(recs), "profile", str(tmp_path))
    assert any(tmp_path.iterdir())
    # the same configuration profiled at two depths: two bars, each labelled with its depth
    new = dict(recs[1], category_time="union")
    deeper = step_profile_chart([new, dict(new, layers=16)], source="recorded: H200").to_dict()
    points = {r["point"] for r in next(iter(deeper["datasets"].values()))}
    assert points == {"sm120_mla, 4 layers / ngram / 64k", "sm120_mla, 16 layers / ngram / 64k"}
    older = step_profile_chart([recs[1]]).to_dict()
    assert {r["point"] for r in next(iter(older["datasets"].values()))} == {
        "sm120_mla, 4 layers / ngram / 64k (summed spans)"}
    assert deeper["title"]["subtitle"] == "recorded: H200"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="steps"):
        summarize_trace({"traceEvents": []}, steps=0)
    with pytest.raises(ValueError, match="no GPU kernel events"):
        summarize_trace({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}, steps=1)


def _profile_records():
    import pandas as pd

    base = {"backend": "sm120_mla", "spec": "ngram", "ctx": 65536, "layers": 4, "tp": 1, "expert_record": True,
            "per_step_ms": 4.0, "busy_share": 0.3, "steps": 10}
    return pd.DataFrame([
        {**base, "date": "2026-11-29T16:00", "trace_file": "old.trace.json.gz", "per_step_ms": 7.0},
        {**base, "date": "2026-11-29T17:00", "trace_file": "new.trace.json.gz", "ngram_tail": True},
        {**base, "date": "2026-11-29T16:30", "trace_file": "kept.trace.json.gz", "with_stack": True},
        {**base, "date": "2026-11-29T18:00", "trace_file": "gone.trace.json.gz", "with_stack": True},
        {**base, "date": "2026-11-29T18:10", "trace_file": "deep.trace.json.gz", "layers": 16},
        {**base, "date": "2026-11-29T17:30", "trace_file": "newer.trace.json.gz"},
    ])


def test_timed_profiles_drop_stacked_windows_and_keep_the_newest_of_each_point():
    from sm120_workbook.step_profile import timed_profiles

    recs = timed_profiles(_profile_records())
    got = sorted((r["config"], r["layers"], r["trace_file"]) for r in recs)
    # with_stack windows are not timed; the unpatched and patched runs, and the two depths, are
    # separate points; the older unstacked record of a point is replaced by the newer
    assert got == [("sm120_mla", 4, "newer.trace.json.gz"), ("sm120_mla", 16, "deep.trace.json.gz"),
                   ("sm120_mla + ngram_tail", 4, "new.trace.json.gz")]
    with pytest.raises(ValueError, match="profiles: missing columns"):
        timed_profiles(_profile_records().drop(columns="date"))


def test_pick_stacked_trace_takes_the_newest_whose_file_is_kept(tmp_path):
    from sm120_workbook.step_profile import pick_stacked_trace

    profiles = _profile_records()
    rec, path, missing = pick_stacked_trace(profiles, tmp_path)
    assert rec is None and path is None and missing == ["gone.trace.json.gz", "kept.trace.json.gz"]
    (tmp_path / "kept.trace.json.gz").write_bytes(b"")
    (tmp_path / "old.trace.json.gz").write_bytes(b"")   # kept, but not a stacked profile
    rec, path, missing = pick_stacked_trace(profiles, tmp_path)
    assert rec["trace_file"] == "kept.trace.json.gz" and path == tmp_path / "kept.trace.json.gz"
    assert missing == ["gone.trace.json.gz"]
    assert pick_stacked_trace(profiles.drop(columns="with_stack"), tmp_path) == (None, None, [])


def test_host_functions_match_by_function_not_line():
    from sm120_workbook.step_profile import host_functions

    top = [["threading.py(1030): _bootstrap", 4, 52.9],
           ["sglang/srt/managers/scheduler.py(3527): run_batch", 11, 10.46],
           ["sglang/srt/managers/scheduler.py(3600): run_batch", 11, 9.0],            # another SGLang version
           ["sglang/srt/managers/scheduler.py(2924): get_next_batch_to_run", 11, 1.1],
           ["sglang/srt/speculative/ngram_worker.py(237): _prepare_draft_tokens", 10, 2.15],
           ["sglang/srt/managers/tp_worker.py(558): forward_batch_generation", 10, 2.03]]
    t = host_functions(top)
    assert list(t.columns) == ["ms_per_step", "calls", "function"]
    assert list(t["ms_per_step"]) == [10.46, 9.0, 2.15, 2.03]
    assert host_functions([]).empty
