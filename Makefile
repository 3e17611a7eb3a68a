# The two commands a new user types: `make demo` and `make test`. Each one creates .venv, installs
# what it runs and nothing more, and says what and why before each step: `make demo` the agent and
# mosquitto; `make test` also the test tools (tools/os-deps.sh lists each package and its reason).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# pip prints a line per package it collects, downloads and builds (no -q: a first run downloads
# about 135 MB, and minutes without output read as a hang).
PIP    := $(PY) -m pip install --progress-bar on
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test lint typecheck pytest gpu-test bench os-deps os-deps-demo os-deps-test venv clean

$(PY):
	@echo "== make: creating $(VENV) ($(PYTHON) -m venv)"
	$(PYTHON) -m venv $(VENV)
	@echo "== make: upgrading pip in $(VENV)"
	$(PIP) --upgrade pip

# The agent and what it imports at run time (numpy, OpenCV, ONNX Runtime, ONNX, paho-mqtt, ...).
$(DEMO_STAMP): pyproject.toml | $(PY)
	@echo "== make: installing edge-agent and its run-time dependencies into $(VENV) (pip: about 135 MB of wheels on a first run)"
	$(PIP) -e .
	touch $@

# What the tests and linters run besides: pytest, ruff, mypy, Playwright, the controller's extras.
$(TEST_STAMP): pyproject.toml | $(PY)
	@echo "== make: installing edge-agent with its [dev,fleet] extras into $(VENV) (pip)"
	$(PIP) -e '.[dev,fleet]'
	@# tensorrt-stubs pins the real tensorrt wheel, which is a stub that downloads from NVIDIA's
	@# index; --no-deps takes only the type stubs.
	@echo "== make: installing the TensorRT type stubs (mypy checks the TensorRT code against them)"
	$(PIP) --no-deps 'tensorrt-stubs>=10.3,<11'
	$(PY) tools/fix_tensorrt_stubs.py
	touch $@ $(DEMO_STAMP)

venv: $(DEMO_STAMP)

os-deps-demo:
	@./tools/os-deps.sh demo

os-deps-test:
	@./tools/os-deps.sh test

os-deps: os-deps-test

demo: os-deps-demo $(DEMO_STAMP)
	@echo "== make: running the demo (edge-agent demo)"
	$(VENV)/bin/edge-agent demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check agent tests bench tools
	$(VENV)/bin/ruff format --check agent tests bench tools

typecheck: $(TEST_STAMP)
	$(VENV)/bin/mypy

# The suite in parallel (pytest-xdist): most tests wait on real processes, brokers and sockets, not on
# the CPU, so two workers per usable CPU, as many as the available memory holds (tools/pytest_workers.py,
# docs/testing.md). --dist loadgroup keeps the tests marked @pytest.mark.xdist_group(name) on one
# worker, one at a time. `make pytest PYTEST_WORKERS=N` runs N (0: serially, in one process).
PYTEST_WORKERS ?= $(shell $(PYTHON) tools/pytest_workers.py)
pytest: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

test: os-deps-test lint typecheck pytest

# Run on a machine with a CUDA GPU and cuda-python (see docs/gpu.md).
gpu-test: $(TEST_STAMP)
	$(PY) -m pytest -q -m gpu -p no:cacheprovider

bench: os-deps-demo $(DEMO_STAMP)
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
