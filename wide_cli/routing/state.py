"""Routing state shared by the routed layers of one model: mode, temperature, padding mask,
forced masks, and the records used for the sparsity loss and measured sparsity.

One ``RoutingState`` per model, attached as ``model.wide_routing`` (no global state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wide_cli.models.arch import ROUTED_MODULES, ModelShape
from wide_cli.routing.config import GroupLayout, RoutingConfig
from wide_cli.routing.gumbel import argmax_execute, hard_gumbel_execute, skip_fraction

MODULES = ROUTED_MODULES  # copied by value into hf exports (export/modeling_template.py)
MODES = ("argmax", "gumbel", "dense")


@dataclass
class SparsityCounter:
    """Measured sparsity accumulated over forwards (detached counts, padding excluded).

    ``skipped[m][i]`` / ``decisions[m][i]``: skipped and total (valid token, group) decisions of
    module ``m`` in layer ``i``.
    """

    num_layers: int
    skipped: dict[str, list[float]] = field(default_factory=dict)
    decisions: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        for m in MODULES:
            self.skipped.setdefault(m, [0.0] * self.num_layers)
            self.decisions.setdefault(m, [0.0] * self.num_layers)

    def add(self, module: str, layer: int, execute: torch.Tensor, valid: torch.Tensor | None) -> None:
        ex = execute.detach().bool()
        if valid is None:
            n_valid = ex.shape[0] * ex.shape[1]
            skipped = (~ex).sum().item()
        else:
            v = valid.unsqueeze(-1)
            n_valid = int(valid.sum().item())
            skipped = ((~ex) & v).sum().item()
        self.skipped[module][layer] += float(skipped)
        self.decisions[module][layer] += float(n_valid * ex.shape[-1])

    def per_layer(self, module: str) -> list[float | None]:
        """Skip fraction per layer (None where the module is not routed)."""
        return [
            (s / d if d > 0 else None) for s, d in zip(self.skipped[module], self.decisions[module])
        ]

    def module(self, module: str) -> float | None:
        """Mean over layers of the per-layer skip fraction (DESIGN.md §1 averaging)."""
        vals = [v for v in self.per_layer(module) if v is not None]
        return sum(vals) / len(vals) if vals else None

    def summary(self) -> dict:
        """``{attention, ffn, total, per_layer: {attention: [...], ffn: [...]}}``; total is the
        mean over the routed modules; modules that are not routed report None."""
        att, ffn = self.module("attention"), self.module("ffn")
        active = [v for v in (att, ffn) if v is not None]
        return {
            "attention": att,
            "ffn": ffn,
            "total": sum(active) / len(active) if active else 0.0,
            "per_layer": {m: self.per_layer(m) for m in MODULES},
        }


class RoutingState:
    """Mutable per-model routing state (owned by the model, not global).

    Attributes:
        cfg, shape, layout: the routing settings and the model's resolved group layout.
        mode: ``argmax`` (inference, deterministic), ``gumbel`` (training, hard STE) or
            ``dense`` (routers ignored: every group executes).
        tau: current Gumbel temperature.
        valid: ``[B, T]`` bool for the current forward (False = padding), set by a forward
            pre-hook from ``attention_mask``; None = all valid.
        forced: ``{(layer, module): [B, T, G] bool}`` decisions that override the routers (tests,
            inspection); a ``[G]`` mask broadcasts over tokens.
        records: per forward, ``(layer, module, skip_fraction)`` with gradients, for the loss.
        counter: a ``SparsityCounter`` when measuring, else None.
        trace: when a list, every decision ``(layer, module, execute [B, T, G] bool)`` is appended.
        grad_checkpointing: recompute each decoder layer during backward (training only).
        recomputing: set while a checkpointed layer replays its forward (records nothing).
    """

    def __init__(self, cfg: RoutingConfig, shape: ModelShape, layout: GroupLayout):
        self.cfg = cfg
        self.shape = shape
        self.layout = layout
        self.mode = "dense" if cfg.method == "dense" else "argmax"
        self.tau = cfg.tau_start
        self.valid: torch.Tensor | None = None
        self.forced: dict[tuple[int, str], torch.Tensor] = {}
        self.records: list[tuple[int, str, torch.Tensor]] = []
        self.counter: SparsityCounter | None = None
        self.trace: list | None = None
        self.generator: torch.Generator | None = None
        self.world, self.rank = 1, 0  # data-parallel layout for the Gumbel noise
        self.grad_checkpointing = False  # training: recompute each layer during backward
        self.recomputing = False  # True while a checkpointed layer replays its forward

    @property
    def active_modules(self) -> tuple[str, ...]:
        if self.cfg.method == "dense":
            return ()
        return tuple(
            m for m, on in (("attention", self.cfg.route_attention), ("ffn", self.cfg.route_ffn)) if on
        )

    def groups(self, module: str) -> int:
        return self.layout.attn_groups if module == "attention" else self.layout.ffn_groups

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r} not in {MODES}")
        self.mode = mode

    def start_counting(self) -> SparsityCounter:
        """Begin measuring sparsity; returns the counter that forwards accumulate into."""
        self.counter = SparsityCounter(self.shape.num_layers)
        return self.counter

    def stop_counting(self) -> SparsityCounter | None:
        c, self.counter = self.counter, None
        return c

    def _valid_for(self, hidden: torch.Tensor) -> torch.Tensor | None:
        v = self.valid
        if v is None or v.shape[0] != hidden.shape[0] or v.shape[1] != hidden.shape[1]:
            return None
        return v

    def decide(self, layer_module, layer: int, module: str, hidden: torch.Tensor) -> torch.Tensor | None:
        """Execute decisions of one router.

        Args:
            layer_module: the decoder layer holding ``router_attention`` / ``router_ffn``.
            layer: layer index.
            module: ``attention`` or ``ffn``.
            hidden: ``[B, T, D]`` router input (residual stream).

        Returns:
            ``[B, T, G]`` float (1.0 = execute; STE gradients in gumbel mode) or None when the
            module runs dense.
        """
        key = (layer, module)
        if key in self.forced:
            ex = self.forced[key].to(hidden.device)
            if ex.dim() == 1:
                ex = ex.expand(*hidden.shape[:-1], ex.shape[0])
            ex = ex.to(torch.float32)
        else:
            if self.mode == "dense" or module not in self.active_modules:
                return None
            router = getattr(layer_module, f"router_{module}", None)
            if router is None:
                return None
            logits = router(hidden)  # [B, T, G, 2] fp32
            if self.mode == "gumbel":
                ex = hard_gumbel_execute(logits, self.tau, self.generator, world=self.world, rank=self.rank)
            else:
                ex = argmax_execute(logits).to(torch.float32)
        valid = self._valid_for(hidden)
        if self.recomputing:  # activation-checkpoint replay: the forward already recorded this
            return ex
        if torch.is_grad_enabled() and ex.requires_grad:
            self.records.append((layer, module, skip_fraction(ex, valid)))
        if self.counter is not None:
            self.counter.add(module, layer, ex, valid)
        if self.trace is not None:
            self.trace.append((layer, module, ex.detach().bool().cpu()))
        return ex

    def measured_s_hat(self) -> dict[str, torch.Tensor]:
        """Differentiable skip fraction per module from this forward's records: mean over layers.

        Under data parallelism (``world > 1``) the fractions are averaged over ranks with a
        differentiable all-reduce, so the sparsity term sees the global batch.
        """
        by_mod: dict[str, list[torch.Tensor]] = {}
        for _, m, frac in self.records:
            by_mod.setdefault(m, []).append(frac)
        out = {m: torch.stack(v).mean() for m, v in by_mod.items()}
        if self.world > 1 and out:
            import torch.distributed.nn.functional as dist_fn

            names = sorted(out)
            summed = dist_fn.all_reduce(torch.stack([out[m] for m in names]))
            out = {m: summed[i] / self.world for i, m in enumerate(names)}
        return out
