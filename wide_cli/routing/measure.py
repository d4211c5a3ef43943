"""Measuring the routing sparsity of a model: one accumulator and one measuring loop, used by
training (the skip-offset calibration), the export (held-out sparsity), ``wide eval`` and
``wide inspect``. The runtime accumulates its own decisions on the device
(``runtime.sparsity.SparsityStats``) and summarises them with the same ``SparsityCounter`` maths.
A physically narrowed static-width export makes no decisions: ``static_sparsity`` gives its
sparsity from the kept groups, in the same summary shape.

Not copied into hf exports (unlike ``state.py``'s ``SparsityCounter``, which the generated
modeling code carries verbatim).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from wide_cli.routing.state import MODULES, SparsityCounter

logger = logging.getLogger("wide.eval")


@dataclass
class SparsityMeter:
    """Routing decisions counted over many forwards (and merged across measurements).

    Attributes:
        routed: False for a dense model (no ``wide_routing``); then ``summary`` is None.
        skipped / decisions: ``{module: [per layer]}`` counts of (valid token, group) decisions.
        tokens_measured: non-padding tokens that went through the model while measuring (kept
            by the callers that know it).
    """

    routed: bool = False
    skipped: dict[str, list[float]] = field(default_factory=dict)
    decisions: dict[str, list[float]] = field(default_factory=dict)
    tokens_measured: int = 0

    def _add_counts(self, skipped: dict, decisions: dict) -> None:
        self.routed = True
        for m, sk in skipped.items():
            s = self.skipped.setdefault(m, [0.0] * len(sk))
            d = self.decisions.setdefault(m, [0.0] * len(decisions[m]))
            for i, (a, b) in enumerate(zip(sk, decisions[m])):
                s[i] += a
                d[i] += b

    def add_counter(self, counter: SparsityCounter) -> None:
        """Accumulate a ``SparsityCounter`` (one measurement's counts)."""
        self._add_counts(counter.skipped, counter.decisions)

    def merge(self, other: SparsityMeter) -> None:
        """Add another meter's counts and tokens (e.g. per-task meters into a per-model one)."""
        if not other.routed:
            return
        self.tokens_measured += other.tokens_measured
        self._add_counts(other.skipped, other.decisions)

    def counts(self) -> SparsityCounter | None:
        """The accumulated counts as a ``SparsityCounter`` (None for a dense model)."""
        if not self.routed:
            return None
        n = max((len(v) for v in self.skipped.values()), default=0)
        return SparsityCounter(n, {m: list(v) for m, v in self.skipped.items()},
                               {m: list(v) for m, v in self.decisions.items()})

    def summary(self) -> dict | None:
        """``SparsityCounter.summary()`` of the counts (``{attention, ffn, total, per_layer}``:
        per module the mean over layers of the per-layer skip fraction, ``total`` the mean over
        the routed modules) plus ``tokens_measured``; None for a dense model."""
        counts = self.counts()
        return None if counts is None else {**counts.summary(), "tokens_measured": self.tokens_measured}


@contextlib.contextmanager
def count_sparsity(model, meter: SparsityMeter | None = None):
    """Count the routing decisions of every forward inside the block into a ``SparsityMeter``
    (yielded; a new one when None).

    Padding is excluded where the forwards pass ``attention_mask``. For a dense model the meter
    stays ``routed=False``. A model left in ``gumbel`` (training) mode is switched to
    deterministic ``argmax`` routing for the block, with a warning, and restored afterwards:
    measured numbers must not depend on Gumbel noise.

    Raises:
        RuntimeError: a counter is already running on this model (nested measurement).
    """
    meter = meter if meter is not None else SparsityMeter()
    state = getattr(model, "wide_routing", None)
    if state is None:
        yield meter
        return
    if state.counter is not None:
        raise RuntimeError("a sparsity counter is already running on this model")
    prev_mode = state.mode
    if prev_mode == "gumbel":
        logger.warning("routing was in gumbel (training) mode; evaluating with argmax decisions")
        state.set_mode("argmax")
    counter = state.start_counting()
    try:
        yield meter
    finally:
        state.stop_counting()
        state.set_mode(prev_mode)
        meter.add_counter(counter)


@torch.no_grad()
def measure_sparsity(model, batches: Iterable[torch.Tensor], *, distinct_masks: bool = False) -> dict:
    """Measured sparsity of a routed model over ``batches`` of token ids (each ``[B, T]`` int64,
    no padding; batches may differ in shape), without gradients or a KV cache.

    With ``distinct_masks`` the decisions are also traced (``RoutingState.trace``) and each
    router's distinct execute masks counted: a router whose every token executes the same groups
    is a static mask, whatever its sparsity says (the symptom of routers whose input barely varies
    between tokens, see ``RoutingConfig.router_input``).

    Returns:
        ``SparsityCounter.summary()`` (``{attention, ffn, total, per_layer}``) plus ``tokens``
        (how many token ids went through the model), and with ``distinct_masks`` the key
        ``distinct_masks``: ``{module: [per layer: number of distinct [G] masks over the
        measured tokens, None where not routed]}``.

    Raises:
        ValueError: ``model`` is not routed (no ``wide_routing``).
    """
    if getattr(model, "wide_routing", None) is None:
        raise ValueError("measure_sparsity needs a routed model (attach_routers or a loaded export)")
    device = next(model.parameters()).device
    state = model.wide_routing
    n_layers = int(state.shape.num_layers)
    seen: dict[str, list[set | None]] = {m: [None] * n_layers for m in MODULES}
    tokens = 0
    with count_sparsity(model) as meter:
        for ids in batches:
            if distinct_masks:
                state.trace = []
            try:
                model(input_ids=ids.to(device), use_cache=False)
                trace = state.trace if distinct_masks else None
            finally:
                if distinct_masks:
                    state.trace = None
            for layer, module, ex in trace or ():
                rows = ex.reshape(-1, ex.shape[-1])  # [B * T, G] bool
                masks = seen[module][layer] = seen[module][layer] or set()
                masks.update(bytes(r) for r in torch.unique(rows, dim=0).to(torch.uint8).numpy())
            tokens += int(ids.numel())
    summary = meter.summary()
    summary.pop("tokens_measured")
    out = {**summary, "tokens": tokens}
    if distinct_masks:
        out["distinct_masks"] = {m: [None if s is None else len(s) for s in v] for m, v in seen.items()}
    return out


def static_routers(distinct: dict, per_layer: dict | None = None) -> list[tuple[str, int]]:
    """``(module, layer)`` of every router that gave all measured tokens one mask, from
    ``measure_sparsity(..., distinct_masks=True)["distinct_masks"]``. A layer that skips every
    group or none (``per_layer`` sparsity 1.0 or 0.0) is left out: one mask is then what it was
    trained to give, not a router that cannot tell tokens apart."""
    out = []
    for m, counts in distinct.items():
        sp = (per_layer or {}).get(m) or []
        for i, n in enumerate(counts):
            if n == 1 and not (i < len(sp) and sp[i] in (0.0, 1.0)):
                out.append((m, i))
    return out


def batches_of(sequences: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    """``sequences [N, T]`` in consecutive batches of at most ``batch_size`` rows."""
    return (sequences[i : i + batch_size] for i in range(0, len(sequences), batch_size))


def static_sparsity(wc: dict) -> dict:
    """Sparsity of a physically narrowed static-width export, from its kept groups (input
    independent): per layer ``1 - kept / G``; the same summary shape as a measurement."""
    lay = wc.get("layout") or {}
    G = {"attention": lay["attn_groups"], "ffn": lay["ffn_groups"]}
    per_layer = {m: [1.0 - len(k) / G[m] for k in wc["static"]["kept_groups"][m]] for m in MODULES}
    mods = {m: sum(v) / len(v) for m, v in per_layer.items()}
    return {**mods, "total": sum(mods.values()) / len(mods), "per_layer": per_layer, "data": "kept groups"}
