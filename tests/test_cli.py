"""The command-line tools as a user meets them: a bad flag is a usage error naming it, read before
any GPU check or build; a machine without what a tool needs is told so in one line, not a
traceback; and a run that measured nothing does not say it appended."""
import pytest

torch = pytest.importorskip("torch")

NO_GPU = not torch.cuda.is_available()
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="a GPU is visible: the tool would run rather than refuse")


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("module,argv,message", [
    ("profile", ["--heads", "0"], "argument --heads: must be 1..128, got 0"),
    ("profile", ["--tile-keys", "7"], "argument --tile-keys: invalid choice: 7"),
    ("profile", ["--cta-rows", "64", "--tile-keys", "32"], "--tile-keys: the 64-row kernel has 16-key tiles only"),
    ("cta_timeline", ["--ctx", "-1"], "argument --ctx: must be at least 1, got -1"),
    ("phase_trace", ["--q-len", "99"], "argument --q-len: must be 1..16, got 99"),
    ("phase_trace", ["--batch", "two"], "argument --batch: an integer, got 'two'"),
    ("bench", ["--impls", "sm120_mla,flashmal"], "--impls: unknown ['flashmal']"),
    ("gpu_check", ["--out", "x", "--jobs", "testz"], "--jobs: no job named testz"),
], ids=["heads", "tile", "tile_for_rows", "ctx", "q_len", "batch", "impls", "jobs"])
def test_a_bad_flag_is_refused_before_any_gpu_check(module, argv, message, capsys):
    import importlib

    main = importlib.import_module(f"sm120_workbook.kernels.{module}").main
    assert message in _usage_error(main, argv, capsys)


def test_an_out_path_that_cannot_take_records_is_refused_when_the_flags_are_read(tmp_path, capsys):
    """Found after a GPU run, it would lose the measurements."""
    from sm120_workbook.kernels import bench

    assert f"argument --out: {tmp_path} is a folder" in _usage_error(bench.main, ["--out", str(tmp_path)], capsys)
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert f"{blocked} is not a folder" in _usage_error(bench.main, ["--out", str(blocked / "x.jsonl")], capsys)
    from sm120_workbook.results import record_file

    new = tmp_path / "new" / "deeper" / "runs.jsonl"
    assert record_file(str(new)) == str(new)
    assert not (tmp_path / "new").exists()   # checked, nothing made: a typo leaves no folders behind


def test_a_run_that_measured_nothing_exits_rather_than_say_it_appended(tmp_path):
    from sm120_workbook.results import append_cli_records

    out = tmp_path / "bench.jsonl"
    with pytest.raises(SystemExit, match="nothing to record .no measurement succeeded"):
        append_cli_records("kernel_bench", [], "sm120_workbook.kernels.bench", [], str(out))
    assert not out.exists()


def test_the_ablation_takes_no_record_as_every_timing_tool_does(monkeypatch, capsys):
    from sm120_workbook import results
    from sm120_workbook.kernels import ablation

    # --no-record is taken; the next flag's error is the one said
    assert "--ctx: contexts must be positive" in _usage_error(ablation.main, ["--no-record", "--ctx", "0"], capsys)
    monkeypatch.setattr(ablation.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ablation, "build_all", lambda variants: None)
    monkeypatch.setattr(ablation, "run", lambda **kw: [{"variant": "full", "time_us": 80.0}])

    def no_append(*a, **kw):
        raise AssertionError("--no-record appended")

    monkeypatch.setattr(results, "append_cli_records", no_append)
    ablation.main(["--no-record", "--variants", "full"])


@needs_no_gpu
@pytest.mark.parametrize("module,argv,message", [
    ("sm120_workbook.kernels.sanitize", ["--no-record"], "the sanitizer runs need a CUDA GPU"),
    ("sm120_workbook.kv_fragmentation", ["--no-record"], "kv_fragmentation times the sm120 kernel, which cannot run here"),
    ("sm120_workbook.decode_bench", ["--no-record"], "tp=-1 asks for every visible GPU, but no CUDA GPU is visible"),
], ids=["sanitize", "kv_fragmentation", "decode_bench"])
def test_a_tool_on_a_machine_without_a_gpu_says_so_in_one_line(module, argv, message):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert message in str(e.value.code)


def test_kv_fragmentation_refuses_a_shape_the_kernel_does_not_serve_before_its_simulation(capsys):
    from sm120_workbook import kv_fragmentation

    assert "--heads: must be 1..128, got 0" in _usage_error(kv_fragmentation.main, ["--heads", "0"], capsys)
