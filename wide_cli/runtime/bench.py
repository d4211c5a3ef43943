"""``wide bench``: prefill and decode throughput of dense Hugging Face transformers, the runtime in
dense mode, and the routed backends, on one export, with the ideal bound next to each number.

Protocol (one process, same weights, same threads, same prompts for every system):
- Prompts are real English text (CPython's ``pydoc_data.topics``, the embedded default data set)
  tokenized with the export's tokenizer, so the routers see natural inputs.
- Prefill: one prompt of each length, batch 1; tokens/s = prompt tokens / wall time of the forward
  (HF with ``logits_to_keep=1``, the runtime computes last-token logits only).
- Decode: ``batch`` prompts of ``decode_prompt_len`` tokens are prefilled (not timed), then
  ``new_tokens`` greedy steps are timed; tokens/s = batch * new_tokens / time.
- Systems are measured round-robin (warm-up rounds first, then ``repeats`` rounds); the median
  is reported, so load from other processes hits every system alike.
- Ideal speedup = dense weight bytes per token / bytes the routed model must read at the measured
  per-module sparsity (routed Q/O and Gate/Up/Down scale with ``1 - s``; K/V, norms and the LM
  head stay dense; DESIGN.md §3). Attention-score FLOPs are not in the bound.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from wide_cli.errors import ConfigError
from wide_cli.runtime.backend import ModelWeights

SYSTEMS_FIXED = ("hf", "dense")  # dense HF transformers; the runtime with routing disabled


@dataclass(frozen=True)
class BenchConfig:
    """What ``run_bench`` measures.

    Attributes:
        prefill_lengths: prompt lengths of the prefill measurements (batch 1).
        decode_batches: batch sizes of the decode measurements.
        new_tokens: timed decode steps per decode measurement.
        decode_prompt_len: prompt tokens per row before decoding (not timed).
        repeats: timed rounds (median reported); warmup: untimed rounds first.
        systems: ``hf``, ``dense`` (runtime, routing off, on ``dense_backend``) and backend names.
        dense_backend: backend of the ``dense`` system.
        dtype: ``fp32`` / ``bf16`` (None = fp32).
        threads: torch intra-op threads for every system (0 = torch's default). The default is 1:
            on a shared CPU, OpenMP barriers stall whenever another process holds a core (measured
            on the 2-core dev box: decode steps of 30 ms turned into 300 ms with 2 threads under
            load), which makes multi-threaded numbers measure the neighbours, not the code.
        forced_sparsity: replace the routers by random per-token masks skipping this fraction of
            groups (for models without trained routers; reported in the output).
        seed: prompt offsets and forced masks.
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
    threads: int = 1
    forced_sparsity: float | None = None
    seed: int = 0

    def __post_init__(self):
        from wide_cli.runtime.backend import BACKENDS

        known = (*SYSTEMS_FIXED, *BACKENDS)
        for s in self.systems:
            if s not in known:
                raise ConfigError(f"unknown bench system {s!r}", f"choose from {', '.join(known)}")
        if not self.systems:
            raise ConfigError("no systems to benchmark", f"choose from {', '.join(known)}")
        for name in ("new_tokens", "decode_prompt_len", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.threads < 0:
            raise ConfigError(f"threads {self.threads} must be >= 0 (0 = torch's default)")
        if self.warmup < 0:
            raise ConfigError(f"warmup {self.warmup} must be >= 0")
        if any(n < 1 for n in (*self.prefill_lengths, *self.decode_batches)):
            raise ConfigError("prefill lengths and decode batches must be >= 1")
        if self.forced_sparsity is not None and not (0.0 <= self.forced_sparsity <= 1.0):
            raise ConfigError(f"forced-sparsity {self.forced_sparsity} is outside [0, 1]")


@dataclass
class BenchEntry:
    """One (system, shape) measurement."""

    system: str
    phase: str  # prefill | decode
    batch: int
    prompt_len: int
    new_tokens: int
    seconds: list[float]
    tokens: int  # tokens processed per timed run
    measured_sparsity: dict | None = None
    ideal_speedup: float = 1.0
    speedup_vs_hf: float | None = None
    speedup_vs_dense: float | None = None
    weight_bytes_per_step: float | None = None

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
        d = {
            "system": self.system,
            "phase": self.phase,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens if self.phase == "decode" else 0,
            "tokens_per_s": self.tokens_per_s,
            "ms_per_step": self.ms_per_step,
            "median_s": self.median_s,
            "seconds": self.seconds,
            "speedup_vs_hf": self.speedup_vs_hf,
            "speedup_vs_dense": self.speedup_vs_dense,
            f"{self.phase}_speedup_vs_hf": self.speedup_vs_hf,
            "ideal_speedup": self.ideal_speedup,
            "measured_sparsity": self.measured_sparsity,
            "weight_gb_per_s": self.gb_per_s,
        }
        return d


@dataclass
class BenchReport:
    """Everything ``run_bench`` measured (``to_dict`` is the ``--json`` document)."""

    export: str
    config: BenchConfig
    entries: list[BenchEntry]
    environment: dict = field(default_factory=dict)
    weight_bytes: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "export": self.export,
            "config": asdict(self.config),
            "environment": self.environment,
            "weight_bytes": self.weight_bytes,
            "notes": self.notes,
            "results": [e.to_dict() for e in self.entries],
        }


def decode_cost(weights: ModelWeights):
    """The ``decode_bytes`` cost model (``wide_cli.cost``) of a model held as runtime weights."""
    from wide_cli.cost import cost_model, shape_of_layers

    shape = shape_of_layers(weights.layers, weights.embed.shape[0], weights.embed.shape[1])
    return cost_model(shape, metric="decode_bytes")


def weight_bytes(weights: ModelWeights, itemsize: int) -> dict:
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
    """The runtime on one backend, routed or not."""

    def __init__(self, runtime, routing: bool, forced_sparsity: float | None, seed: int):
        self.rt = runtime
        self.routed = routing
        self.forced_sparsity = forced_sparsity if routing else None
        self.seed = seed

    def _setup(self, batch: int, slots: int):
        self.rt.routing = self.routed
        self.rt.forced = {}
        if self.forced_sparsity is not None:
            self.rt.forced = random_forced_masks(self.rt, batch, slots, self.forced_sparsity, self.seed)

    def prefill(self, ids: torch.Tensor) -> float:
        self._setup(ids.shape[0], ids.shape[1])
        cache = self.rt.new_cache(ids.shape[0], ids.shape[1])
        t = time.perf_counter()
        self.rt.step(ids, None, cache)
        return time.perf_counter() - t

    def decode(self, ids: torch.Tensor, steps: int) -> float:
        B, P = ids.shape
        self._setup(B, P + steps)
        cache = self.rt.new_cache(B, P + steps)
        logits = self.rt.step(ids, None, cache)
        t = time.perf_counter()
        for _ in range(steps):
            logits = self.rt.step(logits.argmax(-1, keepdim=True), None, cache)
        return time.perf_counter() - t


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
# the benchmark


def run_bench(path, cfg: BenchConfig, *, log=None) -> BenchReport:
    """Measure every system of ``cfg`` on the export at ``path``.

    Raises:
        CheckpointError: an unreadable export. ConfigError: bad settings or an unavailable backend.
    """
    import platform

    from wide_cli.models.loader import load_tokenizer, resolve_dtype
    from wide_cli.runtime.backend import weights_from_export
    from wide_cli.runtime.engine import Runtime

    log = log or (lambda msg: None)
    path = Path(path)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    dtype = resolve_dtype(cfg.dtype)
    weights = weights_from_export(path)
    tokenizer = load_tokenizer(path)
    notes = []
    if cfg.forced_sparsity is not None:
        notes.append(
            f"routers replaced by random per-token masks skipping {cfg.forced_sparsity:.0%} of groups (--forced-sparsity)"
        )

    systems: dict[str, object] = {}
    runtimes: dict[str, Runtime] = {}

    def runtime_for(backend: str) -> Runtime:
        if backend not in runtimes:
            runtimes[backend] = Runtime(weights, backend, dtype=dtype, tokenizer=tokenizer)
        return runtimes[backend]

    for s in cfg.systems:
        log(f"loading {s}")
        if s == "hf":
            systems[s] = _HFSystem(path, dtype)
        elif s == "dense":
            systems[s] = _RuntimeSystem(runtime_for(cfg.dense_backend), False, None, cfg.seed)
        else:
            systems[s] = _RuntimeSystem(runtime_for(s), True, cfg.forced_sparsity, cfg.seed)
    wbytes = weight_bytes(weights, torch.finfo(dtype).bits // 8)
    dense_bytes = sum(wbytes.values())
    dcost = decode_cost(weights)

    stream = text_token_stream(tokenizer, max((*cfg.prefill_lengths, cfg.decode_prompt_len)) * 4)
    shapes = [("prefill", 1, L) for L in cfg.prefill_lengths] + [
        ("decode", B, cfg.decode_prompt_len) for B in cfg.decode_batches
    ]
    entries: list[BenchEntry] = []
    for phase, B, L in shapes:
        ids = _prompts(stream, B, L, cfg.seed + B * 7919 + L)
        times: dict[str, list[float]] = {s: [] for s in systems}
        sparsity: dict[str, dict] = {}
        for r in range(cfg.warmup + cfg.repeats):
            for name, sys_ in systems.items():
                if isinstance(sys_, _RuntimeSystem) and r == cfg.warmup:
                    sys_.rt.stats.reset()  # measured sparsity of the timed rounds only
                t = sys_.prefill(ids) if phase == "prefill" else sys_.decode(ids, cfg.new_tokens)
                if r >= cfg.warmup:
                    times[name].append(t)
                if isinstance(sys_, _RuntimeSystem) and r == cfg.warmup + cfg.repeats - 1:
                    sparsity[name] = sys_.rt.stats.summary() if sys_.routed else None
            log(f"{phase} batch {B} len {L}: round {r + 1}/{cfg.warmup + cfg.repeats}")
        for name in systems:
            sp = sparsity.get(name)
            sp_short = None if sp is None else {k: sp[k] for k in ("attention", "ffn", "total")}
            ideal = dcost.speedup_bound(sp_short) if sp_short else 1.0
            ntok = B * L if phase == "prefill" else B * cfg.new_tokens
            entry = BenchEntry(
                system=name, phase=phase, batch=B, prompt_len=L,
                new_tokens=cfg.new_tokens if phase == "decode" else 0, seconds=times[name], tokens=ntok,
                measured_sparsity=sp_short, ideal_speedup=ideal, weight_bytes_per_step=dense_bytes / ideal,
            )  # fmt: skip
            entries.append(entry)
    _fill_speedups(entries)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": __import__("os").cpu_count(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return BenchReport(str(path), cfg, entries, env, wbytes, notes)


def _fill_speedups(entries: list[BenchEntry]) -> None:
    by_shape: dict[tuple, dict[str, BenchEntry]] = {}
    for e in entries:
        by_shape.setdefault((e.phase, e.batch, e.prompt_len), {})[e.system] = e
    for group in by_shape.values():
        hf, dense = group.get("hf"), group.get("dense")
        for e in group.values():
            if hf is not None:
                e.speedup_vs_hf = e.tokens_per_s / hf.tokens_per_s
            if dense is not None:
                e.speedup_vs_dense = e.tokens_per_s / dense.tokens_per_s
