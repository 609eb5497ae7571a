"""cta_timeline: the %globaltimer stamps of every CTA turned into milestones and spans."""
import numpy as np
import pytest

from sm120_workbook.kernels.cta_timeline import median_over, milestone_table, resolution_ns, span_table

T0 = 1_000_000_000


def synthetic(ctas=4, empty=1, combine=3):
    """Attention CTAs that start 32 ns apart and take 1 / 2 / 1 / 5 / 3 us between milestones
    (the last `empty` of them exit at once, like empty splits), and combine CTAs that start
    after the last attention CTA exits."""
    s = np.zeros((2, 4096, 6), dtype=np.int64)
    for c in range(ctas):
        t = T0 + 32 * c
        s[0, c, 0] = t
        if c >= ctas - empty:
            s[0, c, 5] = t + 320
            continue
        for slot, d in zip((1, 2, 3, 4, 5), (1000, 2000, 1000, 5000, 3000)):
            t += d
            s[0, c, slot] = t
    end = s[0, :ctas, 5].max()
    for c in range(combine):
        s[1, c, 0] = end + 640 + 32 * c
        s[1, c, 1] = s[1, c, 0] + 1024
        s[1, c, 5] = s[1, c, 1] + 2048
    return s


def test_milestones_are_timed_from_the_first_attention_entry():
    m = milestone_table(synthetic()).set_index(["kernel", "milestone"])
    assert m.loc[("attention", "entry"), "first_us"] == 0 and m.loc[("attention", "entry"), "ctas"] == 4
    # only the three CTAs with tiles stage indices; the empty one reaches its exit at once
    assert m.loc[("attention", "indices staged"), "ctas"] == 3
    assert m.loc[("attention", "indices staged"), "first_us"] == pytest.approx(1.0)
    assert m.loc[("attention", "exit"), "first_us"] == pytest.approx(0.096 + 0.32)
    assert m.loc[("attention", "exit"), "last_us"] == pytest.approx(0.064 + 12.0)
    assert m.loc[("combine", "exit"), "ctas"] == 3
    assert ("combine", "tile 0 landed") not in m.index   # the combine step stamps no tiles


def test_spans_per_cta():
    s = span_table(synthetic()).set_index(["kernel", "span"])
    assert s.loc[("attention", "prologue (indptr, indices)"), "median_us"] == pytest.approx(1.0)
    assert s.loc[("attention", "loop"), "median_us"] == pytest.approx(6.0)   # tile 0 landed -> loop end
    assert s.loc[("attention", "epilogue"), "ctas"] == 3                      # not the empty split
    assert s.loc[("combine", "merge"), "max_us"] == pytest.approx(2.048)


def test_the_prologue_milestones_of_session_12_fall_in_order_and_older_stamps_lack_them():
    old = synthetic()
    s = np.zeros((2, 4096, 8), dtype=np.int64)
    s[:, :, :6] = old
    s[0, :3, 6] = s[0, :3, 0] + 600       # indptr read
    s[0, :3, 7] = s[0, :3, 0] + 700       # Q requested, before "indices staged" (+1000)
    m = milestone_table(s)
    assert list(m[m.kernel == "attention"].milestone)[:4] == ["entry", "indptr read", "Q requested", "indices staged"]
    spans = span_table(s).set_index(["kernel", "span"])
    assert spans.loc[("attention", "indptr reads"), "median_us"] == pytest.approx(0.6)
    assert spans.loc[("attention", "Q and indices arrive"), "median_us"] == pytest.approx(0.3)
    assert "indptr read" not in set(milestone_table(old).milestone)
    assert "indptr reads" not in set(span_table(old).span)


def test_resolution_and_median_over_replays():
    assert resolution_ns(synthetic()) == 32
    a, b = milestone_table(synthetic()), milestone_table(synthetic())
    b["last_us"] += 2.0
    m = median_over([a, b, b], ["kernel", "milestone"])
    assert list(m["milestone"][:2]) == ["entry", "indices staged"]       # row order kept
    assert m["last_us"].tolist() == pytest.approx((a["last_us"] + 2.0).tolist())


def test_bad_stamps_raise():
    with pytest.raises(ValueError, match="stamps: expected"):
        milestone_table(np.zeros((3, 10, 6)))
    with pytest.raises(ValueError, match="CTA_TIMELINE"):
        span_table(np.zeros((2, 10, 6)))
    with pytest.raises(ValueError, match="tables"):
        median_over([], ["kernel"])


def test_recorded_table_puts_versions_side_by_side():
    import pandas as pd

    from sm120_workbook.kernels.cta_timeline import recorded_table

    def rec(version, kernel, milestone, us, date, defines=()):
        return dict(heads=8, q_len=16, ctx=4096, kind="milestone", kernel=kernel, milestone=milestone,
                    median_us=us, kernel_version=version, date=date, defines=list(defines), gpu="NVIDIA H200")

    df = pd.DataFrame([rec("v1", "attention", "entry", 0.1, "1"), rec("v1", "attention", "exit", 14.6, "1"),
                       rec("v1", "combine", "exit", 21.9, "1"), rec("v2", "attention", "entry", 0.1, "2"),
                       rec("v2", "attention", "exit", 12.7, "2"), rec("v2", "attention", "exit", 12.5, "3"),
                       rec("v2", "combine", "exit", 16.9, "2"),
                       rec("v3", "attention", "exit", 9.0, "4", defines=("COMBINE_PDL=0",)),
                       dict(rec("v4", "attention", "exit", 8.0, "5"), gpu="NVIDIA RTX PRO 6000 Blackwell Workstation Edition")])
    t = recorded_table(df)
    assert list(t.columns) == ["kernel", "milestone", "v1", "v2"]          # v3 has extra defines, v4 another GPU
    assert recorded_table(df, gpu="RTX PRO 6000")["v4"].tolist() == [8.0]
    assert t["milestone"].tolist() == ["entry", "exit", "exit"]
    assert t.loc[1, "v2"] == 12.5                                          # the newest record
    assert t.attrs["source"].startswith("recorded: NVIDIA H200")            # the chart's provenance
    assert recorded_table(df, versions=["v2"]).columns.tolist() == ["kernel", "milestone", "v2"]
    with pytest.raises(ValueError, match="versions"):
        recorded_table(df, versions=["v9"])
    with pytest.raises(ValueError, match="kind"):
        recorded_table(df, kind="phase")


def test_recorded_table_keeps_the_two_attention_kernels_apart():
    """The split kernel's timelines (cta_rows 32, decode's kernel) are their own table; records
    without the field are the 64-row kernel's."""
    import pandas as pd

    from sm120_workbook.kernels.cta_timeline import recorded_table

    def rec(version, us, cta_rows=None):
        r = dict(heads=8, q_len=1, ctx=4096, kind="milestone", kernel="attention", milestone="exit",
                 median_us=us, kernel_version=version, date=version, defines=[], gpu="NVIDIA H200")
        return r if cta_rows is None else dict(r, cta_rows=cta_rows)

    df = pd.DataFrame([rec("v1", 12.0), rec("v2", 11.0, 64), rec("v2", 6.5, 32)])
    assert recorded_table(df, q_len=1).columns.tolist() == ["kernel", "milestone", "v1", "v2"]
    assert recorded_table(df, q_len=1)["v2"].tolist() == [11.0]
    split = recorded_table(df, q_len=1, cta_rows=32)
    assert split.columns.tolist() == ["kernel", "milestone", "v2"] and split["v2"].tolist() == [6.5]


def test_timeline_chart_has_a_bar_per_segment_and_version():
    import pandas as pd

    from sm120_workbook.kernels.cta_timeline import SEGMENTS, timeline_chart

    names = [("attention", m) for m in ("entry", "indices staged", "tile 0 landed", "tile 1 landed", "loop end", "exit")]
    names += [("combine", m) for m in ("entry", "weights ready", "exit")]
    t = pd.DataFrame([{"kernel": k, "milestone": m, "v1": float(i), "v2": i / 2} for i, (k, m) in enumerate(names)])
    t.attrs["source"] = "recorded: NVIDIA H200; commit abc1234; 2026-12-04"
    chart = timeline_chart(t)
    assert chart.title.subtitle == t.attrs["source"]
    data = chart.data
    assert len(data) == 2 * len(SEGMENTS)
    merge = data[(data["version"] == "v2") & (data["segment"] == "combine: merge")].iloc[0]
    assert (merge["start_us"], merge["end_us"]) == (3.5, 4.0)   # combine weights ready -> exit
    assert (data["end_us"] >= data["start_us"]).all()


def test_the_milestone_slots_are_the_kernels_timeline_events():
    """cta_timeline's slot numbers are TimelineEvent's (mla_verify.cuh), and every slot fits in
    the kTimelineEvents the launcher copies out."""
    import re

    from sm120_workbook.kernels.build import KERNEL_DIR
    from sm120_workbook.kernels.cta_timeline import MILESTONES

    src = (KERNEL_DIR / "mla_verify.cuh").read_text()
    enum = dict(re.findall(r"(kEv\w+) = (\d+)", re.search(r"enum TimelineEvent \{(.*?)\};", src, re.S).group(1)))
    events = int(re.search(r"constexpr int kTimelineEvents = (\d+);", src).group(1))
    slots = {slot for kernel in MILESTONES.values() for slot in kernel}
    assert slots == {int(v) for v in enum.values()} and max(slots) < events
    assert MILESTONES["attention"][int(enum["kEvIndptr"])] == "indptr read"
    assert MILESTONES["attention"][int(enum["kEvQRequested"])] == "Q requested"
    assert MILESTONES["attention"][int(enum["kEvStaged"])] == "indices staged"

