"""wheel_folders: the SGLang wheels repacked into folders that each fit one device call
(synthetic wheels: zip files of known size and top-level names)."""
from __future__ import annotations

import os
import subprocess
import zipfile

import pytest

from sm120_workbook import wheel_folders as wf

KIB = 1024


def _wheel(folder, name, top, size_kib):
    """A wheel `name` installing the top-level directory `top`, ~size_kib KiB on disk (stored)."""
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{top}/__init__.py", os.urandom(size_kib * KIB))
        z.writestr(f"{name}-1.0.dist-info/METADATA", "Name: " + name)
    return path


def test_pack_first_fit_decreasing_within_the_limit():
    bins = wf.pack([40, 30, 20, 15, 10], limit=50)
    assert sorted(sorted(b) for b in bins) == [[0, 4], [1, 2], [3]]
    with pytest.raises(ValueError, match="larger than the 50 bytes"):
        wf.pack([60, 10], limit=50)


def test_wheels_sharing_a_top_level_name_form_one_install_group(tmp_path):
    a = _wheel(tmp_path, "otel_api", "opentelemetry", 1)
    b = _wheel(tmp_path, "otel_sdk", "opentelemetry", 1)
    c = _wheel(tmp_path, "torchao", "torchao", 1)
    groups = wf.install_groups([a, c, b])
    assert sorted(len(g) for g in groups) == [1, 2]
    assert [a, b] in groups and wf.top_level_names(c) == {"torchao"}


def test_repack_fits_every_folder_keeps_groups_and_leaves_the_project_wheel(tmp_path):
    _wheel(tmp_path / ".whl1", "big", "big", 300)
    _wheel(tmp_path / ".whl1", "otel_api", "opentelemetry", 120)
    _wheel(tmp_path / ".whl2", "otel_sdk", "opentelemetry", 120)
    _wheel(tmp_path / ".whl2", "small", "small", 50)
    _wheel(tmp_path / ".whl5", "flashinfer", "flashinfer", 200)
    _wheel(tmp_path / ".whlp", "sm120_workbook", "sm120_workbook", 10)
    limit = 330 * KIB
    folders = wf.repack(tmp_path, limit)
    assert [f.name for f in folders] == [f".whl{n}" for n in range(1, len(folders) + 1)]
    assert not (tmp_path / ".whl-pool").exists() and (tmp_path / ".whlp").is_dir()
    assert sorted(p.name for p in tmp_path.glob(".whl*")) == sorted([f.name for f in folders] + [".whlp"])
    where = {}
    for f in folders:
        assert (f / "install.sh").read_text() == wf.INSTALL_SH
        assert sum(w.stat().st_size for w in f.glob("*.whl")) <= limit
        where.update({w.name.split("-")[0]: f.name for w in f.glob("*.whl")})
    assert set(where) == {"big", "otel_api", "otel_sdk", "small", "flashinfer"}
    assert where["otel_api"] == where["otel_sdk"]          # one pip call for the namespace
    # a second run finds the same wheels and packs them the same way
    again = wf.repack(tmp_path, limit)
    assert {w.name: f.name for f in again for w in f.glob("*.whl")} == \
        {w.name: f.name for f in folders for w in f.glob("*.whl")}


def test_a_wheel_too_big_for_any_call_is_named_and_nothing_moves(tmp_path):
    _wheel(tmp_path / ".whl3", "xgrammar", "xgrammar", 400)
    _wheel(tmp_path / ".whl3", "small", "small", 10)
    with pytest.raises(ValueError, match=r"xgrammar-1\.0-py3-none-any\.whl .* does not fit.*Nothing was moved"):
        wf.repack(tmp_path, 300 * KIB)
    assert len(list((tmp_path / ".whl3").glob("*.whl"))) == 2 and not (tmp_path / ".whl-pool").exists()
    folders = wf.repack(tmp_path, 500 * KIB)
    assert [f.name for f in folders] == [".whl1"] and len(list(folders[0].glob("*.whl"))) == 2


def test_an_interrupted_run_leaves_wheels_in_the_pool_and_a_rerun_finds_them(tmp_path):
    _wheel(tmp_path / ".whl-pool", "a", "a", 10)       # moved before the interruption
    _wheel(tmp_path / ".whl2", "b", "b", 10)           # not yet
    folders = wf.repack(tmp_path, 100 * KIB)
    assert sorted(w.name for f in folders for w in f.glob("*.whl")) == ["a-1.0-py3-none-any.whl",
                                                                          "b-1.0-py3-none-any.whl"]
    assert [f.name for f in folders] == [".whl1"]
    assert not (tmp_path / ".whl-pool").exists() and not (tmp_path / ".whl2").exists()


def test_two_versions_of_one_project_are_refused(tmp_path):
    _wheel(tmp_path / ".whl1", "tomlkit", "tomlkit", 1)                       # tomlkit-1.0
    stale = _wheel(tmp_path / ".whl5", "tomlkit", "tomlkit", 1)               # left by an earlier run
    stale = stale.rename(stale.with_name("TomlKit-0.9-py3-none-any.whl"))     # names normalize alike
    with pytest.raises(ValueError, match="two versions of one project") as e:
        wf.repack(tmp_path, 100 * KIB)
    assert "TomlKit-0.9-py3-none-any.whl" in str(e.value) and "tomlkit-1.0-py3-none-any.whl" in str(e.value)
    assert stale.exists()


def test_top_level_names_read_data_purelib_and_leave_bin_out(tmp_path):
    w = _wheel(tmp_path, "pkg", "pkg", 1)
    with zipfile.ZipFile(w, "a") as z:
        z.writestr("pkg-1.0.data/purelib/extra_mod.py", "x = 1")
        z.writestr("pkg-1.0.data/scripts/tool", "#!/bin/sh")
        z.writestr("bin/pkg-cli", "#!/bin/sh")
    assert wf.top_level_names(w) == {"pkg", "extra_mod.py"}
    broken = tmp_path / "broken-1.0-py3-none-any.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable wheel"):
        wf.top_level_names(broken)


def test_install_sh_exits_with_pips_status(tmp_path):
    folder = tmp_path / ".whl1"
    _wheel(folder, "a", "a", 1)
    (folder / "install.sh").write_text(wf.INSTALL_SH)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho 'ERROR: ResolutionImpossible'\nexit 3\n")
    (fake / "python3").chmod(0o755)
    site = tmp_path / "site"
    site.mkdir()
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", SM120_SITE=str(site))
    r = subprocess.run(["bash", str(folder / "install.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 3 and "pip failed (exit 3)" in r.stderr and "ResolutionImpossible" in r.stdout
    assert not (site / ".installed-.whl1").exists()   # a failed install is tried again
    (fake / "python3").write_text("#!/bin/sh\nexit 0\n")
    r = subprocess.run(["bash", str(folder / "install.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "installed 1 wheels from .whl1" in r.stdout


def _counting_install(tmp_path, folder):
    """install.sh of `folder` run against a fake pip that counts its calls: (install, calls, site)."""
    (folder / "install.sh").write_text(wf.INSTALL_SH)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    calls = tmp_path / "pip_calls"
    (fake / "python3").write_text(f"#!/bin/sh\necho x >> {calls}\nexit 0\n")
    (fake / "python3").chmod(0o755)
    site = tmp_path / "site"
    site.mkdir()
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", SM120_SITE=str(site))

    def install():
        return subprocess.run(["bash", str(folder / "install.sh")], env=env, capture_output=True, text=True)

    return install, lambda: calls.read_text().count("x"), site


def test_install_sh_installs_a_folder_once_per_machine(tmp_path):
    """A second call on the same machine leaves the installed files (and their mtimes) alone;
    a folder whose wheels changed installs again."""
    folder = tmp_path / ".whl4"
    _wheel(folder, "a", "a", 1)
    install, pip_calls, _ = _counting_install(tmp_path, folder)
    assert "installed 1 wheels" in install().stdout
    r = install()
    assert r.returncode == 0 and "wheels of .whl4 already installed" in r.stdout
    assert pip_calls() == 1
    _wheel(folder, "b", "b", 1)
    assert "installed 2 wheels" in install().stdout and pip_calls() == 2


def test_install_sh_installs_the_project_wheel_once_per_commit(tmp_path):
    """.whlp's wheel keeps its name from commit to commit: its COMMIT file decides. A reinstall of
    the same commit would give the kernel's headers new mtimes and rebuild it (75 s, session 33)."""
    folder = tmp_path / ".whlp"
    _wheel(folder, "sm120_workbook", "sm120_workbook", 1)
    (folder / "COMMIT").write_text("aaa\n")
    install, pip_calls, site = _counting_install(tmp_path, folder)
    assert "installed 1 wheels from .whlp" in install().stdout
    assert "wheels of .whlp already installed" in install().stdout
    assert (site / ".installed-.whlp").read_text().endswith("\ncommit aaa\n")
    (folder / "COMMIT").write_text("bbb\n")
    assert "installed 1 wheels from .whlp" in install().stdout
    assert pip_calls() == 2


def test_no_wheels_is_an_error_that_says_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="wheelhouse.sh"):
        wf.repack(tmp_path, 100)


def test_the_limit_is_what_the_shipped_tree_leaves(tmp_path, capsys):
    """A call ships the tracked files and the untracked ones git does not ignore (both count);
    ignored ones, the wheel folders among them, travel only when a call carries them."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/.whl*/\n/ignored.bin\n")
    (tmp_path / "tracked.bin").write_bytes(os.urandom(100 * KIB))
    (tmp_path / "untracked.bin").write_bytes(os.urandom(50 * KIB))
    (tmp_path / "ignored.bin").write_bytes(os.urandom(70 * KIB))
    subprocess.run(["git", "add", "tracked.bin", ".gitignore"], cwd=tmp_path, check=True)
    shipped = 150 * KIB + len((tmp_path / ".gitignore").read_bytes())
    assert wf.shipped_tree_bytes(tmp_path) == shipped
    _wheel(tmp_path / ".whl1", "a", "a", 20)
    assert wf.shipped_tree_bytes(tmp_path) == shipped
    assert wf.main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    limit_mib = (wf.CALL_LIMIT_BYTES - shipped - wf.MARGIN_BYTES) / 2**20
    assert f"folders of at most {limit_mib:.1f} MiB" in out and ".whl1: 1 wheels" in out


def test_static_archives_are_stripped_and_the_rest_kept(tmp_path):
    w = _wheel(tmp_path, "xgrammar", "xgrammar", 4)
    with zipfile.ZipFile(w, "a") as z:
        z.writestr("xgrammar/lib/libxgrammar.a", os.urandom(300 * KIB))
        z.writestr("xgrammar/data/table.a", "not an archive: kept")
    saved = wf.strip_static_archives(w)
    assert saved > 290 * KIB and wf.strip_static_archives(w) == 0       # once, then nothing to do
    names = zipfile.ZipFile(w).namelist()
    assert "xgrammar/lib/libxgrammar.a" not in names
    assert {"xgrammar/__init__.py", "xgrammar-1.0.dist-info/METADATA", "xgrammar/data/table.a"} <= set(names)
    assert zipfile.ZipFile(w).testzip() is None


def test_a_given_limit_needs_no_git_and_must_be_positive(tmp_path, capsys):
    _wheel(tmp_path / ".whl1", "a", "a", 20)                  # tmp_path is no git checkout
    assert wf.main(["--root", str(tmp_path), "--limit-mib", "1"]) == 0
    assert "given; folders of at most 1.0 MiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        wf.main(["--root", str(tmp_path), "--limit-mib", "0"])
    assert "--limit-mib: must be positive" in capsys.readouterr().err


def test_check_names_the_folders_that_no_longer_fit_beside_the_tree_and_whlp(tmp_path, capsys, monkeypatch):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/.whl*/\n")   # as the project's: the folders travel when carried
    (tmp_path / "tracked.bin").write_bytes(os.urandom(100 * KIB))
    subprocess.run(["git", "add", "tracked.bin"], cwd=tmp_path, check=True)
    _wheel(tmp_path / ".whl1", "a", "a", 40)
    _wheel(tmp_path / ".whl2", "b", "b", 10)
    _wheel(tmp_path / ".whlp", "sm120_workbook", "sm120_workbook", 10)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob(".whl*/*.whl"))
    # a 64 MiB call shrunk to 145 KiB: the tree (100), .whlp (10) and .whl2 (10) fit; with .whl1 (40) they do not
    monkeypatch.setattr(wf, "CALL_LIMIT_BYTES", 145 * KIB)
    over = wf.folders_over_a_call(tmp_path)
    assert [name for name, _ in over] == [".whl1"] and 0 < over[0][1] < 10 * KIB
    assert wf.main(["--root", str(tmp_path), "--check"]) == 1
    out = capsys.readouterr().out
    assert ".whl1 no longer fits" in out and ".whl2" not in out and "python -m sm120_workbook.wheel_folders" in out
    monkeypatch.setattr(wf, "CALL_LIMIT_BYTES", 400 * KIB)
    assert wf.main(["--root", str(tmp_path), "--check"]) == 0 and capsys.readouterr().out == ""
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob(".whl*/*.whl")) == before   # nothing moved
