"""The churn study on SGLang's real TokenToKVPoolAllocator (CPU)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("sglang")

from sm120_workbook import kv_fragmentation as kf  # noqa: E402
from sm120_workbook.patches import kv_sort  # noqa: E402

SMALL = dict(capacity_tokens=8192, num_requests=120, max_running=16, prompt_len_range=(16, 1024),
             output_len_range=(8, 256), probe_prompt_len=512, probe_output_len=32)


def test_index_layout_counts_runs_and_pages():
    contiguous = kf.index_layout(np.arange(10, 20), row_bytes=1152, page_bytes=4096)
    assert contiguous["runs"] == 1 and contiguous["mean_run_tokens"] == 10
    # rows 10..19 cover bytes 11520..23039: pages 2..5
    assert contiguous["pages_touched"] == 4 and contiguous["pages_ideal"] == 3
    reversed_ = kf.index_layout(np.arange(20, 10, -1))
    assert reversed_["runs"] == 10 and reversed_["mean_run_tokens"] == 1
    # row 3 straddles pages 0 and 1; row 0 sits in page 0
    assert kf.index_layout([3])["pages_touched"] == 2
    assert kf.index_layout([0])["pages_touched"] == 1
    assert kf.index_layout([0, 2, 4], row_bytes=1, page_bytes=1)["pages_touched"] == 3
    assert kf.index_layout([], 1152, 4096)["tokens"] == 0
    # a row longer than a page touches every page it spans
    assert kf.index_layout([1], row_bytes=10_000, page_bytes=4096)["pages_touched"] == 3


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="indices"):
        kf.index_layout([-1, 2])
    with pytest.raises(ValueError, match="page_bytes"):
        kf.index_layout([1], page_bytes=0)
    with pytest.raises(ValueError, match="capacity_tokens"):
        kf.ChurnConfig(capacity_tokens=1000)
    with pytest.raises(ValueError, match="tokens_per_step"):
        kf.ChurnConfig(tokens_per_step=0)
    with pytest.raises(ValueError, match="prompt_len_range"):
        kf.ChurnConfig(prompt_len_range=(100, 10))
    with pytest.raises(ValueError, match=r"^prompt_len_range: \[low, high\], two ints, got \[16\]"):
        kf.ChurnConfig(prompt_len_range=[16])   # a notebook parameter of one item
    for bad in ("x", -1, True):
        with pytest.raises(ValueError, match="^seed: must be an int >= 0"):
            kf.ChurnConfig(seed=bad)
    with pytest.raises(ValueError, match="probe_arrival"):
        kf.ChurnConfig(probe_arrival=1.5)


@pytest.mark.parametrize("tokens_per_step", [1, 4])
def test_same_schedule_both_ways_and_slots_are_valid(tokens_per_step, seed):
    config = kf.ChurnConfig(**SMALL, tokens_per_step=tokens_per_step, seed=seed)
    unsorted, sorted_ = kf.compare_need_sort(config)
    assert unsorted.steps == sorted_.steps  # only the free-list order differs
    def calls(run):
        return [(op.replace("alloc+sort", "alloc"), n) for op, n, _ in run.ops]

    assert calls(unsorted) == calls(sorted_)
    assert unsorted.merges == 0
    for run in (unsorted, sorted_):
        row = run.probe_row
        assert row.size == config.probe_prompt_len + config.probe_output_len
        assert np.unique(row).size == row.size, "a slot handed out twice"
        assert row.min() >= 1 and row.max() <= config.capacity_tokens  # slot 0 is the pad slot
    again = kf.simulate_churn(config, need_sort=False)
    assert np.array_equal(again.probe_row, unsorted.probe_row)


def test_need_sort_shortens_fragmentation_over_seeds(seed):
    """Averaged over several churns, sorted frees give the probe fewer, longer runs."""
    totals = {False: 0, True: 0}
    for s in range(seed, seed + 8):
        config = kf.ChurnConfig(**SMALL, tokens_per_step=4, seed=s)
        for run in kf.compare_need_sort(config):
            totals[run.need_sort] += kf.index_layout(run.probe_row)["runs"]
    print(totals)
    assert totals[True] < 0.8 * totals[False]


def test_study_refuses_need_sort_false_under_the_override():
    was_installed = kv_sort.is_installed()
    kv_sort.install()
    try:
        with pytest.raises(RuntimeError, match="override is installed"):
            kf.simulate_churn(kf.ChurnConfig(**SMALL), need_sort=False)
    finally:
        if not was_installed:
            kv_sort.uninstall()


def test_frames_records_and_charts():
    configs = [kf.ChurnConfig(**SMALL), kf.ChurnConfig(**SMALL, tokens_per_step=3)]
    layout, timings, runs = kf.churn_study(configs)
    assert set(layout.columns) == {"scenario", "tokens_per_step", "need_sort", "part", "metric",
                                   "value"}
    assert len(layout) == 2 * 2 * len(kf.PARTS) * len(kf.LAYOUT_METRICS)
    assert set(layout["scenario"]) == {"decode", "verify 3 tokens"}
    table = kf.layout_table(layout)
    assert list(table.columns) == list(kf.LAYOUT_METRICS) and len(table) == 4
    summary = kf.timing_summary(timings)
    assert {"alloc", "alloc+sort", "free_group"} <= set(summary["op"])
    assert (summary.loc[summary["op"] == "alloc+sort", "need_sort"]).all()
    assert (runs["merges"] > 0).tolist() == [False, True, False, True]
    records = kf.churn_records(layout, summary, runs, configs)
    assert {r["kind"] for r in records} == {"churn_layout", "churn_timing", "churn_run"}
    assert all("config" in r for r in records if r["kind"] == "churn_layout")
    timed = pd.DataFrame([{"layout": "contiguous", "time_us": 30.5}, {"layout": "scattered", "time_us": 31.0}])
    recs = kf.kernel_layout_records(timed, configs[-1])
    assert [(r["kind"], r["scenario"], r["layout"], r["time_us"]) for r in recs] == [
        ("kernel_layout", configs[-1].scenario, "contiguous", 30.5), ("kernel_layout", configs[-1].scenario, "scattered", 31.0)]
    assert all(r["config"]["tokens_per_step"] == configs[-1].tokens_per_step for r in recs)
    for chart in (kf.layout_chart(layout), kf.pages_chart(layout), kf.sort_cost_chart(summary)):
        spec = chart.to_dict()
        assert spec["data"] or spec.get("datasets")


def test_probe_layouts_same_length_and_ordered_by_scatter():
    config = kf.ChurnConfig(**SMALL, tokens_per_step=4)
    layouts = kf.probe_layouts(config, seed=1)
    frame = kf.layouts_frame(layouts).set_index("layout")
    assert frame["tokens"].nunique() == 1
    assert frame.loc["contiguous", "runs"] == 1
    assert frame.loc["random", "runs"] >= frame.loc["churn, need_sort=False", "runs"]
    assert frame.loc["contiguous", "pages_touched"] <= frame["pages_touched"].min()


def test_kernel_layout_timing_names_why_it_cannot_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; notebook 04 times the kernel there")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        kf.kernel_layout_timing({"contiguous": np.arange(1, 9)})


def test_recorded_kernel_layout_keeps_one_run_per_shape():
    """Layouts are compared within one recorded run: a newer run on another GPU or commit
    replaces the older one whole, never mixes with it. Each shape timed keeps its own newest run."""
    import pandas as pd

    def run(gpu, commit, date, us, keys=2176, batch=8):
        return [{"kind": "kernel_layout", "gpu": gpu, "commit": commit, "date": date, "layout": name,
                 "batch": batch, "heads": 16, "q_len": 4, "keys_per_request": keys, "runs": runs,
                 "pages_touched": 600 + runs, "time_us": us + i, "kv_gb_per_s": 400.0 - i}
                for i, (name, runs) in enumerate((("contiguous", 1), ("random", 2176)))]

    churn = [{"kind": "churn_run", "date": "2026-12-01"}]
    old, new = run("H200", "aaa", "2026-11-29", 48.0), run("RTX PRO 6000", "bbb", "2026-11-30", 30.0)
    recs = pd.DataFrame(new[:1] + old + new[1:] + churn)      # appended out of order, other kinds between
    got = kf.recorded_kernel_layout(recs)
    assert list(got["layout"]) == ["contiguous", "random"] and set(got["commit"]) == {"bbb"}
    assert list(got["time_us"]) == [30.0, 31.0]
    t = kf.kernel_layout_table(got)
    assert list(t.columns) == kf.KERNEL_LAYOUT_COLUMNS and list(t["kv_gb_per_s"]) == [400, 399]
    assert kf.recorded_kernel_layout(pd.DataFrame(churn)).empty
    assert kf.recorded_kernel_layout(pd.DataFrame()).empty
    with pytest.raises(ValueError, match="timings: missing columns"):
        kf.kernel_layout_table(got.drop(columns="kv_gb_per_s"))
    chart = kf.kernel_layout_chart(got, source="recorded: RTX PRO 6000").to_dict()
    assert chart["title"]["subtitle"] == "recorded: RTX PRO 6000"
    # a long-context shape recorded earlier stays beside the newest short one, after it
    long = run("H200", "aaa", "2026-11-28", 90.0, keys=65536, batch=1)
    both = kf.recorded_kernel_layout(pd.DataFrame(long + old + new))
    assert list(both["keys_per_request"]) == [2176, 2176, 65536, 65536]
    assert list(both["commit"]) == ["bbb", "bbb", "aaa", "aaa"]
    assert list(kf.layout_shape(both).unique()) == ["b8 h16 q4, 2,176 keys", "b1 h16 q4, 65,536 keys"]
    # a record without a shape key is kept, not dropped by the grouping
    odd = pd.DataFrame([dict(r, heads=None) for r in long] + old + new)
    assert len(kf.recorded_kernel_layout(odd)) == 4
    facet = kf.kernel_layout_chart(both).to_dict()
    assert facet["facet"]["row"]["sort"] == ["b8 h16 q4, 2,176 keys", "b1 h16 q4, 65,536 keys"]


def test_seed_spread_counts_the_seeds_where_sorting_helps():
    config = kf.ChurnConfig(**SMALL, tokens_per_step=4)
    spread = kf.seed_spread(config, seeds=3)
    assert list(spread["part"].unique()) == list(kf.PARTS) and (spread["seeds"] == 3).all()
    t = spread[spread["part"] == "prompt"].set_index("need_sort")
    assert t.loc[False, "sorted_fewer_runs"] is pd.NA and 0 <= t.loc[True, "sorted_fewer_runs"] <= 3
    per_seed = [kf.index_layout(r.probe_prompt)["runs"] for s in range(3)
                for r in kf.compare_need_sort(kf.ChurnConfig(**SMALL, tokens_per_step=4, seed=s))]
    unsorted, sorted_ = per_seed[0::2], per_seed[1::2]
    assert t.loc[False, "runs_median"] == np.median(unsorted) and t.loc[True, "runs_max"] == max(sorted_)
    assert t.loc[True, "sorted_fewer_runs"] == sum(b < a for a, b in zip(unsorted, sorted_))
    with pytest.raises(ValueError, match="seeds"):
        kf.seed_spread(config, seeds=0)


def test_verify_keeps_slots_ahead_and_frees_them_at_finish():
    """SGLang 0.5.17's v2 speculative workers: a request's slots run ahead of its committed
    length by 2 x the step's tokens and no rejected draft is freed mid-request; the probe's row
    is its committed slots only."""
    config = kf.ChurnConfig(**SMALL, tokens_per_step=4)
    assert config.ahead == 8 and kf.ChurnConfig(**SMALL).ahead == 0
    assert config.decode_slots(32) == 31 + 8 and kf.ChurnConfig(**SMALL).decode_slots(32) == 32
    for need_sort in (False, True):
        run = kf.simulate_churn(config, need_sort=need_sort)
        assert {op for op, _, _ in run.ops} <= {"alloc", "alloc+sort", "free_group"}   # no mid-request free
        assert run.probe_decode.size == config.probe_output_len
        # every slot is free or held: the tails allocated ahead went back at each finish
        assert run.free_slots + run.held_slots == config.capacity_tokens
        # the last step topped the probe up to its committed length before it + 2k, then kept 1..k
        ahead = run.probe_allocated - run.probe_row.size
        assert config.tokens_per_step <= ahead <= config.ahead - 1


def test_cli_names_a_bad_churn_argument(capsys):
    with pytest.raises(SystemExit) as e:
        kf.main(["--capacity-tokens", "100"])
    assert e.value.code == 2 and "capacity_tokens: 100 cannot hold" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kf.main(["--help"])
    assert "--probe-prompt-len 65408" in capsys.readouterr().out   # the long-context example
