"""The machine a notebook runs on, and the two ceilings later notebooks divide by.

`measure_copy_bandwidth` (device-to-device copy, GB/s counting bytes read + written) and
`measure_bf16_matmul_tflops` are the practical memory and tensor-core ceilings of *this*
GPU; `target_hardware_table` lists the GPUs the workbook targets (from roofline.TARGET_GPUS).
"""
from __future__ import annotations

import os
import platform
import statistics

from .provenance import provenance
from .roofline import TARGET_GPUS


# The compute capability majors that each MLA library's kernels are built for (the benchmark's
# impl and SGLang's attention backend share the name). sgl_kernel ships FlashMLA as sm_90a,
# sm_100 and sm_103 code only, with no PTX: on sm_120 (or sm_80-89) it has no kernel to run.
LIBRARY_MAJORS = {"flashmla": (9, 10)}


def unsupported_reason(library: str, capability: tuple[int, int]) -> str | None:
    """Why `library` cannot run on a GPU of compute capability `capability`, or None where it
    can (or may: one that is not installed still fails when it is called, and says so)."""
    majors = LIBRARY_MAJORS.get(library)
    if majors is None or capability[0] in majors:
        return None
    built = " or ".join(f"{m}.x" for m in majors)
    return f"{library} has no kernel for this GPU (sm_{capability[0]}{capability[1]}), only for compute capability {built}"


class NoGPUError(RuntimeError):
    """A measurement that needs a CUDA GPU was asked for on a machine without one."""


def _require_cuda(what: str):
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError(f"{what} needs a CUDA GPU; torch.cuda.is_available() is False on this machine")
    return torch


# Set by notebooks/conftest.py for nbval: cell outputs are compared with those the notebooks were
# saved with, which render data/results/, so a GPU machine must render those too.
RECORDED_ONLY_ENV = "SM120_RECORDED_ONLY"


def live_gpu() -> tuple[bool, str]:
    """Whether a notebook may run its GPU cells live here, and if not, why (for its SKIPPED line).

    No CUDA GPU, or $SM120_RECORDED_ONLY set (nbval, `make test`): the notebook shows the
    recorded results instead. The reason names the GPU first, so a machine without one prints
    the same line either way.
    """
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU (torch.cuda.is_available() is False)"
    if os.environ.get(RECORDED_ONLY_ENV, "") not in ("", "0"):
        return False, (f"{RECORDED_ONLY_ENV} is set (nbval compares the recorded results the "
                       "notebooks were saved with)")
    return True, ""


def describe_machine() -> dict:
    """GPUs (name, sm arch, SM count, memory), driver and library versions, host basics."""
    prov = provenance(command="")
    gpus = []
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append({"index": i, "name": p.name, "sm_arch": f"sm_{p.major}{p.minor}",
                             "sm_count": p.multi_processor_count,
                             "mem_gib": round(p.total_memory / 2**30, 1)})
    except ImportError:
        pass
    return {
        "gpus": gpus,
        "driver": prov.get("driver"),
        "cuda_runtime": prov.get("cuda_runtime"),
        "torch": prov.get("torch"),
        "sglang": prov.get("sglang"),
        "triton": prov.get("triton"),
        "nvcc": prov.get("nvcc"),
        "python": prov.get("python"),
        "commit": prov.get("commit"),
        "host": platform.node(),
        "cpu_count": _cpu_count(),
        "platform": platform.platform(),
    }


def _cpu_count() -> int | None:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _time_ms(torch, fn, repeats: int, warmup: int) -> list[float]:
    """Per-call times in ms, each bracketed by CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _check_repeats(repeats, warmup):
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive int, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected a non-negative int, got {warmup!r}")


def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20, warmup: int = 3,
                           device: int = 0) -> dict:
    """Device-to-device copy of `nbytes`; GB/s counts bytes read plus bytes written.

    Returns dict(copy_gbps (median), copy_gbps_max, ms_median, nbytes, bytes_moved, repeats).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1 << 20:
        raise ValueError(f"nbytes: expected an int >= 1 MiB, got {nbytes!r}")
    _check_repeats(repeats, warmup)
    torch = _require_cuda("measure_copy_bandwidth")
    n = nbytes // 4
    with torch.cuda.device(device):
        src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
        dst = torch.empty_like(src)
        times = _time_ms(torch, lambda: dst.copy_(src), repeats, warmup)
        del src, dst
    moved = 2 * n * 4
    med = statistics.median(times)
    return {"copy_gbps": moved / (med * 1e6), "copy_gbps_max": moved / (min(times) * 1e6),
            "ms_median": med, "nbytes": n * 4, "bytes_moved": moved, "repeats": repeats}


def measure_bf16_matmul_tflops(n: int = 8192, repeats: int = 20, warmup: int = 3,
                               device: int = 0) -> dict:
    """An n x n x n bf16 matmul (random data); TFLOP/s = 2 n^3 / median time.

    Returns dict(bf16_tflops (median), bf16_tflops_max, ms_median, n, repeats).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 64:
        raise ValueError(f"n: expected an int >= 64, got {n!r}")
    _check_repeats(repeats, warmup)
    torch = _require_cuda("measure_bf16_matmul_tflops")
    with torch.cuda.device(device):
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
        times = _time_ms(torch, lambda: torch.matmul(a, b, out=c), repeats, warmup)
        del a, b, c
    flops = 2 * n**3
    med = statistics.median(times)
    return {"bf16_tflops": flops / (med * 1e9), "bf16_tflops_max": flops / (min(times) * 1e9),
            "ms_median": med, "n": n, "repeats": repeats}


def target_hardware_table():
    """The target GPUs as a DataFrame (SMs, bandwidth, bf16 rate, smem/block, wgmma)."""
    import pandas as pd

    rows = []
    for name, g in TARGET_GPUS.items():
        rows.append({
            "gpu": name,
            "arch": g["sm_arch"],
            "SMs": g["sms"],
            "mem GB/s (spec)": g["mem_gbps_spec"],
            "mem GB/s (roofline)": g["mem_gbps"],
            "bf16 TFLOP/s": g["bf16_tflops"],
            "smem/block (B)": g["smem_per_block_optin"],
            "wgmma": "yes" if g["wgmma"] else "no",
        })
    return pd.DataFrame(rows).set_index("gpu")


def target_name(gpu: str) -> str:
    """The target table's name for a GPU as torch names it ("NVIDIA H200" -> "H200"), else as given."""
    return next((name for name in TARGET_GPUS if name in str(gpu)), str(gpu))


def recorded_ceilings(records):
    """Per GPU (named as in the target table): how many ceilings runs were recorded, when, and
    their median and range. Many runs are recorded (every benchmark measures its own), and a
    chart of each would stack them. `mma_sync_tflops` is the rate of the tensor path this kernel
    may use (mma.sync; torch.matmul's bf16_tflops is wgmma's on the H200), in the runs that
    measured it (`mma_sync_runs`)."""
    import pandas as pd

    cols = ["gpu", "runs", "first", "last", "copy_gbps", "copy_gbps_min", "copy_gbps_max",
            "bf16_tflops", "bf16_tflops_min", "bf16_tflops_max", "mma_sync_tflops", "mma_sync_runs"]
    if records is None or not len(records):
        return pd.DataFrame(columns=cols)
    r = records.assign(gpu=records["gpu"].map(target_name), day=records["date"].astype(str).str[:10])
    if "mma_sync_tflops" not in r:
        r = r.assign(mma_sync_tflops=float("nan"))
    g = r.groupby("gpu")
    out = pd.DataFrame({"runs": g.size(), "first": g["day"].min(), "last": g["day"].max()})
    for m in ("copy_gbps", "bf16_tflops"):
        out[m], out[f"{m}_min"], out[f"{m}_max"] = g[m].median(), g[m].min(), g[m].max()
    out["mma_sync_tflops"], out["mma_sync_runs"] = g["mma_sync_tflops"].median(), g["mma_sync_tflops"].count()
    return out.reset_index()[cols]


def ceilings_frame(records=None):
    """Tidy frame of ceilings: the target table's numbers (the roofline's inputs, each labelled by
    where it comes from: a spec, a measurement by others, or the median of our records), and per
    GPU the median of its measured records (`results.load_records("ceilings")`, or None), labelled
    as recorded, with their runs and dates.

    Returns columns gpu, metric, value, source; a GPU's measured rows say how many runs.
    """
    import pandas as pd

    def kind(source: str) -> str:
        # what a target-table number is: a spec sheet's, someone else's measurement, or our records'
        for key, label in (("measured by others", "roofline input: measured by others"),
                           ("median", "roofline input: recorded median"), ("spec", "roofline input: spec")):
            if key in source:
                return label
        return "roofline input"

    rows = []
    for name, g in TARGET_GPUS.items():
        rows.append({"gpu": name, "metric": "memory GB/s", "value": g["mem_gbps"], "source": kind(g["mem_source"])})
        rows.append({"gpu": name, "metric": "bf16 TFLOP/s", "value": g["bf16_tflops"],
                     "source": kind(g["tflops_source"])})
    for r in recorded_ceilings(records).itertuples():
        src = f"measured, recorded: median of {r.runs} runs, {r.first} to {r.last}"
        rows.append({"gpu": r.gpu, "metric": "memory GB/s", "value": r.copy_gbps, "source": src})
        rows.append({"gpu": r.gpu, "metric": "bf16 TFLOP/s", "value": r.bf16_tflops, "source": src})
    return pd.DataFrame(rows)


def ceilings_chart(frame, source: str = ""):
    """Altair bars: memory and bf16 ceilings per GPU, each bar labelled by its source (the
    roofline's inputs by where they come from; the measured ones as recorded). `source`
    (results.source_label of the ceilings records) names their GPUs, commits and dates in the
    subtitle, so that the saved chart says it too."""
    import altair as alt

    from .charts import chart_title

    return (
        alt.Chart(frame)
        .mark_bar()
        .encode(y=alt.Y("gpu:N", title=None), x=alt.X("value:Q", title=None),
                color=alt.Color("source:N"), yOffset="source:N",
                tooltip=["gpu", "metric", alt.Tooltip("value:Q", format=",.0f"), "source"])
        .properties(width=300, height=120)
        .facet(column=alt.Column("metric:N", title=None))
        .resolve_scale(x="independent")
        .properties(title=chart_title("Memory and bf16 ceilings: roofline inputs and recorded measurements", source))
    )
