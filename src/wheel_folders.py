"""Pack the GPU machine's SGLang wheels into folders that each fit one device call.

The GPU machine has no network, so the wheels travel with the calls: one folder a call, beside
the tree it ships (tracked files and untracked ones git does not ignore), 64 MiB in all. The
tree (records, traces, code and notebooks) grows with every session, so folders made once by
../shared/device/wheelhouse.sh stop fitting. This repacks every wheel of
the `.whl*` folders into `.whl1`, `.whl2`, ... of at most the room the tree leaves, largest
first (first-fit decreasing), writes each folder's install.sh, and removes the folders left over.

Wheels that share a top-level directory (a namespace package such as `opentelemetry`) stay in
one folder: `pip install --target --upgrade` replaces a top-level directory that exists, so a
later call would delete what an earlier one put there. (`bin/`, where 18 wheels put console
scripts, is the exception: grouping on it would make one folder too big, and nothing here runs
/tmp/site/bin, so each call's scripts may replace the last's.) Static archives (`lib*.a`) are dropped from
the wheels first: they are for linking C++ against a package, and Python never loads them.
xgrammar 0.2.1 ships a 31 MB `libxgrammar.a` in its 45 MB wheel, which would otherwise stop
fitting a call once the tree passes ~21 MiB. (wheelhouse.sh strips sgl_kernel's unused kernels
the same way.)

    python -m sm120_workbook.wheel_folders            # from the project root (make wheelhouse runs it)
    python -m sm120_workbook.wheel_folders --check    # whether they still fit (make device-wheel runs it)
"""
from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CALL_LIMIT_BYTES = 64 << 20    # what one device call ships: the tree, plus the folders it carries
MARGIN_BYTES = 2 << 20         # for the scripts and .whlp a call carries, and a session's records
INSTALL_SH = """#!/bin/bash
# install this folder's wheels into /tmp/site on the GPU machine; exits with pip's status.
# Once per machine and content: a reinstall gives every file a new mtime, and builds that track
# headers (FlashInfer's ninja builds, tvm-ffi's, this project's kernel: 75 s in session 33) would
# then rebuild at the next server. The content is the wheels' names and, for the project's own
# wheel (.whlp, whose name stays the same from commit to commit), the COMMIT file beside them.
cd "$(dirname "$0")" || exit 1
site=${SM120_SITE:-/tmp/site}
stamp="$site/.installed-$(basename "$PWD")"
wheels=$(ls ./*.whl)
content="$wheels$(test -f COMMIT && printf '\\ncommit %s' "$(cat COMMIT)")"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$content" ]; then
  echo "wheels of $(basename "$PWD") already installed"; exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" ./*.whl 2>&1 | grep -v 'already exists'
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ]; then echo "installed $(echo "$wheels" | wc -l) wheels from $(basename "$PWD")"; echo "$content" > "$stamp"
else echo "pip failed (exit $rc) installing the wheels of $(basename "$PWD")" >&2; fi
exit "$rc"
"""


def shipped_tree_bytes(root: Path) -> int:
    """The size of what every device call ships from `root`: the files git tracks and the untracked
    ones it does not ignore (a stray `make gpu-check OUT=...` folder travels too)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def top_level_names(wheel: Path) -> set[str]:
    """What a wheel installs at the top of site-packages (packages, single-file modules, and what
    its .data/purelib and .data/platlib hold), less `bin` (see the module's docstring)."""
    try:
        members = zipfile.ZipFile(wheel).namelist()
    except zipfile.BadZipFile:
        raise ValueError(f"{wheel}: not a readable wheel (a truncated download?); delete it and rerun "
                         "../shared/device/wheelhouse.sh") from None
    names = set()
    for m in members:
        parts = m.split("/")
        if parts[0].endswith(".data") and len(parts) > 2 and parts[1] in ("purelib", "platlib"):
            names.add(parts[2])
        elif not parts[0].endswith((".dist-info", ".data")):
            names.add(parts[0])
    return names - {"bin"}


def project_of(wheel: Path) -> str:
    """A wheel's project name, normalized (its file name's first field, PEP 427/503)."""
    return wheel.name.split("-")[0].lower().replace("_", "-").replace(".", "-")


def strip_static_archives(wheel: Path) -> int:
    """Rewrite `wheel` without its static archives (lib*.a); return the bytes saved (0: none
    there). Its RECORD still lists them: pip installs what the wheel holds and does not miss the rest."""
    with zipfile.ZipFile(wheel) as z:
        drop = [i for i in z.infolist() if Path(i.filename).name.startswith("lib") and i.filename.endswith(".a")]
        if not drop:
            return 0
        before = wheel.stat().st_size
        tmp = wheel.with_name(wheel.name + ".tmp")
        with zipfile.ZipFile(tmp, "w") as out:
            for i in z.infolist():
                if i not in drop:
                    out.writestr(i, z.read(i), compress_type=i.compress_type)
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def install_groups(wheels: list[Path]) -> list[list[Path]]:
    """Wheels joined wherever they share a top-level name (transitively): each group must be
    installed by one pip call."""
    groups: list[tuple[set[str], list[Path]]] = []
    for w in wheels:
        names, members = top_level_names(w), [w]
        for g in [g for g in groups if g[0] & names]:
            groups.remove(g)
            names |= g[0]
            members += g[1]
        groups.append((names, members))
    return [sorted(m) for _, m in groups]


def pack(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of `sizes` in bins of at most `limit`, first-fit decreasing."""
    too_big = [s for s in sizes if s > limit]
    if too_big:
        raise ValueError(f"limit: an item of {max(too_big)} bytes is larger than the {limit} bytes a folder may hold")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = next((j for j, r in enumerate(room) if r >= sizes[i]), None)
        if j is None:
            bins.append([])
            room.append(limit)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= sizes[i]
    return bins


def numbered_folders(root: Path) -> list[Path]:
    """root/.whl1, .whl2, ...: the SGLang wheel folders (not .whlp, the project's own, nor .whl-pool)."""
    return sorted(p for p in root.glob(".whl*") if p.is_dir() and p.name[4:].isdigit())


def repack(root: Path, limit: int) -> list[Path]:
    """Move every wheel of root/.whl*/ into root/.whl1, .whl2, ... of at most `limit` bytes each
    (install groups kept whole), write install.sh in each, remove the rest; return the folders.
    Nothing moves until the packing is known to fit. The wheels then pass through
    root/.whl-pool, so a rerun after an interruption finds them all."""
    pool = root / ".whl-pool"
    old = numbered_folders(root)
    found = sorted({w.name: w for w in [*pool.glob("*.whl"), *(w for d in old for w in d.glob("*.whl"))]}.values())
    if not found:
        raise FileNotFoundError(f"no wheels in {root}/.whl*/: run ../shared/device/wheelhouse.sh first")
    by_project: dict[str, list[str]] = {}
    for w in found:
        by_project.setdefault(project_of(w), []).append(w.name)
    twice = {p: names for p, names in by_project.items() if len(names) > 1}
    if twice:
        raise ValueError("two versions of one project (pip would refuse their folder): "
                         + "; ".join(", ".join(n) for n in twice.values())
                         + ". Remove the stale wheel, or rerun make wheelhouse, which starts from empty folders")
    for w in found:
        strip_static_archives(w)
    groups = install_groups(found)
    sizes = [sum(w.stat().st_size for w in g) for g in groups]
    try:
        bins = pack(sizes, limit)
    except ValueError:
        big = max(range(len(groups)), key=lambda i: sizes[i])
        raise ValueError(f"{', '.join(w.name for w in groups[big])} ({sizes[big] / 2**20:.1f} MiB) does not fit "
                         f"a folder of {limit / 2**20:.1f} MiB. A call ships the tree beside its folder: "
                         "shrink the tree (archive records: python -m sm120_workbook.results archive NAME) or that wheel. "
                         "Nothing was moved") from None
    pool.mkdir(exist_ok=True)
    name_of = {}
    for w in found:
        if w.parent != pool:
            shutil.move(str(w), pool / w.name)
        name_of[w] = pool / w.name
    for d in old:
        shutil.rmtree(d)
    folders = []
    for n, b in enumerate(bins, start=1):
        folder = root / f".whl{n}"
        folder.mkdir()
        for w in (w for i in b for w in groups[i]):
            shutil.move(str(name_of[w]), folder / w.name)
        (folder / "install.sh").write_text(INSTALL_SH)
        folders.append(folder)
    pool.rmdir()   # every wheel is in a folder now
    return folders


def folders_over_a_call(root: Path) -> list[tuple[str, int]]:
    """(folder, bytes over) for each root/.whlN/ that no longer fits one call beside the shipped
    tree and .whlp (which a working call carries too): the tree grows with every session's records,
    and a call over 64 MiB is refused before it starts."""
    def size(d: Path) -> int:
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

    base = shipped_tree_bytes(root) + (size(root / ".whlp") if (root / ".whlp").is_dir() else 0)
    return [(d.name, over) for d in numbered_folders(root) if (over := base + size(d) - CALL_LIMIT_BYTES) > 0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="the project root (holds .whl1 ...)")
    ap.add_argument("--limit-mib", type=float, default=None,
                    help="bytes a folder may hold, in MiB (default: 64 MiB less the shipped tree and a 2 MiB margin)")
    ap.add_argument("--check", action="store_true",
                    help="only say whether each folder still fits a call beside the tree and .whlp (exit 1 if not)")
    a = ap.parse_args(argv)
    root = a.root.resolve()
    if a.check or a.limit_mib is None:   # both size the shipped tree: what `git ls-files` names there
        try:
            subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            ap.error(f"--root: {root} is not a git checkout of the project (run from its root, or name it)")
    if a.check:
        over = folders_over_a_call(root)
        if not numbered_folders(root):
            print(f"no .whl1, .whl2 ... folders under {root} (make wheelhouse makes them)")
        for name, extra in over:
            print(f"{name} no longer fits a device call beside the shipped tree and .whlp "
                  f"({extra / 2**20:.2f} MiB over 64 MiB): run `python -m sm120_workbook.wheel_folders` to repack")
        return 1 if over else 0
    if a.limit_mib is not None:
        if not (math.isfinite(a.limit_mib) and a.limit_mib > 0):
            ap.error(f"--limit-mib: must be positive, got {a.limit_mib}")
        limit, where = int(a.limit_mib * 2**20), "given"
    else:
        tree = shipped_tree_bytes(root)
        limit, where = CALL_LIMIT_BYTES - tree - MARGIN_BYTES, f"shipped tree {tree / 2**20:.1f} MiB"
        if limit <= 0:
            sys.exit(f"the shipped tree ({tree / 2**20:.1f} MiB) leaves no room in a 64 MiB call")
    try:
        folders = repack(root, limit)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"wheel_folders: {e}")
    print(f"{where}; folders of at most {limit / 2**20:.1f} MiB, one device call each:")
    for f in folders:
        size = sum(w.stat().st_size for w in f.glob("*.whl"))
        print(f"  {f.name}: {len(list(f.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
