"""The commit a record names: the code that ran, even where the environment claims another."""
import subprocess
import tarfile
import io

from sm120_workbook import build_commit, project_root, provenance

SHA_A = "a" * 40
SHA_B = "b" * 40


def test_git_archive_fills_in_the_commit_a_wheel_is_built_from():
    root = project_root()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "HEAD", "src/build_commit.py"], cwd=root, capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        text = tar.extractfile("src/build_commit.py").read().decode()
    assert f'ARCHIVED_FROM = "{head}"' in text
    assert build_commit.archived_commit() is None   # this checkout's copy stays unfilled


def test_the_archived_commit_wins_over_a_claim_that_disagrees(monkeypatch, capsys):
    monkeypatch.setattr(provenance, "archived_commit", lambda: SHA_A)
    monkeypatch.setenv("SM120_COMMIT", SHA_B)
    assert provenance.git_commit() == SHA_A
    assert "SM120_COMMIT=" + SHA_B in capsys.readouterr().err
    monkeypatch.setenv("SM120_COMMIT", SHA_A[:12])   # a short claim of the same commit
    assert provenance.git_commit() == SHA_A[:12]
    monkeypatch.delenv("SM120_COMMIT")
    assert provenance.git_commit() == SHA_A        # a wheel without .git or a claim


def test_a_checkout_names_its_head(monkeypatch):
    monkeypatch.setattr(provenance, "archived_commit", lambda: None)
    monkeypatch.delenv("SM120_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=project_root(),
                          capture_output=True, text=True).stdout.strip()
    assert provenance.git_commit().removesuffix("+dirty") == head
    monkeypatch.setenv("SM120_COMMIT", SHA_B)
    assert provenance.git_commit() == SHA_B


def test_every_recorded_decode_bench_command_runs_as_written():
    """A record's `command` is the provenance a reader re-runs: each decode_bench command in
    data/results parses with the CLI's own parser, as a shell would split it (records before
    e2c53e1 had joined an empty argument unquoted; they were mended in session 49)."""
    import contextlib
    import glob
    import json
    import shlex

    import pytest

    pytest.importorskip("sglang")
    from sm120_workbook.decode_bench import cli_parser
    from sm120_workbook.results import record_lines

    prefix = "python -m sm120_workbook.decode_bench"
    bad, seen = {}, 0
    results = project_root() / "data" / "results"
    names = {p.name.split(".")[0] for p in [*results.glob("service_*.jsonl"), *results.glob("archive/service_*.jsonl.gz")]}
    for name in sorted(names):
        for line in record_lines(name):
            cmd = json.loads(line).get("command", "")
            if not cmd.startswith(prefix):
                continue
            seen += 1
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    cli_parser().parse_args(shlex.split(cmd)[len(prefix.split()):])
            except SystemExit:
                bad.setdefault(err.getvalue().strip().splitlines()[-1], cmd)
    assert seen > 0 and not bad, bad


def test_archived_records_read_as_before_and_appends_go_on(tmp_path, monkeypatch, capsys):
    """`results archive` moves a record file into archive/<name>.jsonl.gz: readers see the same
    records in the same order, appends land in the emptied live file after them, and archiving
    again puts the newer records after the older ones, byte for byte the same for the same records."""
    import pytest

    from sm120_workbook import results

    monkeypatch.setattr(results, "results_dir", lambda: tmp_path)
    monkeypatch.setattr(results, "provenance", lambda command=None: {"command": command})
    results.append_records("demo", [{"i": i} for i in range(3)], command="one")
    assert results.main(["archive", "demo"]) == 0
    assert "demo: 3 records archived" in capsys.readouterr().out
    assert (tmp_path / "demo.jsonl").read_text() == "" and (tmp_path / "archive" / "demo.jsonl.gz").exists()
    assert list(results.load_records("demo")["i"]) == [0, 1, 2]
    results.append_records("demo", [{"i": 3}], command="two")
    assert list(results.load_records("demo")["i"]) == [0, 1, 2, 3]
    assert results.archive_records("demo") == 1 and results.archive_records("demo") == 0
    assert list(results.load_records("demo")["command"]) == ["one"] * 3 + ["two"]
    first = (tmp_path / "archive" / "demo.jsonl.gz").read_bytes()
    (tmp_path / "archive" / "demo.jsonl.gz").unlink()
    (tmp_path / "demo.jsonl").write_text("".join(line + "\n" for line in [
        '{"command": "one", "i": 0}', '{"command": "one", "i": 1}', '{"command": "one", "i": 2}',
        '{"command": "two", "i": 3}']))
    results.archive_records("demo")
    assert (tmp_path / "archive" / "demo.jsonl.gz").read_bytes() == first
    assert results.load_records("demo", path=tmp_path / "demo.jsonl").empty   # --out: that file alone
    # a run that stopped half-way leaves its set-aside records: the next one says so, moving nothing
    results.append_records("demo", [{"i": 4}], command="three")
    (tmp_path / "demo.jsonl.archiving").write_text('{"i": 99}\n')
    with pytest.raises(FileExistsError, match="demo.jsonl.archiving: left by an archive run that did not finish"):
        results.archive_records("demo")
    assert list(results.load_records("demo")["i"]) == [0, 1, 2, 3, 4]
    with pytest.raises(SystemExit):
        results.main(["archive", "nosuch"])
    assert "NAME: no data/results/<NAME>.jsonl for nosuch" in capsys.readouterr().err


def test_append_records_takes_a_tools_out_path_as_text(tmp_path):
    """A tool's --out reaches append_records as argparse's str (kv_fragmentation --out)."""
    import json

    from sm120_workbook.results import append_records

    out = tmp_path / "sub" / "kv.jsonl"
    assert append_records("kv_fragmentation", [{"kind": "kernel_layout"}], path=str(out)) == out
    assert json.loads(out.read_text())["kind"] == "kernel_layout"


def test_a_machine_without_a_gpu_still_gives_every_provenance_key(monkeypatch):
    """gpu_info on a CPU-only machine names gpu and driver (None), so records from a fake server
    carry every key of PROVENANCE_KEYS."""
    import torch

    from sm120_workbook.provenance import provenance
    from sm120_workbook.results import PROVENANCE_KEYS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rec = provenance("python -m x")
    assert set(PROVENANCE_KEYS) <= set(rec) and rec["gpu"] is None and rec["driver"] is None
    assert {"flashinfer", "sgl_kernel"} <= set(rec)   # versions of what serves prefill, drafts, FlashMLA

