# Two commands do everything on a fresh machine:
#   make run    runs every notebook with papermill into runs/<timestamp>/ (charts beside them)
#   make test   runs pytest, then nbval over every notebook
# Each sets up .venv on first use. `make lab` opens JupyterLab on the notebooks.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
# USE_ENV=<prefix>: an environment made elsewhere (`conda env create -f environment.yml`, then
# `make run USE_ENV=$CONDA_PREFIX`), used as it is: checked on every use, never made, installed
# into or cleaned. Given empty (no env activated), it is refused rather than read as make's .venv.
ifneq ($(origin USE_ENV),undefined)
ifeq ($(strip $(USE_ENV)),)
$(error USE_ENV is empty: activate the environment first (conda activate sm120-workbook), or leave USE_ENV out for make's own .venv)
endif
endif
VENV   := $(or $(USE_ENV),.venv)
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# One source of truth for the SGLang pin: the `gpu` extra in pyproject.toml.
SGLANG_PIN = $(shell $(PYTHON) -c "import tomllib;d=tomllib.load(open('pyproject.toml','rb'));print(next(r for r in d['project']['optional-dependencies']['gpu'] if r.startswith('sglang')))")
# torch is held at the `cpu` extra's version while the rest installs.
TORCH_PIN = $(shell $(PYTHON) -c "import tomllib;d=tomllib.load(open('pyproject.toml','rb'));print('\n'.join(d['project']['optional-dependencies']['cpu']))")
# A machine with an NVIDIA GPU (nvidia-smi lists one) gets the `gpu` extra: SGLang 0.5.17 with
# its CUDA stack (torch 2.11, a CUDA 13 build), so that `make run` and JupyterLab run the GPU cells
# live. Any other gets torch 2.14.1 run on the CPU (the `cpu` extra) and the pure-Python parts of
# SGLang the CPU tests import (CI).
# `make setup TORCH=cpu` (or gpu) chooses; a .venv, once made, stays as it is (rm -rf .venv).
# Its stamp holds the kind it was made with, so a re-run after pyproject.toml changes (a pull)
# installs the same kind again rather than detecting anew, and an explicit other kind is refused
# (venv-kind).
VENV_KIND := $(shell cat $(STAMP) 2>/dev/null)
ifeq ($(origin TORCH),undefined)
ifneq ($(filter gpu cpu,$(VENV_KIND)),)
TORCH := $(VENV_KIND)
TORCH_WHY := the kind $(VENV) was made with ($(STAMP))
else
TORCH := $(if $(shell nvidia-smi -L 2>/dev/null | grep -m1 '^GPU'),gpu,cpu)
TORCH_WHY := nvidia-smi $(if $(filter gpu,$(TORCH)),lists a GPU,lists none)
endif
else
TORCH_WHY := TORCH=$(TORCH) from the $(origin TORCH)
endif
# `:=` takes the time once: a recursive variable would call `date` at each use, and a second
# boundary between them would split one run over two folders.
RUN_DIR := $(or $(RUN_DIR),runs/$(shell date +%Y%m%d-%H%M%S))
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

.PHONY: help setup venv-kind run test lab kernel-resources wheelhouse device-wheel gpu-check clean

help:
	@echo "make run      run the workbook (papermill) into runs/<timestamp>/"
	@echo "make test     pytest + nbval over every notebook"
	@echo "make lab      JupyterLab with widgets"
	@echo "make setup [TORCH=cpu|gpu]   only the .venv (run and test make it on first use)"
	@echo "make run|test|lab USE_ENV=\$$CONDA_PREFIX   use environment.yml's conda environment instead of .venv"
	@echo "make clean    remove .venv, build folders and runs/ (the executed notebooks and server logs)"
	@echo "make kernel-resources   nvcc resource report (sm_120a, sm_90) -> data/results/kernel_resources.json"
	@echo "make wheelhouse         SGLang wheels for the offline GPU machine (.whl1, .whl2, ...: one device call each)"
	@echo "make device-wheel       this project's committed code as a wheel for the GPU machine (.whlp; sets up .venv first)"
	@echo "make gpu-check OUT=dir [TAG=vN] [NCU=1] [JOBS=\"tests targets\"]   on the GPU machine: every kernel check (or those named), over all GPUs"

setup: $(STAMP)

# Every target that uses the venv comes through its stamp, so this check (order-only: it never
# makes the stamp out of date) refuses an explicit TORCH of the other kind, up to date or not.
venv-kind:
	@case "$(VENV_KIND)" in ""|"$(TORCH)") ;; gpu|cpu) echo "error: $(VENV) was made for TORCH=$(VENV_KIND), not $(TORCH); rm -rf $(VENV) to switch"; exit 1;; esac

ifdef USE_ENV
.PHONY: $(STAMP)
$(STAMP):
	@$(PY) -c "import sys, pathlib, torch, sglang, papermill, nbval, sm120_workbook as w; \
	there, here = pathlib.Path(w.__file__).resolve().parent, pathlib.Path('src').resolve(); \
	there == here or sys.exit(f'sm120_workbook is imported from {there}, not this checkout: pip install -e . here')" \
	  || { echo "error: $(PY) cannot run this workbook (above); set it up as environment.yml's header says"; exit 1; }
else
$(STAMP): pyproject.toml | venv-kind
	@test -n "$(PYTHON)" || { echo "error: no python3 found; install Python 3.11 (the torch wheel on disk is for 3.11)"; exit 1; }
	@$(PYTHON) -c "import sys; assert sys.version_info >= (3, 11), sys.version" 2>/dev/null \
	  || { echo "error: $(PYTHON) is older than 3.11; set PYTHON=/path/to/python3.11"; exit 1; }
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || { echo "error: $(PYTHON) has no venv module (apt-get install python3-venv)"; exit 1; }
	@case "$(TORCH)" in gpu|cpu) ;; *) echo "error: $(TORCH_WHY); use TORCH=gpu or TORCH=cpu"; exit 1;; esac
	@command -v nvcc >/dev/null || echo "note: nvcc not found; kernel compile tests will skip (visibly)"
	@echo "setup ($(TORCH), $(TORCH_WHY)): $(if $(filter gpu,$(TORCH)),SGLang with its CUDA stack,torch on the CPU and SGLang's pure-Python parts)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ "$(TORCH)" = gpu ]; then \
	  $(PY) -m pip install -q -e '.[gpu,test]'; \
	else \
	  printf '%s\n' $(TORCH_PIN) > $(VENV)/torch-constraint.txt && \
	  $(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[cpu,sglang-cpu-deps,test]' && \
	  $(PY) -m pip install -q --no-deps '$(SGLANG_PIN)'; \
	fi
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(PY) -c "import torch, sglang, sm120_workbook; print('env ok: torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available(), 'sglang', sglang.__version__)"
	@# a GPU set-up whose torch cannot see the GPU would run every notebook on records and skip every
	@# GPU test as on a CPU machine: refused here (no stamp), with the likely cause
	@if [ "$(TORCH)" = gpu ]; then $(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit( \
	  'error: nvidia-smi lists a GPU, but torch ' + torch.__version__ + ' (CUDA ' + str(torch.version.cuda) + ') cannot use it. ' \
	  'SGLang 0.5.17 pins a CUDA 13 torch, which needs NVIDIA driver 580 or newer; this one: $(or $(shell nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1),unknown). ' \
	  'Update the driver, or rm -rf $(VENV) and make setup TORCH=cpu to work from the records')"; fi
	@echo $(TORCH) > $@
endif

run: $(STAMP)
	@mkdir -p $(RUN_DIR)
	@for nb in $(NOTEBOOKS); do \
	  name=$$(basename $$nb); echo "== $$name"; \
	  $(VENV)/bin/papermill --cwd notebooks --log-level WARNING $$nb $(RUN_DIR)/$$name -p out_dir $(abspath $(RUN_DIR)) || exit 1; \
	done
	@echo "executed notebooks and charts: $(RUN_DIR)"

# SM120_REQUIRE_SGLANG: setup installed SGLang, so a broken import fails the run rather than
# turning the plugin and allocator tests into skips (tests/conftest.py)
test: $(STAMP)
	SM120_REQUIRE_SGLANG=1 $(VENV)/bin/python -m pytest tests
	SM120_REQUIRE_SGLANG=1 $(VENV)/bin/python -m pytest --nbval-lax -p no:cacheprovider notebooks

LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
lab: $(STAMP) $(if $(USE_ENV),,$(LAB_OVERRIDES))
	$(VENV)/bin/jupyter lab notebooks

# JupyterLab then saves widget state in the notebook (the widget manager's default is not to), so a
# notebook re-run and saved in `make lab` reopens with its widgets, as papermill's runs do.
$(LAB_OVERRIDES): | $(STAMP)
	mkdir -p $(@D)
	echo '{"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": true}}' > $@

kernel-resources: $(STAMP)
	$(PY) -m sm120_workbook.kernels.resources --write

EXTRA_DEVICE_WHEELS = sgl-deep-gemm==0.1.5.post1
# The notebook stack, so that the GPU machine runs the notebooks as `make run` does (papermill with
# an ipykernel, altair and vl-convert for the charts, ipywidgets): seen working there in session 50.
NOTEBOOK_DEVICE_WHEELS = papermill==2.7.0 nbclient==0.11.0 nbformat==5.11.1 jupyter_client==8.10.0 \
  jupyter_core==5.9.1 ipykernel==7.4.0 nest_asyncio2==1.7.4 comm==0.2.3 debugpy==1.8.22 tornado==6.6.1 \
  fastjsonschema==2.22.3 entrypoints==0.4.2 tenacity==9.2.1 platformdirs==4.14.9 altair==6.3.0 \
  narwhals==2.29.0 ipywidgets==8.1.9 widgetsnbextension==4.0.16 jupyterlab_widgets==3.0.17 \
  vl-convert-python==1.9.0.post1

wheelhouse:
	@test -x ../shared/device/wheelhouse.sh || { echo "error: ../shared/device/wheelhouse.sh not found"; exit 1; }
	@# from empty folders: a stale wheel left by an earlier run would sit beside its newer version
	rm -rf .whl[0-9]* .whl-pool
	../shared/device/wheelhouse.sh
	@# SGLang 0.5.17 requires sgl-deep-gemm (its METADATA), which the lock leaves out; its EAGLE worker
	@# imports deep_gemm as it captures its CUDA graphs, so without it an EAGLE server cannot start
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux2014_x86_64 -d .whl-pool $(EXTRA_DEVICE_WHEELS) $(NOTEBOOK_DEVICE_WHEELS)
	@# a call ships the tree (it grows with the records) beside its folder, within
	@# 64 MiB: repack the wheels into as many folders as that leaves room for (stdlib only: no venv needed)
	$(PYTHON) src/wheel_folders.py

# The project for the GPU machine, from the committed tree (`git archive` of one commit, so a
# record's commit names the code that ran): there `bash .whlp/install.sh` installs it into
# /tmp/site once per commit (a reinstall would make the kernel rebuild), and
# `export SM120_COMMIT=$(cat .whlp/COMMIT)`. pip builds the wheel in .venv (made on first use).
device-wheel: $(STAMP)
	@test -z "$$(git status --porcelain -- src pyproject.toml)" || echo "warning: changes to src/ or pyproject.toml that are not committed are not in the wheel (it is built from HEAD)"
	rm -rf .whlp && mkdir -p .whlp
	commit=$$(git rev-parse HEAD) && tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  git archive "$$commit" | tar -x -C "$$tmp" && \
	  (cd "$$tmp" && "$(abspath $(PY))" -m pip wheel -q --no-deps --no-build-isolation -w "$(CURDIR)/.whlp" .) && \
	  (cd "$$tmp" && $(PYTHON) -c "import sys; sys.path.insert(0, 'src'); import wheel_folders as w; sys.stdout.write(w.INSTALL_SH)") > .whlp/install.sh && \
	  echo "$$commit" > .whlp/COMMIT
	@echo "made .whlp ($$(ls .whlp/*.whl | xargs -n1 basename), commit $$(cut -c1-7 .whlp/COMMIT))"
	@$(PY) -m sm120_workbook.wheel_folders --check || echo "warning: a call carrying that folder would be refused (64 MiB)"

# On a GPU machine: tests, sanitizers, backend tests, benchmark and ablation side by side over
# the visible GPUs, into $(OUT). The project's .venv where it has one; python3 on the lent GPU
# machine, whose wheels sit in /tmp/site (README).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	@test -n "$(OUT)" || { echo "error: set OUT=<folder> for the logs and records"; exit 1; }
	$(GPU_PY) -m sm120_workbook.kernels.gpu_check --out $(OUT) $(if $(TAG),--tag $(TAG)) $(if $(NCU),--ncu) $(if $(JOBS),--jobs $(JOBS))

clean:
	rm -rf $(if $(USE_ENV),,$(VENV)) build *.egg-info runs
