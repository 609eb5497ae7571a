"""NVML sampler: a clean error where NVML is absent, the sampling logic against a stand-in NVML
module, the real thing on a GPU, and the tidy frame and chart on synthetic data."""
from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from sm120_workbook import nvml_sampler as ns


def _nvml_available() -> bool:
    try:
        ns.init_nvml().nvmlShutdown()
        return True
    except ns.NvmlUnavailableError:
        return False


@pytest.mark.skipif(_nvml_available(), reason="NVML works here; the no-NVML error path cannot be shown")
def test_without_nvml_it_raises_clearly():
    with pytest.raises(ns.NvmlUnavailableError, match="NVML is not available on this machine|pynvml"):
        with ns.NvmlSampler():
            pass


def _fake_nvml(n_gpus=2):
    """A stand-in for the pynvml module: enough to drive visible_gpus and sample_once."""
    class NVMLError(Exception):
        pass

    m = types.SimpleNamespace(NVMLError=NVMLError, NVML_PCIE_UTIL_TX_BYTES=0, NVML_PCIE_UTIL_RX_BYTES=1)
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)
    m.nvmlDeviceGetHandleByUUID = lambda u: ("h", int(u.split("-")[-1]))
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=10 * h[1] + 5, memory=3)
    m.nvmlDeviceGetPowerUsage = lambda h: 250_500
    def pcie(h, counter):
        if h[1] == 1:
            raise NVMLError("Not Supported")
        return 2000 if counter == 0 else 1000
    m.nvmlDeviceGetPcieThroughput = pcie
    m.nvmlShutdown = lambda: None
    return m


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    nv = _fake_nvml(4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g for g, _ in ns.visible_gpus(nv)] == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-x-1")
    assert ns.visible_gpus(nv) == [(0, ("h", 3)), (1, ("h", 1))]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-abc")
    with pytest.raises(ns.NvmlUnavailableError, match="MIG-abc"):
        ns.visible_gpus(nv)


def test_mixed_gpu_models_need_pci_bus_order(monkeypatch):
    """CUDA's default order (fastest first) and NVML's (PCI bus) differ once models mix: an index
    in CUDA_VISIBLE_DEVICES would sample the wrong GPU, so it is refused unless the order is PCI's."""
    nv = _fake_nvml(2)
    nv.nvmlDeviceGetName = lambda h: ["NVIDIA RTX PRO 6000 Blackwell", "NVIDIA RTX A4000"][h[1]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    with pytest.raises(ns.NvmlUnavailableError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        ns.visible_gpus(nv)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert ns.visible_gpus(nv) == [(0, ("h", 1))]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-x-1")   # a UUID names one GPU in any order
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    assert ns.visible_gpus(nv) == [(0, ("h", 1))]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")   # every GPU, numbered as CUDA does: unknown here too
    with pytest.raises(ns.NvmlUnavailableError, match="^CUDA_VISIBLE_DEVICES unset: .*CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        ns.visible_gpus(nv)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert ns.visible_gpus(nv) == [(0, ("h", 0)), (1, ("h", 1))]


def test_start_samples_stops_and_always_shuts_nvml(monkeypatch):
    """start/stop drive the sampling thread; NVML is shut once on every path, including
    visible_gpus' own errors (a MIG entry), which used to leave it initialised."""
    calls = {"init": 0, "shutdown": 0}
    def fake(n=2):
        nv = _fake_nvml(n)
        nv.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
        return nv
    def init():
        calls["init"] += 1
        return fake()
    monkeypatch.setattr(ns, "init_nvml", init)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with ns.NvmlSampler(interval_s=0.01) as s:
        time.sleep(0.1)
    assert calls == {"init": 1, "shutdown": 1}
    assert set(s.dataframe()["gpu"]) == {0, 1} and len(s.dataframe()) >= 2 * 2   # a loaded machine samples less
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-abc")
    with pytest.raises(ns.NvmlUnavailableError, match="MIG-abc"):
        ns.NvmlSampler().start()
    assert calls == {"init": 2, "shutdown": 2}


def _counting(monkeypatch, nv_of=lambda nv: nv):
    """init_nvml replaced by a fake (changed by `nv_of`) that counts its inits and shutdowns."""
    calls = {"init": 0, "shutdown": 0}

    def init():
        calls["init"] += 1
        nv = _fake_nvml(2)
        nv.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
        return nv_of(nv)

    monkeypatch.setattr(ns, "init_nvml", init)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    return calls


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -0.1, True, "0.2"])
def test_interval_must_be_a_finite_positive_number(bad):
    """NaN passed `interval_s <= 0` and the thread then waited no time between samples."""
    with pytest.raises(ValueError, match="^interval_s: must be a positive number"):
        ns.NvmlSampler(interval_s=bad)


def test_a_second_start_is_refused(monkeypatch):
    """Two starts initialised NVML twice, and one stop shut it down once, leaving a thread behind."""
    calls = _counting(monkeypatch)
    s = ns.NvmlSampler(interval_s=0.01).start()
    first = s._thread
    with pytest.raises(RuntimeError, match="^start: this NvmlSampler was already started"):
        s.start()
    s.stop()
    with pytest.raises(RuntimeError, match="^start: this NvmlSampler was already started"):
        s.start()   # nor after stop(): its series would start again at t=0
    assert calls == {"init": 1, "shutdown": 1} and not first.is_alive() and s.failure is None


def test_an_unexpected_error_in_the_thread_is_kept_for_the_caller(monkeypatch):
    """Not an NVMLError: it used to end the thread silently, and the series looked whole."""
    def failing(nv):
        n = {"k": 0}

        def util(h):
            n["k"] += 1
            if n["k"] > 2:
                raise OSError("driver went away")
            return types.SimpleNamespace(gpu=1, memory=1)

        nv.nvmlDeviceGetUtilizationRates = util
        return nv

    calls = _counting(monkeypatch, failing)
    with ns.NvmlSampler(interval_s=0.01) as s:
        deadline = time.monotonic() + 5
        while s._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not s._thread.is_alive()
    assert "OSError('driver went away')" in s.errors["sampler"] and s.failure == s.errors["sampler"]
    assert calls == {"init": 1, "shutdown": 1}


def test_stop_leaves_nvml_initialised_while_the_thread_runs_on(monkeypatch):
    """A thread stuck in an NVML call past stop()'s wait: NVML is not shut under it (said in
    errors); a later stop() finishes the job once the thread has ended."""
    release, inside = threading.Event(), threading.Event()

    def stuck(nv):
        def util(h):
            inside.set()
            release.wait(10)
            return types.SimpleNamespace(gpu=1, memory=1)

        nv.nvmlDeviceGetUtilizationRates = util
        return nv

    calls = _counting(monkeypatch, stuck)
    s = ns.NvmlSampler(interval_s=0.01)
    s.stop_timeout_s = 0.2
    s.start()
    assert inside.wait(5)
    s.stop()
    assert calls == {"init": 1, "shutdown": 0}
    assert "still running 0.2 s after stop(); NVML was left initialised" in s.failure
    release.set()
    s.stop_timeout_s = 5
    s.stop()
    assert calls == {"init": 1, "shutdown": 1} and s._thread is None


def test_sample_once_units_and_unsupported_metrics():
    s = ns.NvmlSampler(interval_s=0.1)
    s._nvml = _fake_nvml(2)
    s._gpus = [(0, ("h", 0)), (1, ("h", 1))]
    s.sample_once()
    df = s.dataframe()
    v = df.set_index(["gpu", "metric"])["value"]
    assert v[(0, "sm_util_pct")] == 5 and v[(1, "sm_util_pct")] == 15 and v[(1, "mem_util_pct")] == 3
    assert v[(0, "power_w")] == pytest.approx(250.5)
    assert v[(0, "pcie_tx_mb_s")] == pytest.approx(2.0) and v[(0, "pcie_rx_mb_s")] == pytest.approx(1.0)
    assert (1, "pcie_tx_mb_s") not in v.index and "Not Supported" in s.errors["pcie_tx_mb_s"]
    assert list(df.columns) == ["t", "gpu", "metric", "value"]
    with pytest.raises(ValueError, match="interval_s"):
        ns.NvmlSampler(interval_s=0)


def test_each_gpu_is_stamped_when_its_reads_began_and_the_interval_is_measured():
    """Each PCIe query blocks ~20 ms a GPU: one time for all GPUs shifted GPU k's curve early by
    ~40 ms x k (0.28 s at TP8), and the recorded interval was the one asked for, not the one run."""
    s = ns.NvmlSampler(interval_s=0.05)
    nv = _fake_nvml(4)
    slow = nv.nvmlDeviceGetPowerUsage
    nv.nvmlDeviceGetPowerUsage = lambda h: time.sleep(0.03) or slow(h)
    s._nvml, s._gpus, s._t0 = nv, [(g, ("h", g)) for g in range(4)], time.monotonic()
    for _ in range(3):
        s.sample_once()
        time.sleep(0.05)
    t = s.dataframe().query("metric == 'sm_util_pct'").groupby("gpu")["t"].first()
    assert all(t[g + 1] - t[g] >= 0.025 for g in range(3)), t
    assert s.measured_interval_s >= 0.05 + 4 * 0.03 - 0.005


def test_the_sampler_keeps_to_the_gpus_it_is_given(monkeypatch):
    """A server of 2 ranks on a 4-GPU machine: the idle two would read as imbalance."""
    _counting(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with ns.NvmlSampler(interval_s=0.01, gpus=[1]) as s:
        time.sleep(0.05)
    assert set(s.dataframe()["gpu"]) == {1}
    with pytest.raises(ns.NvmlUnavailableError, match=r"^gpus: CUDA indices \[2\] are not visible"):
        ns.NvmlSampler(gpus=[1, 2]).start()
    for bad in ([], "0", [0.0], [-1], [True]):
        with pytest.raises(ValueError, match="^gpus: expected a non-empty list of CUDA indices"):
            ns.NvmlSampler(gpus=bad)


@pytest.mark.gpu
def test_real_sampling_on_a_gpu():
    with ns.NvmlSampler(interval_s=0.05) as s:
        time.sleep(0.5)
    df = s.dataframe()
    assert len(df) > 0 and set(df["metric"]) >= {"sm_util_pct", "mem_util_pct", "power_w"}
    assert df.groupby("metric")["t"].count().min() >= 3


def test_frame_summary_and_chart_on_synthetic_samples(seed, tmp_path):
    from sm120_workbook.charts import save_chart

    rng = np.random.default_rng(seed)
    rows = [(t * 0.2, g, m, float(rng.uniform(0, 100)))
            for t in range(20) for g in range(2) for m in ns.METRICS]
    df = ns.samples_frame(rows)
    summ = ns.summarize(df)
    assert len(summ) == 2 * len(ns.METRICS) and (summ["max"] >= summ["mean"]).all()
    chart = ns.timeline_chart(df)
    spec = chart.to_dict()
    assert spec["facet"]["row"]["field"] == "metric"
    assert all(p.stat().st_size > 0 for p in save_chart(chart, "nvml_test", tmp_path))
    with pytest.raises(ValueError, match="no samples"):
        ns.timeline_chart(df, metrics=("nope",))
    with pytest.raises(ValueError, match="no NVML samples"):
        ns.summarize(df.iloc[:0])
