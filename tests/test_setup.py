"""`make setup` (what `make run` and `make test` start with) picks the environment for the machine:
SGLang with its CUDA stack where an NVIDIA GPU is, torch on the CPU elsewhere (CI). Read from `make -n`,
which prints the recipe without running it."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed here")


def _env(**extra) -> dict:
    """This environment without a choice of TORCH or USE_ENV, which a parent make also passes in MAKEFLAGS."""
    return {**{k: v for k, v in os.environ.items()
               if k not in ("TORCH", "USE_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
            **extra}


def _setup_recipe(tmp_path, gpu_line: str, *args: str) -> str:
    """The recipe `make setup` would run, with an nvidia-smi that prints `gpu_line` (or fails)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{gpu_line}'\n" if gpu_line else "#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    env = _env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", *args, "setup"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    return out.stdout + out.stderr


def test_a_gpu_machine_gets_sglang_with_its_cuda_stack(tmp_path):
    recipe = _setup_recipe(tmp_path, "GPU 0: NVIDIA RTX PRO 6000 Blackwell Workstation Edition (UUID: GPU-0)")
    assert 'echo "setup (gpu, nvidia-smi lists a GPU): SGLang with its CUDA stack' in recipe
    assert 'if [ "gpu" = gpu ]' in recipe and "pip install -q -e '.[gpu,test]'" in recipe


def test_a_machine_without_one_gets_cpu_torch(tmp_path):
    recipe = _setup_recipe(tmp_path, "")
    assert 'echo "setup (cpu, nvidia-smi lists none): torch on the CPU' in recipe and 'if [ "cpu" = gpu ]' in recipe
    assert "-e '.[cpu,sglang-cpu-deps,test]'" in recipe and "--no-deps 'sglang==" in recipe


def test_torch_chooses_and_a_misspelt_choice_is_refused(tmp_path):
    chosen = _setup_recipe(tmp_path, "GPU 0: NVIDIA H200", "TORCH=cpu")
    assert 'if [ "cpu" = gpu ]' in chosen and "setup (cpu, TORCH=cpu from the command line)" in chosen
    out = subprocess.run(["make", f"VENV={tmp_path / 'venv'}", "TORCH=rocm", "setup"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True)   # refused before the venv is made
    assert out.returncode != 0 and "error: TORCH=rocm from the command line; use TORCH=gpu or TORCH=cpu" in out.stdout
    assert not (tmp_path / "venv").exists()


def test_a_venv_keeps_the_kind_it_was_made_with(tmp_path):
    """A re-run after pyproject.toml changes (a pull) installs the venv's own kind again, whatever
    nvidia-smi says now; an explicit other kind is refused before anything is installed."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text("cpu\n")
    os.utime(venv / ".installed", (0, 0))   # older than pyproject.toml: make re-runs the recipe
    recipe = _setup_recipe(tmp_path, "GPU 0: NVIDIA RTX PRO 6000 Blackwell Workstation Edition (UUID: GPU-0)")
    assert f"setup (cpu, the kind {venv} was made with ({venv}/.installed))" in recipe and 'if [ "cpu" = gpu ]' in recipe
    out = subprocess.run(["make", f"VENV={venv}", "TORCH=gpu", "setup"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True)
    assert out.returncode != 0 and f"error: {venv} was made for TORCH=cpu, not gpu; rm -rf {venv} to switch" in out.stdout
    assert sorted(p.name for p in venv.iterdir()) == [".installed"]
    # an up-to-date venv too: `make test TORCH=gpu` must not run on the cpu venv
    os.utime(venv / ".installed", None)
    out = subprocess.run(["make", f"VENV={venv}", "TORCH=gpu", "setup"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True)
    assert out.returncode != 0 and f"error: {venv} was made for TORCH=cpu, not gpu" in out.stdout
    ok = subprocess.run(["make", f"VENV={venv}", "TORCH=cpu", "setup"], cwd=ROOT, env=_env(),
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr   # its own kind: nothing to do


def test_an_environment_made_elsewhere_is_used_as_it_is(tmp_path):
    """`make run USE_ENV=$CONDA_PREFIX` (environment.yml's route): the environment is checked on every
    use, never made, installed into or cleaned; one that lacks the workbook, or an empty USE_ENV
    (no environment activated), is refused."""
    import sys

    env = tmp_path / "conda"   # a prefix whose python is this test's own, which has everything
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (env / "bin" / "python").chmod(0o755)
    (env / ".installed").write_text("cpu\n")   # a stamp left there is no reason to skip the check
    ok = subprocess.run(["make", f"USE_ENV={env}", "setup"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert ok.returncode == 0 and "Nothing to be done" not in ok.stdout, ok.stdout + ok.stderr
    assert sorted(p.name for p in env.iterdir()) == [".installed", "bin"]   # nothing made or installed
    assert subprocess.run(["make", "-n", f"USE_ENV={env}", "clean"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True).stdout.split() == ["rm", "-rf", "build", "*.egg-info", "runs"]
    empty = tmp_path / "env"
    out = subprocess.run(["make", f"USE_ENV={empty}", "run"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert out.returncode != 0 and f"error: {empty}/bin/python cannot run this workbook" in out.stdout
    assert "environment.yml" in out.stdout and not empty.exists()
    out = subprocess.run(["make", "USE_ENV=", "run"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert out.returncode != 0 and "USE_ENV is empty: activate the environment first" in out.stderr


def test_lab_saves_widget_state_with_the_notebook(tmp_path):
    """`make lab` sets JupyterLab's widget manager to save widget state (its default is not to), so
    a notebook re-run and saved there reopens with its widgets."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text("cpu\n")   # newer than pyproject.toml: set up already
    out = subprocess.run(["make", "-n", f"VENV={venv}", "lab"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert f"> {venv}/share/jupyter/lab/settings/overrides.json" in out.stdout
    assert '{"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": true}}' in out.stdout
    assert f"{venv}/bin/jupyter lab notebooks" in out.stdout
