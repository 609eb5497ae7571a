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
    ("attention: flashmla", r"flash_fwd_splitkv_mla|flashmla|flash_mla|mla_combine|get_mla_metadata"),
    ("attention: triton", r"^_fwd_kernel|_fwd_grouped_kernel|_fwd_kernel_stage|extend_attention|decode_att"),
    # FlashInfer's attention by kernel name: its namespace also holds norms and sampling
    ("attention: flashinfer", r"(prefill|decode|pod)withkvcache|(batch|single)(prefill|decode)with"
                              r"|batchmlapaged?attention|mergestate"),
    # A top-k over the vocabulary (torch.topk in a tree draft, a chain's draft top-k, FlashInfer's
    # sampling) ahead of the router's top-k kernels, which "moe" takes (a router that fell back
    # to torch.topk would read as sampling here; SGLang's DeepSeek router does not)
    ("sampling / speculative", r"sampling::|at::native::\w*topk|_draft_topk"),
    # TP's collectives: ahead of "norm" (an all-reduce fused with RMSNorm) and "copy" ("reduce")
    ("communication (all-reduce)", r"all_?reduce|all_?gather|reduce_scatter|nccl|cross_device_reduce"),
    ("moe", r"moe|topk|router|expert|grouped_gemm|fused_experts|count_and_sort"),
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


# How summarize_trace adds up a category's kernels; a record without the key summed their spans.
CATEGORY_TIME = "union"
SUMMED_CATEGORIES = "summed spans"


def category_time(record: dict) -> str:
    """How a profile record's categories were added up: CATEGORY_TIME, or SUMMED_CATEGORIES for
    a record from before it was written (a PDL dependent's wait counted in its category too)."""
    v = record.get("category_time")
    return v if isinstance(v, str) and v else SUMMED_CATEGORIES   # absent, or NaN in a frame


def summarize_trace(trace: dict, steps: int, top: int = 8, top_python: int = 40) -> dict:
    """Per-step GPU time by kernel category over a trace of `steps` forward steps.

    Returns window_ms (first kernel start to last kernel end), busy_ms (any kernel running),
    busy_share, per_step_ms (window / steps), gpu_ms_per_step {category: ms}, kernels (count),
    graph_launches (cudaGraphLaunch calls), top_kernels [(name, calls, ms per step)] and, for a
    trace taken with_stack, top_python [(function, calls, inclusive ms per step)].

    A category's time is the union of its kernels' spans, not their sum: on sm_90 the kernel's
    combine step is a programmatic dependent launch (COMBINE_PDL), so its span starts beside the
    attention kernel's and includes its wait for it. Summed, the attention read about twice its
    GPU time (records made before commit 07a1e0a, which lack `category_time`: SUMMED_CATEGORIES).
    `top_kernels` still sums each kernel's own spans. Kernels of different categories on other
    streams can overlap too, so the categories can add up to more than busy_ms (5% of it, 2.4% of
    the step, in a 16-layer NGRAM step at 64k); busy_ms is the union of all.

    The window runs from the first step's first kernel to the last step's last kernel, so it
    holds `steps` GPU passes but only steps - 1 of the host gaps between them: per_step_ms and
    the idle share (1 - busy_share) read low by up to one gap over `steps` (a tenth of the
    between-step gap at 10 steps). Step boundaries are not in the trace, so it is not corrected.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])   # a bare event list too
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise ValueError("the trace has no GPU kernel events (was the GPU activity recorded?)")
    graph_launches = sum(1 for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", ""))
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e["dur"]) for e in kernels)
    busy = _union_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
    by_name = _calls_and_us(kernels)
    spans: dict[str, list] = defaultdict(list)
    for e in kernels:
        spans[categorize(e["name"])].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    by_cat = {cat: _union_us(iv) for cat, iv in spans.items()}
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
        "category_time": CATEGORY_TIME,
        "kernels": len(kernels),
        "graph_launches": graph_launches,
        "top_kernels": [[name[:120], n, round(us / 1e3 / steps, 4)] for name, (n, us) in top_k],
        "top_python": [[name[:160], n, round(us / 1e3 / steps, 4)] for name, (n, us) in top_py],
    }


def _config(r: dict) -> str:
    """A record's `config` where set, else its configuration label (service_charts.label_of)."""
    from .service_charts import label_of

    return r.get("config") or label_of(r)


def timed_profiles(profiles: pd.DataFrame) -> list[dict]:
    """The step-profile records to time: without Python stacks (they slow the host: those
    windows name functions, see host_functions, but their step is not the served one), the
    newest of each configuration, layer count, spec and context, each with its `config` label."""
    from .service_charts import _need, label_of

    _need(profiles, ["backend", "spec", "ctx", "per_step_ms", "date"], "profiles")
    d = _with_stack_flag(profiles)
    d["config"] = [label_of(r) for r in d.to_dict("records")]
    d["layers"] = d["layers"] if "layers" in d else None
    d = d[~d["with_stack"]].sort_values("date").drop_duplicates(["config", "layers", "spec", "ctx"], keep="last")
    return d.to_dict("records")


def _with_stack_flag(profiles):
    """A copy with `with_stack` a bool (absent in older records, which had no stacks)."""
    d = profiles.copy()
    d["with_stack"] = d["with_stack"].eq(True) if "with_stack" in d else False
    return d


def pick_stacked_trace(profiles: pd.DataFrame, traces_dir: str | Path) -> tuple[dict | None, Path | None, list[str]]:
    """The newest profile taken with Python stacks whose trace file is in `traces_dir` (record
    and path; None, None where there is none), and the trace files of newer stacked profiles
    that are not there (traces are large, and not every one is kept)."""
    from .service_charts import _need

    _need(profiles, ["trace_file", "date"], "profiles")
    d = _with_stack_flag(profiles)
    stacked = d[d["with_stack"]]
    missing = []
    for r in stacked.sort_values("date", ascending=False).to_dict("records"):
        path = Path(traces_dir) / str(r["trace_file"])
        if path.is_file():
            return r, path, missing
        missing.append(path.name)
    return None, None, missing


# Where a step's host time goes, by SGLang function: the scheduler's batch step, NGRAM's draft
# search and corpus update, and the TP worker's forward (matched by file and function, not line).
HOST_FUNCTIONS = (r"managers/scheduler\.py\(\d+\): run_batch$", r"speculative/ngram_worker\.py",
                  r"managers/tp_worker\.py")


def host_functions(top_python, patterns=HOST_FUNCTIONS) -> pd.DataFrame:
    """The entries of summarize_trace's `top_python` ([function, calls, inclusive ms per step])
    that match `patterns`, as a table: ms per step, calls, function."""
    import pandas as pd

    compiled = [re.compile(p) for p in patterns]
    rows = [{"ms_per_step": ms, "calls": calls, "function": name} for name, calls, ms in top_python
            if any(c.search(name) for c in compiled)]
    return pd.DataFrame(rows, columns=["ms_per_step", "calls", "function"])


def profile_frame(records) -> pd.DataFrame:
    """Long table of step-profile records: one row per (config, layers, spec, ctx, category),
    with the per-step GPU ms and, as category 'host / idle', the rest of the step. A record's
    `config` (e.g. "sm120_mla TP2 + ngram_tail") names it where set, else its label_of."""
    import pandas as pd

    rows = []
    for r in records:
        key = {"config": _config(r), "category_time": category_time(r),
               **{k: r.get(k) for k in ("backend", "layers", "spec", "ctx", "per_step_ms", "busy_share")}}
        cats = r.get("gpu_ms_per_step") or {}
        for cat, ms in cats.items():
            rows.append({**key, "category": cat, "ms": ms})
        rows.append({**key, "category": "host / idle (no kernel running)", "ms": host_idle_ms(r)})
    return pd.DataFrame(rows)


def _layers_of(value) -> int | None:
    """A record's layer count, None where unknown (absent, or NaN in a frame)."""
    return None if value is None or value != value else int(value)


def step_profile_chart(records, title: str = "", source: str = ""):
    """Per-step time of each profiled point as stacked bars: GPU time by kernel category, then
    the part of the step with no kernel running (host work: scheduler, drafting, Python). A bar
    can run a little past its step where kernels of two categories overlap (summarize_trace);
    `source` (service_charts.source_label) says whether it shows recorded or live numbers."""
    import altair as alt

    from .service_charts import chart_title, ctx_label

    df = profile_frame(records)
    if len(df) == 0:
        raise ValueError("records: no step profiles to chart")
    # the layer count is in the label: profiles at two depths are two bars, never one stack;
    # an older record's summed categories overlap (its bar overshoots its step), and say so
    df["point"] = [f"{c}, {_layers_of(n) or '?'} layers / {s} / {ctx_label(int(x))}"
                   + ("" if t == CATEGORY_TIME else f" ({t})")
                   for c, n, s, x, t in zip(df["config"], df["layers"], df["spec"], df["ctx"], df["category_time"])]
    order = list(df.sort_values(["spec", "ctx", "point"])["point"].unique())
    return (alt.Chart(df).mark_bar()
            .encode(y=alt.Y("point:N", sort=order, title=None, axis=alt.Axis(labelLimit=360)),
                    x=alt.X("sum(ms):Q", title="ms per step (profiled window / steps)"),
                    color=alt.Color("category:N", title="where the step goes", scale=alt.Scale(scheme="tableau20")),
                    tooltip=["point", "category", alt.Tooltip("ms:Q", format=".3f")])
            .properties(width=520, height=28 * df["point"].nunique(),
                        title=chart_title(title or "Where a served step goes (torch profiler, SGLang /start_profile)",
                                          source)))


def unprofiled_steps(decode) -> dict:
    """{(run_id, ctx): median verify_step_ms} of decode records (a frame or a list of dicts): the
    step each server measured without the profiler, which a profile of that server and context
    sets beside its own (the profiler costs host time, a little or, where the host holds the step,
    much)."""
    import pandas as pd

    d = pd.DataFrame(decode)
    if not len(d) or not {"run_id", "ctx", "verify_step_ms"} <= set(d.columns):
        return {}
    return d.dropna(subset=["run_id", "verify_step_ms"]).groupby(["run_id", "ctx"])["verify_step_ms"].median().to_dict()


def profile_table(records, decode=None):
    """One row per profiled point: its configuration and layer count, step ms, with `decode`
    records the step its server measured unprofiled at that context (unprofiled_steps; NaN where
    none did), GPU busy share, attention ms, host/idle ms, how its categories were added up
    (category_time) and the commit that measured it."""
    import pandas as pd

    from .service_charts import short_commit

    unprofiled = unprofiled_steps(decode) if decode is not None else None
    rows = []
    for r in records:
        cats = r.get("gpu_ms_per_step") or {}
        attention = sum(v for k, v in cats.items() if k.startswith("attention"))
        row = {"config": _config(r), "layers": _layers_of(r.get("layers")) or "?",
               "spec": r["spec"], "ctx": r["ctx"], "step_ms": round(r["per_step_ms"], 2)}
        if unprofiled is not None:
            row["unprofiled_ms"] = round(unprofiled.get((r.get("run_id"), r["ctx"]), float("nan")), 2)
        rows.append({**row, "gpu_busy_%": round(100 * (r.get("busy_share") or 0), 1),
                     "attention_ms": round(attention, 3),
                     "host_idle_ms": round(host_idle_ms(r), 2), "categories": category_time(r),
                     "commit": short_commit(r.get("commit"))})
    return pd.DataFrame(rows)
