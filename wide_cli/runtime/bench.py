"""``wide bench``: prefill and decode throughput of dense Hugging Face transformers, llama.cpp, the
runtime in dense mode and the routed backends, per weight format and thread count, on one export.

Protocol (one process, same weights, same prompts, same threads for every system):
- Prompts are real English text (CPython's ``pydoc_data.topics``, the embedded default data set)
  tokenized with the export's tokenizer, so the routers see natural inputs.
- Prefill: one prompt of each length, batch 1; tokens/s = prompt tokens / wall time of the forward
  (HF with ``logits_to_keep=1``, the runtime and llama.cpp compute last-token logits only).
- Decode: ``batch`` prompts of ``decode_prompt_len`` tokens are prefilled (not timed), then
  ``new_tokens`` greedy steps are timed; tokens/s = batch * new_tokens / time.
- Systems are measured round-robin (warm-up rounds first, then ``repeats`` rounds); the median
  is reported, so load from other processes hits every system alike.
- Honest rows: every row says whether its path skips work (``skips_work``) and the share of the
  dense multiply-adds it executed (``executed_mac_fraction``), counted by the runtime's backends
  while they run (weights, attention scores, LM head and routers) and divided by the dense
  multiply-adds of ``wide_cli.cost`` for the same tokens and context. A row skips work when it
  executed fewer multiply-adds than dense (routers excluded); rows that only mask (the reference
  backend, a decode batch whose union of groups is everything) carry no ideal bound. HF and
  llama.cpp are dense code that the runtime cannot count: their fraction is null.
- Ideal speedup (skipping rows only), from ``wide_cli.cost`` at the measured sparsity: decode =
  dense weight bytes per token / routed ones (``decode_bytes``); prefill = dense FLOPs / routed
  FLOPs at the prompt's mean context.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from wide_cli.errors import ConfigError
from wide_cli.runtime.backend import ModelWeights

SYSTEMS_FIXED = ("hf", "dense", "llama.cpp")  # dense HF transformers; runtime with routing off
LLAMA_CPP_TYPES = ("F16", "Q8_0")


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
            (routed), ``llama.cpp`` (``llama-cpp-python``, the GGUF types of ``llama_cpp_types``,
            batch-1 shapes only).
        dense_backend: backend of the ``dense`` system.
        dtype: ``fp32`` / ``bf16``: shorthand for ``weights`` (None = fp32).
        weights: weight formats of the runtime systems (``fp32``, ``bf16``, ``int8``); HF runs the
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
            raise ConfigError("--dtype and --weights both given", "use --weights (fp32, bf16, int8) alone")
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


@dataclass
class BenchEntry:
    """One (system, threads, shape) measurement.

    ``system`` is the row label (``cpu int8``, ``dense bf16``, ``hf fp32``, ``llama.cpp Q8_0``);
    ``kind`` the system (``cpu``, ``dense``, ``reference``, ``hf``, ``llama.cpp``), ``weights``
    its weight format.
    """

    system: str
    kind: str
    weights: str
    threads: int
    phase: str  # prefill | decode
    batch: int
    prompt_len: int
    new_tokens: int
    seconds: list[float]
    tokens: int  # tokens processed per timed run
    measured_sparsity: dict | None = None
    skips_work: bool = False
    executed_mac_fraction: float | None = None
    ideal_speedup: float | None = None
    speedup_vs_hf: float | None = None
    speedup_vs_dense: float | None = None
    weight_bytes_per_step: float | None = None

    @property
    def shape(self) -> str:
        return f"prefill {self.prompt_len}" if self.phase == "prefill" else f"decode b{self.batch}"

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s

    @property
    def ms_per_step(self) -> float:
        """Decode: ms per step (one token per row); prefill: ms for the whole prompt."""
        steps = self.new_tokens if self.phase == "decode" else 1
        return 1e3 * self.median_s / steps

    @property
    def gb_per_s(self) -> float | None:
        """Weight bytes read per second (decode only: the bandwidth the step achieves)."""
        if self.phase != "decode" or self.weight_bytes_per_step is None:
            return None
        return self.weight_bytes_per_step * self.new_tokens / self.median_s / 1e9

    def to_dict(self) -> dict:
        return {
            "system": self.system,
            "kind": self.kind,
            "weights": self.weights,
            "threads": self.threads,
            "shape": self.shape,
            "phase": self.phase,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens if self.phase == "decode" else 0,
            "tokens_per_s": self.tokens_per_s,
            "ms_per_step": self.ms_per_step,
            "median_s": self.median_s,
            "seconds": self.seconds,
            "skips_work": self.skips_work,
            "executed_mac_fraction": self.executed_mac_fraction,
            "speedup_vs_hf": self.speedup_vs_hf,
            "speedup_vs_dense": self.speedup_vs_dense,
            f"{self.phase}_speedup_vs_hf": self.speedup_vs_hf,
            "ideal_speedup": self.ideal_speedup,
            "measured_sparsity": self.measured_sparsity,
            "weight_gb_per_s": self.gb_per_s,
        }


@dataclass
class BenchReport:
    """Everything ``run_bench`` measured (``to_dict`` is the ``--json`` document)."""

    export: str
    config: BenchConfig
    entries: list[BenchEntry]
    environment: dict = field(default_factory=dict)
    weight_bytes: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    quality: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "export": self.export,
            "config": asdict(self.config),
            "environment": self.environment,
            "weight_bytes": self.weight_bytes,
            "notes": self.notes,
            "quality": self.quality,
            "results": [e.to_dict() for e in self.entries],
        }


def decode_cost(weights: ModelWeights):
    """The ``decode_bytes`` cost model (``wide_cli.cost``) of a model held as runtime weights."""
    from wide_cli.cost import cost_model, shape_of_layers

    shape = shape_of_layers(weights.layers, weights.embed.shape[0], weights.embed.shape[1])
    return cost_model(shape, metric="decode_bytes")


def flops_cost(weights: ModelWeights, context_len: float):
    """The ``flops`` cost model (``wide_cli.cost``) at mean attended context ``context_len``."""
    from wide_cli.cost import cost_model, shape_of_layers

    shape = shape_of_layers(weights.layers, weights.embed.shape[0], weights.embed.shape[1])
    return cost_model(shape, metric="flops", context_len=context_len)


def dense_macs(weights: ModelWeights, phase: str, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Dense multiply-adds of one timed run (``wide_cli.cost`` FLOPs / 2): decode = ``batch *
    new_tokens`` tokens at mean context ``prompt_len + (new_tokens + 1) / 2`` (step i reads
    ``prompt_len + i + 1`` keys); prefill = ``prompt_len`` tokens at context ``(L + 1) / 2`` and
    one LM head (last-token logits)."""
    if phase == "decode":
        cm = flops_cost(weights, prompt_len + (new_tokens + 1) / 2)
        return batch * new_tokens * cm.dense_total / 2
    cm = flops_cost(weights, (prompt_len + 1) / 2)
    return batch * (prompt_len * (cm.dense_total - cm.model_floor) + cm.model_floor) / 2


def weight_bytes(weights: ModelWeights, itemsize: float) -> dict:
    """Dense weight bytes read per decode token, split by what routing can skip
    (``wide_cli.cost``, ``decode_bytes``): ``{attention_routed, ffn_routed, dense}``."""
    cm = decode_cost(weights)
    L = cm.num_layers
    return {"attention_routed": L * cm.module_cost("attention") * itemsize,
            "ffn_routed": L * cm.module_cost("ffn") * itemsize, "dense": cm.floor * itemsize}


# ----------------------------------------------------------------------------------------------
# prompts


def text_token_stream(tokenizer, min_tokens: int) -> torch.Tensor:
    """At least ``min_tokens`` token ids of English prose (``pydoc_data.topics``, repeated if the
    tokenizer is very efficient). Returns ``[N]`` int64."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids: list[int] = []
    chunk = 200_000
    for start in range(0, len(text), chunk):
        ids.extend(tokenizer(text[start : start + chunk], add_special_tokens=False).input_ids)
        if len(ids) >= min_tokens:
            break
    while len(ids) < min_tokens:
        ids = ids + ids
    return torch.tensor(ids, dtype=torch.long)


def _prompts(stream: torch.Tensor, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hi = max(len(stream) - length, 1)
    offs = torch.randint(0, hi, (batch,), generator=g).tolist()
    return torch.stack([stream[o : o + length] for o in offs])


# ----------------------------------------------------------------------------------------------
# systems


class _HFSystem:
    """Dense Hugging Face transformers, same weights (the export's backbone as a plain model)."""

    routed = False

    def __init__(self, path: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> float:
        from transformers import DynamicCache

        t = time.perf_counter()
        self.model(input_ids=ids, past_key_values=DynamicCache(config=self.model.config), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, steps: int) -> float:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = self.model(input_ids=nxt, past_key_values=cache, use_cache=True)
        return time.perf_counter() - t


class _RuntimeSystem:
    """The runtime on one backend and weight format, routed or not. ``executed`` holds the
    multiply-adds of its last timed run: ``(weights + attention + LM head, routers)``."""

    def __init__(self, runtime, routing: bool, forced_sparsity: float | None, seed: int):
        self.rt = runtime
        self.routed = routing
        self.forced_sparsity = forced_sparsity if routing else None
        self.seed = seed
        self.executed: tuple[int, int] = (0, 0)

    def _setup(self, batch: int, slots: int):
        self.rt.routing = self.routed
        self.rt.forced = {}
        if self.forced_sparsity is not None:
            self.rt.forced = random_forced_masks(self.rt, batch, slots, self.forced_sparsity, self.seed)

    def _counted(self) -> None:
        c = self.rt.counter
        self.executed = (c.macs + c.attn_macs, c.router_macs)

    def prefill(self, ids: torch.Tensor) -> float:
        self._setup(ids.shape[0], ids.shape[1])
        cache = self.rt.new_cache(ids.shape[0], ids.shape[1])
        self.rt.counter.reset()
        t = time.perf_counter()
        self.rt.step(ids, None, cache)
        t = time.perf_counter() - t
        self._counted()
        return t

    def decode(self, ids: torch.Tensor, steps: int) -> float:
        B, P = ids.shape
        self._setup(B, P + steps)
        cache = self.rt.new_cache(B, P + steps)
        logits = self.rt.step(ids, None, cache)
        self.rt.counter.reset()
        t = time.perf_counter()
        for _ in range(steps):
            logits = self.rt.step(logits.argmax(-1, keepdim=True), None, cache)
        t = time.perf_counter() - t
        self._counted()
        return t


class _LlamaCppSystem:
    """llama.cpp through ``llama-cpp-python`` on a GGUF of the export's dense weights (batch 1).

    The context is created once with ``n_batch = n_ubatch = n_ctx``, so a prompt is one batch;
    logits are kept for the last token only (as the other systems compute them)."""

    routed = False

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise ConfigError(
                "system 'llama.cpp' needs llama-cpp-python, which is not installed",
                "install the llama extra: pip install -e '.[llama]' (compiles llama.cpp, ~20 min on 2 cores)",
            ) from None
        n = max(threads, 1) if threads else None
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n,
                         n_threads_batch=n, logits_all=False, verbose=False)  # fmt: skip

    def _last_logits(self):
        # llama-cpp-python copies no logits without logits_all; read the context's last row (a
        # view of llama.cpp's buffer, no copy)
        import numpy as np

        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))

    def prefill(self, ids: torch.Tensor) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids[0].tolist())
        return time.perf_counter() - t

    def decode(self, ids: torch.Tensor, steps: int) -> float:
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        t = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([int(self._last_logits().argmax())])
        return time.perf_counter() - t

    def close(self) -> None:
        """Free the model now (llama-cpp-python's own finalizer fails at interpreter exit)."""
        self.llm.close()

    def greedy(self, ids: list[int], steps: int) -> list[int]:
        """Greedy continuation of ``ids`` (``steps`` tokens), for equivalence tests."""
        self.llm.reset()
        self.llm.eval(list(ids))
        out = []
        for _ in range(steps):
            out.append(int(self._last_logits().argmax()))
            self.llm.eval([out[-1]])
        return out


def random_forced_masks(runtime, batch: int, slots: int, p_skip: float, seed: int) -> dict:
    """``{(layer, module): [B, slots, G] bool}``: each (token, group) skips with probability
    ``p_skip``, independently (a stand-in for trained routers; label results that use it)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in runtime.meta:
        for module, G in (("attention", m.attn_groups), ("ffn", m.ffn_groups)):
            out[(m.index, module)] = (torch.rand(batch, slots, G, generator=g) >= p_skip).to(runtime.device)
    return out


# ----------------------------------------------------------------------------------------------
# quality: WikiText-2 perplexity per weight format


def runtime_perplexity(rt, ids: torch.Tensor, seq_len: int) -> dict:
    """Token-level perplexity of the runtime (routed as configured) over non-overlapping windows
    of ``seq_len`` tokens of ``ids [N]`` (the pruning papers' protocol, ``eval.perplexity``)."""
    import math

    import torch.nn.functional as F

    from wide_cli.eval.perplexity import token_windows

    nll, scored = 0.0, 0
    rt.stats.reset()
    for b, e, t0 in token_windows(int(ids.numel()), seq_len, None):
        x = ids[b:e][None]
        logits = rt.forward(x)[0]
        nll += float(F.cross_entropy(logits[t0 - 1 - b : e - 1 - b], x[0, t0 - b : e - b], reduction="sum").double())
        scored += e - t0
    return {"perplexity": math.exp(nll / scored), "tokens_scored": scored, "seq_len": seq_len,
            "sparsity": {k: rt.stats.summary()[k] for k in ("attention", "ffn", "total")}}  # fmt: skip


def wikitext_ids(tokenizer, data_dir: Path, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` ids of the WikiText-2 test rows joined with ``"\\n\\n"``."""
    from wide_cli.eval import wikitext

    text = "\n\n".join(wikitext.rows(wikitext.read_raw(Path(data_dir), "test")))
    ids = tokenizer(text[: n_tokens * 8], add_special_tokens=False).input_ids[:n_tokens]
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# the benchmark


def _label(kind: str, fmt: str, formats) -> str:
    return kind if len(formats) == 1 and kind != "llama.cpp" else f"{kind} {fmt}"


def run_bench(path, cfg: BenchConfig, *, log=None) -> BenchReport:
    """Measure every system of ``cfg`` on the export at ``path``.

    Raises:
        CheckpointError: an unreadable export. ConfigError: bad settings, an unavailable backend,
            llama.cpp without llama-cpp-python, perplexity without the data.
    """
    import os
    import platform
    import tempfile

    from wide_cli.models.loader import load_tokenizer
    from wide_cli.runtime.checkpoint import weights_from_export
    from wide_cli.runtime.engine import Runtime
    from wide_cli.runtime.quant import COMPUTE_DTYPE

    log = log or (lambda msg: None)
    path = Path(path)
    weights = weights_from_export(path)
    tokenizer = load_tokenizer(path)
    notes = []
    if cfg.forced_sparsity is not None:
        notes.append(
            f"routers replaced by random per-token masks skipping {cfg.forced_sparsity:.0%} of groups (--forced-sparsity)"
        )
    if cfg.ppl_tokens and cfg.data_dir is None:
        raise ConfigError("--ppl-tokens needs the WikiText-2 data", "pass --data-dir (the folder holding wikitext-2-raw/)")
    stored_int8 = weights.extra.get("weight_format") == "int8"

    runtimes: dict[tuple[str, str], Runtime] = {}

    def runtime_for(backend: str, fmt: str) -> Runtime:
        if (backend, fmt) not in runtimes:
            runtimes[(backend, fmt)] = Runtime(weights, backend, tokenizer=tokenizer, weight_format=fmt)
        return runtimes[(backend, fmt)]

    # (label, kind, format) -> system; llama.cpp systems are built per thread count
    systems: dict[tuple[str, str, str], object] = {}
    llama_types = []
    for s in cfg.systems:
        for fmt in cfg.weights:
            label = _label(s, fmt, cfg.weights)
            if s == "hf":
                if fmt == "int8" or stored_int8:
                    continue  # transformers has no int8 weight-only CPU path for this export
                log(f"loading {label}")
                systems[(label, s, fmt)] = _HFSystem(path, COMPUTE_DTYPE[fmt])
            elif s == "dense":
                systems[(label, s, fmt)] = _RuntimeSystem(runtime_for(cfg.dense_backend, fmt), False, None, cfg.seed)
            elif s != "llama.cpp":
                if fmt == "int8" and s != "cpu":
                    continue  # int8 kernels exist in the cpu backend only
                systems[(label, s, fmt)] = _RuntimeSystem(runtime_for(s, fmt), True, cfg.forced_sparsity, cfg.seed)
        if s == "llama.cpp":
            llama_types = list(cfg.llama_cpp_types)
    dcost = decode_cost(weights)

    quality = {}
    if cfg.ppl_tokens:
        ids = wikitext_ids(tokenizer, Path(cfg.data_dir), cfg.ppl_tokens)
        torch.set_num_threads(min(cfg.threads) or torch.get_num_threads())
        for fmt in cfg.weights:
            rt = runtime_for("cpu", fmt)
            for routed in (True,):  # the routed model is what each format ships
                rt.routing, rt.forced = routed, {}
                t = time.perf_counter()
                res = runtime_perplexity(rt, ids, cfg.ppl_seq_len)
                res["seconds"] = time.perf_counter() - t
                quality[f"{'routed' if routed else 'dense'} {fmt}"] = res
                log(f"WikiText-2 perplexity {'routed' if routed else 'dense'} {fmt}: {res['perplexity']:.3f}")
        base = quality.get("routed fp32")
        if base:
            for k, v in quality.items():
                if k.startswith("routed"):
                    v["vs_routed_fp32"] = v["perplexity"] / base["perplexity"] - 1

    gguf_dir = None
    if llama_types:
        from wide_cli.runtime.gguf_writer import write_gguf

        gguf_dir = tempfile.TemporaryDirectory(prefix="wide-bench-gguf-")
        ggufs = {}
        for t in llama_types:
            log(f"writing GGUF {t}")
            ggufs[t] = write_gguf(path, Path(gguf_dir.name) / f"model-{t}.gguf", t)
        notes.append("llama.cpp rows: the export's dense weights written as GGUF by `gguf` (no routers), "
                     "batch-1 shapes only")  # fmt: skip
    n_ctx = max((*cfg.prefill_lengths, cfg.decode_prompt_len + cfg.new_tokens)) + 8

    stream = text_token_stream(tokenizer, max((*cfg.prefill_lengths, cfg.decode_prompt_len)) * 4)
    shapes = [("prefill", 1, L) for L in cfg.prefill_lengths] + [
        ("decode", B, cfg.decode_prompt_len) for B in cfg.decode_batches
    ]
    entries: list[BenchEntry] = []
    try:
        for threads in cfg.threads:
            if threads > 0:
                torch.set_num_threads(threads)
            tsys = dict(systems)
            for t in llama_types:
                log(f"loading llama.cpp {t} ({threads} threads)")
                tsys[(f"llama.cpp {t}", "llama.cpp", t)] = _LlamaCppSystem(ggufs[t], threads, n_ctx)
            for phase, B, L in shapes:
                ids = _prompts(stream, B, L, cfg.seed + B * 7919 + L)
                active = {k: v for k, v in tsys.items() if B == 1 or k[1] != "llama.cpp"}
                times: dict = {k: [] for k in active}
                sparsity: dict = {}
                executed: dict = {}
                for r in range(cfg.warmup + cfg.repeats):
                    for key, sys_ in active.items():
                        if isinstance(sys_, _RuntimeSystem) and r == cfg.warmup:
                            sys_.rt.stats.reset()  # measured sparsity of the timed rounds only
                        t = sys_.prefill(ids) if phase == "prefill" else sys_.decode(ids, cfg.new_tokens)
                        if r >= cfg.warmup:
                            times[key].append(t)
                        if isinstance(sys_, _RuntimeSystem):
                            executed[key] = sys_.executed
                            if r == cfg.warmup + cfg.repeats - 1:
                                sparsity[key] = sys_.rt.stats.summary() if sys_.routed else None
                    log(f"{threads} threads, {phase} batch {B} len {L}: round {r + 1}/{cfg.warmup + cfg.repeats}")
                dense = dense_macs(weights, phase, B, L, cfg.new_tokens)
                for key in active:
                    label, kind, fmt = key
                    sp = sparsity.get(key)
                    sp_short = None if sp is None else {k: sp[k] for k in ("attention", "ffn", "total")}
                    frac, skips = None, False
                    if key in executed:
                        work, routers = executed[key]
                        frac = (work + routers) / dense
                        skips = work < dense * (1 - 1e-9)
                    ideal = None
                    if skips and sp_short:
                        ideal = (dcost.speedup_bound(sp_short) if phase == "decode"
                                 else flops_cost(weights, (L + 1) / 2).speedup_bound(sp_short))  # fmt: skip
                    itemsize = {"fp32": 4, "bf16": 2, "int8": 1, "F16": 2, "Q8_0": 34 / 32}[fmt]
                    wb = sum(weight_bytes(weights, itemsize).values())
                    entries.append(BenchEntry(
                        system=label, kind=kind, weights=fmt, threads=threads, phase=phase, batch=B, prompt_len=L,
                        new_tokens=cfg.new_tokens if phase == "decode" else 0, seconds=times[key],
                        tokens=B * L if phase == "prefill" else B * cfg.new_tokens, measured_sparsity=sp_short,
                        skips_work=skips, executed_mac_fraction=frac, ideal_speedup=ideal,
                        weight_bytes_per_step=wb / (dcost.speedup_bound(sp_short) if sp_short else 1.0),
                    ))  # fmt: skip
            for key, sys_ in tsys.items():
                if isinstance(sys_, _LlamaCppSystem):
                    sys_.close()
    finally:
        if gguf_dir is not None:
            gguf_dir.cleanup()
    _fill_speedups(entries)
    env = {
        "torch": torch.__version__,
        "threads": list(cfg.threads),
        "weights": list(cfg.weights),
        "dtype": "/".join(sorted({str(COMPUTE_DTYPE[w]).removeprefix("torch.") for w in cfg.weights})),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if llama_types:
        import llama_cpp

        env["llama_cpp_python"] = llama_cpp.__version__
    wb = {fmt: weight_bytes(weights, {"fp32": 4, "bf16": 2, "int8": 1}[fmt]) for fmt in cfg.weights}
    return BenchReport(str(path), cfg, entries, env, wb, notes, quality)


def _fill_speedups(entries: list[BenchEntry]) -> None:
    """``speedup_vs_hf``: against HF in the same format (fp32 HF for int8 and llama.cpp rows);
    ``speedup_vs_dense``: against the runtime's dense mode in the same format (fp32 for HF rows,
    int8 for llama.cpp rows). Same threads and shape."""
    by_shape: dict[tuple, dict[tuple[str, str], BenchEntry]] = {}
    for e in entries:
        by_shape.setdefault((e.threads, e.phase, e.batch, e.prompt_len), {})[(e.kind, e.weights)] = e
    for group in by_shape.values():
        for e in group.values():
            hf = group.get(("hf", e.weights)) or group.get(("hf", "fp32"))
            dense_fmt = {"F16": "int8", "Q8_0": "int8"}.get(e.weights, e.weights)
            dense = group.get(("dense", dense_fmt))
            if hf is not None:
                e.speedup_vs_hf = e.tokens_per_s / hf.tokens_per_s
            if dense is not None:
                e.speedup_vs_dense = e.tokens_per_s / dense.tokens_per_s
