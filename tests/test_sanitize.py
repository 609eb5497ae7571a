"""The compute-sanitizer wrapper's CPU side: the case program and the report parser."""
from __future__ import annotations

import ast

from sm120_workbook.kernels import sanitize


def test_case_script_is_python_and_names_the_build():
    for defines in sanitize.BUILDS.values():
        src = sanitize.case_script(defines)
        ast.parse(src)
        assert f"kernel_defines={tuple(defines)!r}" in src


def test_case_script_passes_every_host_check(monkeypatch):
    """The case program, run on the CPU: every call passes mla_verify_attention's argument checks
    (shapes, lengths, workspace size), which run before the launch, and stops only where a CUDA
    tensor is required. So a case that the GPU machine would refuse fails here, in CI."""
    import sm120_workbook.kernels as kernels
    from sm120_workbook.kernels import verify_attention

    calls = []

    def host_checks_only(*args, **kwargs):
        try:
            verify_attention.mla_verify_attention(*args, **kwargs)
        except ValueError as e:
            assert "must be a CUDA tensor" in str(e), e
        calls.append(kwargs["max_q_len"])

    monkeypatch.setattr(kernels, "mla_verify_attention", host_checks_only)
    src = sanitize.case_script().replace("'cuda'", "'cpu'").replace("torch.cuda.synchronize(); ", "")
    exec(compile(src, "sanitizer case", "exec"), {"__name__": "sanitizer_case"})
    # 13 valid calls, then 4 a kernel at 130 and 3 requests (valid, kv and qo broken, overlap), then
    # 2 a kernel past T (2 requests, 1 request), then 3 a kernel past kv_indices, the mask, and a
    # wrapping kv_indptr
    assert len(calls) == 31


def test_parse_racecheck_report():
    report = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at void sm120_mla::mla_verify_split_kernel<16>+0x1a30
=========     and Read access at void sm120_mla::mla_verify_split_kernel<16>+0x2b40 [256 hazards]
ran
========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)
"""
    r = sanitize.parse_report(report)
    assert r["count"] == 3 and r["summary"].startswith("RACECHECK SUMMARY")
    assert r["first_lines"][0].startswith("========= Error: Race")


def test_parse_clean_and_missing_summary():
    assert sanitize.parse_report("ran\n========= ERROR SUMMARY: 0 errors\n")["count"] == 0
    assert sanitize.parse_report("Segmentation fault")["count"] is None


def test_exit_status_is_the_shipped_builds():
    ok = {"build": "default", "clean": True}
    assert sanitize.exit_status([ok, {"build": "group_barriers", "clean": False}]) == 0
    assert sanitize.exit_status([ok, {"build": "default", "clean": False}]) == 1


def test_recorded_table_keeps_each_builds_newest_commit():
    import pandas as pd

    from sm120_workbook.kernels.sanitize import recorded_table

    rows = [  # default ran at commits a and b; pv_lag only at c, the newest of all
        ("default", "racecheck", False, "a" * 40, "2026-11-29T10:00"),
        ("default", "memcheck", True, "a" * 40, "2026-11-29T10:01"),
        ("default", "racecheck", True, "b" * 40, "2026-11-29T11:00"),
        ("pv_lag", "racecheck", True, "c" * 40, "2026-11-29T12:00"),
        ("racecheck_probe", "racecheck", True, "a" * 40, "2026-11-29T10:02"),   # a build no longer in BUILDS
    ]
    df = pd.DataFrame(rows, columns=["build", "tool", "clean", "commit", "date"]).assign(gpu="NVIDIA H200")
    rtx = pd.DataFrame([("default", "racecheck", False, "d" * 40, "2026-11-30T10:00", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition")],   # sm_120a's binary
                       columns=["build", "tool", "clean", "commit", "date", "gpu"])
    t = recorded_table(pd.concat([df, rtx]))
    assert list(zip(t["build"], t["tool"], t["clean"], t["commit"])) == [
        ("default", "racecheck", True, "bbbbbbb"), ("pv_lag", "racecheck", True, "ccccccc")]
    assert recorded_table(pd.concat([df, rtx]), gpu="RTX PRO 6000")["commit"].tolist() == ["ddddddd"]
    tagged = recorded_table(df.assign(kernel_version=["v1", "v1", None, "v2", "v1"]))
    assert tagged["kernel_version"].tolist() == ["untagged", "v2"]   # a run without --tag
