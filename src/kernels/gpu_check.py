"""Every GPU check of the kernel in one command, spread over the visible GPUs.

Device time is scarce (minutes per session), so the checks that a kernel change needs run
side by side: the correctness tests, the three compute-sanitizer tools on the shipped build,
the SGLang backend tests (where SGLang imports), the benchmark, the ablation, the 64-row
kernel's phase trace, its CTA timeline at 4k, the issue's targets in interleaved rounds and,
with --ncu, an Nsight Compute profile of the headline shape read by sass_profile. Timing jobs
get a GPU of their own where there are enough GPUs; otherwise jobs share GPUs in turn. The
records land in --out, and the jobs' logs end up in one file, gpu_check.log (the device machine
returns at most 8 files: the records and the bench's ceilings are seven more), with a summary
of which passed and how long each took. On two H200s the whole set takes longer than one
10-minute device call allows; `--jobs` runs a part of it.

    python -m sm120_workbook.kernels.gpu_check --out $OUT --tag v14 [--ncu] [--jobs tests targets]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from .build import load_kernel_module


def ncu_path() -> str | None:
    return shutil.which("ncu") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/ncu"))), None)


def jobs(out: Path, tag: str | None, ncu: str | None = None) -> list[tuple[str, list[str], bool]]:
    """(name, command, timed): timed jobs should not share their GPU with another job."""
    py, tag_args = sys.executable, (["--tag", tag] if tag else [])
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
    out_jobs = [
        ("tests", pytest + ["tests/test_kernel_gpu.py", "-k", "not sanitizer"], False),
        # the three tools on the shipped build, recorded. All of sanitize.BUILDS (the shelved schedules
        # too) took ~8 minutes on an H200, most of a device call: `python -m ...sanitize` runs them.
        ("sanitizer", [py, "-m", "sm120_workbook.kernels.sanitize", "--tools", "memcheck", "racecheck", "synccheck",
                       "--builds", "default", "--out", str(out / "kernel_sanitizer.jsonl")] + tag_args, False),
        ("bench", [py, "-m", "sm120_workbook.kernels.bench", "--quick", "--out", str(out / "kernel_bench.jsonl")]
         + tag_args, True),
        ("ablation", [py, "-m", "sm120_workbook.kernels.ablation", "--out", str(out / "kernel_ablation.jsonl")]
         + tag_args, True),
        # the 64-row kernel's round phase by phase (clock64() stamps of a WIDE_TRACE build)
        ("phase_trace", [py, "-m", "sm120_workbook.kernels.phase_trace", "--out", str(out / "kernel_phase_trace.jsonl")]
         + tag_args, True),
        # the call around the loop at 4k, CTA by CTA (%globaltimer stamps of a CTA_TIMELINE build)
        ("cta_timeline", [py, "-m", "sm120_workbook.kernels.cta_timeline", "--ctx", "4096",
                          "--out", str(out / "kernel_timeline.jsonl")] + tag_args, True),
        # the targets timed in interleaved rounds: each ratio with its spread
        ("targets", [py, "-m", "sm120_workbook.kernels.targets", "--out", str(out / "kernel_targets.jsonl")]
         + tag_args, True),
    ]
    if importlib.util.find_spec("sglang") is not None:
        out_jobs.insert(2, ("backend", pytest + ["tests/test_backend_gpu.py"], False))
    if ncu:   # one launch at b1 q16 h8 64k of the kernel the workspace picks there, its SASS with stall samples
        from .verify_attention import choose_cta_rows

        kernel = "wide_kernel" if choose_cta_rows(1, 8, 16) == 64 else "split_kernel"
        # the CSV stays on the machine (sass_profile's table is in the log): the machine returns 8 files,
        # and the log, the bench's ceilings and six records are 8
        rep, csv = "/tmp/sm120_prof", "/tmp/sm120_prof_sass.csv"
        script = (f"{shlex.quote(ncu)} --profile-from-start off --set full --import-source yes -k regex:{kernel} "
                  f"-o {rep} -f {shlex.quote(py)} -m sm120_workbook.kernels.profile && "
                  f"{shlex.quote(ncu)} --import {rep}.ncu-rep --page source --csv --print-source sass > {shlex.quote(csv)} && "
                  f"{shlex.quote(py)} -m sm120_workbook.kernels.sass_profile {shlex.quote(csv)} --kernel {kernel}")
        out_jobs.append(("profile", ["bash", "-c", script], True))
    return out_jobs


def assign(job_list, num_gpus: int) -> list[list[tuple[str, list[str], bool]]]:
    """Queues, one per GPU: timed jobs first, each alone where the GPUs allow; the rest fill
    the remaining queues (or run after the timed job when GPUs are short)."""
    queues: list[list] = [[] for _ in range(max(1, num_gpus))]
    timed = [j for j in job_list if j[2]]
    other = [j for j in job_list if not j[2]]
    for i, j in enumerate(timed):
        queues[i % len(queues)].append(j)
    free = [q for q in queues if not q] or queues
    for i, j in enumerate(other):
        # untimed jobs go before a shared timed job, so the timing runs on a quiet GPU
        free[i % len(free)].insert(0, j)
    return queues


# the builds test_kernel_gpu.py makes besides the shipped one and checks.SCHEDULE_VARIANTS
TEST_BUILDS = (("BALANCED_SPLITS=0",), ("COMBINE_PDL=0",), ("POOL_TRACE",))


def prebuild_defines(names) -> list[tuple[str, ...]]:
    """The variant builds that the jobs named would otherwise make one at a time: the tests' (the
    schedule variants and TEST_BUILDS) and the ablation's. Only those jobs': the ablation's own ~30
    builds, made for `--jobs tests` too, pushed it past a 10-minute call on one fresh H200."""
    from .ablation import VARIANTS
    from .checks import SCHEDULE_VARIANTS

    builds = set()
    if "tests" in names:
        builds |= {tuple(sorted(d)) for d, _ in SCHEDULE_VARIANTS} | set(TEST_BUILDS)
    if "ablation" in names:
        builds |= {tuple(sorted(v.defines)) for v in VARIANTS.values()}
    return sorted(builds)


def select(job_list, names: list[str] | None):
    """The jobs named (all when names is None), in their usual order; an unknown name raises."""
    if names is None:
        return job_list
    unknown = sorted(set(names) - {j[0] for j in job_list})
    if unknown:
        raise ValueError(f"--jobs: no job named {', '.join(unknown)} here "
                         f"(jobs: {', '.join(j[0] for j in job_list)})")
    return [j for j in job_list if j[0] in names]


def start_prebuild(defines: list[tuple[str, ...]]) -> subprocess.Popen:
    """The variant builds (CPU only, a few minutes in parallel) overlap the jobs that need none
    instead of delaying those that do, which then find them cached."""
    code = f"from sm120_workbook.kernels.build import build_in_parallel; build_in_parallel({defines!r})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for logs and records")
    ap.add_argument("--tag", default=None, help="kernel version label for the records (NOTES.md)")
    ap.add_argument("--ncu", action="store_true", help="also profile the headline shape with Nsight Compute")
    ap.add_argument("--jobs", nargs="+", metavar="NAME",
                    help="run only these jobs (tests sanitizer backend bench ablation phase_trace cta_timeline "
                         "targets, profile with --ncu); default: all")
    a = ap.parse_args(argv)
    ncu = ncu_path() if a.ncu else None
    if a.ncu and not ncu:
        sys.exit("--ncu: Nsight Compute (ncu) is not on PATH nor in /usr/local/cuda*/bin")
    try:   # before anything else: a misspelt name is refused on any machine, at no device time
        job_list = select(jobs(a.out, a.tag, ncu), a.jobs)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU; none is visible to torch")
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs"   # one per job while they run; merged into gpu_check.log at the end
    logs.mkdir(exist_ok=True)
    load_kernel_module()   # build once here, so the jobs find it cached instead of queueing on the lock
    defines = prebuild_defines([j[0] for j in job_list])
    prebuild = start_prebuild(defines) if defines else None
    queues = assign(job_list, torch.cuda.device_count())
    # GPU i of this process is the i-th entry of an existing CUDA_VISIBLE_DEVICES, if any
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    results: dict[str, int] = {}
    seconds: dict[str, str] = {}
    runners = []
    for gpu, queue in enumerate(queues):
        if not queue:
            continue
        # one line per job, in turn: its log, then its exit status for the summary
        script = "\n".join(f"start=$SECONDS; {shlex.join(cmd)} > {shlex.quote(str(logs / (name + '.log')))} 2>&1; "
                           f"echo {name} $? $((SECONDS - start)) >> {shlex.quote(str(logs / 'status'))}"
                           for name, cmd, _ in queue)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible[gpu] if gpu < len(visible) else str(gpu),
                   PYTHONUNBUFFERED="1")
        runners.append(subprocess.Popen(["bash", "-c", script], env=env))
        print(f"GPU {gpu}: {', '.join(name for name, _, _ in queue)}", flush=True)
    t0 = time.monotonic()
    for r in runners:
        r.wait()
    if prebuild is not None:
        prebuild.wait()
    for line in (logs / "status").read_text().splitlines():
        name, rc, seconds[name] = line.split()
        results[name] = int(rc)
    summary = [f"all jobs done in {time.monotonic() - t0:.0f} s"]
    for name, rc in results.items():
        tail = (logs / f"{name}.log").read_text().strip().splitlines()[-1:] or [""]
        summary.append(f"{'PASS' if rc == 0 else 'FAIL'} {name:12s} {seconds[name]:>4s} s  {tail[0][:150]}")
    with open(a.out / "gpu_check.log", "w") as f:
        f.write("\n".join(summary) + "\n")
        for name, rc in results.items():
            f.write(f"\n===== {name} (exit {rc}) =====\n" + (logs / f"{name}.log").read_text())
    shutil.rmtree(logs)
    print("\n".join(summary) + f"\nlogs: {a.out / 'gpu_check.log'}")
    return 0 if results and all(rc == 0 for rc in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
