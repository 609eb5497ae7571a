"""Tables and charts of live-service records: decode speed against context, speedup over the
Triton backend, and the NVML / expert-load records turned back into tidy frames.

The same functions serve a live run (records in memory) and recorded results (data/results/).
"""
from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np
import pandas as pd

from .charts import chart_title  # noqa: F401 - the service charts' modules import it from here
from .results import short_commit, source_label  # noqa: F401 - charts name commits so; notebooks import them from here
from .service import DRAFT_MODEL_SPECS, usual_draft_backend

# A point is one configuration: records differing in any of these are never pooled or paired.
# expert_record (the recorder costs time on every forward) and ngram_tail (the host-side NGRAM
# fix, patches/ngram_tail.py) change the step time without changing the kernel;
# prefill_attention_backend (a prefill on another backend, "" for none) the time to first token,
# and prefill_as_base (that hybrid spelt with the prefill backend first) SGLang's prefill path.
# draft_backend (derived, `draft_backend_of`): a draft's attention backend where it is not the
# usual one ("" where it is, and for modes without a draft model), e.g. sm120_mla's EAGLE MTP
# draft kept on Triton. eagle_topk: an EAGLE(3) tree's width (1, a chain, for every other record).
# draft_head (derived, `draft_head_of`): an EAGLE3 head's layout, "mla" or "llama" ("" for the
# other modes; EAGLE3 records from before the Llama head are MLA ones). dflash_host_plan: "off",
# or "probe", the timing probe without the DFlash draft's per-step sync (patches/dflash_host_plan.py;
# data/results/probes/ has session 39's records of it as "on", and "check", which synced anyway).
# kv_sort (SM120_KV_SORT=1, the allocator override: b888adc's servers ran 2034-2349 tok/s off and
# 2483-2642 on) and allreduce_fusion (TP > 1) change the step too.
POINT_KEYS = ["gpu", "model", "layers", "tp", "ep_size", "weights", "backend", "spec", "draft_tokens", "ctx",
              "decode_tokens", "cuda_graph", "expert_record", "ngram_tail", "prefill_attention_backend",
              "prefill_as_base", "draft_backend", "eagle_topk", "draft_head", "dflash_host_plan", "kv_sort",
              "allreduce_fusion"]
# What a record without the key ran with (older records predate ep_size and ngram_tail;
# decode_tokens: decode_bench's default).
KEY_DEFAULTS = {"ep_size": 1, "decode_tokens": 256, "cuda_graph": True, "draft_tokens": 0,
                "expert_record": False, "ngram_tail": False, "prefill_attention_backend": "",
                "prefill_as_base": False, "draft_backend": "", "eagle_topk": 1, "dflash_host_plan": "off",
                "kv_sort": False, "allreduce_fusion": False}
# One decode_bench call's id (its records of every backend): a pair within one is the same run, on
# one machine in one session. run_id names a server; records before the key have neither, or run_id alone.
INVOCATION_KEY = "invocation"
SPEC_TITLES = {"none": "no speculation", "dflash": "DFlash (dummy draft)", "ngram": "NGRAM",
               "eagle": "EAGLE (MTP layer, dummy weights)",
               "eagle3": "EAGLE3 (draft head, dummy weights)"}


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def _need(df, cols, name="df"):
    if df is None or len(df) == 0:
        raise ValueError(f"{name}: no rows")
    missing = set(cols) - set(df.columns)
    if missing:
        raise ValueError(f"{name}: missing columns {sorted(missing)}")


def _value(r, key):
    """A record's (mapping or row tuple) value of `key`, at its default where absent or NaN."""
    v = r.get(key) if isinstance(r, dict) else getattr(r, key, None)
    return KEY_DEFAULTS.get(key) if v is None or (isinstance(v, float) and math.isnan(v)) else v


def draft_head_of(spec, draft_head) -> str:
    """The point key `draft_head` of a record: an EAGLE3 record's head layout ("mla" where the
    record has none: the first EAGLE3 heads were MLA), "" for every other mode."""
    if spec != "eagle3":
        return ""
    return draft_head if isinstance(draft_head, str) and draft_head else "mla"


def draft_backend_of(spec, backend, draft_attention_backend, draft_head=None, prefill_backend=None) -> str:
    """The point key `draft_backend` of a record: its draft's attention backend where the record
    names one other than the usual, else "". The usual (service.usual_draft_backend): flashinfer
    for an EAGLE3 Llama head under sm120_mla, else SGLang's choice: for DFlash its prefill backend
    (`prefill_backend`, else `backend`) where SGLang runs a DFlash draft on it, else flashinfer; for
    EAGLE(3) the decode backend (None, as in the first EAGLE records, is that). DFlash records that
    name none (9880eff's) ran the launcher's default then, triton. Other modes have no draft
    backend."""
    if spec not in DRAFT_MODEL_SPECS:
        return ""
    named = (draft_attention_backend if isinstance(draft_attention_backend, str) and draft_attention_backend
             else "triton" if spec == "dflash" else "")
    prefill = prefill_backend if isinstance(prefill_backend, str) and prefill_backend else None
    usual = usual_draft_backend(spec, backend, prefill, draft_head_of(spec, draft_head) == "llama")
    return named if named not in ("", usual) else ""


def with_defaults(df):
    """A copy of records with every point key set: absent keys at KEY_DEFAULTS, else "?"
    (draft_head derived from spec and draft_head, draft_backend from those, backend and
    draft_attention_backend)."""
    d = df.copy()
    heads = d["draft_head"] if "draft_head" in d else [None] * len(d)
    d["draft_head"] = [draft_head_of(s, h) for s, h in zip(d["spec"], heads)]
    if "draft_backend" not in d:
        named = d["draft_attention_backend"] if "draft_attention_backend" in d else [None] * len(d)
        prefill = d["prefill_attention_backend"] if "prefill_attention_backend" in d else [None] * len(d)
        d["draft_backend"] = [draft_backend_of(s, b, n, h, p) for s, b, n, h, p
                              in zip(d["spec"], d["backend"], named, d["draft_head"], prefill)]
    for k in POINT_KEYS:
        if k in KEY_DEFAULTS:
            d[k] = d[k].where(d[k].notna(), KEY_DEFAULTS[k]) if k in d else KEY_DEFAULTS[k]
        elif k not in d.columns:
            d[k] = "?"
    for k in ("ep_size", "decode_tokens", "draft_tokens", "eagle_topk"):
        d[k] = d[k].astype(int)
    for k in ("cuda_graph", "expert_record", "ngram_tail", "prefill_as_base", "kv_sort", "allreduce_fusion"):
        d[k] = d[k].astype(bool)
    return d


def _run_names(points) -> pd.Series:
    """Each row's run: its commit, and its invocation where it has one; "?" (no commit, no
    invocation) is no run's."""
    inv = points[INVOCATION_KEY].fillna("").astype(str) if INVOCATION_KEY in points else ""
    return (points["commit"].astype(str) + "@" + inv).str.rstrip("@").where(
        (points["commit"] != "?") | (inv != ""), "?")


def one_run_per_line(points, line_keys, axis: str) -> pd.DataFrame:
    """The points of each line (rows alike in `line_keys`, along `axis`) from one run: the newest
    run (commit, and invocation where the records name one) that measured every `axis` value the
    line holds, so that a line joins points of one kernel, machine and session. Where no run did
    (or the line has one `axis` value), each value's newest run, and `other_run` marks the points
    of a line that do not come from its main run (the one with most of its points, the newest of
    equals). Rows without a commit or invocation ("?") never count as a whole run; between
    whole runs of one date the later run name wins, so the choice is deterministic."""
    d = points.assign(_run=_run_names(points))
    chosen = []
    for _, g in d.groupby(line_keys, dropna=False):
        runs = g[g["_run"] != "?"].groupby("_run").agg(n=(axis, "nunique"), date=("date", "max"))
        whole = runs[runs["n"] == g[axis].nunique()].reset_index().sort_values(["date", "_run"])
        if len(whole) and g[axis].nunique() >= 2:
            chosen.append(g[g["_run"] == whole["_run"].iloc[-1]].assign(other_run=False))
            continue
        pick = g.sort_values(["date", "_run"]).groupby(axis, dropna=False).tail(1)
        count = pick.groupby("_run").agg(n=(axis, "size"), date=("date", "max")).reset_index()
        main = count.sort_values(["n", "date", "_run"])["_run"].iloc[-1]
        chosen.append(pick.assign(other_run=pick["_run"] != main))
    return pd.concat(chosen).drop(columns="_run").reset_index(drop=True) if chosen else points.iloc[:0].assign(
        other_run=pd.Series(dtype=bool))


def decode_points(df, every_run: bool = False):
    """One row per measured point: the median tok/s, accept length and step time of its requests.
    Where a server (run_id) repeated a request two or more times, its first (repeat 0, at times
    7-9% slower outside NGRAM) is left out of the three, as ttft_s leaves it out; each server's median comes
    first, then the median over its servers, so that a server with more requests does not outvote
    another. `requests` counts the requests the medians are over, `n_runs` the servers.
    A line (a configuration along context) is one run's: the newest run (commit, and invocation
    where recorded) that measured each of its contexts, else each point's newest run, `other_run`
    then marking the points that come from another run than the rest of their line
    (one_run_per_line). With `every_run`, one row per point and run, for pairing within a run."""
    _need(df, ["backend", "spec", "ctx", "tok_s", "accept_len", "verify_step_ms"])
    d = with_defaults(df)
    d["commit"] = d["commit"].map(short_commit) if "commit" in d else "?"
    d["date"] = d["date"].fillna("").astype(str) if "date" in d else ""
    d[INVOCATION_KEY] = d[INVOCATION_KEY].fillna("").astype(str) if INVOCATION_KEY in d else ""
    d["_server"] = d["run_id"].fillna("").astype(str) if "run_id" in d else ""
    d["_repeat"] = pd.to_numeric(d["repeat"], errors="coerce").fillna(0) if "repeat" in d else 0
    run_keys = POINT_KEYS + ["commit", INVOCATION_KEY]
    server_keys = run_keys + ["_server"]
    repeated = d.groupby(server_keys, dropna=False)["_repeat"].transform("nunique") >= 2
    kept = d[~(repeated & (d["_repeat"] == 0))]
    per_server = (kept.groupby(server_keys, dropna=False)
                      .agg(tok_s=("tok_s", "median"), accept_len=("accept_len", "median"),
                           verify_step_ms=("verify_step_ms", "median"), requests=("tok_s", "size"))
                      .reset_index())
    agg = (per_server.groupby(run_keys, dropna=False)
                     .agg(tok_s=("tok_s", "median"), accept_len=("accept_len", "median"),
                          verify_step_ms=("verify_step_ms", "median"), requests=("requests", "sum"),
                          n_runs=("_server", "size"))
                     .reset_index())
    # ttft_s: the fastest repeat's (repeat >= 1): a server's first request at a new length can
    # wait on the host (first_token_points); NaN for a point without a repeat
    at = {"date": ("date", "max")}
    if {"ttft_s", "repeat"} <= set(d):
        d["repeat_ttft_s"] = d["ttft_s"].where(d["_repeat"] >= 1)
        at["ttft_s"] = ("repeat_ttft_s", "min")
    agg = agg.merge(d.groupby(run_keys, dropna=False).agg(**at).reset_index(), on=run_keys, how="left")
    if not every_run:   # (two runs on one machine append in turn, so the file is not in date order)
        agg = one_run_per_line(agg, [k for k in POINT_KEYS if k != "ctx"], "ctx")
    agg["ctx_label"] = agg["ctx"].map(ctx_label)
    agg["spec_title"] = agg["spec"].map(lambda s: SPEC_TITLES.get(s, s))
    # the layer count and decode tokens join the label only where the records hold more than one;
    # draft tokens only where points otherwise alike differ in them (draft_tokens_differ)
    drafts = draft_tokens_differ(agg)
    agg["config"] = [label_of(r, layers=agg["layers"].nunique() > 1,
                              decode_tokens=agg["decode_tokens"].nunique() > 1, draft_tokens=n)
                     for r, n in zip(agg.itertuples(), drafts)]
    agg["setup"] = [setup_label(r) for r in agg.itertuples()]
    agg["line"] = [line_label(r, draft_tokens=n) for r, n in zip(agg.itertuples(), drafts)]
    return agg.sort_values(["backend", "spec", "ctx", "layers", "tp", "config", "date"]).reset_index(drop=True)


def tp_of(value) -> int | None:
    """A record's tp as an int (records may hold 2, 2.0 or "2"); None where unknown."""
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def select_tp(df, tp: int = 1):
    """The rows of records or points measured with `tp` GPUs per server."""
    return df[df["tp"].map(tp_of) == tp]


def config_label(backend: str, expert_record: bool = True, ngram_tail: bool = False, tp=1, layers=None, *,
                 ep_size=1, cuda_graph: bool = True, decode_tokens=None, prefill_backend: str = "",
                 prefill_as_base: bool = False, draft_backend: str = "", eagle_topk=1,
                 draft_head: str = "", dflash_host_plan: str = "off", draft_tokens=None, kv_sort: bool = False,
                 allreduce_fusion: bool = False) -> str:
    """How charts and tables name a configuration: the backend, plus what differs from the
    usual run (one GPU, no expert parallelism, CUDA graphs, expert recorder on, SGLang's NGRAM
    draft prep unpatched, SGLang's allocator (kv_sort) and all-reduce (allreduce_fusion), the
    prefill on the same backend, a draft on its usual backend, an EAGLE chain, an EAGLE3 head of
    MLA layout, the DFlash draft's plan as SGLang has it), and the layer count, decode tokens and
    draft tokens when given."""
    n, ep = tp_of(tp), tp_of(ep_size)
    return (backend + (f" TP{n}" if n not in (None, 1) else "") + (f" EP{ep}" if ep not in (None, 1) else "")
            + (f", {int(layers)} layers" if layers is not None else "")
            + (f", {int(decode_tokens)} decode tokens" if decode_tokens is not None else "")
            + ("" if expert_record else " (recorder off)") + ("" if cuda_graph else " (no CUDA graph)")
            + (" + ngram_tail" if ngram_tail else "")
            + (" + kv_sort" if kv_sort else "") + (" + allreduce_fusion" if allreduce_fusion else "")
            + (f" + {prefill_backend} prefill" if prefill_backend else "")
            + (" as base" if prefill_backend and prefill_as_base else "")
            + (f" + {draft_backend} draft" if draft_backend else "")
            + (f", EAGLE topk {int(eagle_topk)}" if eagle_topk not in (None, 1) else "")
            + (f", {int(draft_tokens)} draft tokens" if draft_tokens is not None else "")
            + (f", {draft_head.capitalize()} EAGLE3 head" if draft_head not in ("", "mla", None) else "")
            + {"off": "", "": "", None: "", "on": " + dflash_host_plan probe"}.get(
                dflash_host_plan, f" + dflash_host_plan {dflash_host_plan}"))


def _draft_key(r) -> str:
    """draft_backend of a point (which has it) or a record (derived, as with_defaults does)."""
    v = lambda k: _value(r, k)  # noqa: E731
    has = (r.get("draft_backend") if isinstance(r, dict) else getattr(r, "draft_backend", None))
    if isinstance(has, str):
        return has
    return draft_backend_of(v("spec"), v("backend"), v("draft_attention_backend"), v("draft_head"),
                            v("prefill_attention_backend"))


def draft_tokens_differ(points, keys=POINT_KEYS) -> pd.Series:
    """Per point: whether points alike in every other key of `keys` (context aside: a line's
    points share a label) differ in draft tokens, so that the label must name them. Draft tokens
    differ between spec modes as a rule (0 without one), and a chart's panel is a mode: a label
    naming them everywhere would say little and change every label."""
    same = [k for k in keys if k not in ("draft_tokens", "ctx")]
    if len(points) == 0:
        return pd.Series(False, index=points.index)
    return points.groupby(same, dropna=False)["draft_tokens"].transform("nunique").gt(1)


def label_of(r, layers: bool = False, decode_tokens: bool = False, draft_tokens: bool = False) -> str:
    """config_label of a record or point (a mapping or a row tuple), absent keys at their defaults;
    with `layers` / `decode_tokens` / `draft_tokens`, those too."""
    v = lambda k: _value(r, k)  # noqa: E731
    return config_label(v("backend"), bool(v("expert_record")), bool(v("ngram_tail")), v("tp"),
                        v("layers") if layers else None, ep_size=v("ep_size"), cuda_graph=bool(v("cuda_graph")),
                        decode_tokens=v("decode_tokens") if decode_tokens else None,
                        prefill_backend=str(v("prefill_attention_backend") or ""),
                        prefill_as_base=bool(v("prefill_as_base")), draft_backend=_draft_key(r),
                        eagle_topk=v("eagle_topk"), draft_head=draft_head_of(v("spec"), v("draft_head")),
                        dflash_host_plan=str(v("dflash_host_plan") or "off"),
                        draft_tokens=v("draft_tokens") if draft_tokens else None,
                        kv_sort=bool(v("kv_sort")), allreduce_fusion=bool(v("allreduce_fusion")))


def setup_label(r) -> str:
    """What a point's server ran beside its backend, speculation and draft: its GPUs, layers,
    decode tokens, recorder, NGRAM fix, allocator, all-reduce and prefill (config_label's words,
    layers and decode tokens always). Points of one setup differ only in their line (line_label)
    and panel (spec)."""
    v = lambda k: _value(r, k)  # noqa: E731
    return config_label("", bool(v("expert_record")), bool(v("ngram_tail")), v("tp"), v("layers"),
                        ep_size=v("ep_size"), cuda_graph=bool(v("cuda_graph")), decode_tokens=v("decode_tokens"),
                        prefill_backend=str(v("prefill_attention_backend") or ""),
                        prefill_as_base=bool(v("prefill_as_base")), kv_sort=bool(v("kv_sort")),
                        allreduce_fusion=bool(v("allreduce_fusion"))).lstrip(" ,")


def line_label(r, draft_tokens: bool = False) -> str:
    """A point's line within its setup: the backend, and its draft where that is not the usual one
    (the rest of label_of's words); with `draft_tokens`, those too."""
    v = lambda k: _value(r, k)  # noqa: E731
    return config_label(v("backend"), draft_backend=_draft_key(r), eagle_topk=v("eagle_topk"),
                        draft_head=draft_head_of(v("spec"), v("draft_head")),
                        dflash_host_plan=str(v("dflash_host_plan") or "off"),
                        draft_tokens=v("draft_tokens") if draft_tokens else None)


def setup_table(points) -> pd.DataFrame:
    """The setups that decode points hold, a row each: lines (a line a speculation mode, as the
    chart draws them), backends, points, layers and the newest date. The first row is the
    default setup (pick_setup): the most lines, then the most layers (the least host-bound
    steps), then the newest."""
    _need(points, ["setup", "line", "spec", "backend", "layers", "date"], "points")
    t = (points.assign(line_spec=points["line"] + " / " + points["spec"])
               .groupby("setup").agg(lines=("line_spec", "nunique"), backends=("backend", "nunique"),
                                     points=("line", "size"), layers=("layers", "max"), newest=("date", "max"))
               .reset_index())
    t["newest"] = t["newest"].astype(str).str[:10]
    return t.sort_values(["lines", "layers", "newest", "setup"], ascending=[False, False, False, True],
                         kind="stable").reset_index(drop=True)


def pick_setup(points, setup: str = "") -> str:
    """`setup` where the points hold it; "" picks setup_table's first row."""
    names = list(setup_table(points)["setup"])
    if setup and setup not in names:
        raise ValueError(f"setup: {setup!r} is not a setup of these points; one of {names}")
    return setup or names[0]


def _pairing(m) -> pd.Series:
    """How a pair_points row was paired, in words: "same run" (one invocation: one machine, one
    session), "same commit" (the same code; nothing says the same machine or session), else
    "separate runs"."""
    return pd.Series(np.where(m["same_run"], "same run", np.where(m["same_commit"], "same commit", "separate runs")),
                     index=m.index)


def pair_points(mine, base, keys, value: str = "tok_s", also=()):
    """Each point of `mine` with the point of `base` that has equal `keys`: from the same run
    (one decode_bench invocation) where both were measured in one, else from the same commit,
    the newest such pair; else the newest of each, from separate runs; else none (base columns
    NaN). `same_run` and `same_commit` say which (records before the invocation key pair on
    their commit at best). Runs differ in code and in load (another job on the machine), so a
    pair within one run is the fair one. `also`: more base columns to carry, as base_<name>."""
    cols = [value, *also]
    b = _with_invocation(base)[keys + cols + ["commit", INVOCATION_KEY, "date"]]
    b = b.rename(columns={c: f"base_{c}" for c in cols + ["commit", INVOCATION_KEY, "date"]})
    m = _with_invocation(mine).merge(b, on=keys, how="left")
    m["same_commit"] = (m["commit"] == m["base_commit"]) & (m["commit"] != "?")
    m["same_run"] = _one_invocation(m[INVOCATION_KEY], m[f"base_{INVOCATION_KEY}"])
    m = m.sort_values(["same_run", "same_commit", "date", "base_date"], na_position="first")
    return m.groupby(POINT_KEYS, dropna=False).tail(1).reset_index(drop=True)


def same_commit_ratios(mine, base, keys, value: str = "tok_s") -> pd.DataFrame:
    """Every pair that one commit measured, not only the newest: per point of `mine`
    (POINT_KEYS), how many commits paired it with a `base` point of equal `keys` (`same_commits`;
    of them `same_runs` within one invocation, each commit's pair within a run where it has one)
    and the lowest and highest ratio of `value` among them (`ratio_min`, `ratio_max`), so that a
    verdict shows whether it held in each."""
    b = _with_invocation(base)[keys + [value, "commit", INVOCATION_KEY]]
    b = b.rename(columns={value: f"base_{value}", INVOCATION_KEY: f"base_{INVOCATION_KEY}"})
    m = _with_invocation(mine[mine["commit"] != "?"]).merge(b, on=keys + ["commit"])
    m["same_run"] = _one_invocation(m[INVOCATION_KEY], m[f"base_{INVOCATION_KEY}"])
    m["pair_ratio"] = m[value] / m[f"base_{value}"]
    m = m.sort_values(["same_run", "date"]).groupby(POINT_KEYS + ["commit"], dropna=False).tail(1)   # a pair per commit
    return (m.groupby(POINT_KEYS, dropna=False)
             .agg(same_commits=("pair_ratio", "size"), same_runs=("same_run", "sum"), ratio_min=("pair_ratio", "min"),
                  ratio_max=("pair_ratio", "max")).reset_index())


def _with_invocation(points):
    """points with the invocation column ("" for records from before the key)."""
    return points if INVOCATION_KEY in points else points.assign(**{INVOCATION_KEY: ""})


def _one_invocation(a, b):
    """Whether paired rows come from one decode_bench call: one machine, one session ("" is none)."""
    return (a == b) & (a != "")


def _need_runs(points, name="points"):
    _need(points, POINT_KEYS + ["tok_s"], name)
    points = points if {"commit", "date"} <= set(points) else points.assign(commit="?", date="")
    return _with_invocation(points)


def _with_base_draft(points, baseline: str):
    """points with `base_draft`, the draft key that pairs them with `baseline`'s points: "" where
    the draft runs on its own backend's usual attention backend or on the baseline's usual one (a
    draft kept on Triton is triton's own), else that backend. draft_backend is relative to each
    backend's usual, so sm120_mla's EAGLE draft on triton ("triton") and triton's own ("") would
    never pair on it, though both drafts ran on Triton."""
    def key(r):
        named = r.draft_backend if isinstance(r.draft_backend, str) else ""
        if r.spec not in DRAFT_MODEL_SPECS or not named:
            return ""
        prefill = r.prefill_attention_backend if isinstance(r.prefill_attention_backend, str) else ""
        usual = usual_draft_backend(r.spec, baseline, prefill or None, draft_head_of(r.spec, r.draft_head) == "llama")
        return "" if named == usual else named

    return points.assign(base_draft=[key(r) for r in points.itertuples()])


def _baseline_keys() -> list[str]:
    """What a point and the baseline's must share: every point key but the backend, and the draft
    as _with_base_draft keys it."""
    return [k for k in POINT_KEYS if k not in ("backend", "draft_backend")] + ["base_draft"]


def speedup_over(points, baseline: str = "triton"):
    """tok/s of each backend divided by the baseline backend's at the same point (a draft on the
    same attention backend, or each on its usual: _with_base_draft), paired within one run where
    the points (decode_points(..., every_run=True)) hold one (pair_points; `pairing` says how).
    `step_speedup` is the baseline's verify step time over the point's: it does not depend on
    acceptance, which can differ between the sides (NGRAM's drafts follow the greedy tokens, which
    another prompt or numerical noise changes), so speedup / step_speedup is the ratio of tokens a step."""
    points = _with_base_draft(_need_runs(points), baseline)
    base = points[points["backend"] == baseline]
    if len(base) == 0:
        raise ValueError(f"points: no rows of the baseline backend {baseline!r}")
    m = pair_points(points, base, _baseline_keys(), also=("verify_step_ms",))
    m = m[m["base_tok_s"].notna()].copy()
    m["speedup"] = m["tok_s"] / m["base_tok_s"]
    m["step_speedup"] = m["base_verify_step_ms"] / m["verify_step_ms"]
    m["pairing"] = _pairing(m)
    return m.sort_values(["backend", "spec", "ctx", "layers", "config"]).reset_index(drop=True)


def speedup_table(sp):
    """Speedups as a table, the step-time ratio beside (speedup_over), with the commit of each
    side: points of different commits come from separate server runs (e.g. a newer kernel
    against an older baseline run)."""
    cols = [c for c in ("config", "spec", "ctx_label", "tok_s", "base_tok_s", "speedup", "step_speedup", "commit",
                        "base_commit") if c in sp]
    t = sp[cols].copy()
    return t.round({"tok_s": 1, "base_tok_s": 1, "speedup": 2, "step_speedup": 2}).reset_index(drop=True)


# The live-service issue's targets at TP1 with speculation on: sm120_mla over triton.
SPEEDUP_TARGETS = {4096: 3.0, 16384: 4.3, 65536: 6.1}
TARGET_COLUMNS = ["target", "config", "measured", "ratio", "met", "commits", "pairing", "runs"]
# what each target is, as data, beside its printed name: the speculation mode, the context and
# what it is held against ("triton", "plain decode")
TARGET_KEYS = ["spec", "ctx", "against"]


def _target_row(target, key: dict, r, need, mine: str, base: str):
    """One target's row from a pair_points row: measured, or "not measured" naming the side
    that is missing (met None, never False), and the baseline's draft where it must be another
    than its usual (_with_base_draft)."""
    draft = getattr(r, "base_draft", "")
    base = f"{base} point with a {draft} draft" if isinstance(draft, str) and draft else f"{base} point"
    missing = f"{mine} point" if pd.isna(r.tok_s) else base if pd.isna(r.base_tok_s) else None
    if missing:
        return {"target": target, "config": r.config, "measured": "not measured", "ratio": float("nan"),
                "met": None, "commits": "", "pairing": f"no {missing}", "runs": "", **key}
    ratio = r.tok_s / r.base_tok_s
    n = 0 if pd.isna(r.same_commits) else int(r.same_commits)
    # the verdict is the newest pair's; `runs` says whether the pairs of older commits agree
    kind = "same-run" if n and r.same_runs == n else "same-commit"
    runs = (f"{n} {kind} pairs, {r.ratio_min:.2f}-{r.ratio_max:.2f}x: "
            + ("met in each" if r.ratio_min >= need else "missed in each" if r.ratio_max < need else "mixed")
            if n > 1 else f"{n} {kind} pair" + ("s" if n != 1 else ""))
    return {"target": target, "config": r.config, "measured": f"{r.tok_s:.0f} vs {r.base_tok_s:.0f} tok/s",
            "ratio": round(ratio, 2), "met": bool(ratio >= need), "commits": f"{r.commit} / {r.base_commit}",
            "pairing": "same run" if r.same_run else "same commit" if r.same_commit else "separate runs",
            "runs": runs, **key}


def service_targets(points, ours: str = "sm120_mla", baseline: str = "triton", tp: int = 1) -> pd.DataFrame:
    """The service targets, measured at `tp` GPUs per server (the issue's are at TP1), one row
    per configuration of `ours` that ran the speculation mode: `ours` over `baseline` at each
    target context, and `ours` with speculation against `ours` without it at each context it
    ran. Pairs match on every point key (the draft against `baseline` as speedup_over matches
    it) and come from one run (invocation) where the points (pass decode_points(...,
    every_run=True)) hold one, else one commit; `pairing` says which, or "separate runs". A
    side not measured reads "not measured" (met None), never "missed", and names that side.
    Columns: TARGET_COLUMNS to read, TARGET_KEYS to select by."""
    pts = _with_base_draft(select_tp(_need_runs(points), tp), baseline)
    mine_all, base = pts[pts["backend"] == ours], pts[pts["backend"] == baseline]
    config_keys = [k for k in POINT_KEYS if k not in ("backend", "ctx")]
    rows = []
    for spec in [s for s in pts["spec"].unique() if s != "none"]:
        mine = mine_all[mine_all["spec"] == spec]
        configs = mine.drop_duplicates(config_keys).sort_values(["layers", "config"])[config_keys + ["config"]]
        keys = _baseline_keys()
        pairs = (pair_points(mine, base, keys).drop(columns="config")
                 .merge(same_commit_ratios(mine, base, keys), on=POINT_KEYS, how="left"))
        for ctx, need in SPEEDUP_TARGETS.items():
            target = f"{spec} {ctx_label(ctx)}: {ours} >= {need:g}x {baseline}"
            key = {"spec": spec, "ctx": ctx, "against": baseline}
            at = configs.merge(pairs[pairs["ctx"] == ctx], on=config_keys, how="left")
            rows += [_target_row(target, key, r, need, ours, baseline) for r in at.itertuples()] or [
                {"target": target, "config": "", "measured": "not measured", "ratio": float("nan"), "met": None,
                 "commits": "", "pairing": f"no {ours} point", "runs": "", **key}]
        # speculation against plain decode: the same point but for spec and its draft tokens
        plain = mine_all[mine_all["spec"] == "none"]
        plain_keys = [k for k in POINT_KEYS
                      if k not in ("spec", "draft_tokens", "draft_backend", "eagle_topk", "draft_head")]
        vs_plain = (pair_points(mine, plain, plain_keys)
                    .merge(same_commit_ratios(mine, plain, plain_keys), on=POINT_KEYS, how="left"))
        for r in vs_plain.sort_values(["layers", "config", "ctx"]).itertuples():
            rows.append(_target_row(f"{spec} {ctx_label(r.ctx)}: {ours} speculation >= plain decode",
                                    {"spec": spec, "ctx": int(r.ctx), "against": "plain decode"},
                                    r._replace(base_draft=""), 1.0, ours, "plain-decode"))
    out = pd.DataFrame(rows, columns=TARGET_COLUMNS + TARGET_KEYS)
    out["met"] = out["met"].astype(object)
    return out


GAP_COLUMNS = ["config", "missing", "open targets"]


def target_gaps(targets: pd.DataFrame) -> pd.DataFrame:
    """The "not measured" rows of a service_targets table folded into one row per configuration
    and missing side, naming the targets left open by speculation mode and context ("dflash
    4k/16k/64k vs triton"), so that the verdicts can be read apart from what no run measured."""
    gaps = targets[targets["met"].isna()]
    rows = []
    # a configuration's lines together, in the order the targets table first names it
    first_seen = {c: i for i, c in reversed(list(enumerate(targets["config"])))}
    gaps = gaps.sort_values("config", key=lambda c: c.map(first_seen), kind="stable")
    for (config, pairing), g in gaps.groupby(["config", "pairing"], sort=False):
        open_by_claim: dict[tuple[str, str], list[str]] = {}
        for r in g.itertuples():
            open_by_claim.setdefault((r.spec, r.against), []).append(ctx_label(r.ctx))
        rows.append({"config": config or "(no configuration of ours)",
                     "missing": pairing.removeprefix("no "),
                     "open targets": "; ".join(f"{spec} {'/'.join(ctxs)} vs {against}"
                                               for (spec, against), ctxs in open_by_claim.items())})
    return pd.DataFrame(rows, columns=GAP_COLUMNS)


def ngram_fix_gain(points, backend: str = "sm120_mla", spec: str = "ngram", layers: int = 4,
                   tp: int = 1) -> pd.DataFrame:
    """What SGLang's NGRAM draft prep fixed (ngram_tail) gains, from two adjacent runs of one
    configuration otherwise: the newest run without the fix and the run with it nearest in time
    (the least else changed: kernel, load). `points` from decode_points(..., every_run=True);
    one row per context both runs measured, empty where either run is missing."""
    d = select_tp(_need_runs(points), tp)
    # the usual run otherwise: expert recorder on, no expert parallelism, CUDA graphs, one backend
    d = d[(d["backend"] == backend) & (d["spec"] == spec) & (d["layers"] == layers) & d["expert_record"]
          & (d["ep_size"] == 1) & d["cuda_graph"] & (d["prefill_attention_backend"] == "")]
    cols = ["ctx_label", "unpatched_tok_s", "ngram_tail_tok_s", "gain", "commits"]
    off, on = d[~d["ngram_tail"]], d[d["ngram_tail"]]
    if len(off) == 0 or len(on) == 0:
        return pd.DataFrame(columns=cols)

    def run_times(x):   # each run's (commit's) last record
        return pd.to_datetime(x.groupby("commit")["date"].max(), utc=True)

    off_times = run_times(off).sort_values()
    c_off = off_times.index[-1]
    c_on = (run_times(on) - off_times.iloc[-1]).abs().idxmin()
    same = [k for k in POINT_KEYS if k != "ngram_tail"]   # one configuration but for the fix
    m = off[off["commit"] == c_off].merge(on[on["commit"] == c_on], on=same, suffixes=("_off", "_on"))
    m = m.sort_values(["date_off", "date_on"]).drop_duplicates(same, keep="last")   # a commit's newest run
    return pd.DataFrame({"ctx_label": m["ctx"].map(ctx_label), "unpatched_tok_s": m["tok_s_off"].round(1),
                         "ngram_tail_tok_s": m["tok_s_on"].round(1),
                         "gain": (m["tok_s_on"] / m["tok_s_off"]).round(2),
                         "commits": f"{c_off} -> {c_on}"}, columns=cols)


def _pairs_in_one_commit(points, key: str, first, second, suffixes) -> pd.DataFrame:
    """Points of one configuration and one commit that differ only in `key`: the points where
    `first(points)` holds merged with those where `second(points)` holds, columns suffixed by
    `suffixes`. Records without a commit ("?") are never paired: nothing says they ran the same code."""
    d = _need_runs(points)
    d = d[d["commit"] != "?"]
    same = [k for k in POINT_KEYS if k != key] + ["commit"]
    m = d[first(d)].merge(d[second(d)], on=same, suffixes=suffixes)
    # a commit's several runs (invocations) of a side: a pair within one invocation first (one
    # machine, one session), then the newest
    m = m.assign(_one_run=_one_invocation(*(m[f"{INVOCATION_KEY}{s}"] for s in suffixes)))
    return (m.sort_values(["_one_run", f"date{suffixes[0]}", f"date{suffixes[1]}"])
             .drop_duplicates(same, keep="last").drop(columns="_one_run"))


# dflash_host_plan values of the timing probe: session 39 recorded it as "on"
HOST_PLAN_PROBE = ("probe", "on")


HOST_PLAN_PROBE_RECORDS = "probes/dflash_host_plan_decode.jsonl"   # under data/results


def host_plan_probe(model: str, gpu: str, path=None) -> pd.DataFrame:
    """The host-plan timing probe's decode records (HOST_PLAN_PROBE_RECORDS: kept apart from
    service_decode.jsonl, since the probe's draft attention is wrong and its tok/s only times
    the step) of `model` on a GPU whose name contains `gpu`, to set beside the usual records
    in host_plan_cost."""
    from .results import load_records, on_gpu, results_dir

    probe = load_records("service_decode", path=path or results_dir() / HOST_PLAN_PROBE_RECORDS)
    return probe[on_gpu(probe, gpu) & (probe["model"] == model)] if len(probe) else probe


def host_plan_cost(points) -> pd.DataFrame:
    """What the DFlash draft's host round-trips cost a step: each point of the host-plan timing probe
    (patches/dflash_host_plan.py) beside the point of the same configuration and commit as SGLang
    plans it. `points` from decode_points(..., every_run=True) over the usual records and the
    probe's (data/results/probes/); one row per pair, empty where none (records without a commit
    are never paired, as in recorder_cost)."""
    cols = ["ctx_label", "sglang_plan_ms", "probe_ms", "saved_ms", "saved", "commit"]
    m = _pairs_in_one_commit(points, "dflash_host_plan", lambda d: d["dflash_host_plan"] == "off",
                             lambda d: d["dflash_host_plan"].isin(HOST_PLAN_PROBE), ("_off", "_probe")).sort_values("ctx")
    if not len(m):
        return pd.DataFrame(columns=cols)
    saved = m["verify_step_ms_off"] - m["verify_step_ms_probe"]
    return pd.DataFrame({"ctx_label": m["ctx"].map(ctx_label), "sglang_plan_ms": m["verify_step_ms_off"].round(2),
                         "probe_ms": m["verify_step_ms_probe"].round(2), "saved_ms": saved.round(2),
                         "saved": (saved / m["verify_step_ms_off"]).map(lambda x: f"{x:.0%}"),
                         "commit": m["commit"]}, columns=cols).reset_index(drop=True)


def recorder_cost(points) -> pd.DataFrame:
    """What SGLang's expert distribution recorder costs a decode step: every point measured with
    the recorder on and with it off at one commit (the same code; two servers, one after the
    other), side by side. `points` from decode_points(..., every_run=True) (no rows: ValueError,
    as for its siblings); the frame is empty where no configuration was run both ways. Records
    without a commit ("?") are never paired: nothing says they ran the same code.
    `recorder_off_gain` is tok/s off over on."""
    cols = ["config", "spec", "ctx_label", "on_tok_s", "off_tok_s", "recorder_off_gain", "on_step_ms",
            "off_step_ms", "commit"]
    m = _pairs_in_one_commit(points, "expert_record", lambda d: d["expert_record"], lambda d: ~d["expert_record"],
                             ("_on", "_off"))
    if len(m) == 0:
        return pd.DataFrame(columns=cols)
    m = m.sort_values(["layers", "backend", "spec", "ctx", "commit"]).assign(expert_record=True)
    return pd.DataFrame({"config": [label_of(r, layers=True, draft_tokens=n)
                                    for r, n in zip(m.itertuples(), draft_tokens_differ(m))],
                         "spec": m["spec"], "ctx_label": m["ctx"].map(ctx_label),
                         "on_tok_s": m["tok_s_on"].round(1), "off_tok_s": m["tok_s_off"].round(1),
                         "recorder_off_gain": (m["tok_s_off"] / m["tok_s_on"]).round(2),
                         "on_step_ms": m["verify_step_ms_on"].round(2), "off_step_ms": m["verify_step_ms_off"].round(2),
                         "commit": m["commit"]}, columns=cols).reset_index(drop=True)


def startup_summary(records) -> str:
    """How long the recorded servers took to start: one start per server (run_id)."""
    _need(records, ["run_id", "startup_s"], "records")
    s = records.groupby("run_id")["startup_s"].first().dropna()
    if len(s) == 0:
        return "no recorded start-up times"
    return f"{len(s)} server starts: {s.min():.0f}-{s.max():.0f} s (median {s.median():.0f} s)"


def decode_table(points):
    """The compact table a notebook prints (rounded, deterministic order)."""
    cols = ["config", "spec", "ctx_label", "tok_s", "accept_len", "verify_step_ms", "requests", "n_runs", "commit",
            "other_run"]
    t = points[[c for c in cols if c in points]].copy()
    return t.round({"tok_s": 1, "accept_len": 2, "verify_step_ms": 2})


def prefill_label(backend: str, prefill_backend: str = "", as_base: bool = False) -> str:
    """Which kernels a prompt's prefill runs on a server of `backend`: its own, or with SGLang's
    hybrid backend (--prefill-attention-backend) another's, `as_base` where the hybrid was spelt
    with it as --attention-backend. sm120_mla prefills on its parent, SGLang's Triton backend."""
    own = {"sm120_mla": "triton"}.get(backend, backend)
    if prefill_backend:
        return f"{backend} (prefill: {prefill_backend}{' as base' if as_base else ''})"
    return f"{backend} (prefill: {own})" if own != backend else backend


def first_token_points(points):
    """Time to the first token against context, one row per server backend with its prefill
    backend, layer count and context: decode_points' ttft_s, the fastest request that repeated
    a length on its server (repeat >= 1). A server's first request at a new length can wait
    seconds on the host with the GPU idle while kernels are built (16-33 s on the H200 at the
    first prompt beyond one chunk, FlashInfer prefilling), so a first request may not show the
    prefill's time; a repeat does. Points without a repeat are left out.
    Configurations that do not change a prefill (no speculation or NGRAM, the expert recorder,
    the NGRAM fix) are pooled: the newest point with a repeat stands. Pass every run's points
    (decode_points(..., every_run=True)): with each point's newest run alone, a newer run without
    a repeat would hide an older one's. DFlash's draft model, EAGLE's MTP layer and an EAGLE3 head
    prefill the prompt too, so their points stay apart (", DFlash draft", ", MTP draft",
    ", EAGLE3 draft", ", Llama EAGLE3 draft": an MHA head prefills other work than an MLA one),
    and a draft on a backend other than its usual one is named (", MTP draft on triton")."""
    _need(points, ["backend", "spec", "ctx", "layers", "date", "prefill_attention_backend", "prefill_as_base"], "points")
    if "ttft_s" not in points:
        raise ValueError("points: missing column ttft_s (records without a time to first token or a repeat index)")
    d = points[points["ttft_s"].notna()].copy()
    drafts = {"dflash": ", DFlash draft", "eagle": ", MTP draft", "eagle3": ", EAGLE3 draft"}
    heads = d["draft_head"] if "draft_head" in d else [None] * len(d)
    named = d["draft_backend"] if "draft_backend" in d else [""] * len(d)
    d["prefill"] = [prefill_label(b, p if isinstance(p, str) else "", bool(a))
                    + (", Llama EAGLE3 draft" if draft_head_of(s, h) == "llama" else drafts.get(s, ""))
                    + (f" on {n}" if isinstance(n, str) and n and s in drafts else "")
                    for b, p, a, s, h, n in zip(d["backend"], d["prefill_attention_backend"], d["prefill_as_base"],
                                                d["spec"], heads, named)]
    keys = ["gpu", "model", "tp", "ep_size", "weights", "layers", "prefill", "ctx"]
    d = d.sort_values("date").groupby(keys, dropna=False).tail(1)
    cols = keys + ["backend", "prefill_attention_backend", "ctx_label", "ttft_s", "requests", "n_runs", "spec", "commit",
                   "date"]
    return d[cols].sort_values(["layers", "prefill", "ctx"]).reset_index(drop=True)


def first_token_table(tt):
    """first_token_points as a table: seconds to the first token, a row per layer count and
    prefill, a column per context."""
    _need(tt, ["layers", "prefill", "ctx", "ctx_label", "ttft_s"], "first-token points")
    for k in ("gpu", "model", "tp", "ep_size", "weights"):
        if k in tt and tt[k].nunique(dropna=False) > 1:
            raise ValueError(f"first-token points: more than one {k} ({sorted(map(str, tt[k].unique()))}); "
                             "select one first")
    t = tt.pivot(index=["layers", "prefill"], columns="ctx", values="ttft_s")
    t.columns = [ctx_label(c) for c in t.columns]
    return t.round(2).reset_index()


def context_x(df):
    """The x encoding of a chart against context: log2 scale, a tick at each measured context,
    labelled in k."""
    import altair as alt

    ticks = sorted(df["ctx"].unique().tolist())
    return alt.X("ctx:Q", title="context (tokens)", scale=alt.Scale(type="log", base=2),
                 axis=alt.Axis(values=ticks, labelExpr="datum.value >= 1024 ? datum.value / 1024 + 'k' : datum.value"))


def first_token_chart(tt, title: str = "", source: str = ""):
    """Seconds to the first token against context (log-log), a line per server backend and
    prefill, a panel per layer count."""
    import altair as alt

    _need(tt, ["layers", "prefill", "ctx", "ctx_label", "ttft_s"], "first-token points")
    base = alt.Chart(tt).encode(
        x=context_x(tt),
        y=alt.Y("ttft_s:Q", title="time to first token (s, log)", scale=alt.Scale(type="log")),
        color=series_colors(tt["prefill"], "server (prefill kernels)"),
        tooltip=["prefill", "layers", "ctx_label", alt.Tooltip("ttft_s:Q", format=".2f"), "requests", "commit"])
    return ((base.mark_line() + base.mark_point(filled=True))
            .properties(width=240, height=200)
            .facet(column=alt.Column("layers:O", title="decoder layers"))
            .properties(title=chart_title(title or "Time to the first token against context length", source)))


def _spec_order(d) -> list[str]:
    present = set(d["spec_title"])
    return [t for t in SPEC_TITLES.values() if t in present] + sorted(present - set(SPEC_TITLES.values()))


def series_colors(values, title: str):
    """A color encoding for a chart's lines from a palette with a color for each: tableau10 up to
    10 lines, else tableau20 (past 20, colors repeat)."""
    import altair as alt

    n = values.nunique()
    return alt.Color(f"{values.name}:N", title=title, scale=alt.Scale(scheme="tableau10" if n <= 10 else "tableau20"),
                     legend=alt.Legend(labelLimit=360))


def decode_speed_chart(points, title: str = "", source: str = "", setup: str | None = None):
    """Decode tok/s against context (log-log), a line per configuration, a panel per spec mode;
    `source` (source_label) says whether it shows recorded or live numbers. With `setup` (a value
    of setup_table, or "" for its default), that setup's points alone, a line per backend and draft,
    the setup named in the title. The tooltip names each point's commit, and whether it comes from
    another run than the rest of its line (decode_points' other_run)."""
    import altair as alt

    _need(points, ["config", "spec_title", "ctx", "tok_s", "ctx_label"], "points")
    field, legend = "config", "attention backend"
    if setup is not None:
        setup = pick_setup(points, setup)
        points, field, legend = points[points["setup"] == setup], "line", "attention backend (draft)"
        title = title or f"Decode speed against context length: {setup}"
    elif points["config"].nunique() > 20:
        raise ValueError(f"points: {points['config'].nunique()} configurations, more lines than a chart has "
                         "colors; pass setup (\"\" for the default) to chart one setup")
    base = alt.Chart(points).encode(
        x=context_x(points),
        y=alt.Y("tok_s:Q", title="decode tok/s (batch 1)", scale=alt.Scale(type="log")),
        color=series_colors(points[field], legend),
        tooltip=[field, "spec", "ctx_label", alt.Tooltip("tok_s:Q", format=".1f"),
                 alt.Tooltip("accept_len:Q", format=".2f"), alt.Tooltip("verify_step_ms:Q", format=".2f")]
        + [c for c in ("commit", "other_run") if c in points])
    return ((base.mark_line() + base.mark_point(filled=True))
            .properties(width=260, height=220)
            .facet(column=alt.Column("spec_title:N", title=None, sort=_spec_order(points)))
            .properties(title=chart_title(title or "Decode speed against context length", source)))


def decode_speed_explorer(points, setup: str = "", live: bool = False):
    """An ipywidgets UI: a dropdown of the points' setups (setup_table's order, starting at
    `setup`, "" for the default) and the decode-speed chart of the one chosen."""
    import ipywidgets as w
    from IPython.display import display

    names = list(setup_table(points)["setup"])
    pick = w.Dropdown(options=names, value=pick_setup(points, setup), description="setup",
                      layout=w.Layout(width="640px"))
    out = w.Output()

    def update(_=None):
        chosen = points[points["setup"] == pick.value]
        out.clear_output(wait=True)
        with out:
            display(decode_speed_chart(points, setup=pick.value, source=source_label(chosen, live)))

    pick.observe(update, names="value")
    update()
    return w.VBox([pick, out])


def speedup_chart(speedups, baseline: str = "triton", title: str = "", source: str = ""):
    """Speedup over the baseline backend against context, one panel per spec mode."""
    import altair as alt

    _need(speedups, ["config", "backend", "spec_title", "ctx", "speedup"], "speedups")
    d = speedups[speedups["backend"] != baseline]
    if len(d) == 0:
        raise ValueError(f"speedups: only the baseline backend {baseline!r} was measured")
    base = alt.Chart(d).encode(
        x=context_x(d),
        y=alt.Y("speedup:Q", title=f"tok/s ÷ {baseline} tok/s (log)", scale=alt.Scale(type="log")),
        color=alt.Color("config:N", title="attention backend", scale=alt.Scale(scheme="tableau20"),
                        legend=alt.Legend(labelLimit=360)),
        tooltip=["config", "spec", "ctx_label", alt.Tooltip("speedup:Q", format=".2f")]
        + [alt.Tooltip("step_speedup:Q", format=".2f")] * ("step_speedup" in d)
        + [c for c in ("commit", "base_commit", "pairing") if c in d])
    rule = alt.Chart().mark_rule(color="gray", strokeDash=[4, 3]).encode(y=alt.datum(1.0))
    return (alt.layer(base.mark_line() + base.mark_point(filled=True), rule, data=d)
            .properties(width=260, height=200)
            .facet(column=alt.Column("spec_title:N", title=None, sort=_spec_order(d)))
            .properties(title=chart_title(title or f"Speedup over the {baseline} backend", source)))


def nvml_samples(records):
    """Tidy (t, gpu, metric, value, backend, spec, ctx, run_id, repeat) from NVML records (arrays
    per row). Each repeat of a point has its own clock from 0: select one (pick_point does)."""
    import pandas as pd

    _need(records, ["nvml_gpu", "metric", "t", "value"], "records")
    rows = []
    for r in records.itertuples(index=False):
        r = r._asdict()
        for t, v in zip(r["t"], r["value"]):
            rows.append((t, r["nvml_gpu"], r["metric"], v, r.get("backend"), r.get("spec"),
                         r.get("ctx"), r.get("run_id"), r.get("repeat")))
    return pd.DataFrame(rows, columns=["t", "gpu", "metric", "value", "backend", "spec", "ctx", "run_id", "repeat"])


def pick_point(df, backend: str | None = None, spec: str | None = None, ctx: int | None = None,
               most_gpus: bool = False, log: Callable[[str], None] | None = print) -> dict:
    """The (backend, spec, ctx, run_id, and repeat where records have one) to show in
    single-point charts: the longest context of the given backend and spec (each where recorded,
    else any, said through `log`), latest run, its last repeat (repeats of a request each sample
    from t = 0: pooled, they would draw one zig-zag line); with `most_gpus`, among the runs of
    the largest recorded tp (per-GPU charts show most with most GPUs)."""
    _need(df, ["backend", "spec", "ctx", "run_id"])
    d = df
    if most_gpus and "tp" in d.columns:
        tp = d["tp"].map(tp_of)
        if tp.notna().any():
            d = d[tp == tp.max()]
    for key, want in (("backend", backend), ("spec", spec), ("ctx", ctx)):
        if want is None:
            continue
        if (d[key] == want).any():
            d = d[d[key] == want]
        elif log is not None:
            among = f" of the TP{tp_of(d['tp'].iloc[0])} runs" if most_gpus and "tp" in d.columns else ""
            log(f"no records of {key} {want!r}{among}; any {key} shown instead")
    repeats = "repeat" in d.columns and bool(d["repeat"].notna().any())
    d = d.sort_values(["ctx", "run_id"] + (["repeat"] if repeats else []))
    last = d.iloc[-1]
    point = {"backend": last["backend"], "spec": last["spec"], "ctx": int(last["ctx"]), "run_id": last["run_id"]}
    return {**point, "repeat": int(last["repeat"])} if repeats and pd.notna(last["repeat"]) else point


def select_point(df, point: dict):
    m = np.ones(len(df), dtype=bool)
    for k, v in point.items():
        if k in df.columns:
            m &= (df[k] == v).to_numpy()
    return df[m]


def load_service_results(model: str | None = None, gpu: str | None = None) -> dict:
    """Recorded live-service results from data/results/ as DataFrames, filtered to `model` and
    to the GPUs whose name contains `gpu` (an H200 point and an RTX PRO 6000 one share a
    configuration label, so one view is one GPU's).

    Keys: decode, nvml, expert, failures, profiles (empty frames where nothing is recorded).
    """
    from .decode_bench import DECODE_RESULTS, EXPERT_RESULTS, FAILURE_RESULTS, NVML_RESULTS, PROFILE_RESULTS
    from .results import load_records, on_gpu

    out = {}
    for key, name in (("decode", DECODE_RESULTS), ("nvml", NVML_RESULTS), ("expert", EXPERT_RESULTS),
                      ("failures", FAILURE_RESULTS), ("profiles", PROFILE_RESULTS)):
        df = load_records(name)
        if model is not None and len(df) and "model" in df.columns:
            df = df[df["model"] == model].reset_index(drop=True)
        if gpu is not None:
            df = df[on_gpu(df, gpu)].reset_index(drop=True)
        out[key] = df
    return out


def live_results(result) -> dict:
    """The same dict of DataFrames from a live run_matrix result."""
    import pandas as pd

    return {"decode": pd.DataFrame(result.decode), "nvml": pd.DataFrame(result.nvml),
            "expert": pd.DataFrame(result.expert), "failures": pd.DataFrame(result.failures),
            "profiles": pd.DataFrame(result.profiles)}


# A Python exception's own line ("torch.OutOfMemoryError: ...", "RuntimeError: ..."), which
# SGLang's crash diagnostics (py-spy, coredump notes) follow with lines that also say "error".
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b:")


def failure_cause(log_tail) -> str:
    """The line of a server's log tail that names why it failed: the last raised exception,
    else the last line that names an error (a CUDA fault), else the last line; "" without a tail."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()] if isinstance(log_tail, str) else []
    raised = [ln for ln in lines if _RAISED.match(ln)]
    named = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (raised or named or lines or [""])[-1][:120]


def failures_table(failures):
    """Recorded configurations that did not run: backend, spec, status, the client's error and,
    where the server's log was kept, the line of it that names the cause."""
    cols = [c for c in ("backend", "spec", "layers", "status", "error") if c in failures.columns]
    t = failures[cols].copy()
    if "error" in t:   # the first line: the log path and tail follow in the record
        t["error"] = (t["error"].astype(str).str.split("\n").str[0]
                      .str.replace(r" \(log: .*\)$", "", regex=True)
                      .str.replace(r"; log \S+ ends:$", "", regex=True))
    t["cause in the server log"] = [failure_cause(x) for x in failures.get("log_tail", [None] * len(failures))]
    return t
