"""KV-slot fragmentation under request churn, on SGLang's own allocator, need_sort off vs on.

A serving loop is replayed on SGLang 0.5.17's `TokenToKVPoolAllocator` (page size 1, as the
sm120_mla backend uses; CPU tensors, the real class with no kvcache attached, since
allocation never touches the KV data): requests of mixed lengths arrive and get their prompt
slots in one `alloc`. Each step then allocates for the whole batch in one `alloc`, as the
scheduler does:
- plain decode (`tokens_per_step` 1): one slot a request (`alloc_for_decode`);
- speculative verify of `tokens_per_step` tokens: SGLang 0.5.17's v2 workers (EAGLE, DFlash)
  keep each request's slots allocated ahead, up to its committed length plus twice the step's
  tokens (`eagle_prepare_for_decode`, `get_alloc_reserve_per_decode`), and top them up each
  step (`alloc_for_spec_decode`). A rejected draft's slot is not freed: the next step writes
  over it. 1 to `tokens_per_step` tokens are accepted a step.
At the end of a step the finished requests are freed together inside `free_group_begin` /
`free_group_end`, as the scheduler does: the committed row, then the slots allocated past it
(`release_kv_cache`: `cache_finished_req`, then `_release_overallocated_kv_indices`). That is
a server without the radix cache (`--disable-radix-cache`, SGLang's ChunkCache); the radix
cache keeps finished requests' slots and frees them later, on eviction, in LRU order, which
this model does not replay. The same seed gives the same arrivals, lengths and acceptances with
need_sort False and True, so the two runs differ only in the allocator's free-list order.
One seed is one schedule: `seed_spread` gives the spread over several.

When a probe request, admitted late into the churn, finishes, its KV index row (prompt
slots, then its committed decode slots: what the attention kernel gathers) is measured:
- runs of consecutive slot indices and their mean length (the kernel gathers one 1152-byte
  row per key; a run is a stretch it could fetch as one contiguous block);
- distinct memory pages touched in one layer's KV buffer: row r occupies bytes
  [r * row_bytes, (r + 1) * row_bytes) of the layer's [P, 1, 576] bf16 buffer, and a page
  is page_bytes long. Defaults: row_bytes = 576 x 2 = 1152 (one token's MLA KV in one
  layer), page_bytes = 4096 (a small DRAM/OS page; larger values model TLB reach).
The allocator calls are timed (perf_counter, CPU tensors: a proxy for the host-side cost;
on a GPU server the free list lives on the device), and an `alloc` that triggered
`merge_and_sort_free` is labelled `alloc+sort` — that is where need_sort pays.
"""
from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd

from .mla import DIM_QK, DIM_V, KV_BYTES_PER_TOKEN, SM_SCALE

LAYOUT_METRICS = ("tokens", "runs", "mean_run_tokens", "pages_touched", "pages_ideal")
PARTS = ("prompt", "decode", "row")


@dataclass(frozen=True)
class ChurnConfig:
    """One churn scenario. Lengths are drawn log-uniformly from the (low, high) ranges."""

    capacity_tokens: int = 32_768
    num_requests: int = 300
    max_running: int = 32
    prompt_len_range: tuple[int, int] = (16, 4096)
    output_len_range: tuple[int, int] = (8, 512)
    tokens_per_step: int = 1          # 1: plain decode; k+1: verify of k draft tokens
    probe_prompt_len: int = 2048
    probe_output_len: int = 128
    probe_arrival: float = 0.75       # the probe arrives after this fraction of requests
    row_bytes: int = KV_BYTES_PER_TOKEN
    page_bytes: int = 4096
    seed: int = 0

    def __post_init__(self):
        for name in ("capacity_tokens", "num_requests", "max_running", "tokens_per_step",
                     "probe_prompt_len", "probe_output_len", "row_bytes", "page_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed: must be an int >= 0, got {self.seed!r}")   # numpy's generators refuse others
        for name in ("prompt_len_range", "output_len_range"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ValueError(f"{name}: [low, high], two ints, got {value!r}")
            low, high = value
            if not 1 <= low <= high:
                raise ValueError(f"{name}: need 1 <= low <= high, got {(low, high)}")
        if not 0.0 <= self.probe_arrival <= 1.0:
            raise ValueError(f"probe_arrival: must be in [0, 1], got {self.probe_arrival}")
        largest = max(self.prompt_len_range[1] + self.decode_slots(self.output_len_range[1]),
                      self.probe_prompt_len + self.decode_slots(self.probe_output_len))
        if largest > self.capacity_tokens:
            raise ValueError(f"capacity_tokens: {self.capacity_tokens} cannot hold the largest "
                             f"request ({largest} slots with its decode reservation)")

    @property
    def ahead(self) -> int:
        """Slots a verify step keeps allocated past the committed length: SGLang 0.5.17's
        get_alloc_reserve_per_decode, 2 x the draft tokens (a chain's tokens_per_step)."""
        return 0 if self.tokens_per_step == 1 else 2 * self.tokens_per_step

    def decode_slots(self, output_len: int) -> int:
        """The most slots a request of `output_len` tokens allocates after its prompt."""
        return output_len if self.tokens_per_step == 1 else output_len - 1 + self.ahead

    @property
    def scenario(self) -> str:
        if self.tokens_per_step == 1:
            return "decode"
        return f"verify {self.tokens_per_step} tokens"


@dataclass
class ChurnRun:
    """What one simulation leaves: the probe's slots and every timed allocator call."""

    config: ChurnConfig
    need_sort: bool
    probe_prompt: np.ndarray
    probe_decode: np.ndarray
    steps: int
    merges: int
    ops: list[tuple[str, int, float]] = field(repr=False)   # (op, tokens, seconds)
    probe_allocated: int = 0   # the probe's slots at its finish: its row and those kept ahead
    held_slots: int = 0        # slots the running requests (the probe too) held at that point
    free_slots: int = 0        # the allocator's free slots then: with held_slots, the whole pool

    @property
    def probe_row(self) -> np.ndarray:
        return np.concatenate([self.probe_prompt, self.probe_decode])

    @property
    def parts(self) -> dict[str, np.ndarray]:
        """The probe's slots by PARTS: its prompt, its committed decode tokens, the whole row."""
        return {"prompt": self.probe_prompt, "decode": self.probe_decode, "row": self.probe_row}


@dataclass
class _Request:
    slots: list       # tensors of slot indices, in the order of the request's KV row
    prompt: int
    committed: int    # row length the kernel reads (prompt + accepted tokens)
    allocated: int    # row length allocated (committed + the slots kept ahead)
    remaining: int    # output tokens still to accept
    reserve: int      # slots promised at admission and not yet allocated
    probe: bool

    def row(self, start: int = 0, end: int | None = None):
        import torch

        return torch.cat(self.slots)[start:end]


def index_layout(indices, row_bytes: int = KV_BYTES_PER_TOKEN, page_bytes: int = 4096) -> dict:
    """Runs, mean run length and pages touched by one request's KV slot indices (in order)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if row_bytes < 1 or page_bytes < 1:
        raise ValueError(f"row_bytes, page_bytes: must be positive, got {row_bytes}, {page_bytes}")
    n = int(idx.size)
    if n == 0:
        return dict(tokens=0, runs=0, mean_run_tokens=0.0, pages_touched=0, pages_ideal=0)
    if idx.min() < 0:
        raise ValueError("indices: slot indices must be non-negative")
    runs = 1 + int(np.count_nonzero(np.diff(idx) != 1))
    first = idx * row_bytes // page_bytes
    last = ((idx + 1) * row_bytes - 1) // page_bytes
    span = int((last - first).max())
    pages = np.unique(np.concatenate([np.minimum(first + k, last) for k in range(span + 1)]))
    return dict(tokens=n, runs=runs, mean_run_tokens=n / runs, pages_touched=int(pages.size),
                pages_ideal=math.ceil(n * row_bytes / page_bytes))


def _log_uniform(rng, low: int, high: int, size: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(low), np.log(high + 1), size)).astype(np.int64).clip(low, high)


def simulate_churn(config: ChurnConfig, need_sort: bool) -> ChurnRun:
    """Replay the serving loop of `config` on a fresh TokenToKVPoolAllocator."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    allocator = TokenToKVPoolAllocator(config.capacity_tokens, torch.bfloat16, "cpu", None,
                                       bool(need_sort))
    if allocator.need_sort != bool(need_sort):
        raise RuntimeError("the KV sort override is installed in this process "
                           "(sm120_workbook.patches.kv_sort); uninstall it to study "
                           "need_sort=False")
    rng = np.random.default_rng(config.seed)
    prompts = _log_uniform(rng, *config.prompt_len_range, config.num_requests)
    outputs = _log_uniform(rng, *config.output_len_range, config.num_requests)
    arrivals = [(int(p), int(o), False) for p, o in zip(prompts, outputs)]
    arrivals.insert(int(round(config.probe_arrival * config.num_requests)),
                    (config.probe_prompt_len, config.probe_output_len, True))
    queue = deque(arrivals)
    tps = config.tokens_per_step
    ops: list[tuple[str, int, float]] = []
    merges = 0

    def alloc(n: int):
        nonlocal merges
        had_release = len(allocator.release_pages) > 0
        t0 = time.perf_counter()
        got = allocator.alloc(n)
        dt = time.perf_counter() - t0
        merged = had_release and len(allocator.release_pages) == 0
        merges += merged
        ops.append(("alloc+sort" if merged else "alloc", n, dt))
        if got is None:  # the reservation below rules this out
            raise RuntimeError(f"alloc({n}) failed with {allocator.available_size()} free")
        return got

    running: list[_Request] = []
    reserved = 0  # slots promised to running requests and not yet allocated
    steps = 0
    while True:
        while queue and len(running) < config.max_running:
            prompt, out_len, probe = queue[0]
            future = config.decode_slots(out_len)
            if allocator.available_size() - reserved < prompt + future:
                break
            queue.popleft()
            running.append(_Request([alloc(prompt)], prompt, prompt, prompt, out_len, future, probe))
            reserved += future
        if not running:
            raise RuntimeError("no request fits the pool")  # ruled out by ChurnConfig
        steps += 1
        # one alloc for the batch, split in request order (alloc_for_decode / alloc_for_spec_decode)
        window = config.ahead or 1
        needs = [max(r.allocated, r.committed + window) - r.allocated for r in running]
        fresh = alloc(sum(needs)) if sum(needs) else None
        offset = 0
        for req, need in zip(running, needs):
            if need:
                req.slots.append(fresh[offset:offset + need])
                offset += need
                req.allocated += need
                req.reserve -= need
                reserved -= need
            keep = 1 if tps == 1 else int(rng.integers(1, tps + 1))
            keep = min(keep, req.remaining)
            req.committed += keep
            req.remaining -= keep
        finished = [r for r in running if r.remaining <= 0]
        probe = next((r for r in finished if r.probe), None)
        if probe is not None:
            return ChurnRun(config, bool(need_sort),
                            probe.row(0, probe.prompt).numpy().copy(),
                            probe.row(probe.prompt, probe.committed).numpy().copy(),
                            steps, merges, ops, probe_allocated=probe.allocated,
                            held_slots=sum(r.allocated for r in running),
                            free_slots=int(allocator.available_size()))
        if finished:
            t0 = time.perf_counter()
            allocator.free_group_begin()
            for r in finished:
                allocator.free(r.row(0, r.committed))
                if r.allocated > r.committed:   # the slots allocated ahead and never committed
                    allocator.free_segment(r.row(r.committed), start_pos=r.committed)
                reserved -= r.reserve
            allocator.free_group_end()
            ops.append(("free_group", sum(r.allocated for r in finished), time.perf_counter() - t0))
            running = [r for r in running if r.remaining > 0]


def compare_need_sort(config: ChurnConfig) -> list[ChurnRun]:
    """The same churn with need_sort False, then True."""
    return [simulate_churn(config, need_sort) for need_sort in (False, True)]


def layout_frame(runs: list[ChurnRun]) -> pd.DataFrame:
    """Tidy: one row per (scenario, need_sort, part of the probe's row, metric)."""
    rows = []
    for run in runs:
        c = run.config
        for part, idx in run.parts.items():
            for metric, value in index_layout(idx, c.row_bytes, c.page_bytes).items():
                rows.append(dict(scenario=c.scenario, tokens_per_step=c.tokens_per_step,
                                 need_sort=run.need_sort, part=part, metric=metric,
                                 value=float(value)))
    return pd.DataFrame(rows)


def timing_frame(runs: list[ChurnRun]) -> pd.DataFrame:
    """Tidy: one row per timed allocator call."""
    rows = [dict(scenario=run.config.scenario, need_sort=run.need_sort, op=op, tokens=n,
                 duration_us=seconds * 1e6)
            for run in runs for op, n, seconds in run.ops]
    return pd.DataFrame(rows, columns=["scenario", "need_sort", "op", "tokens", "duration_us"])


def timing_summary(timings: pd.DataFrame) -> pd.DataFrame:
    """Per (scenario, need_sort, op): count, median and p99 µs, total ms."""
    if timings.empty:
        return pd.DataFrame(columns=["scenario", "need_sort", "op", "count", "median_us",
                                     "p99_us", "total_ms"])
    g = timings.groupby(["scenario", "need_sort", "op"])["duration_us"]
    out = pd.DataFrame({"count": g.size(), "median_us": g.median(),
                        "p99_us": g.quantile(0.99), "total_ms": g.sum() / 1e3})
    return out.reset_index()


def run_summary(runs: list[ChurnRun]) -> pd.DataFrame:
    """One row per run: steps, merges, and the allocator's total time."""
    return pd.DataFrame([dict(scenario=r.config.scenario, need_sort=r.need_sort, steps=r.steps,
                              merges=r.merges, allocator_calls=len(r.ops),
                              allocator_ms=sum(s for _, _, s in r.ops) * 1e3) for r in runs])


def churn_study(configs: list[ChurnConfig], progress: bool = False):
    """Run every config with need_sort False and True: (layout, timings, runs) frames."""
    iterator = configs
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(configs, desc="churn scenarios")
    runs = [run for c in iterator for run in compare_need_sort(c)]
    return layout_frame(runs), timing_frame(runs), run_summary(runs)


def seed_spread(config: ChurnConfig, seeds: int = 10) -> pd.DataFrame:
    """One seed is one schedule, and the probe's layout swings with it. Seeds `config.seed` ..
    `config.seed + seeds - 1`, need_sort False and True: per (scenario, part of the probe's
    row, need_sort), its runs (median, min, max), median mean run length and pages touched,
    and in how many seeds need_sort gave fewer runs than the same schedule without it."""
    if not isinstance(seeds, (int, np.integer)) or seeds < 1:
        raise ValueError(f"seeds: must be a positive int, got {seeds!r}")
    rows = []
    for s in range(config.seed, config.seed + seeds):
        for run in compare_need_sort(replace(config, seed=s)):
            rows += [dict(seed=s, part=part, need_sort=run.need_sort,
                          **index_layout(idx, config.row_bytes, config.page_bytes))
                     for part, idx in run.parts.items()]
    per_seed = pd.DataFrame(rows)
    g = per_seed.groupby(["part", "need_sort"], sort=False)
    out = pd.DataFrame({"runs_median": g["runs"].median(), "runs_min": g["runs"].min(),
                        "runs_max": g["runs"].max(), "mean_run_tokens": g["mean_run_tokens"].median(),
                        "pages_touched": g["pages_touched"].median()}).reset_index()
    runs = per_seed.pivot(index=["part", "seed"], columns="need_sort", values="runs")
    fewer = (runs[True] < runs[False]).groupby(level="part").sum()
    out["sorted_fewer_runs"] = pd.array([int(fewer[part]) if sort else pd.NA
                                         for part, sort in zip(out["part"], out["need_sort"])], dtype="Int64")
    out.insert(0, "scenario", config.scenario)
    out["seeds"] = seeds
    return out


def layout_table(layout: pd.DataFrame, part: str = "row") -> pd.DataFrame:
    """Wide view for printing: one row per (scenario, need_sort), metrics as columns."""
    sub = layout[layout["part"] == part]
    wide = sub.pivot_table(index=["scenario", "need_sort"], columns="metric", values="value")
    return wide[list(LAYOUT_METRICS)].round(1)


def churn_records(layout: pd.DataFrame, summary: pd.DataFrame, runs: pd.DataFrame,
                  configs: list[ChurnConfig]) -> list[dict]:
    """Records for append_records("kv_fragmentation", ...)."""
    by_scenario = {c.scenario: asdict(c) for c in configs}
    records = []
    for row in layout.to_dict("records"):
        records.append({"kind": "churn_layout", **row, "config": by_scenario[row["scenario"]]})
    for row in summary.to_dict("records"):
        records.append({"kind": "churn_timing", "device": "cpu", **row})
    for row in runs.to_dict("records"):
        records.append({"kind": "churn_run", **row})
    return records


def kernel_layout_records(kernel_times: pd.DataFrame, config: ChurnConfig) -> list[dict]:
    """Records of kernel_layout_timing's table for append_records("kv_fragmentation", ...),
    each naming the churn scenario whose layouts were timed, and its config."""
    return [{"kind": "kernel_layout", "scenario": config.scenario, "config": asdict(config), **row}
            for row in kernel_times.to_dict("records")]


# ---------------------------------------------------------------- charts
_COLORS = {"need_sort=False": "#4c78a8", "need_sort=True": "#f58518",
           "contiguous (ideal)": "#9d9d9d"}


def _color(title: str, keys=("need_sort=False", "need_sort=True")):
    import altair as alt

    return alt.Color("need_sort:N", title=title,
                     scale=alt.Scale(domain=list(keys), range=[_COLORS[k] for k in keys]))


def _sort_label(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    out["need_sort"] = out["need_sort"].map(lambda v: f"need_sort={bool(v)}")
    return out


def _facet_by_scenario(data: pd.DataFrame, title: str):
    import altair as alt

    base = alt.Chart(data).mark_bar().encode(
        x=alt.X("need_sort:N", title=None, axis=alt.Axis(labels=False, ticks=False)),
        y=alt.Y("value:Q", title=None),
        color=_color("allocator"),
        tooltip=["scenario", "need_sort", "part", "metric",
                 alt.Tooltip("value:Q", format=".1f")],
    ).properties(width=90, height=120)
    return base.facet(
        column=alt.Column("part:N", title=None, sort=list(PARTS)),
        row=alt.Row("scenario_metric:N", title=None),
    ).resolve_scale(y="independent").properties(title=title)


def _with_row_key(data: pd.DataFrame) -> pd.DataFrame:
    data = data.copy()
    data["scenario_metric"] = data["scenario"] + " · " + data["metric"]
    return data


def layout_chart(layout: pd.DataFrame):
    """Runs and mean run length of the probe's slots: rows scenario x metric, columns part."""
    data = _with_row_key(_sort_label(layout[layout["metric"].isin(["runs", "mean_run_tokens"])]))
    return _facet_by_scenario(data, "Probe request's KV slots: runs and mean run length")


def pages_chart(layout: pd.DataFrame):
    """Pages touched by the probe's slots vs the contiguous ideal, per scenario and part."""
    import altair as alt

    data = _sort_label(layout[layout["metric"].isin(["pages_touched", "pages_ideal"])])
    ideal = data[data["metric"] == "pages_ideal"].drop_duplicates(["scenario", "part"])
    ideal = ideal.assign(need_sort="contiguous (ideal)")
    data = pd.concat([data[data["metric"] == "pages_touched"], ideal])
    return alt.Chart(data).mark_bar().encode(
        x=alt.X("need_sort:N", title=None, axis=alt.Axis(labels=False, ticks=False),
                sort=["need_sort=False", "need_sort=True", "contiguous (ideal)"]),
        y=alt.Y("value:Q", title="pages touched"),
        color=_color("slots", tuple(_COLORS)),
        tooltip=["scenario", "need_sort", "part", alt.Tooltip("value:Q", format=".0f")],
    ).properties(width=90, height=130).facet(
        column=alt.Column("part:N", title=None, sort=list(PARTS)),
        row=alt.Row("scenario:N", title=None),
    ).resolve_scale(y="independent").properties(title="Pages of one layer's KV buffer touched")


def sort_cost_chart(summary: pd.DataFrame):
    """Median µs per allocator call, by op, need_sort and scenario."""
    import altair as alt

    data = _sort_label(summary)
    return alt.Chart(data).mark_bar().encode(
        x=alt.X("op:N", title=None, sort=["alloc", "alloc+sort", "free_group"]),
        xOffset="need_sort:N",
        y=alt.Y("median_us:Q", title="median µs per call (CPU)"),
        color=_color("allocator"),
        tooltip=["scenario", "need_sort", "op", "count",
                 alt.Tooltip("median_us:Q", format=".1f"), alt.Tooltip("p99_us:Q", format=".1f"),
                 alt.Tooltip("total_ms:Q", format=".2f")],
    ).properties(width=220, height=180).facet(column=alt.Column("scenario:N", title=None)) \
        .properties(title="Allocator call cost: the sort runs inside alloc+sort")


# ---------------------------------------------------------------- GPU: what the layout costs the kernel
def probe_layouts(config: ChurnConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """The probe's KV rows in four layouts of the same length: contiguous, after churn with
    need_sort False and True, and a uniformly random scatter over the pool."""
    runs = compare_need_sort(config)
    n = runs[0].probe_row.size
    rng = np.random.default_rng(seed)
    return {
        "contiguous": np.arange(1, n + 1, dtype=np.int64),
        "churn, need_sort=False": runs[0].probe_row.astype(np.int64),
        "churn, need_sort=True": runs[1].probe_row.astype(np.int64),
        "random": rng.choice(np.arange(1, config.capacity_tokens + 1), n, replace=False),
    }


def layouts_frame(layouts: dict[str, np.ndarray], row_bytes: int = KV_BYTES_PER_TOKEN,
                  page_bytes: int = 4096) -> pd.DataFrame:
    """One row per layout: tokens, runs, mean run length, pages touched."""
    return pd.DataFrame([dict(layout=name, **index_layout(idx, row_bytes, page_bytes))
                         for name, idx in layouts.items()])


def kernel_layout_timing(layouts: dict[str, np.ndarray], batch: int = 8, heads: int = 16,
                         q_len: int = 4, reps: int = 50, row_bytes: int = KV_BYTES_PER_TOKEN,
                         page_bytes: int = 4096) -> pd.DataFrame:
    """Median µs of one verify step of `mla_verify_attention` (CUDA-graph replays) per layout.

    Each of the `batch` requests has the same layout, shifted into its own region of the pool
    so requests do not share rows; the draft tokens' KV comes as k_extend. GPU only. The
    `runs` and `pages_touched` columns count as `index_layout(idx, row_bytes, page_bytes)` does.
    """
    import torch

    from sm120_workbook.kernels import MlaVerifyWorkspace, kernel_available, mla_verify_attention
    from sm120_workbook.kernels.bench import time_graph_us

    ok, why = kernel_available()
    if not ok:
        raise RuntimeError(f"kernel_layout_timing needs the sm120 kernel: {why}")
    if batch < 1 or heads < 1 or q_len < 1:
        raise ValueError(f"batch, heads, q_len: must be positive, got {batch}, {heads}, {q_len}")
    lengths = {name: len(idx) for name, idx in layouts.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"layouts: all must have the same length, got {lengths}")
    device = torch.device("cuda")
    span = int(max(int(np.max(idx)) for idx in layouts.values())) + 1
    g = torch.Generator(device=device).manual_seed(0)
    pool = torch.randn(batch * span, 1, DIM_QK, device=device, generator=g).to(torch.bfloat16)
    tokens = batch * q_len
    q = torch.randn(tokens, heads, DIM_QK, device=device, generator=g).to(torch.bfloat16)
    k_extend = torch.randn(tokens, 1, DIM_QK, device=device, generator=g).to(torch.bfloat16)
    out = torch.empty(tokens, heads, DIM_V, device=device, dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device=device, dtype=torch.float32)
    workspace = MlaVerifyWorkspace(tokens, heads, device)
    qo_indptr = torch.arange(0, tokens + 1, q_len, device=device, dtype=torch.int32)
    n = next(iter(lengths.values()))
    kv_indptr = torch.arange(0, batch * n + 1, n, device=device, dtype=torch.int32)
    rows = []
    for name, idx in layouts.items():
        base = torch.arange(batch, device=device, dtype=torch.int64)[:, None] * span
        kv_indices = (base + torch.as_tensor(idx, device=device)[None, :]).reshape(-1).contiguous()

        def step(kv_indices=kv_indices):
            mla_verify_attention(q, pool, qo_indptr, kv_indptr, kv_indices, out=out, lse=lse,
                                 workspace=workspace, sm_scale=SM_SCALE, max_q_len=q_len,
                                 k_extend=k_extend)

        timing = time_graph_us(step, reps=reps)
        layout = index_layout(idx, row_bytes, page_bytes)
        rows.append(dict(layout=name, batch=batch, heads=heads, q_len=q_len, keys_per_request=n,
                         runs=layout["runs"], pages_touched=layout["pages_touched"],
                         time_us=timing["time_us"], time_us_min=timing["time_us_min"], l2_flush=timing["l2_flush"],
                         kv_gb_per_s=batch * n * KV_BYTES_PER_TOKEN / (timing["time_us"] * 1e-6) / 1e9))
    return pd.DataFrame(rows)


KERNEL_LAYOUT_COLUMNS = ["layout", "batch", "heads", "q_len", "keys_per_request", "runs", "pages_touched",
                         "time_us", "kv_gb_per_s"]


def recorded_kernel_layout(records: pd.DataFrame) -> pd.DataFrame:
    """The kernel-layout timings (kind "kernel_layout"): for each shape timed (batch, heads,
    q_len, keys a request), its newest recorded run. The layouts are compared within one run,
    never across GPUs or commits; shapes are rows of their own, shortest context first.
    Empty where none."""
    d = records[records["kind"] == "kernel_layout"] if "kind" in records else records[:0]
    if len(d) == 0:
        return pd.DataFrame(columns=KERNEL_LAYOUT_COLUMNS)
    # one append is one run: its records share the GPU, the commit and the date
    run = [k for k in ("gpu", "commit", "date") if k in d]
    shape = [k for k in ("batch", "heads", "q_len", "keys_per_request") if k in d]
    picked = []
    for _, g in d.groupby(shape, sort=True, dropna=False) if shape else [(None, d)]:
        newest = g.sort_values("date").iloc[-1] if "date" in g else g.iloc[-1]
        picked.append(g[(g[run] == newest[run]).all(axis=1)])
    out = pd.concat(picked)
    if "keys_per_request" in out:
        out = out.sort_values("keys_per_request", kind="stable")
    return out.reset_index(drop=True)


def kernel_layout_table(timings: pd.DataFrame) -> pd.DataFrame:
    """The compact table a notebook prints (rounded): each layout's time and KV bytes per second."""
    missing = set(KERNEL_LAYOUT_COLUMNS) - set(timings.columns)
    if missing:
        raise ValueError(f"timings: missing columns {sorted(missing)}")
    t = timings[KERNEL_LAYOUT_COLUMNS].round({"time_us": 1}).reset_index(drop=True)
    t["kv_gb_per_s"] = t["kv_gb_per_s"].round().astype(int)
    return t


def layout_shape(timings: pd.DataFrame) -> pd.Series:
    """A label per timed shape: "b8 h16 q4, 2,176 keys"."""
    return (("b" + timings["batch"].astype(int).astype(str) + " h" + timings["heads"].astype(int).astype(str)
             + " q" + timings["q_len"].astype(int).astype(str) + ", ")
            + timings["keys_per_request"].map(lambda k: f"{int(k):,} keys"))


def kernel_layout_chart(timings: pd.DataFrame, source: str = ""):
    """Kernel time per layout of the same request (one step), a panel per shape timed (each on
    its own scale); `source` (service_charts.source_label) says whether it shows recorded or
    live timings."""
    import altair as alt

    from .service_charts import chart_title

    data = timings.assign(shape=layout_shape(timings))
    layouts = list(dict.fromkeys(data["layout"]))
    bars = alt.Chart(data).mark_bar().encode(
        y=alt.Y("layout:N", title=None, sort=layouts),
        x=alt.X("time_us:Q", title="µs per step (CUDA-graph replay, median)"),
        color=alt.Color("layout:N", legend=None, sort=layouts),
        tooltip=["shape", "layout", "runs", "pages_touched", alt.Tooltip("time_us:Q", format=".1f"),
                 alt.Tooltip("kv_gb_per_s:Q", format=".0f")],
    ).properties(width=360, height=30 * max(1, len(layouts)))
    title = chart_title("sm120_mla kernel: same request, different KV slot layouts", source)
    shapes = list(dict.fromkeys(data["shape"]))
    if len(shapes) == 1:
        return bars.properties(title=title)
    return bars.facet(row=alt.Row("shape:N", title=None, sort=shapes)) \
        .resolve_scale(x="independent").properties(title=title)


def main(argv=None) -> int:
    """GPU machine entry point (no Jupyter there): time the kernel on the churned layouts of a
    probe request and append them to data/results/kv_fragmentation.jsonl. The defaults are
    notebook 04's study: the layouts of a verify-of-4 churn (--tokens-per-step), timed at 8
    requests of 2,176 keys, 16 heads and 4 query tokens (--batch, --heads, --q-len). A long
    context, the same churn scenario's layouts timed at decode, as recorded in session 49:

        python -m sm120_workbook.kv_fragmentation --capacity-tokens 524288 \\
            --prompt-len-range 256 32768 --probe-prompt-len 65408 --batch 1 --heads 8 --q-len 1
    """
    import argparse

    from .kernels.bench import int_in, replays
    from .results import add_record_args, append_records, cli_command

    defaults = ChurnConfig()
    ap = argparse.ArgumentParser(description="KV layout cost on the sm120 kernel (GPU)", epilog=main.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int_in(1), default=8)
    ap.add_argument("--heads", type=int_in(1, 128), default=16)
    ap.add_argument("--q-len", type=int_in(1, 16), default=4)
    ap.add_argument("--reps", type=replays, default=50)
    ap.add_argument("--tokens-per-step", type=int, default=4, help="churn scenario of the probe")
    ap.add_argument("--capacity-tokens", type=int, default=defaults.capacity_tokens)
    ap.add_argument("--prompt-len-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
                    default=defaults.prompt_len_range)
    ap.add_argument("--probe-prompt-len", type=int, default=defaults.probe_prompt_len)
    ap.add_argument("--probe-output-len", type=int, default=defaults.probe_output_len)
    ap.add_argument("--seed", type=int, default=defaults.seed)
    add_record_args(ap, "kv_fragmentation")   # --out: the GPU machine returns only what is under $OUT
    args = ap.parse_args(argv)
    try:
        config = ChurnConfig(tokens_per_step=args.tokens_per_step, capacity_tokens=args.capacity_tokens,
                             prompt_len_range=tuple(args.prompt_len_range), probe_prompt_len=args.probe_prompt_len,
                             probe_output_len=args.probe_output_len, seed=args.seed)
    except ValueError as e:
        ap.error(str(e))
    from .kernels import kernel_available

    ok, why = kernel_available()   # before the churn simulation's seconds, not after them
    if not ok:
        sys.exit(f"kv_fragmentation times the sm120 kernel, which cannot run here: {why}")
    times = kernel_layout_timing(probe_layouts(config), batch=args.batch, heads=args.heads,
                                 q_len=args.q_len, reps=args.reps)
    print(times.round(1).to_string(index=False))
    if args.no_record:
        return 0
    rows = [dict(r, kernel_version=args.tag) if args.tag else r for r in kernel_layout_records(times, config)]
    print("appended to", append_records("kv_fragmentation", rows, path=args.out,
                                        command=cli_command("sm120_workbook.kv_fragmentation", argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
