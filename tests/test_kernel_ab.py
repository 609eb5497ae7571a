"""The A/B tool (kernels/ab.py) without a GPU: its table and its refusals."""
from __future__ import annotations

import shutil

import pytest

from sm120_workbook.kernels import ab
from sm120_workbook.kernels.build import KERNEL_DIR, SOURCES
from sm120_workbook.results import NotRecorded


def _rec(variant, rnd, t, ctx=65536, diff=None):
    r = {"variant": variant, "round": rnd, "time_us": t, "batch": 1, "heads": 8, "q_len": 16, "ctx": ctx,
         "short_ctx": 0, "gpu": "NVIDIA H200"}
    return r if diff is None else dict(r, max_abs_diff=diff)


def test_ab_table_pairs_each_round():
    """Each round's ratio pairs that round's two timings; the medians are over the rounds, and a
    round with only one build timed is left out."""
    recs = [_rec("full", 0, 100.0, diff=0.0), _rec("src_v25", 0, 101.0, diff=0.0),
            _rec("full", 1, 99.0), _rec("src_v25", 1, 100.0),
            _rec("full", 2, 105.0), _rec("src_v25", 2, 100.0),
            _rec("full", 3, 90.0)]   # its pair is missing
    t = ab.ab_table(recs, "src_v25")
    assert t["shape"].tolist() == ["b1 h8 q16 64k"]
    row = t.iloc[0]
    assert row["rounds"] == 3 and row["shipped_us"] == 100.0 and row["baseline_us"] == 100.0
    assert row["ratio"] == round(100 / 101, 4) and row["ratio_min"] == round(99 / 100, 4)
    assert row["ratio_max"] == 1.05 and row["max_abs_diff"] == 0.0


def test_ab_table_says_whether_the_builds_outputs_agree():
    """A baseline build that computes something else would still be timed: the table says so
    (outputs_agree), and keeps its columns as before for records from before the check."""
    recs = [dict(_rec("full", 0, 100.0, diff=0.3), outputs_agree=False),
            dict(_rec("src_v25", 0, 101.0, diff=0.3), outputs_agree=False)]
    assert ab.ab_table(recs, "src_v25")["outputs_agree"].tolist() == [False]
    assert "outputs_agree" not in ab.ab_table([_rec("full", 0, 100.0), _rec("src_v25", 0, 101.0)], "src_v25")
    assert not 0.3 <= ab.AB_MAX_ABS_DIFF and 1e-2 <= ab.AB_MAX_ABS_DIFF


@pytest.mark.parametrize("baseline_out, agree", [(0.0, True), (0.3, False), (float("nan"), False)])
def test_run_ab_checks_that_the_builds_compute_the_same(monkeypatch, capsys, baseline_out, agree):
    """Round 0 compares the two builds' outputs: past AB_MAX_ABS_DIFF (or NaN) the records say
    outputs_agree False and a warning names the shape (no GPU: the builds and timing are stand-ins)."""
    import torch

    class Fn:
        tile_keys, cta_rows, num_splits = 16, 64, 66

        def __init__(self, value):
            self.value = value

        def __call__(self):
            return torch.full((16, 8, 512), self.value)

    monkeypatch.setattr(ab, "Inputs", lambda s: s)
    monkeypatch.setattr(ab, "build_sm120_mla", lambda x, kernel_source, custom_mask:
                        Fn(0.0 if kernel_source is None else baseline_out))
    monkeypatch.setattr(ab, "time_graph_us", lambda fn, reps: {"time_us": 1.0, "reps": reps})
    recs = ab.run_ab([ab.Shape(1, 8, 16, 4096)], "/baseline", "src_v30", rounds=2, reps=2)
    assert len(recs) == 4 and [r.get("outputs_agree") for r in recs] == [agree, agree, None, None]
    assert ("the builds' outputs differ" in capsys.readouterr().err) is not agree


def test_ab_table_keeps_masked_shapes_apart():
    """A shape timed with SGLang's custom mask (--masked-shape) is its own row, labelled "mask";
    records from before the field (NaN in a loaded table) count as unmasked."""
    import numpy as np

    recs = [_rec("full", 0, 100.0), _rec("src_v30", 0, 100.0),
            dict(_rec("full", 0, 110.0), custom_mask=np.bool_(True)), dict(_rec("src_v30", 0, 100.0), custom_mask=True),
            dict(_rec("full", 1, 100.0), custom_mask=float("nan")), dict(_rec("src_v30", 1, 100.0), custom_mask=False)]
    t = ab.ab_table(recs, "src_v30")
    assert t["shape"].tolist() == ["b1 h8 q16 64k", "b1 h8 q16 64k mask"]
    assert t["rounds"].tolist() == [2, 1] and t["ratio"].tolist() == [1.0, 1.1]


def test_ab_refuses_a_masked_decode_shape(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(KERNEL_DIR), "--baseline-name", "x", "--tag", "v9", "--masked-shape", "1,8,1,4096"])
    assert "--masked-shape: decode" in capsys.readouterr().err


def test_ab_refuses_a_baseline_that_is_not_another_revision(tmp_path, capsys):
    """--baseline must hold every kernel source, and must not be the shipped folder itself (the
    A/B would time one build twice)."""
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(tmp_path), "--baseline-name", "x", "--tag", "v9"])
    err = capsys.readouterr().err
    assert "--baseline:" in err and "lacks mla_verify.cuh" in err
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(KERNEL_DIR), "--baseline-name", "x", "--tag", "v9"])
    assert "shipped sources' own folder" in capsys.readouterr().err
    for name in SOURCES:
        shutil.copy(KERNEL_DIR / name, tmp_path / name)
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(tmp_path), "--baseline-name", "x"])
    assert "--tag: an A/B run's records need" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(tmp_path), "--baseline-name", "x", "--tag", "v9", "--rounds", "0"])
    assert "--rounds must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # statistics.quantiles needs two replays
        ab.main(["--baseline", str(tmp_path), "--baseline-name", "x", "--tag", "v9", "--reps", "1"])
    assert "--reps: at least 2 replays" in capsys.readouterr().err


def test_ab_times_the_target_shapes():
    shapes = ab.target_shapes()
    assert len(shapes) == len(set(shapes)) == 26   # 2 head counts x (4 verify + b32 + 8 decode)
    assert {s.q_len for s in shapes} == {1, 16} and {s.batch for s in shapes} == {1, 32}


def test_ab_takes_more_shapes(tmp_path, capsys):
    """--shape batch,heads,q_len,ctx adds a shape (a batch past 128 requests, whose pool rule
    the targets do not reach); a malformed one is refused by name before anything is built."""
    assert ab.parse_shape("256,8,1,4096") == ab.Shape(256, 8, 1, 4096)
    for bad in ("256,8,1", "256,8,x,4096", "256,8,17,4096", "0,8,1,4096"):
        with pytest.raises(ValueError, match="--shape"):
            ab.parse_shape(bad)
    for name in SOURCES:
        shutil.copy(KERNEL_DIR / name, tmp_path / name)
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(tmp_path), "--baseline-name", "x", "--tag", "v9", "--shape", "256,8,1"])
    assert "--shape: '256,8,1'" in capsys.readouterr().err


def test_recorded_ab_table_takes_the_newest_run_of_a_pair():
    """A recorded A/B run by its tag and baseline name: the newest append of that pair (one
    date), and a clear error naming what is recorded when the pair is not."""
    import pandas as pd

    def run(date, shipped, base, tag="v27", baseline="src_v25", gpu="NVIDIA H200"):
        return [dict(_rec("full", 0, shipped), kernel_version=tag, baseline=baseline, date=date, gpu=gpu),
                dict(_rec(baseline, 0, base), kernel_version=tag, baseline=baseline, date=date, gpu=gpu)]

    df = pd.DataFrame(run("2026-12-01T10:00", 50.0, 100.0) + run("2026-12-01T11:00", 99.0, 100.0)
                      + run("2026-12-01T12:00", 1.0, 100.0, baseline="src_p25")
                      + run("2026-12-01T13:00", 2.0, 100.0, gpu="NVIDIA RTX PRO 6000")   # another GPU's run
                      + [{"variant": "full", "time_us": 1.0}])
    t = ab.recorded_ab_table("v27", "v25", df)
    assert t["ratio"].tolist() == [0.99] and t["rounds"].tolist() == [1]
    assert t.attrs["source"] == "recorded: NVIDIA H200; 2026-12-01"   # that run's, for the notebook's line
    assert ab.recorded_ab_table("v27", "v25", df, gpu="RTX PRO 6000")["ratio"].tolist() == [0.02]
    with pytest.raises(NotRecorded, match=r"^version, baseline: no A/B run of 'v26' against 'v25' on H200; "
                                          r"recorded on any GPU: "
                                          r"\[\('v27', 'p25'\), \('v27', 'v25'\)\]"):
        ab.recorded_ab_table("v26", "v25", df)


def test_the_ablation_tables_leave_ab_runs_out():
    """An A/B run's records share kernel_ablation.jsonl with the ablations; the ablation table's
    newest version is an ablation's, never an A/B run's."""
    import pandas as pd

    from sm120_workbook.kernels.ablation import recorded_table

    abl = dict(_rec("full", 0, 90.0), kernel_version="v24", date="2026-11-30", defines=[], cta_rows=32)
    a_b = [dict(_rec(v, 0, 80.0), kernel_version="v28", date="2026-12-01", defines=[], cta_rows=64,
                baseline="src_v25") for v in ("full", "src_v25")]
    t = recorded_table(pd.DataFrame([abl, *a_b]))
    assert t["variant"].tolist() == ["full"] and t["q16 h8"].tolist() == [90.0]


def test_a_notebook_cell_says_which_run_is_not_recorded(capsys):
    """unless_recorded (notebook 03, pointed at a GPU whose records lack a run) prints a NotRecorded
    and goes on after the block; any other error still stops the cell."""
    import pandas as pd

    from sm120_workbook.results import unless_recorded

    with unless_recorded():
        ab.recorded_ab_table("v29", "v28", pd.DataFrame([{"kernel_version": "v29", "baseline": "src_v28",
                                                          "gpu": "NVIDIA H200", "date": "d"}]), gpu="RTX PRO 6000")
        print("never reached")
    out = capsys.readouterr().out
    assert out.startswith("not recorded: version, baseline: no A/B run of 'v29' against 'v28' on RTX PRO 6000")
    assert "never reached" not in out
    with pytest.raises(ValueError, match="plain"), unless_recorded():
        raise ValueError("plain")


def test_a_baselines_sources_digest_names_its_revision(tmp_path):
    """An A/B record names its baseline by the digest of its sources, since the folder (.ab/REV) is
    not in git: a copy of a revision's files (as `git archive` leaves them) gives its digest."""
    import shutil

    from sm120_workbook.kernels.build import KERNEL_DIR, SOURCES, sources_sha256

    copy = tmp_path / "src" / "kernels"
    shutil.copytree(KERNEL_DIR, copy)
    assert sources_sha256(copy) == sources_sha256() and len(sources_sha256()) == 64
    (copy / SOURCES[0]).write_text((copy / SOURCES[0]).read_text() + "\n// another revision\n")
    assert sources_sha256(copy) != sources_sha256()


def test_the_timing_flush_reads_and_records_how(monkeypatch):
    """The L2 flush before each timed replay reads its buffer (clean lines: a written one left dirty
    lines whose write-back landed inside memory-bound timings, +21% on decode at 64k on the H200),
    and every timing says which flush it had."""
    import torch

    from sm120_workbook.kernels import bench

    assert bench.L2_FLUSH == "read" and bench.L2_FLUSH_BYTES >= 2 * (128 << 20)   # twice an RTX PRO 6000's L2
    monkeypatch.setattr(bench, "L2_FLUSH_BYTES", 1 << 20)   # a small one on the CPU
    flush = bench.L2Flush(device="cpu")
    assert flush.buf.numel() * 8 == 1 << 20
    flush.buf[::1024] = 1
    before = flush.buf.clone()
    flush()
    assert torch.equal(flush.buf, before) and flush.sink.item() == before.sum().item()
    with pytest.raises(ValueError, match="^reps: .* at least 2"):
        bench.time_graph_us(lambda: None, reps=1)
    # the written flush on request (--l2-flush write), for a side-by-side with the read one
    written = bench.L2Flush("write", device="cpu")
    written.buf[::1024] = 1
    written()
    assert written.kind == "write" and not written.buf.any()
    with pytest.raises(ValueError, match="^kind: 'flushed' is no L2 flush"):
        bench.L2Flush("flushed", device="cpu")
    # the layer flush: the read, then what a served MLA layer runs before attention (LayerPrelude)
    layer = bench.L2Flush("layer", device="cpu")
    assert layer.kind == "layer" and layer.graph is None   # on the CPU eagerly; one graph launch on a GPU
    p = layer.prelude
    p.q_out.fill_(float("nan"))
    layer.buf[::1024] = 3
    layer()
    assert layer.sink.item() == 3 * 128 and p is not None and flush.prelude is None
    assert p.q_out.shape == (p.HEADS, p.TOKENS, p.KV_RANK) and p.q_out.isfinite().all() and p.q_out.abs().sum() > 0
    written_rows = p.kv_pool[p.slots]   # the step's latent rows written, the pool's other rows untouched
    assert written_rows.shape[-1] == bench.DIM_QK and (written_rows != 0).any(dim=-1).all()
    assert not p.kv_pool[: p.TOKENS].any() and not p.kv_pool[2 * p.TOKENS:].any()
    monkeypatch.setattr(bench, "L2_FLUSH", "read")   # restored after the test, whatever use_l2_flush sets
    bench.use_l2_flush("write")
    assert bench.L2_FLUSH == "write" and bench.L2Flush(device="cpu").kind == "write"
    with pytest.raises(ValueError, match="^kind: 'none' is no L2 flush"):
        bench.use_l2_flush("none")


@pytest.mark.parametrize("tool", ["bench", "targets"])
def test_the_timing_tools_take_the_flush_by_name(tool, capsys):
    import importlib

    main = importlib.import_module(f"sm120_workbook.kernels.{tool}").main
    with pytest.raises(SystemExit) as e:
        main(["--l2-flush", "zero", "--no-record"])
    assert e.value.code == 2 and "--l2-flush: invalid choice: 'zero'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["write", "layer"])
def test_the_targets_time_after_the_flush_they_are_given(kind, monkeypatch):
    """`targets --l2-flush write` (or layer) sets the flush before its first timing (each record
    then says so)."""
    import torch

    from sm120_workbook.kernels import bench, targets

    class Timed(Exception):
        pass

    def run_rounds(rounds, reps):
        assert bench.L2_FLUSH == kind and bench.L2Flush(device="cpu").kind == kind
        raise Timed

    monkeypatch.setattr(bench, "L2_FLUSH", "read")   # restored after the test
    monkeypatch.setattr(bench, "L2_FLUSH_BYTES", 1 << 20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(targets, "run_rounds", run_rounds)
    with pytest.raises(Timed):
        targets.main(["--l2-flush", kind, "--no-record"])


def test_interleaved_medians_alternate_the_order_and_take_medians(monkeypatch):
    """The L2 probes' rounds (bench.interleaved_medians_us): every `before` once a round, the order
    reversed every other round, and per name the median over rounds of each round's median."""
    from sm120_workbook.kernels import bench

    calls, times = [], {"a": iter([[1.0, 2.0, 9.0], [3.0], [5.0]]), "b": iter([[7.0], [4.0, 6.0], [8.0]])}
    befores = {"a": lambda: None, "b": lambda: None}

    def replay_times_us(graph, before, reps):
        name = next(n for n, f in befores.items() if f is before)
        calls.append((name, reps))
        return next(times[name])

    monkeypatch.setattr(bench, "replay_times_us", replay_times_us)
    med = bench.interleaved_medians_us("graph", befores, rounds=3, reps=7)
    assert [n for n, _ in calls] == ["a", "b", "b", "a", "a", "b"] and {r for _, r in calls} == {7}
    assert med == {"a": 3.0, "b": 7.0}   # a: medians 2, 3, 5; b: 7, 5, 8


def test_the_nsplit_explorer_times_what_a_user_lets_go_of_once(monkeypatch):
    """Notebook 03's NSPLIT widget: the workspace's choice timed once at build (not again by the
    controls), the slider timed on release rather than at every value a drag passes, and a
    64-row pick offers (and resets to) the 16-key tile, timed once."""
    from types import SimpleNamespace

    import pytest

    from sm120_workbook.kernels import bench

    monkeypatch.setattr(bench, "kernel_available", lambda: (False, "no CUDA GPU is visible to torch"))
    with pytest.raises(RuntimeError, match="needs a GPU that runs the kernel .no CUDA GPU"):
        bench.nsplit_explorer()
    timings, retimed = [], []
    monkeypatch.setattr(bench, "kernel_available", lambda: (True, "sm_120"))
    monkeypatch.setattr(bench, "Inputs", lambda shape: shape)
    monkeypatch.setattr(bench, "build_sm120_mla", lambda x: SimpleNamespace(num_splits=94, cta_rows=32, tile_keys=32))
    monkeypatch.setattr(bench, "time_graph_us", lambda fn, reps: timings.append(fn) or {"time_us": 80.0})
    monkeypatch.setattr(bench, "nsplit_retime", lambda x, *setting, auto_us, reps: retimed.append(setting) or "")
    ui = bench.nsplit_explorer()
    splits, cta_rows, tile_keys = ui.children[1].children
    assert len(timings) == 1 and retimed == [] and not splits.continuous_update
    assert (splits.value, splits.min, splits.max) == (94, 1, bench.MAX_SPLITS)
    splits.value = 66
    cta_rows.value = 64
    assert tuple(tile_keys.options) == (16,) and retimed == [(66, 32, 32), (66, 64, 16)]
    cta_rows.value = 32
    assert tuple(tile_keys.options) == (16, 32) and retimed[-1] == (66, 32, 16) and len(retimed) == 3


def test_the_nsplit_explorer_times_a_forced_schedule_and_names_a_refused_one(monkeypatch):
    """Notebook 03's explorer line (bench.nsplit_retime): the forced schedule timed against the
    workspace's choice; a schedule the workspace refuses is shown in its words, not raised."""
    from types import SimpleNamespace

    from sm120_workbook.kernels import bench

    def build(x, num_splits, tile_keys, cta_rows):
        if cta_rows == 64 and tile_keys != 16:
            raise ValueError("tile_keys: the 64-row kernel has 16-key tiles only, got 32")
        return SimpleNamespace(cta_rows=cta_rows)

    monkeypatch.setattr(bench, "build_sm120_mla", build)
    monkeypatch.setattr(bench, "time_graph_us", lambda fn, reps: {"time_us": 90.0})
    assert bench.nsplit_retime(None, 33, 32, 16, auto_us=60.0) == \
        "splits  33, 32-row kernel, 16-key tiles: 90.0 µs (1.50x the workspace's choice)"
    assert bench.nsplit_retime(None, 66, 64, 32, auto_us=60.0) == \
        "not a schedule the kernel has: tile_keys: the 64-row kernel has 16-key tiles only, got 32"
