"""Measured sparsity of the runtime's own routing decisions, counted on the device.

``routing.measure`` counts the decisions of a routed Hugging Face model; the runtime makes its own
decisions (``engine.Runtime._decide``) and counts them here, as device tensors so a decode step
needs no host sync per layer. The summary is ``routing.SparsityCounter``'s, so both read alike.
"""

from __future__ import annotations

import torch

from wide_cli.models.arch import ROUTED_MODULES

# Pending records folded per flush: bounds the memory held by the masks of a long prefill.
FLUSH_EVERY = 4096


class SparsityStats:
    """Measured sparsity of the runtime's own decisions: skipped / total (valid token, group)
    decisions per layer and module, accumulated as device tensors (no sync per layer)."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.skipped = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)
        self.decisions = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)

        self._pending: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []

    def reset(self) -> None:
        self.skipped.zero_()
        self.decisions.zero_()
        self._pending.clear()

    def add(self, layer: int, module: str, execute: torch.Tensor, n_valid: torch.Tensor) -> None:
        """Record ``execute [B, T, G]`` bool (already False on padding) of a block with ``n_valid``
        (0-d tensor) real tokens. Counted lazily, in batches (a decode step stays cheap)."""
        self._pending.append((layer, ROUTED_MODULES.index(module), execute, n_valid))
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Fold the pending records into the counts, one stacked reduction per mask shape."""
        by_shape: dict = {}
        for rec in self._pending:
            by_shape.setdefault(tuple(rec[2].shape), []).append(rec)
        self._pending.clear()
        for shape, recs in by_shape.items():
            idx = torch.tensor([r[0] * 2 + r[1] for r in recs], device=self.skipped.device)
            executed = torch.stack([r[2] for r in recs]).flatten(1).sum(1).double()  # [n]
            decided = torch.stack([r[3] for r in recs]).double() * shape[-1]  # [n]
            self.decisions.view(-1).index_add_(0, idx, decided)
            self.skipped.view(-1).index_add_(0, idx, decided - executed)

    def summary(self) -> dict:
        """``{attention, ffn, total, per_layer}`` like ``routing.SparsityCounter.summary``: per
        module the mean over layers of the per-layer skip fraction; None where not routed."""
        # imported here: wide_cli.routing imports transformers, which the runtime does not need
        from wide_cli.routing.state import SparsityCounter

        self.flush()
        c = SparsityCounter(self.num_layers)
        sk, de = self.skipped.tolist(), self.decisions.tolist()
        for m, name in enumerate(ROUTED_MODULES):
            c.skipped[name] = [row[m] for row in sk]
            c.decisions[name] = [row[m] for row in de]
        return c.summary()
