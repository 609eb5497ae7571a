"""Reading Nsight Compute's source page: the SASS of a kernel with its warp-stall samples.

    ncu --import prof.ncu-rep --page source --csv --print-source sass > prof_sass.csv
    python -m sm120_workbook.kernels.sass_profile prof_sass.csv

prints where the warps of the profiled launch spent their time: the share of each stall
reason, every hot loop (found by its backward branch) with the instructions one pass of
it issues and the stall samples inside it, and the hottest instructions. That is how the
v12-v14 notes in NOTES.md were read (e.g. "the value loop issues 250 instructions a tile").
"""
from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

import pandas as pd

_BRANCH = re.compile(r"\bBRA\s+(?:\S+\s+)?(0x[0-9a-f]+)", re.I)


def _section(lines: list[str], kernel: str) -> list[str]:
    """The lines of the first kernel section whose name contains `kernel`. Newer ncu versions
    export one section per profiled kernel, each opened by a "Kernel Name" line; older ones
    export one section without it."""
    heads = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    if not heads:
        return lines
    names = [lines[i].split(",", 1)[1] for i in heads]
    pick = next((k for k, name in enumerate(names) if kernel in name), None)
    if pick is None and len(heads) == 1:
        pick = 0   # one kernel in the report: that one, whatever its name
    if pick is None:
        raise ValueError(f"no profiled kernel matches {kernel!r}; the report has {sorted(set(names))}")
    end = heads[pick + 1] if pick + 1 < len(heads) else len(lines)
    return lines[heads[pick] + 1:end]


def load(path: str | Path, kernel: str = "split_kernel") -> pd.DataFrame:
    """One row per SASS instruction of the first profiled kernel whose name contains `kernel`:
    off (bytes from the first), sass, samples, executed and one column per stall reason
    (`stall_*`, all samples)."""
    lines = _section(Path(path).read_text().splitlines(), kernel)
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f"{path}: no source-page header (export with --page source --csv --print-source sass)")
    df = pd.read_csv(io.StringIO("\n".join(lines[start:])))
    if "Warp Stall Sampling (All Samples)" not in df:
        raise ValueError(f"{path}: no warp-stall samples (profile with --set full or the SourceCounters section)")
    out = pd.DataFrame({
        "addr": df["Address"].map(lambda a: int(str(a), 16)),
        "sass": df["Source"].astype(str).str.strip(),
        "samples": pd.to_numeric(df["Warp Stall Sampling (All Samples)"], errors="coerce").fillna(0).astype(int),
        "executed": pd.to_numeric(df["Instructions Executed"], errors="coerce").fillna(0).astype(int),
    })
    for c in df.columns:
        if c.startswith("stall_") and "Not Issued" not in c:
            out[c] = pd.to_numeric(df[c], errors="coerce").fillna(0).astype(int)
    out["off"] = out["addr"] - out["addr"].min()
    return out


def stall_shares(df: pd.DataFrame) -> pd.Series:
    """Percent of all stall samples per reason, largest first."""
    cols = [c for c in df.columns if c.startswith("stall_")]
    tot = df[cols].sum()
    return (100 * tot / max(1, tot.sum())).round(1).rename(lambda c: c[len("stall_"):]).sort_values(ascending=False)


def loops(df: pd.DataFrame, min_passes: int = 1000) -> pd.DataFrame:
    """Every loop closed by a backward branch taken at least `min_passes` times: its span,
    passes (the branch's executions), instructions one pass issues per warp, and samples."""
    rows = []
    by_addr = df.set_index("addr")
    for r in df.itertuples():
        m = _BRANCH.search(r.sass)
        if not m or r.executed < min_passes:
            continue
        target = int(m.group(1), 16)
        if target >= r.addr or target not in by_addr.index:
            continue
        body = df[(df["addr"] >= target) & (df["addr"] <= r.addr)]
        rows.append({"start": f"{target - df['addr'].min():#06x}", "end": f"{r.off:#06x}", "passes": r.executed,
                     "instr_per_pass": round(body["executed"].sum() / r.executed, 1),
                     "hmma_per_pass": round(body.loc[body["sass"].str.contains("HMMA"), "executed"].sum() / r.executed, 1),
                     "samples": int(body["samples"].sum()),
                     "samples_pct": round(100 * body["samples"].sum() / max(1, df["samples"].sum()), 1)})
    return pd.DataFrame(rows)


def hottest(df: pd.DataFrame, n: int = 15) -> pd.DataFrame:
    """The n instructions with the most stall samples, with their two main reasons."""
    cols = [c for c in df.columns if c.startswith("stall_")]
    top = df.sort_values("samples", ascending=False).head(n)

    def reasons(r):
        s = r[cols].astype(int).sort_values(ascending=False)
        return ", ".join(f"{k[len('stall_'):]} {v}" for k, v in s.head(2).items() if v > 0)

    return pd.DataFrame({"off": top["off"].map(lambda o: f"{o:#06x}"), "samples": top["samples"],
                         "executed": top["executed"], "sass": top["sass"].str.slice(0, 60),
                         "reasons": top.apply(reasons, axis=1)}).reset_index(drop=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=15, help="the hottest instructions to list (at least 1)")
    ap.add_argument("--kernel", default="split_kernel", help="which profiled kernel (a part of its name)")
    a = ap.parse_args(argv)
    if a.top < 1:
        ap.error(f"--top: at least 1, got {a.top}")
    try:
        df = load(a.csv, a.kernel)
    except (OSError, ValueError) as e:   # no such file, a folder, an empty CSV, no such kernel in it
        ap.error(f"{a.csv}: {e}")
    print(f"{len(df)} SASS instructions, {df['samples'].sum()} stall samples, "
          f"{df['executed'].sum():,} warp instructions executed")
    print("\nstall reasons, % of samples:\n" + stall_shares(df).head(10).to_string())
    lp = loops(df)
    print("\nloops:\n" + (lp.to_string(index=False) if len(lp) else "none taken 1000+ times"))
    print("\nhottest instructions:\n" + hottest(df, a.top).to_string(index=False))


if __name__ == "__main__":
    main()
