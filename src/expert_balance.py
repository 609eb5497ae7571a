"""Expert load from SGLang's expert-distribution recorder, and the GPU imbalance it implies
under expert parallelism.

SGLang 0.5.17, `--expert-distribution-recorder-mode stat`: POST /dump_expert_distribution_record
makes rank 0 torch.save {"rank", "logical_count", "average_utilization_rate_over_window"} to
$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_<time>.pt, where
logical_count is an int tensor (forward passes, layers, logical experts) of routed-token counts
(sglang/srt/eplb/expert_distribution.py, _StatAccumulator.dump). Before saving it is all-reduced
(summed) over ranks; under plain TP every rank routes every token, so the counts are tp times
the token-expert assignments: divide by `ranks_summed`. Dense layers (first_k_dense_replace)
stay all-zero rows.

EP placement: experts in contiguous blocks, 384 / 8 = 48 per GPU (SGLang's trivial expert
location and its `compute_gpu_physical_count`). Balancedness is SGLang's formula, mean over
max of per-GPU load per layer (`compute_utilization_rate`, with its +1e-5 guards); 1.0 is
perfect balance, 1/num_gpus is everything on one GPU. It is applied here to the counts summed
over a whole request, where SGLang's own figure (`average_utilization_rate_over_window`)
averages it over forward passes: a sum over many passes evens out, so this one reads higher
(a random router, in a synthetic check: 0.99 over a 16k request, about 0.6 averaged over
its decode passes of 4 tokens).
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np

EP_GPUS = 8


@functools.lru_cache(maxsize=1)
def _sglang_eplb_import():
    """(the module, None), or (None, why it would not import)."""
    try:
        with warnings.catch_warnings():  # SGLang warns about every missing accelerator on import
            warnings.simplefilter("ignore")
            import sglang.srt.eplb.expert_distribution as m
    except Exception as e:  # noqa: BLE001 - a partial SGLang install fails in various ways
        return None, repr(e)
    return m, None


def sglang_eplb():
    """sglang.srt.eplb.expert_distribution when importable here, else None (then replicas run)."""
    return _sglang_eplb_import()[0]


def sglang_eplb_error() -> str | None:
    """Why sglang_eplb() is None (the import's error), or None where it imports."""
    return _sglang_eplb_import()[1]


def load_expert_dump(path: str | Path) -> dict:
    """Read one stat-mode dump: {"logical_count": (passes, layers, experts) ndarray, ...}."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: {path} does not exist")
    data = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or "logical_count" not in data:
        keys = list(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"path: {path} is not a stat-mode expert dump (keys: {keys}); "
                         "per_pass/per_token dumps hold 'records' instead")
    count = data["logical_count"]
    count = count.cpu().numpy() if hasattr(count, "cpu") else np.asarray(count)
    if count.ndim == 2:
        count = count[None]
    if count.ndim != 3:
        raise ValueError(f"path: logical_count has shape {count.shape}, expected (passes, layers, experts)")
    return {"logical_count": count, "rank": data.get("rank"),
            "average_utilization_rate_over_window": data.get("average_utilization_rate_over_window")}


def routed_passes(dump: dict) -> int:
    """The forward passes in a dump that routed any token. A circular buffer (a positive
    --expert-distribution-recorder-buffer-size) dumps all its rows, the unwritten ones zero, and a
    DFlash draft's passes (no MoE layers) append zero rows too: neither counts."""
    count = np.asarray(dump["logical_count"])
    return int(count.any(axis=tuple(range(1, count.ndim))).sum())


def expert_counts(dump: dict, ranks_summed: int = 1) -> np.ndarray:
    """(layers, experts) routed-token counts, summed over passes, divided by ranks_summed."""
    c = np.asarray(dump["logical_count"]).sum(axis=0).astype(np.int64)
    if ranks_summed < 1:
        raise ValueError(f"ranks_summed: must be positive, got {ranks_summed}")
    if ranks_summed > 1:
        if np.any(c % ranks_summed):
            raise ValueError(f"ranks_summed: counts are not multiples of {ranks_summed}; "
                             "they were not summed over that many identical ranks")
        c //= ranks_summed
    return c


def _check_counts(counts) -> np.ndarray:
    c = np.asarray(counts)
    if c.ndim != 2:
        raise ValueError(f"counts: expected (layers, experts), got shape {c.shape}")
    if np.any(c < 0):
        raise ValueError("counts: negative counts")
    return c


def moe_layer_ids(counts) -> list[int]:
    """Layers that routed any token (dense layers are all-zero rows)."""
    c = _check_counts(counts)
    return [int(i) for i in np.flatnonzero(c.sum(axis=1) > 0)]


def gpu_load(counts, num_gpus: int = EP_GPUS) -> np.ndarray:
    """(layers, num_gpus) tokens per GPU with experts placed contiguously (48 per GPU for 384/8)."""
    c = _check_counts(counts)
    if num_gpus < 1 or c.shape[1] % num_gpus:
        raise ValueError(f"num_gpus: {num_gpus} does not divide {c.shape[1]} experts")
    eplb = sglang_eplb()
    if eplb is not None:
        import torch

        return eplb.compute_gpu_physical_count(torch.as_tensor(c), num_gpu=num_gpus).numpy()
    else:
        # Replica of sglang/srt/eplb/expert_distribution.py:compute_gpu_physical_count (0.5.17):
        # "... num_layer (num_gpu num_expert_per_gpu) -> ... num_layer num_gpu", sum.
        return c.reshape(c.shape[0], num_gpus, c.shape[1] // num_gpus).sum(axis=2)


def balancedness(load) -> np.ndarray:
    """Per layer: mean over max of per-GPU load (SGLang's utilization rate)."""
    g = np.asarray(load)
    if g.ndim != 2:
        raise ValueError(f"load: expected (layers, gpus), got shape {g.shape}")
    eplb = sglang_eplb()
    if eplb is not None:
        import torch

        return eplb.compute_utilization_rate(torch.as_tensor(g)).numpy().astype(np.float64)
    else:
        # Replica of sglang/srt/eplb/expert_distribution.py:compute_utilization_rate (0.5.17).
        g = g.astype(np.float32)
        return ((g.mean(axis=1) + 1e-5) / (g.max(axis=1) + 1e-5)).astype(np.float64)


def placement_label(ep_size: int, num_gpus: int = EP_GPUS) -> str:
    """'EP8' when the run placed its experts over that many GPUs (its ep_size), else
    'simulated EP8': under plain TP every GPU holds every expert, however many GPUs ran."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size: expected a positive int, got {ep_size!r}")
    return f"EP{num_gpus}" if ep_size == num_gpus else f"simulated EP{num_gpus}"


def expert_load_frame(counts, layers: list[int] | None = None):
    """Tidy (layer, expert, tokens, share): share = tokens / the layer's mean expert load."""
    import pandas as pd

    c = _check_counts(counts)
    layers = moe_layer_ids(c) if layers is None else list(layers)
    rows = []
    for l in layers:
        row = c[l]
        mean = row.mean() if row.sum() else 1.0
        for e, n in enumerate(row):
            rows.append((l, e, int(n), float(n / mean)))
    return pd.DataFrame(rows, columns=["layer", "expert", "tokens", "share"])


def gpu_load_frame(counts, num_gpus: int = EP_GPUS, ep_size: int = 1, layers: list[int] | None = None):
    """Tidy (layer, gpu, tokens, relative_load, balancedness, placement) for the MoE layers; the
    run's `ep_size` says whether the placement was the run's or simulated (placement_label).
    A listed layer that routed no token has relative_load 0 and balancedness NaN."""
    import pandas as pd

    c = _check_counts(counts)
    layers = moe_layer_ids(c) if layers is None else list(layers)
    if not layers:
        raise ValueError("counts: no layer routed any token")
    load = gpu_load(c[layers], num_gpus)
    bal = balancedness(load)
    label = placement_label(ep_size, num_gpus)
    rows = []
    for i, l in enumerate(layers):
        # A layer asked for by name that routed nothing: load 0 (as in expert_load_frame) and
        # balancedness NaN, not the formula's (0 + 1e-5) / (0 + 1e-5) = 1.0, which reads as even.
        empty = not load[i].any()
        mean = 1.0 if empty else load[i].mean()
        for g in range(num_gpus):
            rows.append((l, g, int(load[i, g]), float(load[i, g] / mean), float("nan") if empty else float(bal[i]),
                         label))
    return pd.DataFrame(rows, columns=["layer", "gpu", "tokens", "relative_load", "balancedness", "placement"])


def expert_heatmap_chart(df, num_gpus: int = EP_GPUS, title: str = "", source: str = ""):
    """Altair heat map: layer × expert, colour = load relative to the layer mean; rules at GPU
    blocks; `source` (service_charts.source_label) says whether it is recorded or live."""
    import altair as alt

    from .service_charts import chart_title

    need = {"layer", "expert", "share"}
    if not need <= set(df.columns):
        raise ValueError(f"df: needs columns {sorted(need)}")
    d = df.copy()
    d["x1"] = d["expert"] + 1
    n_exp = int(d["expert"].max()) + 1
    per_gpu = n_exp // num_gpus if n_exp % num_gpus == 0 else None
    # A row per (layer, expert): 14 MoE layers of 384 experts pass altair's default limit of
    # 5,000 rows, and a chart of a DataFrame that long raises MaxRowsError on display (blank in
    # Jupyter). Values given inline skip that check: any layer count, no global setting changed.
    heat = (alt.Chart(alt.to_values(d)).mark_rect()
            .encode(x=alt.X("expert:Q", title="expert", scale=alt.Scale(domain=[0, n_exp], nice=False)),
                    x2="x1:Q",
                    y=alt.Y("layer:O", title="layer"),
                    color=alt.Color("share:Q", title="load / mean",
                                    scale=alt.Scale(scheme="viridis")),
                    tooltip=["layer:Q", "expert:Q", "tokens:Q", alt.Tooltip("share:Q", format=".2f")])
            .properties(width=768, height=max(60, 22 * d["layer"].nunique())))
    layers = [heat]
    if per_gpu:
        import pandas as pd

        edges = pd.DataFrame({"x": [per_gpu * g for g in range(1, num_gpus)]})
        layers.append(alt.Chart(edges).mark_rule(color="white", strokeDash=[3, 2]).encode(x="x:Q"))
    return alt.layer(*layers).properties(title=chart_title(
        title or f"Routed tokens per expert (white rules: {num_gpus}-GPU expert blocks)", source))


def gpu_imbalance_chart(df, title: str = "", source: str = ""):
    """Altair bars: each GPU's load relative to the mean, one panel per MoE layer; `source` as
    in expert_heatmap_chart."""
    import altair as alt

    from .service_charts import chart_title

    need = {"layer", "gpu", "relative_load", "balancedness", "placement"}
    if not need <= set(df.columns):
        raise ValueError(f"df: needs columns {sorted(need)}")
    d = df.copy()
    d["panel"] = [f"layer {l} (no routed tokens)" if np.isnan(b) else f"layer {l} (balancedness {b:.2f})"
                  for l, b in zip(d["layer"], d["balancedness"].astype(float))]
    # panels in layer order: sorted as text, "layer 10" would come before "layer 2"
    order = d.sort_values("layer", kind="stable").drop_duplicates("layer")["panel"].tolist()
    bars = alt.Chart().mark_bar().encode(
        x=alt.X("gpu:O", title="GPU"),
        y=alt.Y("relative_load:Q", title="load / mean"),
        tooltip=["layer", "gpu", "tokens", alt.Tooltip("relative_load:Q", format=".2f")])
    rule = alt.Chart().mark_rule(color="gray", strokeDash=[4, 3]).encode(y=alt.datum(1.0))
    placement = ", ".join(sorted(d["placement"].unique()))
    return (alt.layer(bars, rule, data=d).properties(width=160, height=120)
            .facet(facet=alt.Facet("panel:N", title=None, sort=order), columns=4)
            .properties(title=chart_title(title or f"Per-GPU expert load ({placement}; balancedness = mean/max)",
                                          source)))
