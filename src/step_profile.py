"""Where a served decode or verify step goes: a torch-profiler trace from SGLang, summarised.

SGLang's `/start_profile` (num_steps, activities CPU+GPU) writes one Chrome trace per rank,
`<profile_id>-TP-<rank>.trace.json.gz`. `summarize_trace` reads one and reports, over the
profiled window: the GPU kernels by category (attention per backend, MoE, GEMMs, ...), how
much of the window any kernel was running (the union of kernel intervals), and the window
per step. A step whose GPU is busy for a small share of it is bound by the host (scheduler,
speculative drafting, Python), and a faster attention kernel cannot speed it up much.
"""
from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where a frame is built, not at import time
    import pandas as pd

# First match wins; patterns are searched in lower-cased kernel names.
CATEGORIES = (
    ("attention: sm120_mla", r"mla_verify_(split|wide|combine)_kernel"),
    ("attention: flashmla", r"flash_fwd_splitkv_mla|flashmla|flash_mla|mla_combine"),
    ("attention: triton", r"^_fwd_kernel|_fwd_grouped_kernel|_fwd_kernel_stage|extend_attention|decode_att"),
    ("moe", r"moe|topk|expert|grouped_gemm|fused_experts|count_and_sort"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|splitk|sm90_|wgmma"),
    ("norm / rope / activation", r"norm|rope|rotary|silu|gelu|act_and_mul|apply_rotary"),
    ("kv cache / indices", r"kv_indices|set_mla_kv|store_kv|kv_buffer|assign_.*cache|create_flashinfer"),
    ("sampling / speculative", r"verify|tree|sampl|argmax|top_p|top_k|softmax|accept|draft"),
    ("copy / fill / elementwise", r"copy|memcpy|memset|fill|elementwise|vectorized|cat_|index|reduce|scatter|gather"),
)
_COMPILED = tuple((name, re.compile(pat)) for name, pat in CATEGORIES)
OTHER = "other"


def categorize(kernel_name: str) -> str:
    n = kernel_name.lower()
    for name, pat in _COMPILED:
        if pat.search(n):
            return name
    return OTHER


def load_trace(path: str | Path) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _calls_and_us(events) -> dict[str, list]:
    """{name: [calls, total us]} of complete ('X') events."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        rec = out[e.get("name", "?")]
        rec[0] += 1
        rec[1] += float(e["dur"])
    return out


def host_idle_ms(record: dict) -> float:
    """The part of a profiled step in which no kernel ran (host work), in ms."""
    return max(0.0, record["per_step_ms"] * (1 - (record.get("busy_share") or 0)))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize_trace(trace: dict, steps: int, top: int = 8, top_python: int = 40) -> dict:
    """Per-step GPU time by kernel category over a trace of `steps` forward steps.

    Returns window_ms (first kernel start to last kernel end), busy_ms (any kernel running),
    busy_share, per_step_ms (window / steps), gpu_ms_per_step {category: ms}, kernels (count),
    graph_launches (cudaGraphLaunch calls), top_kernels [(name, calls, ms per step)] and, for a
    trace taken with_stack, top_python [(function, calls, inclusive ms per step)].
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise ValueError("the trace has no GPU kernel events (was the GPU activity recorded?)")
    graph_launches = sum(1 for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", ""))
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e["dur"]) for e in kernels)
    busy = _union_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
    by_name = _calls_and_us(kernels)
    by_cat: dict[str, float] = defaultdict(float)
    for name, (_, us) in by_name.items():
        by_cat[categorize(name)] += us
    window = end - start
    top_k = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    # With with_stack, the trace holds Python calls (cat python_function, nested): their
    # inclusive time per step says where the host part of a step goes.
    py = _calls_and_us(e for e in events
                       if e.get("ph") == "X" and e.get("cat") == "python_function" and "dur" in e)
    top_py = sorted(py.items(), key=lambda kv: -kv[1][1])[:top_python]
    return {
        "steps": steps,
        "window_ms": round(window / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "busy_share": round(busy / window, 4) if window > 0 else None,
        "per_step_ms": round(window / 1e3 / steps, 4),
        "gpu_ms_per_step": {k: round(v / 1e3 / steps, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "kernels": len(kernels),
        "graph_launches": graph_launches,
        "top_kernels": [[name[:120], n, round(us / 1e3 / steps, 4)] for name, (n, us) in top_k],
        "top_python": [[name[:160], n, round(us / 1e3 / steps, 4)] for name, (n, us) in top_py],
    }


def _config(r: dict) -> str:
    """A record's configuration label (service_charts.config_label), else its backend."""
    return r.get("config") or r["backend"]


def profile_frame(records) -> pd.DataFrame:
    """Long table of step-profile records: one row per (config, spec, ctx, category), with
    the per-step GPU ms and, as category 'host / idle', the rest of the step. A record's
    `config` (e.g. "sm120_mla TP2 + ngram_tail") names it where set, else its backend."""
    import pandas as pd

    rows = []
    for r in records:
        key = {"config": _config(r), **{k: r.get(k) for k in ("backend", "spec", "ctx", "per_step_ms", "busy_share")}}
        cats = r.get("gpu_ms_per_step") or {}
        for cat, ms in cats.items():
            rows.append({**key, "category": cat, "ms": ms})
        rows.append({**key, "category": "host / idle (no kernel running)", "ms": host_idle_ms(r)})
    return pd.DataFrame(rows)


def step_profile_chart(records, title: str = ""):
    """Per-step time of each profiled point as stacked bars: GPU time by kernel category, then
    the part of the step with no kernel running (host work: scheduler, drafting, Python)."""
    import altair as alt

    df = profile_frame(records)
    if len(df) == 0:
        raise ValueError("records: no step profiles to chart")
    df["point"] = [f"{b} / {s} / {c // 1024}k" for b, s, c in zip(df["config"], df["spec"], df["ctx"])]
    order = sorted(df["point"].unique(), key=lambda p: (p.split(" / ")[1], int(p.split(" / ")[2][:-1]), p))
    return (alt.Chart(df).mark_bar()
            .encode(y=alt.Y("point:N", sort=order, title=None, axis=alt.Axis(labelLimit=360)),
                    x=alt.X("sum(ms):Q", title="ms per step (profiled window / steps)"),
                    color=alt.Color("category:N", title="where the step goes", scale=alt.Scale(scheme="tableau20")),
                    tooltip=["point", "category", alt.Tooltip("ms:Q", format=".3f")])
            .properties(width=520, height=28 * df["point"].nunique(),
                        title=title or "Where a served step goes (torch profiler, SGLang /start_profile)"))


def profile_table(records):
    """One row per profiled point: step ms, GPU busy share, attention ms and host/idle ms."""
    import pandas as pd

    rows = []
    for r in records:
        cats = r.get("gpu_ms_per_step") or {}
        attention = sum(v for k, v in cats.items() if k.startswith("attention"))
        rows.append({"config": _config(r), "spec": r["spec"], "ctx": r["ctx"],
                     "step_ms": round(r["per_step_ms"], 2), "gpu_busy_%": round(100 * (r.get("busy_share") or 0), 1),
                     "attention_ms": round(attention, 3),
                     "host_idle_ms": round(host_idle_ms(r), 2)})
    return pd.DataFrame(rows)
