"""Every stored record says where it came from: the provenance keys (results.PROVENANCE_KEYS), a
commit in this repository's history, a readable past date with its offset, and a command that
names code that exists. The notebooks plot these records on machines without a GPU, so a record
that lost its commit or date would show a number nobody can trace; nbval would not notice, since
`describe_provenance` leaves missing values out. README.md ("data/results/") lists the gaps
allowed below and why."""
import datetime as dt
import json
import re
import subprocess

import pytest

from sm120_workbook import project_root
from sm120_workbook.results import PROVENANCE_KEYS, REQUIRED_KEYS, _json_lines, results_dir

RESULTS = results_dir()
ROOT = project_root()
# None where the run had none: SGLang not installed (the kernel tools need only torch), no driver
# read (prefill_backend_probe, README). The required keys are never allowed empty.
MAY_BE_NONE = {"gpu", "driver", "sglang", "triton"}
# one provenance header, then the stack dumps it introduces (its command under `run`)
HEADER_THEN_ROWS = {"probes/first_request_stacks.jsonl": "run"}


def _record_files():
    return sorted(p for p in RESULTS.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz")))


def _records(path):
    rel = path.relative_to(RESULTS).as_posix()
    recs = [json.loads(line) for line in _json_lines(path)]
    if rel in HEADER_THEN_ROWS:
        head = dict(recs[0])
        head.setdefault("command", head.get(HEADER_THEN_ROWS[rel]))
        recs = [head]
    return recs


@pytest.mark.parametrize("path", _record_files(), ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_each_stored_record_names_its_provenance(path):
    now = dt.datetime.now(dt.timezone.utc)
    bad = []
    for i, r in enumerate(_records(path)):
        for k in PROVENANCE_KEYS:
            if k not in r:
                bad.append(f"record {i}: no {k!r}")
            elif r[k] in (None, "") and (k in REQUIRED_KEYS or k not in MAY_BE_NONE):
                bad.append(f"record {i}: {k!r} is empty")
        try:
            when = dt.datetime.fromisoformat(str(r.get("date")))
            if when.tzinfo is None or when > now:
                bad.append(f"record {i}: date {r['date']!r} has no offset or is in the future")
        except ValueError:
            bad.append(f"record {i}: date {r.get('date')!r} does not parse")
        for module in re.findall(r"-m\s+sm120_workbook\.(\S+)", str(r.get("command") or "")):
            base = ROOT / "src" / module.replace(".", "/")
            if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
                bad.append(f"record {i}: command names sm120_workbook.{module}, which does not exist")
    assert not bad, f"{path.name}: {len(bad)} problems, the first: {bad[:5]}"


def test_every_recorded_commit_is_in_this_repositorys_history():
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True)
    if shallow.returncode != 0:
        pytest.skip(f"not a git checkout ({shallow.stderr.strip()}): the commits cannot be looked up")
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone: older commits are not here to look up (git fetch --unshallow)")
    commits = {str(r["commit"]).split("+")[0] for p in _record_files() for r in _records(p) if r.get("commit")}
    assert len(commits) > 100   # the sweep reads the real records, archive included
    lookup = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"],
                            input="".join(f"{c}^{{commit}}\n" for c in sorted(commits)),
                            capture_output=True, text=True, check=True)
    missing = [line.split()[0] for line in lookup.stdout.splitlines() if line.endswith("missing")]
    assert not missing, f"records name commits this repository does not have: {missing[:10]}"


def test_the_writer_refuses_a_record_that_blanks_its_provenance(tmp_path):
    from sm120_workbook.results import append_records

    out = tmp_path / "demo.jsonl"
    with pytest.raises(ValueError, match=r"records\[1\]: commit set empty"):
        append_records("demo", [{"i": 0}, {"i": 1, "commit": None}], command="demo", path=out)
    assert not out.exists()   # nothing written, not even the good record before it
    append_records("demo", [{"i": 0, "gpu": None}], command="demo", path=out)
    assert json.loads(out.read_text())["command"] == "demo"
