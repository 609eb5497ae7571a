"""Expert-load math against hand-computed cases, SGLang's dump format, and the charts."""
from __future__ import annotations

import numpy as np
import pytest

from sm120_workbook import expert_balance as eb


def test_gpu_load_and_balancedness_by_hand():
    counts = np.zeros((3, 16), dtype=np.int64)
    counts[1, 0] = 8            # layer 1: everything on expert 0 -> GPU 0 of 4
    counts[2, :] = 1            # layer 2: uniform
    load = eb.gpu_load(counts, num_gpus=4)
    assert load.tolist() == [[0, 0, 0, 0], [8, 0, 0, 0], [4, 4, 4, 4]]
    bal = eb.balancedness(load)
    assert bal[0] == pytest.approx(1.0)                                  # empty layer: (0+eps)/(0+eps)
    assert bal[1] == pytest.approx((2 + 1e-5) / (8 + 1e-5))              # mean 2, max 8
    assert bal[2] == pytest.approx(1.0)
    assert eb.moe_layer_ids(counts) == [1, 2]


def test_ep8_placement_of_384_experts_by_hand():
    counts = np.arange(384, dtype=np.int64)[None, :]    # expert i routed i tokens
    load = eb.gpu_load(counts, 8)[0]
    # GPU g holds experts 48g .. 48g+47: sum = 48*48g + (0+..+47) = 2304g + 1128
    assert load.tolist() == [2304 * g + 1128 for g in range(8)]
    assert eb.balancedness(load[None])[0] == pytest.approx((9192 + 1e-5) / (17256 + 1e-5), rel=1e-6)


def test_replica_matches_sglang(seed):
    if eb.sglang_eplb() is None:
        pytest.skip(f"sglang.srt.eplb.expert_distribution is not importable here: {eb.sglang_eplb_error()}")
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=(5, 384))
    with_sglang = eb.gpu_load(counts, 8), eb.balancedness(eb.gpu_load(counts, 8))
    import unittest.mock as um

    with um.patch.object(eb, "sglang_eplb", lambda: None):
        replica = eb.gpu_load(counts, 8), eb.balancedness(eb.gpu_load(counts, 8))
    np.testing.assert_array_equal(with_sglang[0], replica[0])
    np.testing.assert_allclose(with_sglang[1], replica[1], rtol=1e-6)


def test_checks():
    with pytest.raises(ValueError, match="num_gpus: 5 does not divide 384"):
        eb.gpu_load(np.zeros((1, 384)), 5)
    with pytest.raises(ValueError, match="counts: expected"):
        eb.gpu_load(np.zeros(384), 8)
    with pytest.raises(ValueError, match="ranks_summed"):
        eb.expert_counts({"logical_count": np.ones((1, 2, 8))}, ranks_summed=2)
    assert eb.placement_label(1) == "simulated EP8" and eb.placement_label(8) == "EP8"
    # the placement is the run's only when its experts were spread over 8 GPUs, not when 8 GPUs
    # ran plain TP (every GPU holds every expert)
    assert eb.placement_label(4) == "simulated EP8" and eb.placement_label(16) == "simulated EP8"
    for bad in (0, 8.0, True, None):
        with pytest.raises(ValueError, match="ep_size"):
            eb.placement_label(bad)


def test_load_sglang_stat_dump(tmp_path):
    """A dump built the way SGLang's _StatAccumulator.dump builds it (trivial expert map)."""
    import torch
    from sglang.srt.eplb.expert_distribution import _convert_global_physical_count_to_logical_count

    passes, layers, experts, tp = 3, 4, 384, 2
    phys = torch.zeros(passes, layers, experts, dtype=torch.int32)
    phys[:, 1:, 5] = 2 * tp                     # after an all-reduce over tp identical ranks
    phys[:, 1:, 300] = 1 * tp
    logical = _convert_global_physical_count_to_logical_count(
        phys, num_layers=layers, num_logical_experts=experts,
        physical_to_logical_map=torch.arange(experts).repeat(layers, 1))
    path = tmp_path / "expert_distribution_recorder_123.pt"
    torch.save({"rank": 0, "logical_count": logical, "average_utilization_rate_over_window": None}, path)
    dump = eb.load_expert_dump(path)
    counts = eb.expert_counts(dump, ranks_summed=tp)
    assert counts.shape == (4, 384) and counts[1, 5] == 6 and counts[1, 300] == 3 and counts[0].sum() == 0
    frame = eb.gpu_load_frame(counts, 8, ep_size=1)
    assert sorted(frame["layer"].unique()) == [1, 2, 3] and set(frame["placement"]) == {"simulated EP8"}
    g = frame[frame["layer"] == 1].set_index("gpu")["tokens"]
    assert g[0] == 6 and g[6] == 3 and g.sum() == 9          # expert 300 lives on GPU 300 // 48 = 6
    torch.save({"records": []}, tmp_path / "per_pass.pt")
    with pytest.raises(ValueError, match="not a stat-mode expert dump"):
        eb.load_expert_dump(tmp_path / "per_pass.pt")


def test_charts_on_synthetic_counts(seed, tmp_path):
    from sm120_workbook.charts import save_chart

    rng = np.random.default_rng(seed)
    counts = np.zeros((4, 384), dtype=np.int64)
    counts[1:] = rng.integers(0, 20, size=(3, 384))
    heat = eb.expert_heatmap_chart(eb.expert_load_frame(counts))
    bars = eb.gpu_imbalance_chart(eb.gpu_load_frame(counts, 8, ep_size=8), source="recorded: H200")
    assert heat.to_dict()["layer"][0]["mark"]["type"] == "rect"
    assert "(EP8;" in bars.to_dict()["title"]["text"] and bars.to_dict()["title"]["subtitle"] == "recorded: H200"
    assert eb.expert_heatmap_chart(eb.expert_load_frame(counts), source="measured here").to_dict()["title"][
        "subtitle"] == "measured here"
    assert isinstance(heat.to_dict()["title"], str)   # no source: a plain title
    paths = save_chart(bars, "imbalance_test", tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)
    frame = eb.expert_load_frame(counts)
    assert len(frame) == 3 * 384
    assert frame.groupby("layer")["share"].mean().round(6).tolist() == [1.0, 1.0, 1.0]


def _dense_first(layers, seed=0):
    """(layers, 384) counts of a model whose first layer is dense (an all-zero row), as recorded."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((layers, 384), dtype=np.int64)
    counts[1:] = rng.integers(0, 20, size=(layers - 1, 384))
    return counts


def test_heatmap_of_a_24_layer_model_passes_altairs_row_limit():
    import altair as alt

    frame = eb.expert_load_frame(_dense_first(24))
    assert len(frame) == 23 * 384 > 5000                  # past altair's default max_rows
    with pytest.raises(alt.MaxRowsError):                 # which a chart of the frame as given meets
        alt.Chart(frame).mark_rect().encode(x="expert:Q").to_dict()
    options = dict(alt.data_transformers.options)
    spec = eb.expert_heatmap_chart(frame).to_dict()       # what Jupyter's display does first
    assert len(spec["datasets"][spec["layer"][0]["data"]["name"]]) == 23 * 384
    assert dict(alt.data_transformers.options) == options and alt.data_transformers.active == "default"


def test_imbalance_panels_run_in_layer_order():
    frame = eb.gpu_load_frame(_dense_first(16), 8, ep_size=1)
    facet = eb.gpu_imbalance_chart(frame).to_dict()["facet"]
    assert [int(p.split()[1]) for p in facet["sort"]] == list(range(1, 16))   # not 1, 10, 11, ..., 2
    assert all(p.startswith(f"layer {l} (balancedness ") for l, p in zip(range(1, 16), facet["sort"]))


def test_a_layer_that_routed_nothing_does_not_read_as_balanced():
    counts = _dense_first(3)
    frame = eb.gpu_load_frame(counts, 8, ep_size=1, layers=[0, 1])   # dense layer 0 asked for by name
    empty = frame[frame["layer"] == 0]
    assert (empty["tokens"] == 0).all() and (empty["relative_load"] == 0).all()   # as expert_load_frame's share
    assert empty["balancedness"].isna().all()            # not SGLang's (0 + 1e-5) / (0 + 1e-5) = 1.0
    assert (eb.expert_load_frame(counts, layers=[0])["share"] == 0).all()
    routed = frame[frame["layer"] == 1]
    assert routed["balancedness"].notna().all() and routed["relative_load"].mean() == pytest.approx(1.0)
    assert routed.reset_index(drop=True).equals(eb.gpu_load_frame(counts, 8, ep_size=1, layers=[1]))
    facet = eb.gpu_imbalance_chart(frame).to_dict()["facet"]
    assert facet["sort"][0] == "layer 0 (no routed tokens)" and facet["sort"][1].startswith("layer 1 (balancedness")
