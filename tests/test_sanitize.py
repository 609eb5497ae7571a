"""The compute-sanitizer wrapper's CPU side: the case program and the report parser."""
from __future__ import annotations

import ast

from sm120_workbook.kernels import sanitize


def test_case_script_is_python_and_names_the_build():
    for defines in sanitize.BUILDS.values():
        src = sanitize.case_script(defines)
        ast.parse(src)
        assert f"kernel_defines={tuple(defines)!r}" in src


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
    df = pd.DataFrame(rows, columns=["build", "tool", "clean", "commit", "date"])
    t = recorded_table(df)
    assert list(zip(t["build"], t["tool"], t["clean"], t["commit"])) == [
        ("default", "racecheck", True, "bbbbbbb"), ("pv_lag", "racecheck", True, "ccccccc")]
