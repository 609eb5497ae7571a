"""Roofline for one MLA verify step: bytes moved, FLOPs, and the time floor they imply.

Per request, every query head of every draft token reads the same compressed KV rows
(576 values per token, 1152 bytes in bf16), so the KV stream is paid once per request,
while the math grows with heads x q_len:

    kv_bytes  = batch * ctx * kv_bytes_per_token
    q_bytes   = batch * q_len * heads * 576 * act_bytes
    out_bytes = batch * q_len * heads * 512 * act_bytes
    flops     = batch * 2 * heads * q_len * ctx * (576 + 512)     (QK^T over 576 dims, PV over 512)

`ctx` is the number of keys each query is scored against (committed context plus the
drafts); masking is ignored, as a kernel that tiles the draft block computes it anyway.
Arithmetic intensity ~ 2 * 1088 * heads * q_len / 1152 ~ 1.9 * heads * q_len FLOP/byte at
long context, so a verify step with many heads and drafts leaves the memory-bound regime
that plain decode lives in.
"""
from __future__ import annotations

from typing import Iterable

from .mla import DIM_QK as HEAD_DIM, DIM_V as V_DIM, KV_BYTES_PER_TOKEN  # noqa: F401 (re-exported)

# The GPUs the workbook cares about. `mem_gbps` and `bf16_tflops` are the ceilings the
# roofline uses: measured where a measurement exists, else the spec (and said so).
TARGET_GPUS: dict[str, dict] = {
    "RTX PRO 6000 Blackwell": {
        "sm_arch": "sm_120",
        "sms": 188,
        "mem_gbps_spec": 1792.0,
        "mem_gbps": 1792.0,
        "mem_source": "spec (GDDR7, 512-bit)",
        "bf16_tflops": 400.0,
        "tflops_source": "bf16 mma, measured by others (~400 TFLOP/s dense)",
        "smem_per_block_optin": 101376,   # 99 KB opt-in per block
        "wgmma": False,                   # warp-level mma.sync only: no wgmma, no tcgen05/TMEM
    },
    "H200": {
        "sm_arch": "sm_90",
        "sms": 132,
        "mem_gbps_spec": 4800.0,
        "mem_gbps": 4180.0,
        "mem_source": "device-to-device copy: median of the first 36 runs in ceilings.jsonl, to 2026-11-30 (4,030-4,215 GB/s)",
        "bf16_tflops": 780.0,
        "tflops_source": "bf16 torch.matmul: median of the first 36 runs in ceilings.jsonl, to 2026-11-30 (749-809 TFLOP/s)",
        "smem_per_block_optin": 232448,   # 227 KB opt-in per block
        "wgmma": True,
    },
}


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v


def verify_cost(heads: int, q_len: int, ctx: int, batch: int = 1,
                kv_bytes_per_token: int = KV_BYTES_PER_TOKEN, act_bytes: int = 2) -> dict:
    """Bytes and FLOPs of one verify step (see the module docstring for the formulas).

    Returns dict(kv_bytes, q_bytes, out_bytes, total_bytes, flops, intensity) where
    intensity = flops / total_bytes (FLOP per byte).
    """
    heads = _positive_int("heads", heads)
    q_len = _positive_int("q_len", q_len)
    ctx = _positive_int("ctx", ctx)
    batch = _positive_int("batch", batch)
    kv_bytes_per_token = _positive_int("kv_bytes_per_token", kv_bytes_per_token)
    act_bytes = _positive_int("act_bytes", act_bytes)
    kv_bytes = batch * ctx * kv_bytes_per_token
    q_bytes = batch * q_len * heads * HEAD_DIM * act_bytes
    out_bytes = batch * q_len * heads * V_DIM * act_bytes
    flops = batch * 2 * heads * q_len * ctx * (HEAD_DIM + V_DIM)
    total = kv_bytes + q_bytes + out_bytes
    return {"kv_bytes": kv_bytes, "q_bytes": q_bytes, "out_bytes": out_bytes,
            "total_bytes": total, "flops": flops, "intensity": flops / total}


def _bytes_of(cost: dict) -> int:
    return cost.get("total_bytes", cost["kv_bytes"] + cost["q_bytes"] + cost["out_bytes"])


def roofline_time_us(cost: dict, mem_gbps: float, matmul_tflops: float) -> float:
    """The floor: max(bytes / bandwidth, flops / matmul rate), in microseconds."""
    if not mem_gbps > 0:
        raise ValueError(f"mem_gbps: expected a positive rate, got {mem_gbps!r}")
    if not matmul_tflops > 0:
        raise ValueError(f"matmul_tflops: expected a positive rate, got {matmul_tflops!r}")
    return max(_bytes_of(cost) / (mem_gbps * 1e3), cost["flops"] / (matmul_tflops * 1e6))


def roofline_point(cost: dict, gpu: str) -> dict:
    """Memory time, compute time, floor and which bound wins, for a GPU of TARGET_GPUS."""
    if gpu not in TARGET_GPUS:
        raise ValueError(f"gpu: expected one of {list(TARGET_GPUS)}, got {gpu!r}")
    g = TARGET_GPUS[gpu]
    mem_us = _bytes_of(cost) / (g["mem_gbps"] * 1e3)
    compute_us = cost["flops"] / (g["bf16_tflops"] * 1e6)
    return {"mem_time_us": mem_us, "compute_time_us": compute_us,
            "floor_us": max(mem_us, compute_us),
            "bound": "memory" if mem_us >= compute_us else "compute",
            "ridge_intensity": g["bf16_tflops"] * 1e12 / (g["mem_gbps"] * 1e9)}


def roofline_frame(heads: Iterable[int], q_lens: Iterable[int], ctxs: Iterable[int],
                   gpus: Iterable[str] | None = None, batch: int = 1,
                   kv_bytes_per_token: int = KV_BYTES_PER_TOKEN):
    """Tidy DataFrame: one row per (gpu, heads, q_len, ctx) with bytes, FLOPs and the floor."""
    import pandas as pd

    gpus = list(gpus) if gpus is not None else list(TARGET_GPUS)
    for name, v in (("heads", heads), ("q_lens", q_lens), ("ctxs", ctxs)):
        if isinstance(v, (int, str)) or not isinstance(v, Iterable):
            raise ValueError(f"{name}: a list of values, got {v!r}")
    rows = []
    for gpu in gpus:
        for h in heads:
            for t in q_lens:
                for c in ctxs:
                    cost = verify_cost(h, t, c, batch=batch, kv_bytes_per_token=kv_bytes_per_token)
                    rows.append({"gpu": gpu, "heads": h, "q_len": t, "ctx": c, "batch": batch,
                                 **cost, **roofline_point(cost, gpu)})
    return pd.DataFrame(rows)


def explorer_summary(heads: int, q_len: int, ctx: int, gpu: str, batch: int = 1) -> dict:
    """The numbers the explorer shows, as a dict (tested; the widget only formats them)."""
    cost = verify_cost(heads, q_len, ctx, batch=batch)
    return {"gpu": gpu, "heads": heads, "q_len": q_len, "ctx": ctx, "batch": batch,
            **cost, **roofline_point(cost, gpu)}


def _summary_html(s: dict) -> str:
    return (
        f"<b>{s['gpu']}</b>: heads={s['heads']}, q_len={s['q_len']}, ctx={s['ctx']:,}<br>"
        f"KV {s['kv_bytes'] / 2**20:,.2f} MiB + Q {s['q_bytes'] / 2**20:,.2f} MiB + "
        f"O {s['out_bytes'] / 2**20:,.2f} MiB = {s['total_bytes'] / 2**20:,.2f} MiB; "
        f"{s['flops'] / 1e9:,.2f} GFLOP<br>"
        f"intensity {s['intensity']:,.1f} FLOP/B (ridge {s['ridge_intensity']:,.0f}) -> "
        f"<b>{s['bound']}-bound</b>; floor {s['floor_us']:,.2f} us "
        f"(memory {s['mem_time_us']:,.2f} us, compute {s['compute_time_us']:,.2f} us)"
    )


def roofline_explorer(heads: int = 16, q_len: int = 16, ctx: int = 32768,
                      gpu: str = "RTX PRO 6000 Blackwell"):
    """An ipywidgets UI: sliders for heads, q_len, ctx (log scale) and a GPU dropdown, starting
    at the values given, which must lie within the sliders (the kernel's range): a slider would
    clamp them silently."""
    import ipywidgets as w

    for name, v, lo, hi in (("heads", heads, 1, 128), ("q_len", q_len, 1, 16), ("ctx", ctx, 1024, 262144)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name}: the explorer's slider covers {lo}..{hi}, got {v!r}")
    if gpu not in TARGET_GPUS:
        raise ValueError(f"gpu: one of {list(TARGET_GPUS)}, got {gpu!r}")

    heads_w = w.IntSlider(value=heads, min=1, max=128, description="heads")
    q_w = w.IntSlider(value=q_len, min=1, max=16, description="q_len")
    ctx_w = w.FloatLogSlider(value=ctx, base=2, min=10, max=18, step=0.5, description="ctx",
                             readout_format=".0f")
    gpu_w = w.Dropdown(options=list(TARGET_GPUS), value=gpu, description="GPU")
    out = w.HTML()

    def update(_=None):
        out.value = _summary_html(explorer_summary(heads_w.value, q_w.value,
                                                   int(round(ctx_w.value)), gpu_w.value))

    for c in (heads_w, q_w, ctx_w, gpu_w):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([heads_w, q_w]), w.HBox([ctx_w, gpu_w]), out])


_KILO_LABELS = "datum.value >= 1024 ? format(datum.value / 1024, 'd') + 'k' : format(datum.value, 'd')"


def roofline_chart(df, heads: int | None = None):
    """Altair: time floor vs ctx (log-log), one line per q_len, one panel per GPU.

    `df` is a `roofline_frame`; `heads` picks one head count when it holds several.
    """
    import altair as alt

    from .charts import chart_title

    if heads is not None:
        df = df[df["heads"] == heads]
    if df["heads"].nunique() != 1:
        raise ValueError(f"heads: the frame holds heads {sorted(df['heads'].unique())}; pick one")
    h = int(df["heads"].iloc[0])
    data = df[["gpu", "q_len", "ctx", "floor_us", "bound"]]
    return (
        alt.Chart(data)
        .mark_line(point=True)
        .encode(
            x=alt.X("ctx:Q", scale=alt.Scale(type="log", base=2),
                    axis=alt.Axis(labelExpr=_KILO_LABELS), title="keys per request (ctx)"),
            y=alt.Y("floor_us:Q", scale=alt.Scale(type="log"), title="roofline floor (us)"),
            color=alt.Color("q_len:O", title="q_len"),
            shape=alt.Shape("bound:N"),
            tooltip=["gpu", "q_len", "ctx", alt.Tooltip("floor_us:Q", format=".2f"), "bound"],
        )
        .properties(width=260, height=220)
        .facet(column=alt.Column("gpu:N", title=None))
        .properties(title=chart_title(f"MLA verify step floor: {h} heads, batch {int(df['batch'].iloc[0])}",
                                      ceilings_source(data["gpu"].unique())))
    )


def ceilings_source(gpus: Iterable[str]) -> str:
    """Where each GPU's roofline ceilings come from (TARGET_GPUS' sources, without their
    parentheses): a subtitle, so that a saved chart says which are recorded medians and which a spec."""
    parts = []
    for g in gpus:
        t = TARGET_GPUS[g]
        mem, flops = (t[k].split("(")[0].split(": ", 1)[-1].strip() for k in ("mem_source", "tflops_source"))
        values = f"{t['mem_gbps']:,.0f} GB/s"
        parts.append(f"{g}: {values} and {t['bf16_tflops']:,.0f} TFLOP/s, {mem}" if mem == flops else
                     f"{g}: {values} ({mem}), {t['bf16_tflops']:,.0f} TFLOP/s ({flops})")
    return "; ".join(parts)


def intensity_chart(df):
    """Altair: arithmetic intensity vs heads x q_len (one ctx), with each GPU's ridge point.

    `df` is a `roofline_frame` over one ctx (the largest is used if it holds several).
    """
    import altair as alt
    import pandas as pd

    ctx = int(df["ctx"].max())
    data = df[df["ctx"] == ctx]
    data = data.assign(heads_x_q=data["heads"] * data["q_len"])[["heads_x_q", "intensity"]]
    data = data.drop_duplicates().sort_values("heads_x_q")
    ridges = pd.DataFrame([{"gpu": g, "ridge": v["bf16_tflops"] * 1e3 / v["mem_gbps"]}
                           for g, v in TARGET_GPUS.items()])
    points = alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("heads_x_q:Q", scale=alt.Scale(type="log", base=2),
                axis=alt.Axis(labelExpr=_KILO_LABELS), title="heads x q_len (query rows per request)"),
        y=alt.Y("intensity:Q", scale=alt.Scale(type="log"), title="FLOP per byte"),
        tooltip=["heads_x_q", alt.Tooltip("intensity:Q", format=".1f")],
    )
    rules = alt.Chart(ridges).mark_rule().encode(
        y="ridge:Q", strokeDash=alt.StrokeDash("gpu:N", title="ridge point"),
        tooltip=["gpu", alt.Tooltip("ridge:Q", format=".0f")])
    return (points + rules).properties(
        width=420, height=260, title=f"Arithmetic intensity of one verify step (ctx = {ctx:,})")
