"""compute-sanitizer on the kernel: one small case that wraps the cp.async ring, any build.

    python -m sm120_workbook.kernels.sanitize [--tools racecheck ...] [--builds default group_barriers]
        [--out data/results/kernel_sanitizer.jsonl]

The case (2 requests of 129 and 40 keys, 5 heads, 7 tree-masked drafts) runs with 16-key
tiles on 1 and 3 splits (one split: 9 tiles wrap the 4-stage ring) and with 32-key tiles, and
in the 64-row wide kernel on 1 and 3 splits (35 rows: it also skips its empty m16 tiles); 8
splits of the 32-row kernel run the combine step that loads its partials beside the LSE pass
(COMBINE_PRELOAD, 4 split groups). Broken index values run too: 130 requests (v19's pool
rule) with a decreasing kv_indptr and a decreasing qo_indptr, and 3 requests whose tokens
overlap, in both kernels (the `unbalanced` build runs them unpooled), requests that run past
q's T rows, with q and k_extend allocations of their own (v30: those rows are not read), and a
request whose kv_indptr or mask_indptr range passes kv_indices or the mask, each one entry short
in an allocation of its own, or whose kv_indptr ends at INT_MIN (v31: not read either).
Each build is compiled first, outside the sanitizer (nvcc under it would take minutes).
`group_barriers` (mla_verify.cuh: GROUP_BARRIERS=1) is v14's schedule, where each warp group
waits on its own 128-thread named barrier inside a tile. racecheck reports its P hand-over,
and is clean on the shipped build, whose groups meet only in barrier-0 rounds: the records of
both say which schedule the tool accepts. `pv_lag` (PV_LAG=1) multiplies each tile half a
round later, beside the next tile's softmax; `split_loads` (SPLIT_LOADS=1) has the score warps
issue part of each refill.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

from ..results import add_record_args
from .build import build_command

TOOLS = ("memcheck", "racecheck", "synccheck")
BUILDS = {"default": (), "group_barriers": ("GROUP_BARRIERS=1",), "pv_lag": ("PV_LAG=1",),
          "split_loads": ("SPLIT_LOADS=1",), "wide_fused": ("WIDE_FUSED=1",), "q_cp_async": ("WIDE_Q_LDG=0",),
          "min_keys64": ("MIN_KEYS_PER_SPLIT=64",),
          "unstaged_prologue": ("STAGED_PROLOGUE=0",),
          "early_stages1": ("PROLOGUE_EARLY_STAGES=1",),
          "two_mtiles": ("DECODE_ONE_MTILE=0",), "all_stages_first": ("PROLOGUE_EARLY_STAGES=0",),
          "early_refill": ("EARLY_REFILL=1",), "unbalanced": ("BALANCED_SPLITS=0",),
          "rows_as_m": ("DECODE_ROWS_AS_N=0",)}
_SUMMARY = re.compile(r"(ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: (\d+) hazards?)")


def case_script(defines: tuple[str, ...] = ()) -> str:
    """The Python program the sanitizer runs: prints 'ran' once the kernel calls are done."""
    return (
        "import torch\n"
        "from sm120_workbook.reference import make_verify_case\n"
        "from sm120_workbook.kernels import MlaVerifyWorkspace, mla_verify_attention\n"
        "c = make_verify_case(batch=2, heads=5, q_len=7, ctx_lens=[129, 40], mask='tree', device='cuda')\n"
        "o = torch.empty(14, 5, 512, device='cuda', dtype=torch.bfloat16)\n"
        "l = torch.empty(14, 5, device='cuda')\n"
        "for rows, tk, splits in ((32, 16, 1), (32, 16, 3), (32, 32, 1), (64, 16, 1), (64, 16, 3), (32, 16, 8)):"
        "  # 1 split: 9 tiles wrap the cp.async ring\n"
        "    ws = MlaVerifyWorkspace(14, 5, 'cuda', num_splits=splits, tile_keys=tk, cta_rows=rows,"
        f" kernel_defines={tuple(defines)!r})\n"
        "    mla_verify_attention(c['q'], c['kv_pool'], c['qo_indptr'], c['kv_indptr'], c['kv_indices'], out=o,"
        " lse=l, workspace=ws, sm_scale=c['sm_scale'], max_q_len=7, k_extend=c['k_extend'],"
        " custom_mask=c['custom_mask'], mask_indptr=c['mask_indptr'])\n"
        "for h, all_splits in ((8, (1, 3, 8)), (16, (3,))):  # decode: the split kernel's one-m16-tile builds,"
        " rows as the mma's N (8 rows) and as its M (16)\n"
        "    d = make_verify_case(batch=2, heads=h, q_len=1, ctx_lens=[129, 40], mask=None, with_k_extend=False,"
        " device='cuda')\n"
        "    o, l = torch.empty(2, h, 512, device='cuda', dtype=torch.bfloat16), torch.empty(2, h, device='cuda')\n"
        "    for splits in all_splits:\n"
        "        ws = MlaVerifyWorkspace(2, h, 'cuda', num_splits=splits, tile_keys=16, cta_rows=32,"
        f" kernel_defines={tuple(defines)!r})\n"
        "        mla_verify_attention(d['q'], d['kv_pool'], d['qo_indptr'], d['kv_indptr'], d['kv_indices'], out=o,"
        " lse=l, workspace=ws, sm_scale=d['sm_scale'], max_q_len=1, k_extend=d['k_extend'])\n"
        "e = make_verify_case(batch=2, heads=3, q_len=4, ctx_lens=[1, 37], mask=None, device='cuda')"
        "  # no mask: the implicit causal chain; ctx 1\n"
        "e['kv_indices'] = e['kv_indices'].to(torch.int32)  # the 4-byte index loads\n"
        "q = torch.cat([e['q'], torch.randn(2, 3, 576, device='cuda').bfloat16()])  # 2 padding tokens\n"
        "ke = torch.cat([e['k_extend'], torch.randn(2, 1, 576, device='cuda').bfloat16()])\n"
        "o, l = torch.empty(10, 3, 512, device='cuda', dtype=torch.bfloat16), torch.empty(10, 3, device='cuda')\n"
        "for rows in (32, 64):  # 8 splits over 1 and 37 keys: empty splits\n"
        "    ws = MlaVerifyWorkspace(10, 3, 'cuda', num_splits=8, cta_rows=rows,"
        f" kernel_defines={tuple(defines)!r})\n"
        "    mla_verify_attention(q, e['kv_pool'], e['qo_indptr'], e['kv_indptr'], e['kv_indices'], out=o, lse=l,"
        " workspace=ws, sm_scale=e['sm_scale'], max_q_len=5, k_extend=ke)\n"
        "f = make_verify_case(batch=1, heads=8, q_len=4, ctx_lens=50, mask='causal', with_k_extend=False,"
        " device='cuda')  # decode layout, 4 queries\n"
        "o, l = torch.empty(4, 8, 512, device='cuda', dtype=torch.bfloat16), torch.empty(4, 8, device='cuda')\n"
        "ws = MlaVerifyWorkspace(4, 8, 'cuda', num_splits=2, cta_rows=32,"
        f" kernel_defines={tuple(defines)!r})\n"
        "mla_verify_attention(f['q'], f['kv_pool'], f['qo_indptr'], f['kv_indptr'], f['kv_indices'], out=o, lse=l,"
        " workspace=ws, sm_scale=f['sm_scale'], max_q_len=4, custom_mask=f['custom_mask'],"
        " mask_indptr=f['mask_indptr'])\n"
        "g = make_verify_case(batch=130, heads=8, q_len=2, ctx_lens=[40 + b % 7 for b in range(130)], mask=None,"
        " device='cuda')  # past 128 requests: v19's pool rule\n"
        "kv, qo = g['kv_indptr'].clone(), g['qo_indptr'].clone()\n"
        "kv[65] = kv[66] + 5; qo[66] -= 3  # broken batches: a decreasing kv_indptr, a decreasing qo_indptr\n"
        "o, l = torch.empty(260, 8, 512, device='cuda', dtype=torch.bfloat16), torch.empty(260, 8, device='cuda')\n"
        "for rows in (32, 64):\n"
        "    ws = MlaVerifyWorkspace(260, 8, 'cuda', num_splits=2, cta_rows=rows,"
        f" kernel_defines={tuple(defines)!r})\n"
        "    for qo_, kv_ in ((g['qo_indptr'], g['kv_indptr']), (g['qo_indptr'], kv), (qo, g['kv_indptr'])):\n"
        "        mla_verify_attention(g['q'], g['kv_pool'], qo_, kv_, g['kv_indices'], out=o, lse=l, workspace=ws,"
        " sm_scale=g['sm_scale'], max_q_len=2, k_extend=g['k_extend'])\n"
        "    q3 = qo[:4].clone(); q3[2] = 1  # 3 requests whose tokens overlap: the unpooled layouts' case\n"
        "    mla_verify_attention(g['q'][:6], g['kv_pool'], q3, g['kv_indptr'][:4], g['kv_indices'], out=o[:6],"
        " lse=l[:6], workspace=ws, sm_scale=g['sm_scale'], max_q_len=2, k_extend=g['k_extend'][:6])\n"
        "h = make_verify_case(batch=2, heads=3, q_len=[3, 4], ctx_lens=[60, 20], mask=None, device='cuda')\n"
        "o, l = torch.empty(7, 3, 512, device='cuda', dtype=torch.bfloat16), torch.empty(7, 3, device='cuda')\n"
        "qo2 = h['qo_indptr'].clone(); qo2[2] += 2  # the last request runs 2 rows past q's T: not read (v30)\n"
        "qo1 = torch.tensor([0, 5], dtype=torch.int32, device='cuda')\n"
        "q1, ke1 = h['q'][:3].clone(), h['k_extend'][:3].clone()  # allocations of their own: 3 rows\n"
        "for rows in (32, 64):\n"
        "    ws = MlaVerifyWorkspace(12, 3, 'cuda', num_splits=2, cta_rows=rows,"
        f" kernel_defines={tuple(defines)!r})\n"
        "    for q_, ke_, qo_, kv_ in ((h['q'], h['k_extend'], qo2, h['kv_indptr']), (q1, ke1, qo1, h['kv_indptr'][:2])):\n"
        "        mla_verify_attention(q_, h['kv_pool'], qo_, kv_, h['kv_indices'], out=o[:len(q_)], lse=l[:len(q_)],"
        " workspace=ws, sm_scale=h['sm_scale'], max_q_len=6, k_extend=ke_)\n"
        "m = make_verify_case(batch=2, heads=3, q_len=3, ctx_lens=[50, 30], mask='tree', device='cuda')\n"
        "o, l = torch.empty(6, 3, 512, device='cuda', dtype=torch.bfloat16), torch.empty(6, 3, device='cuda')\n"
        "short_kv, short_mask = m['kv_indices'][:-1].clone(), m['custom_mask'][:-1].clone()"
        "  # allocations of their own, one entry short: the last request's reads would pass them (v31: not read)\n"
        "kv_wraps = m['kv_indptr'].clone(); kv_wraps[-1] = -2**31  # a 32-bit key count that would wrap\n"
        "for rows in (32, 64):\n"
        "    ws = MlaVerifyWorkspace(6, 3, 'cuda', num_splits=2, cta_rows=rows,"
        f" kernel_defines={tuple(defines)!r})\n"
        "    for kv_, kvi, mask in ((m['kv_indptr'], short_kv, m['custom_mask']), (m['kv_indptr'], m['kv_indices'],"
        " short_mask), (kv_wraps, m['kv_indices'], m['custom_mask'])):\n"
        "        mla_verify_attention(m['q'], m['kv_pool'], m['qo_indptr'], kv_, kvi, out=o, lse=l,"
        " workspace=ws, sm_scale=m['sm_scale'], max_q_len=3, k_extend=m['k_extend'], custom_mask=mask,"
        " mask_indptr=m['mask_indptr'])\n"
        "torch.cuda.synchronize(); print('ran')\n")


def build(defines: tuple[str, ...] = ()) -> None:
    """Compile (or find cached) the build in a child process, as the sanitized run will load it."""
    subprocess.run(build_command(defines), check=True)


def parse_report(report: str) -> dict:
    """The summary count and the first hazard/error lines of a compute-sanitizer report."""
    m = _SUMMARY.search(report)
    count = None if m is None else int(m.group(2) or m.group(3))
    lines = [ln.strip() for ln in report.splitlines()
             if ln.lstrip("= ").startswith(("Error:", "Warning:", "Invalid", "Race", "Barrier"))
             or "hazard" in ln.lower() and "SUMMARY" not in ln]
    return {"count": count, "summary": m.group(1) if m else None, "first_lines": lines[:8]}


def sanitizer_env() -> dict:
    """The sanitized process's environment: torch's caching allocator off, so that every tensor
    is its own allocation and an access past one is outside any, which memcheck reports (inside
    a cached block it would land in another tensor's memory, unseen)."""
    return {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}


def sanitizer_exe() -> str:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        raise RuntimeError("compute-sanitizer is not on PATH (it ships with the CUDA toolkit, in its bin/)")
    return exe


def run_tool(tool: str, defines: tuple[str, ...] = (), timeout_s: float = 900) -> dict:
    """Run one sanitizer tool on the case under one build; clean means exit 0, 'ran' and a 0 count."""
    if tool not in TOOLS:
        raise ValueError(f"tool: expected one of {TOOLS}, got {tool!r}")
    exe = sanitizer_exe()
    proc = subprocess.run([exe, f"--tool={tool}", "--error-exitcode=3", sys.executable, "-c", case_script(defines)],
                          capture_output=True, text=True, timeout=timeout_s, env=sanitizer_env())
    report = proc.stdout + proc.stderr
    parsed = parse_report(report)
    clean = proc.returncode == 0 and "ran" in proc.stdout and parsed["count"] == 0
    return {"tool": tool, "defines": list(defines), "returncode": proc.returncode, "clean": clean,
            **parsed, "report_tail": report[-3000:]}


def recorded_table(df=None, gpu: str = "H200"):
    """Each (build, tool) result of the newest recorded run of that build (its newest commit)
    on a GPU whose name contains `gpu` (each arch runs its own binary), from
    data/results/kernel_sanitizer.jsonl, for the builds BUILDS still names. An older commit's
    results for a build are left out: the same build name may have meant another schedule then."""
    from ..results import load_records, on_gpu

    df = load_records("kernel_sanitizer") if df is None else df
    if len(df) == 0:
        return df
    cols = [c for c in ("build", "tool", "clean", "summary", "kernel_version", "commit", "date") if c in df]
    df = df[df["build"].isin(BUILDS) & on_gpu(df, gpu)].sort_values("date")
    if "commit" in df:
        newest_commit = df.groupby("build")["commit"].transform("last")
        df = df[df["commit"] == newest_commit]
    newest = df.groupby(["build", "tool"], as_index=False).tail(1)
    t = newest[cols].copy()
    if "commit" in t:
        t["commit"] = t["commit"].astype(str).str[:7]
    if "kernel_version" in t:   # a run without --tag names no version; its commit says what ran
        t["kernel_version"] = t["kernel_version"].fillna("untagged")
    return t.sort_values(["build", "tool"]).reset_index(drop=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=["racecheck"])
    ap.add_argument("--builds", nargs="+", choices=sorted(BUILDS), default=sorted(BUILDS))
    add_record_args(ap, "kernel_sanitizer")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("the sanitizer runs need a CUDA GPU; none is visible to torch")
    try:   # found before the builds, not after them
        sanitizer_exe()
    except RuntimeError as e:
        sys.exit(str(e))
    for name in args.builds:   # all before any tool: a failed build then costs no sanitizer run
        try:
            build(BUILDS[name])
        except subprocess.CalledProcessError as e:   # the build child printed its error above
            sys.exit(f"the {name} build failed (exit {e.returncode}); see its output above")
    records = []
    for name in args.builds:
        for tool in args.tools:
            r = {"build": name, **run_tool(tool, BUILDS[name]), "kernel_version": args.tag}
            records.append(r)
            print(f"{name:16s} {tool:10s} {'clean' if r['clean'] else 'NOT CLEAN'}  {r['summary']}", flush=True)
            for ln in r["first_lines"][:4]:
                print(f"    {ln}")
    if not args.no_record:
        from ..results import append_cli_records

        path = append_cli_records("kernel_sanitizer", [{k: v for k, v in r.items() if k != "report_tail"} for r in records],
                                  "sm120_workbook.kernels.sanitize", argv, args.out)
        print(f"appended to {path}")
    return exit_status(records)


def exit_status(records) -> int:
    """0 when every tool ran clean on the shipped build: the other builds are recorded, not
    required clean (group_barriers is known not to be, under racecheck)."""
    return 0 if all(r["clean"] for r in records if r["build"] == "default") else 1


if __name__ == "__main__":
    sys.exit(main())
