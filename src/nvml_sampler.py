"""Per-GPU activity while a server works: a background thread polling NVML.

    with NvmlSampler(interval_s=0.2) as s:
        ... run requests ...
    df = s.dataframe()          # tidy: t, gpu, metric, value

Metrics (NVML's own meaning):
- sm_util_pct: % of the driver's sample period (1/6 s to 1 s, by product; not ours) in which at
  least one kernel ran (nvmlDeviceGetUtilizationRates.gpu): one CTA on one SM reads 100%, so this
  is "GPU busy", not a share of SMs
- mem_util_pct: % of that period in which device memory was read or written (….memory); a busy
  fraction, not a fraction of peak bandwidth
- power_w: board power draw; on Ampere and newer (not GA100) NVML averages it over 1 s
- pcie_tx_mb_s / pcie_rx_mb_s: PCIe throughput (NVML reports KB/s over a 20 ms window)

GPUs are those this process may use: CUDA_VISIBLE_DEVICES (indices or GPU- UUIDs) if set, else
all that NVML lists, or of those the `gpus` given (a server's own); `gpu` is the CUDA index as
the server sees it. Each GPU's samples carry the time its reads began: reading 8 GPUs with PCIe
takes ~0.3 s, so one time for all would shift GPU k's curve by ~40 ms x k.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Sequence

import numpy as np

from .service import check_positive

METRICS = ("sm_util_pct", "mem_util_pct", "power_w", "pcie_tx_mb_s", "pcie_rx_mb_s")
METRIC_TITLES = {
    "sm_util_pct": "GPU busy: a kernel running (%)",
    "mem_util_pct": "memory busy (%)",
    "power_w": "power, NVML's 1 s average (W)",
    "pcie_tx_mb_s": "PCIe TX (MB/s)",
    "pcie_rx_mb_s": "PCIe RX (MB/s)",
}
COLUMNS = ("t", "gpu", "metric", "value")


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used here (no driver, no GPU, or nvidia-ml-py missing)."""


def init_nvml():
    """Import and initialise NVML, or raise NvmlUnavailableError saying why."""
    try:
        import pynvml
    except ImportError as e:
        raise NvmlUnavailableError(f"nvidia-ml-py (pynvml) is not installed: {e}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise NvmlUnavailableError(
            f"NVML is not available on this machine ({e}): no NVIDIA driver or GPU") from None
    return pynvml


def visible_gpus(pynvml) -> list[tuple[int, object]]:
    """[(cuda index, NVML handle)] for the GPUs CUDA_VISIBLE_DEVICES leaves visible."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = ([str(i) for i in range(pynvml.nvmlDeviceGetCount())] if cvd is None
               else [e.strip() for e in cvd.split(",") if e.strip()])
    if any(e.isdigit() for e in entries) and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        # CUDA numbers GPUs fastest first, NVML by PCI bus: the same on a machine of one model
        names = {pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())}
        if len(names) > 1:
            given = "CUDA_VISIBLE_DEVICES unset" if cvd is None else f"CUDA_VISIBLE_DEVICES={cvd!r}"
            raise NvmlUnavailableError(
                f"{given}: CUDA numbers GPUs fastest first, NVML by PCI bus, and this "
                f"machine mixes models ({sorted(map(str, names))}): set CUDA_DEVICE_ORDER=PCI_BUS_ID "
                "or name the GPUs by UUID")
    out = []
    for cuda_idx, entry in enumerate(entries):
        if entry.isdigit():
            out.append((cuda_idx, pynvml.nvmlDeviceGetHandleByIndex(int(entry))))
        elif entry.startswith("GPU-"):
            out.append((cuda_idx, pynvml.nvmlDeviceGetHandleByUUID(entry)))
        else:
            raise NvmlUnavailableError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is not a GPU index or GPU- UUID")
    return out


class NvmlSampler:
    """Samples every visible GPU every `interval_s` seconds on a daemon thread.

    `errors` holds what went wrong, by metric: an NVMLError of one metric (that metric skipped),
    and under THREAD_ERRORS an error that ended the sampling thread early or a thread that outlived
    stop(); `failure` says whether the series may be cut short."""

    # errors' keys for the thread itself: the exception that ended it, a stop() it outlived
    THREAD_ERRORS = ("sampler", "stop")
    stop_timeout_s = 10.0

    def __init__(self, interval_s: float = 0.2, pcie: bool = True, gpus: Sequence[int] | None = None):
        check_positive("interval_s", interval_s)   # finite too: NaN would pass `<= 0` and spin
        if gpus is not None and (isinstance(gpus, (str, bytes)) or not gpus
                                 or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)):
            raise ValueError(f"gpus: expected a non-empty list of CUDA indices, got {gpus!r}")
        self.interval_s = interval_s
        self.pcie = pcie  # each PCIe query blocks ~20 ms per GPU and direction
        self.gpus = None if gpus is None else sorted(set(gpus))
        self.rows: list[tuple[float, int, str, float]] = []
        self.sample_starts: list[float] = []   # when each round of reads began (s from start)
        self.errors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._gpus: list[tuple[int, object]] = []
        self._t0 = 0.0
        self._started = False

    @property
    def failure(self) -> str | None:
        """Why the sampled series may be cut short (THREAD_ERRORS), or None."""
        return "; ".join(self.errors[k] for k in self.THREAD_ERRORS if k in self.errors) or None

    def __enter__(self) -> "NvmlSampler":
        self.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def start(self) -> "NvmlSampler":
        if self._started:   # a second nvmlInit would be shut once, and the series would restart at t=0
            raise RuntimeError("start: this NvmlSampler was already started; use a new one per window")
        self._nvml = init_nvml()
        try:
            self._gpus = visible_gpus(self._nvml)
        except BaseException as e:  # whatever visible_gpus raised, NVML is shut again, once
            nv, self._nvml = self._nvml, None
            nv.nvmlShutdown()
            if isinstance(e, nv.NVMLError):  # e.g. a visible index NVML cannot resolve
                raise NvmlUnavailableError(f"NVML could not open the visible GPUs: {e}") from e
            raise
        if self.gpus is not None:   # only the server's GPUs: an idle neighbour would read as imbalance
            missing = sorted(set(self.gpus) - {g for g, _ in self._gpus})
            self._gpus = [(g, h) for g, h in self._gpus if g in self.gpus]
            if missing:
                nv, self._nvml = self._nvml, None
                nv.nvmlShutdown()
                raise NvmlUnavailableError(f"gpus: CUDA indices {missing} are not visible to this process")
        if not self._gpus:
            nv, self._nvml = self._nvml, None
            nv.nvmlShutdown()
            raise NvmlUnavailableError("NVML lists no visible GPU")
        self._t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        self._started = True
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self.stop_timeout_s)
            if self._thread.is_alive():   # still inside NVML: shutting it down under the thread is unsafe
                self.errors.setdefault("stop", f"the sampling thread was still running {self.stop_timeout_s:g} s "
                                               "after stop(); NVML was left initialised")
                return
            self._thread = None
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None

    def _loop(self) -> None:
        try:
            while True:
                self.sample_once()
                if self._stop.wait(self.interval_s):
                    break
        except Exception as e:  # noqa: BLE001 - a thread's error is otherwise lost: keep it for the caller
            self.errors.setdefault("sampler", f"sampling stopped at {time.monotonic() - self._t0:.1f} s: {e!r}")

    def _read(self, metric: str, fn):
        try:
            return fn()
        except self._nvml.NVMLError as e:  # e.g. NotSupported on some boards: note once, skip
            self.errors.setdefault(metric, str(e))
            return None

    @property
    def measured_interval_s(self) -> float | None:
        """The median time between rounds of reads as they ran: interval_s plus the reads' own
        time (~40 ms a GPU with PCIe), or None before two rounds."""
        d = np.diff(self.sample_starts)
        return float(np.median(d)) if len(d) else None

    def sample_once(self) -> None:
        nv = self._nvml
        self.sample_starts.append(time.monotonic() - self._t0)
        for gpu, h in self._gpus:
            t = time.monotonic() - self._t0   # this GPU's own time: the reads before it took a while
            util = self._read("util", lambda: nv.nvmlDeviceGetUtilizationRates(h))
            if util is not None:
                self.rows.append((t, gpu, "sm_util_pct", float(util.gpu)))
                self.rows.append((t, gpu, "mem_util_pct", float(util.memory)))
            mw = self._read("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h))
            if mw is not None:
                self.rows.append((t, gpu, "power_w", mw / 1000.0))
            if self.pcie:
                for metric, counter in (("pcie_tx_mb_s", nv.NVML_PCIE_UTIL_TX_BYTES),
                                        ("pcie_rx_mb_s", nv.NVML_PCIE_UTIL_RX_BYTES)):
                    kb = self._read(metric, lambda: nv.nvmlDeviceGetPcieThroughput(h, counter))
                    if kb is not None:
                        self.rows.append((t, gpu, metric, kb / 1000.0))

    def dataframe(self):
        return samples_frame(self.rows)


def samples_frame(rows):
    """Tidy DataFrame (t, gpu, metric, value) from (t, gpu, metric, value) tuples."""
    import pandas as pd

    return pd.DataFrame(list(rows), columns=list(COLUMNS))


def summarize(df):
    """Mean and max of each metric per GPU (and per any grouping columns present)."""
    if df is None or len(df) == 0:
        raise ValueError("df: no NVML samples")
    missing = set(COLUMNS) - set(df.columns)
    if missing:
        raise ValueError(f"df: missing columns {sorted(missing)}")
    keys = [c for c in ("backend", "spec", "ctx") if c in df.columns] + ["gpu", "metric"]
    return (df.groupby(keys)["value"].agg(["mean", "max"]).reset_index()
              .round({"mean": 1, "max": 1}))


def timeline_chart(df, metrics=("sm_util_pct", "mem_util_pct", "power_w"), title: str = ""):
    """Altair: one row per metric, one line per GPU, time on x."""
    import altair as alt

    missing = set(COLUMNS) - set(df.columns)
    if missing:
        raise ValueError(f"df: missing columns {sorted(missing)}")
    d = df[df["metric"].isin(metrics)].copy()
    if len(d) == 0:
        raise ValueError(f"df: no samples of {list(metrics)}")
    d["gpu"] = "GPU " + d["gpu"].astype(str)
    d["metric"] = d["metric"].map(lambda m: METRIC_TITLES.get(m, m))
    return (alt.Chart(d).mark_line(strokeWidth=1.2)
            .encode(x=alt.X("t:Q", title="time (s)"),
                    y=alt.Y("value:Q", title=None),
                    color=alt.Color("gpu:N", title="GPU"),
                    tooltip=["gpu", "metric", alt.Tooltip("t:Q", format=".1f"),
                             alt.Tooltip("value:Q", format=".1f")])
            .properties(width=520, height=110)
            .facet(row=alt.Row("metric:N", title=None,
                               sort=[METRIC_TITLES.get(m, m) for m in metrics]))
            .resolve_scale(y="independent")
            .properties(title=title or "Per-GPU activity (NVML)"))
