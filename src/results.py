"""Result records: one JSON object per line in data/results/<name>.jsonl, with provenance.

Older records may sit compressed in data/results/archive/<name>.jsonl.gz (`python -m
sm120_workbook.results archive NAME ...` moves them there): every device call ships the tree, and
the records were most of it. Readers see the archive's records first, then the live file's.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shlex
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

from . import project_root
from .provenance import provenance

PROVENANCE_KEYS = ("gpu", "driver", "torch", "sglang", "triton", "commit", "date", "command")
# what a record may not blank (the others are None where there is no GPU, driver or SGLang)
REQUIRED_KEYS = ("commit", "date", "command")


def results_dir() -> Path:
    return project_root() / "data" / "results"


def cli_command(module: str, argv=None) -> str:
    """The command line a `python -m module` run was given (argv, or this process's own), as
    its records' `command`, quoted so that it runs again as written (an empty argument too)."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


def append_records(name: str, records: Iterable[dict], command: str | None = None,
                   path: Path | str | None = None) -> Path:
    """Append measurement dicts to data/results/<name>.jsonl, each stamped with provenance.

    Fields already in a record win over the provenance defaults (a record made on the GPU
    machine and merged here keeps its own GPU and date).
    """
    path = Path(path) if path else results_dir() / f"{name}.jsonl"   # a tool's --out comes as a str
    prov = provenance(command)
    records = list(records)
    for i, r in enumerate(records):
        # a record's own None would replace the stamp: a number nobody could trace
        blanked = [k for k in REQUIRED_KEYS if k in r and r[k] in (None, "")]
        if blanked:
            raise ValueError(f"records[{i}]: {', '.join(blanked)} set empty; a stored record names its commit, "
                             "date and command (nothing was written)")
    if not prov.get("commit"):   # written all the same: a long run's numbers are not thrown away
        print(f"WARNING: {path}: these records name no commit (not a git checkout, and no $SM120_COMMIT)",
              file=sys.stderr)
    stamped = [{**prov, **r} for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in stamped:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return path


def append_cli_records(name: str, records: Iterable[dict], module: str, argv=None, out: str | None = None) -> Path:
    """`append_records` for a `python -m module` tool: the records' command is the tool's own
    command line, and `out` (its --out, if given) replaces data/results/<name>.jsonl. A run with
    nothing to record (every timing failed) exits 1 rather than say it appended."""
    records = list(records)
    if not records:
        raise SystemExit(f"{module}: nothing to record (no measurement succeeded; see above); "
                         f"{out or name + '.jsonl'} left as it was")
    return append_records(name, records, command=cli_command(module, argv), path=Path(out) if out else None)


def record_file(text: str) -> str:
    """--out's argparse type: a jsonl this run can append to, checked when the flags are read
    (found after a GPU run, a bad path would lose its measurements). Nothing is created: the
    file, or else its nearest existing folder, is probed, and append_records makes the rest."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name a .jsonl file")
    try:
        if path.exists():
            with path.open("a"):
                pass
        else:
            folder = path.parent
            while not folder.exists():
                folder = folder.parent
            if not folder.is_dir():
                raise argparse.ArgumentTypeError(f"cannot append to {text}: {folder} is not a folder")
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot append to {text} ({e.strerror or e})") from None
    return text


def add_record_args(ap, name: str) -> None:
    """The flags of a tool whose records go to data/results/<name>.jsonl: --out (another jsonl),
    --tag (the kernel version label each record carries) and --no-record."""
    ap.add_argument("--out", default=None, type=record_file,
                    help=f"jsonl to append to (default data/results/{name}.jsonl)")
    ap.add_argument("--tag", default=None, help="kernel version label stored in each record (see NOTES.md)")
    ap.add_argument("--no-record", action="store_true", help="print the results; append nothing")


def archive_path(name: str) -> Path:
    return results_dir() / "archive" / f"{name}.jsonl.gz"


def _json_lines(path: Path) -> list[str]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [line for line in text.splitlines() if line.strip()]


def record_lines(name: str, path: Path | None = None) -> list[str]:
    """The JSON lines of <name>'s records, oldest first: data/results/archive/<name>.jsonl.gz,
    then data/results/<name>.jsonl; or those of `path` alone (a tool's --out)."""
    paths = [Path(path)] if path else [archive_path(name), results_dir() / f"{name}.jsonl"]
    return [line for p in paths if p.exists() for line in _json_lines(p)]


def load_records(name: str, path: Path | None = None):
    """The records of <name> (see `record_lines`) as a pandas DataFrame (empty if none)."""
    import pandas as pd

    return pd.DataFrame([json.loads(line) for line in record_lines(name, path)])


def archive_records(name: str) -> int:
    """Move the records of data/results/<name>.jsonl to the end of archive/<name>.jsonl.gz and
    leave the live file empty, for appends; returns how many moved. The archive is written
    whole, without a timestamp or a file name inside, so the same records give the same bytes.
    The live file is set aside first, so a record appended meanwhile starts a new live file
    rather than being emptied with the rest."""
    live, archive = results_dir() / f"{name}.jsonl", archive_path(name)
    aside, tmp = live.with_name(live.name + ".archiving"), archive.with_name(archive.name + ".tmp")
    for left in (aside, tmp):
        if left.exists():
            raise FileExistsError(f"{left}: left by an archive run that did not finish; its records are "
                                  f"in neither file that readers see: append it to {live.name} and remove it")
    if not live.exists() or not _json_lines(live):
        return 0
    os.replace(live, aside)
    moved = _json_lines(aside)
    lines = (_json_lines(archive) if archive.exists() else []) + moved
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=9, mtime=0))
    os.replace(tmp, archive)   # the archive is whole before the set-aside records go
    aside.unlink()
    live.touch()               # kept (empty, unless a record came meanwhile), as git tracks it
    return len(moved)


class NotRecorded(ValueError):
    """A recorded table was asked for a run (a tag, a version) that the records hold on no GPU of
    that name: a GPU's records hold only the runs made on it."""


@contextmanager
def unless_recorded():
    """For a notebook cell that shows recorded runs: a NotRecorded raised inside the block is
    printed ("not recorded: ...") and the cell goes on after it, so that a notebook pointed at a
    GPU with fewer recorded runs (recorded_gpu) shows what it has."""
    try:
        yield
    except NotRecorded as e:
        print(f"not recorded: {e}")


def on_gpu(df, name: str):
    """Which records were measured on a GPU whose name contains `name`, in any case ("h200" finds
    "NVIDIA H200"; none, where the records name no GPU)."""
    import pandas as pd

    if "gpu" not in df:
        return pd.Series(False, index=df.index)
    return df["gpu"].fillna("").astype(str).str.lower().str.contains(str(name).lower(), regex=False)


def short_commit(commit, digits: int = 7) -> str:
    """A commit as its first `digits` hex digits, keeping a "+dirty" suffix (the tree differed
    from the commit); "?" for none."""
    if commit is None or (isinstance(commit, float) and math.isnan(commit)):
        return "?"
    sha, plus, rest = str(commit).partition("+")
    return sha[:digits] + plus + rest


def date_span(df) -> str:
    """The records' dates as "2026-12-04" or "2026-12-03..2026-12-04"; "" where none."""
    dates = sorted(str(v)[:10] for v in df["date"].dropna()) if "date" in df else []
    return "" if not dates else dates[0] if dates[0] == dates[-1] else f"{dates[0]}..{dates[-1]}"


def record_times(df):
    """The records' dates as UTC times (NaT where absent or unreadable); records of one file may
    spell them with and without an offset, which pandas' inferred format would read as NaT."""
    import pandas as pd

    if "date" not in df:
        return pd.Series(pd.NaT, index=df.index, dtype="datetime64[ns, UTC]")
    return pd.to_datetime(df["date"], utc=True, errors="coerce", format="ISO8601")


def source_label(df, live: bool) -> str:
    """Where a chart's numbers come from, for its subtitle: "measured here" (this run) or
    "recorded", with the GPU, the commits (the newest named: the commit of the latest record by
    date, else the last record's) and the dates."""
    where = "measured here" if live else "recorded"
    if df is None or len(df) == 0:
        return where
    parts = [", ".join(sorted(set(df["gpu"].dropna().astype(str))))] if "gpu" in df else []
    if "commit" in df:
        commits = {short_commit(c) for c in df["commit"]}
        # a commit's records need not be together: two runs on one machine append in turn
        at = record_times(df).reset_index(drop=True)
        newest = short_commit(df["commit"].iloc[at.idxmax() if at.notna().any() else -1])
        parts.append(f"commit {newest}" if len(commits) == 1 else f"{len(commits)} commits, newest {newest}")
    parts.append(date_span(df))
    return f"{where}: {'; '.join(p for p in parts if p)}"


def table_text(t, **to_string) -> str:
    """A recorded table as a notebook prints it: its rows, then the records' provenance where the
    reader left it in `t.attrs["source"]` (source_label: GPU, commits, dates)."""
    text = t.to_string(index=False, **to_string)
    source = t.attrs.get("source", "")
    return f"{text}\n({source})" if source else text


def describe_provenance(df) -> str:
    """One line naming where recorded results came from, for a notebook to print."""
    if df is None or len(df) == 0:
        return "no recorded results"
    parts = []
    for key in ("gpu", "driver", "torch", "sglang", "triton", "l2_flush", "commit"):
        if key in df:
            vals = sorted({str(v) for v in df[key].dropna()})
            if key == "commit" and len(vals) > 3:   # many runs: their count, the newest, and any from a dirty tree
                dated = df.assign(_at=record_times(df)) if "date" in df else None
                newest = (str(dated.sort_values("_at", na_position="first")["commit"].dropna().iloc[-1])
                          if dated is not None else vals[-1])
                dirty = sum(v.endswith("+dirty") for v in vals)
                parts.append(f"commits={len(vals)} (newest {short_commit(newest, 12)}"
                             + (f"; {dirty} from a dirty tree" if dirty else "") + ")")
            elif vals:
                parts.append(f"{key}={','.join(vals)}")
    dates = sorted(str(v)[:10] for v in df["date"].dropna()) if "date" in df else []
    if dates:
        parts.append(f"dates={dates[0]}..{dates[-1]}")
    return "recorded results: " + "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Result records in data/results/.")
    sub = ap.add_subparsers(dest="action", required=True)
    arc = sub.add_parser("archive", help="move the records of data/results/NAME.jsonl into archive/NAME.jsonl.gz")
    arc.add_argument("names", nargs="+", metavar="NAME", help="a record file's name, without .jsonl")
    args = ap.parse_args(argv)
    missing = [n for n in args.names if not (results_dir() / f"{n}.jsonl").exists()]
    if missing:
        ap.error(f"NAME: no data/results/<NAME>.jsonl for {', '.join(missing)}")
    for name in args.names:
        before = archive_path(name).stat().st_size if archive_path(name).exists() else 0
        n = archive_records(name)
        print(f"{name}: {n} records archived ({before / 2**20:.2f} -> "
              f"{archive_path(name).stat().st_size / 2**20:.2f} MiB compressed)" if n else f"{name}: nothing to archive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
