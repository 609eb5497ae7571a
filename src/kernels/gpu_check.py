"""Every GPU check of the kernel in one command, spread over the visible GPUs.

Device time is scarce (minutes per session), so the checks that a kernel change needs run
side by side: the correctness tests, the three compute-sanitizer tools, the SGLang backend
tests (where SGLang imports), the benchmark and the ablation. Timing jobs get a GPU of
their own where there are enough GPUs; otherwise jobs share GPUs in turn. Each job's log
and records land in --out; a summary says which passed.

    python -m sm120_workbook.kernels.gpu_check --out $OUT --tag v10
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from .build import load_kernel_module


def jobs(out: Path, tag: str | None) -> list[tuple[str, list[str], bool]]:
    """(name, command, timed): timed jobs should not share their GPU with another job."""
    py, tag_args = sys.executable, (["--tag", tag] if tag else [])
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
    out_jobs = [
        ("tests", pytest + ["tests/test_kernel_gpu.py", "-k", "not sanitizer"], False),
        ("sanitizer", pytest + ["tests/test_kernel_gpu.py", "-k", "sanitizer"], False),
        ("bench", [py, "-m", "sm120_workbook.kernels.bench", "--quick", "--out", str(out / "kernel_bench.jsonl")]
         + tag_args, True),
        ("ablation", [py, "-m", "sm120_workbook.kernels.ablation", "--out", str(out / "kernel_ablation.jsonl")]
         + tag_args, True),
    ]
    if importlib.util.find_spec("sglang") is not None:
        out_jobs.insert(2, ("backend", pytest + ["tests/test_backend_gpu.py"], False))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for logs and records")
    ap.add_argument("--tag", default=None, help="kernel version label for the records (NOTES.md)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU; none is visible to torch")
    a.out.mkdir(parents=True, exist_ok=True)
    load_kernel_module()   # build once here, so the jobs find it cached instead of queueing on the lock
    # The ablation's variant builds (CPU only, a minute or two) overlap the correctness jobs
    # instead of delaying the ablation; it finds them cached.
    prebuild = subprocess.Popen([sys.executable, "-c", "from sm120_workbook.kernels.ablation import build_all; build_all()"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    queues = assign(jobs(a.out, a.tag), torch.cuda.device_count())
    results: dict[str, int] = {}
    runners = []
    for gpu, queue in enumerate(queues):
        if not queue:
            continue
        # one line per job, in turn: its log, then its exit status for the summary
        script = "\n".join(f"{shlex.join(cmd)} > {shlex.quote(str(a.out / (name + '.log')))} 2>&1; "
                           f"echo {name} $? >> {shlex.quote(str(a.out / 'status'))}" for name, cmd, _ in queue)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), PYTHONUNBUFFERED="1")
        runners.append(subprocess.Popen(["bash", "-c", script], env=env))
        print(f"GPU {gpu}: {', '.join(name for name, _, _ in queue)}", flush=True)
    t0 = time.monotonic()
    for r in runners:
        r.wait()
    prebuild.wait()
    for line in (a.out / "status").read_text().splitlines():
        name, rc = line.split()
        results[name] = int(rc)
    (a.out / "status").unlink()
    print(f"all jobs done in {time.monotonic() - t0:.0f} s")
    for name, rc in results.items():
        tail = (a.out / f"{name}.log").read_text().strip().splitlines()[-1:] or [""]
        print(f"{'PASS' if rc == 0 else 'FAIL'} {name:10s} {tail[0][:150]}")
    return 0 if results and all(rc == 0 for rc in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
