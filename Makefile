# The two commands a new user types: `make demo` and `make test`. Each one creates .venv and
# installs what it needs, including mosquitto from the OS package manager when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest gpu-test bench os-deps venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,fleet]'
	@# tensorrt-stubs pins the real tensorrt wheel, which is a stub that downloads from NVIDIA's
	@# index; --no-deps takes only the type stubs.
	$(PY) -m pip install -q --no-deps 'tensorrt-stubs>=10.3,<11'
	$(PY) tools/fix_tensorrt_stubs.py
	touch $(STAMP)

venv: $(STAMP)

os-deps:
	@./tools/os-deps.sh

demo: os-deps $(STAMP)
	$(VENV)/bin/edge-agent demo

lint: $(STAMP)
	$(VENV)/bin/ruff check agent tests bench tools
	$(VENV)/bin/ruff format --check agent tests bench tools

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest -q

test: os-deps lint typecheck pytest

# Run on a machine with a CUDA GPU and cuda-python (see docs/gpu.md).
gpu-test: $(STAMP)
	$(PY) -m pytest -q -m gpu -p no:cacheprovider

bench: os-deps $(STAMP)
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
