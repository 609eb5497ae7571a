"""Every notebook runs under papermill with non-default parameters (nbval covers the defaults)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"

# Non-default parameters per notebook: small and quick, but not the defaults.
NOTEBOOK_PARAMS: dict[str, dict] = {
    "00_environment.ipynb": {"copy_mib": 64, "matmul_n": 1024, "repeats": 3, "record_results": False},
    "01_mla_verify_reference.ipynb": {"heads": 8, "q_len": 5, "ctx_list": [2048, 32768], "check_heads": 3,
                                      "check_ctx": [7, 0, 19], "demo_prefix": 2, "demo_q_len": 6, "seed": 11},
    "02_build_kernel.ipynb": {"archs": ["sm_120a"], "check_seed": 7, "check_cases": 2},
    # an RTX PRO 6000's records: the runs it lacks (every study so far ran on the H200) are said, not shown
    "03_benchmark_kernel.ipynb": {"run_live": False, "quick": True, "reps": 10, "record": False,
                                  "explore_heads": 16, "explore_ctx": 16384, "recorded_gpu": "RTX PRO 6000",
                                  "split_sweep": "v30-rtx", "l2_flush": "layer"},
    "04_patch_sglang.ipynb": {"capacity_tokens": 8192, "num_requests": 80, "max_running": 12,
                              "prompt_len_range": [16, 1024], "output_len_range": [8, 256],
                              "tokens_per_step_list": [3], "probe_prompt_len": 512,
                              "probe_output_len": 32, "page_bytes": 2048, "seed": 5, "spread_seeds": 3,
                              "gpu_batch": 2, "gpu_heads": 8, "gpu_q_len": 3, "gpu_reps": 5,
                              "record": False},
    "05_live_service.ipynb": {"tp": 1, "layers": 3, "backends": ["triton", "sm120_mla"], "contexts": [2048, 65536],
                              "spec": ["none", "ngram"], "decode_tokens": 64, "repeats": 2, "record": False,
                              "decode_setup": "16 layers, 128 decode tokens + ngram_tail"},
}


def _notebooks():
    return sorted(p.name for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def _parameter_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]


@pytest.mark.parametrize("name", _notebooks())
def test_notebook_has_one_parameters_cell(name):
    nb = json.loads((NOTEBOOK_DIR / name).read_text())
    cells = _parameter_cells(nb)
    assert len(cells) == 1, f"{name}: {len(cells)} cells tagged 'parameters'"
    assert "out_dir" in "".join(cells[0]["source"]), f"{name}: parameters cell lacks out_dir"
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{name}: stored error outputs"


@pytest.mark.parametrize("name", _notebooks())
def test_notebook_runs_with_papermill(name, tmp_path, monkeypatch):
    """Recorded results only, as under nbval: on a GPU machine the kernels (which inherit this
    environment) would otherwise run live, and 05's parameters would start four SGLang servers."""
    papermill = pytest.importorskip("papermill")
    from sm120_workbook.hardware import RECORDED_ONLY_ENV

    monkeypatch.setenv(RECORDED_ONLY_ENV, "1")
    params = dict(NOTEBOOK_PARAMS.get(name, {}))
    assert params, f"{name}: add non-default parameters to NOTEBOOK_PARAMS"
    params["out_dir"] = str(tmp_path)
    papermill.execute_notebook(str(NOTEBOOK_DIR / name), str(tmp_path / name),
                               parameters=params, cwd=str(NOTEBOOK_DIR), kernel_name="python3",
                               progress_bar=False)
    charts = list((tmp_path / "charts").glob("*.png")) if (tmp_path / "charts").exists() else []
    print(f"{name}: {len(charts)} PNG charts")
    if name == "03_benchmark_kernel.ipynb":
        text = "".join("".join(o.get("text", "")) for c in json.loads((tmp_path / name).read_text())["cells"]
                       for o in c.get("outputs", []))
        assert "not recorded: version: no split sweep of 'v30-rtx' on RTX PRO 6000 recorded" in text


@pytest.mark.parametrize("name", _notebooks())
def test_papermill_reads_every_parameter(name):
    """papermill's own reading of the parameters cell (`papermill --help-notebook`, and the type
    it gives an injected value) finds every parameter: a comment it cannot parse (one holding
    `=`, say) drops that line with a warning."""
    import re

    papermill = pytest.importorskip("papermill")
    source = "".join(_parameter_cells(json.loads((NOTEBOOK_DIR / name).read_text()))[0]["source"])
    names = set(re.findall(r"^(\w+)\s*=", source, flags=re.M))
    assert set(papermill.inspect_notebook(str(NOTEBOOK_DIR / name))) == names


@pytest.mark.parametrize("name", _notebooks())
def test_a_notebooks_records_name_a_command_that_reruns_it(name):
    """notebook_command: papermill on the notebook with every parameter's value (-y, JSON), the
    names papermill itself reads from the parameters cell, split as a shell splits it."""
    import shlex

    papermill = pytest.importorskip("papermill")
    from sm120_workbook.notebook_params import notebook_command, parameter_names

    names = parameter_names(NOTEBOOK_DIR / name)
    assert names == list(papermill.inspect_notebook(str(NOTEBOOK_DIR / name)))
    import math
    from pathlib import Path

    import yaml
    from papermill.cli import NoDatesSafeLoader

    # a quote survives the shell; floats, inf and None come back as themselves, a Path as its str
    values = {k: [i, f"it's {k}", 1e-05, math.inf, None, True] for i, k in enumerate(names)}
    values[names[0]] = Path("/tmp/x")
    argv = shlex.split(notebook_command(name, {**values, "unrelated": 1}))
    assert argv[:5] == ["papermill", "--cwd", "notebooks", f"notebooks/{name}", f"/tmp/{name}"]
    assert argv[5] == "-y" and yaml.load(argv[6], Loader=NoDatesSafeLoader) == {**values, names[0]: "/tmp/x"}
    # a notebook it cannot read still leaves its records a command: the name, and why
    assert notebook_command("no_such.ipynb", values).startswith("notebooks/no_such.ipynb (its parameters unread: ")


@pytest.mark.parametrize("name", _notebooks())
def test_list_parameters_are_checked(name):
    """Every parameter whose default is a list is named in a check_list_params call of the
    notebook, so that papermill's `-p` (which passes a list as its text) gets an error that
    names the parameter and `-y`."""
    import ast

    nb = json.loads((NOTEBOOK_DIR / name).read_text())
    params = ast.parse("".join(_parameter_cells(nb)[0]["source"]))
    lists = {t.id for node in params.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
             for t in node.targets}
    checked = set()
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or "check_list_params(" not in "".join(cell["source"]):
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_list_params":
                checked |= {kw.arg for kw in node.keywords if isinstance(kw.value, ast.Name) and kw.value.id == kw.arg}
    assert lists <= checked, f"{name}: list parameters not checked: {sorted(lists - checked)}"


def test_check_list_params_names_papermill_y():
    from sm120_workbook.notebook_params import check_list_params

    check_list_params(a=[1], b=(2, 3))
    check_list_params({"ab_run": 2}, ab_run=["v31", "v30"], c=[3])
    check_list_params(None, ("ablations",), ablations=[])   # a list of sections to show, where none is a choice
    for bad in ('["ngram"]', 4096, None):
        with pytest.raises(ValueError, match=r"^ctx_list: a list, got \w+ .*papermill: -y 'ctx_list: \[\.\.\.\]', not -p"):
            check_list_params(ctx_list=bad)
    # an empty list, or a pair of the wrong length, fails here and not cells later
    with pytest.raises(ValueError, match=r"^ctx_list: an empty list; give at least one item"):
        check_list_params(ctx_list=[])
    with pytest.raises(ValueError, match=r"^ab_run: 2 items, got 1: \['v31'\]"):
        check_list_params({"ab_run": 2}, ab_run=["v31"])


def test_a_list_given_with_p_fails_naming_it(tmp_path):
    """papermill -p ctx_list '[2048]' hands the notebook a string: it stops at once, naming it."""
    papermill = pytest.importorskip("papermill")
    name = "01_mla_verify_reference.ipynb"
    with pytest.raises(papermill.PapermillExecutionError, match="ctx_list: a list, got str"):
        papermill.execute_notebook(str(NOTEBOOK_DIR / name), str(tmp_path / name),
                                   parameters={"ctx_list": "[2048]", "out_dir": str(tmp_path)},
                                   cwd=str(NOTEBOOK_DIR), kernel_name="python3", progress_bar=False)


def test_a_recorded_gpu_is_matched_in_any_case_and_out_dir_must_be_absolute(tmp_path):
    """Two notebook parameters: recorded_gpu (a name substring, any case) and out_dir."""
    import pandas as pd

    from sm120_workbook.charts import chart_dir
    from sm120_workbook.results import on_gpu

    df = pd.DataFrame({"gpu": ["NVIDIA H200", None, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"]})
    assert on_gpu(df, "h200").tolist() == [True, False, False]
    assert on_gpu(df, "RTX pro 6000").tolist() == [False, False, True]
    assert chart_dir(tmp_path) == tmp_path / "charts"
    with pytest.raises(ValueError, match="^out_dir: 'runs' is relative, and the notebook runs in notebooks/"):
        chart_dir("runs")   # papermill runs the notebook in notebooks/: it would land in the project tree
