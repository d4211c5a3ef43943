"""What ``wide bench`` measures: ``BenchConfig``, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

from wide_cli.errors import ConfigError

# dense HF transformers; the runtime with routing off; the runtime's PyTorch decode step (without
# the native step, routed and dense: what the native step is measured against); llama.cpp
SYSTEMS_FIXED = ("hf", "dense", "cpu-torch", "dense-torch", "llama.cpp")
LLAMA_CPP_TYPES = ("F16", "Q8_0", "Q4_0")


@dataclass(frozen=True)
class BenchConfig:
    """What ``run_bench`` measures.

    Attributes:
        prefill_lengths: prompt lengths of the prefill measurements (batch 1).
        decode_batches: batch sizes of the decode measurements.
        new_tokens: timed decode steps per decode measurement.
        decode_prompt_len: prompt tokens per row before decoding (not timed).
        repeats: timed rounds (median reported); warmup: untimed rounds first.
        systems: ``hf``, ``dense`` (runtime, routing off, on ``dense_backend``), backend names
            (routed), ``cpu-torch`` / ``dense-torch`` (the cpu backend routed / dense with its
            PyTorch decode step instead of the native one), ``llama.cpp`` (``llama-cpp-python``, the GGUF types of ``llama_cpp_types``,
            batch-1 shapes only).
        dense_backend: backend of the ``dense`` system.
        dtype: ``fp32`` / ``bf16``: shorthand for ``weights`` (None = fp32).
        weights: weight formats of the runtime systems (``fp32``, ``bf16``, ``int8``, ``int4``); HF runs the
            float ones (fp32, bf16).
        threads: torch intra-op thread counts, each measured in turn (0 = torch's default). The
            default is 1: on a shared CPU, OpenMP barriers stall whenever another process holds
            a core (decode steps of 30 ms turned into 300 ms with 2 threads under load on the
            2-core dev box), which makes multi-threaded numbers measure the neighbours.
        forced_sparsity: replace the routers by random per-token masks skipping this fraction of
            groups (for models without trained routers; reported in the output).
        seed: prompt offsets and forced masks.
        ppl_tokens: WikiText-2 test tokens scored per runtime format (0 = no perplexity).
        ppl_seq_len: window of the perplexity (non-overlapping windows).
        data_dir: directory holding ``wikitext-2-raw/`` (for the perplexity).
        llama_cpp_types: GGUF types of the llama.cpp rows.
    """

    prefill_lengths: tuple[int, ...] = (128, 1024)
    decode_batches: tuple[int, ...] = (1, 8)
    new_tokens: int = 128
    decode_prompt_len: int = 64
    repeats: int = 3
    warmup: int = 1
    systems: tuple[str, ...] = ("hf", "dense", "reference", "cpu")
    dense_backend: str = "cpu"
    dtype: str | None = None
    weights: tuple[str, ...] | None = None
    threads: tuple[int, ...] = (1,)
    forced_sparsity: float | None = None
    seed: int = 0
    ppl_tokens: int = 0
    ppl_seq_len: int = 512
    data_dir: str | None = None
    llama_cpp_types: tuple[str, ...] = LLAMA_CPP_TYPES

    def __post_init__(self):
        from wide_cli.runtime.backend import BACKENDS
        from wide_cli.runtime.quant import check_format

        known = (*SYSTEMS_FIXED, *BACKENDS)
        for s in self.systems:
            if s not in known:
                raise ConfigError(f"unknown bench system {s!r}", f"choose from {', '.join(known)}")
        if not self.systems:
            raise ConfigError("no systems to benchmark", f"choose from {', '.join(known)}")
        if isinstance(self.threads, int):
            object.__setattr__(self, "threads", (self.threads,))
        if self.weights is None:
            object.__setattr__(self, "weights", ("bf16",) if self.dtype == "bf16" else ("fp32",))
        elif self.dtype is not None:
            raise ConfigError("--dtype and --weights both given", "use --weights (fp32, bf16, int8, int4) alone")
        for w in self.weights:
            check_format(w)
        for t in self.llama_cpp_types:
            if t not in LLAMA_CPP_TYPES:
                raise ConfigError(f"unknown llama.cpp type {t!r}", f"choose from {', '.join(LLAMA_CPP_TYPES)}")
        for name in ("new_tokens", "decode_prompt_len", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if not self.threads or any(t < 0 for t in self.threads):
            raise ConfigError(f"threads {self.threads} must be >= 0 (0 = torch's default)")
        if self.warmup < 0:
            raise ConfigError(f"warmup {self.warmup} must be >= 0")
        if any(n < 1 for n in (*self.prefill_lengths, *self.decode_batches)):
            raise ConfigError("prefill lengths and decode batches must be >= 1")
        if self.forced_sparsity is not None and not (0.0 <= self.forced_sparsity <= 1.0):
            raise ConfigError(f"forced-sparsity {self.forced_sparsity} is outside [0, 1]")
        if self.ppl_tokens < 0 or self.ppl_seq_len < 2:
            raise ConfigError(f"ppl-tokens {self.ppl_tokens} must be >= 0 and ppl-seq-len {self.ppl_seq_len} >= 2")
