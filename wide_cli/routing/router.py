"""Per-layer routers (DESIGN.md §1).

A ``Router`` is a bottleneck MLP ``Linear(D, r) -> Linear(r, 2G)`` with no activation in
between; its output, reshaped to ``[..., G, 2]``, holds per group the execute (0) and skip (1)
logits. A ``StaticRouter`` holds an input-independent keep mask (the static-width baseline).
Routers always compute in fp32, whatever the backbone dtype.
"""

from __future__ import annotations

import torch
from torch import nn


class Router(nn.Module):
    """Token-level group router.

    Args:
        hidden_size: D, width of the residual stream fed to the router.
        rank: bottleneck width r.
        num_groups: G, groups routed by this router.

    Parameters (names match the export format ``router_{attention,ffn}.{compressor,router}``):
        compressor: Linear(D, r), kaiming-uniform (linear gain) weight, zero bias.
        router: Linear(r, 2G), kaiming-uniform (linear gain) weight, zero bias.
        standin: ``[G, D]`` fp32, only with ``standin=True``: what each group adds to the module
            output when it is skipped (``RoutingConfig.standin``); zeros until initialised from
            the calibration statistics. Absent otherwise, so a model without stand-ins pays nothing.
        standin_in, standin_out: ``[G, R, D]`` fp32 each, only with ``standin_rank=R > 0``
            (``lowrank:R`` stand-ins): a skipped group ``g`` adds ``(x @ standin_in[g].T) @
            standin_out[g]`` of the module's normed input ``x`` to its constant ``standin[g]``
            (``apply_standin``). Until ``calibrate.lowrank`` fits them: ``standin_in``
            kaiming-uniform, ``standin_out`` zeros (the map adds nothing, and both get gradients).
    """

    def __init__(self, hidden_size: int, rank: int, num_groups: int, *, standin: bool = False,
                 standin_rank: int = 0):
        super().__init__()
        self.num_groups = num_groups
        self.compressor = nn.Linear(hidden_size, rank, dtype=torch.float32)
        self.router = nn.Linear(rank, 2 * num_groups, dtype=torch.float32)
        if standin or standin_rank:
            self.standin = nn.Parameter(torch.zeros(num_groups, hidden_size, dtype=torch.float32))
        if standin_rank:
            shape = (num_groups, int(standin_rank), hidden_size)
            self.standin_in = nn.Parameter(torch.zeros(shape, dtype=torch.float32))
            self.standin_out = nn.Parameter(torch.zeros(shape, dtype=torch.float32))
        # what the compressor's input is standardised by (``router_input = "standardized"``):
        # identity until ``standardize_input`` sets the calibration moments; not saved, since
        # ``folded_compressor`` writes the map that includes them
        self.register_buffer("input_mean", torch.zeros(hidden_size, dtype=torch.float32), persistent=False)
        self.register_buffer("input_inv_std", torch.ones(hidden_size, dtype=torch.float32), persistent=False)
        self.standardized = False
        self.reset_parameters()

    def standardize_input(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Train on ``(hidden - mean) / std`` instead of the raw residual stream.

        Args:
            mean, std: ``[D]`` per-channel moments of this router's input over calibration tokens
                (``calibrate.statistics.router_input_moments``); ``std`` must be > 0.

        A residual stream whose scale grows to thousands with a large shared component (Gemma 3:
        the mean over tokens is 3-5x the per-token deviation) gives an unstandardised router logits
        in the hundreds that hardly vary between tokens, so every token takes the same groups and
        Adam's fixed step size moves them little. Standardising keeps the logits O(1) and
        token-dependent; the export folds it into the compressor (``folded_compressor``), so
        every runtime runs the same two affine maps.
        """
        with torch.no_grad():
            self.input_mean.copy_(mean.to(self.input_mean))
            self.input_inv_std.copy_(1.0 / std.to(self.input_inv_std))
        self.standardized = True

    def folded_compressor(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight [r, D], bias [r])`` fp32 of the compressor applied to the raw residual stream:
        ``W diag(1/std)`` and ``b - W diag(1/std) mean`` (the weights themselves when not
        standardised)."""
        w, b = self.compressor.weight.detach(), self.compressor.bias.detach()
        if not self.standardized:
            return w, b
        wf = w * self.input_inv_std[None, :]
        return wf, b - wf @ self.input_mean

    def load_folded_compressor(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Set the compressor from a folded ``(weight [r, D], bias [r])`` (the inverse of
        ``folded_compressor`` for this router's standardisation)."""
        w = weight.to(self.compressor.weight)
        b = bias.to(self.compressor.bias)
        with torch.no_grad():
            if self.standardized:
                self.compressor.weight.copy_(w / self.input_inv_std[None, :])
                self.compressor.bias.copy_(b + w @ self.input_mean)
            else:
                self.compressor.weight.copy_(w)
                self.compressor.bias.copy_(b)

    def reset_parameters(self) -> None:
        for lin in (self.compressor, self.router):
            nn.init.kaiming_uniform_(lin.weight, nonlinearity="linear")
            nn.init.zeros_(lin.bias)
        if hasattr(self, "standin_in"):
            # zero maps would be a saddle (neither gets a gradient): start the input side random,
            # the output side at zero, so the stand-in starts as the constant alone
            G, R, D = self.standin_in.shape
            nn.init.kaiming_uniform_(self.standin_in.data.view(G * R, D), nonlinearity="linear")
            nn.init.zeros_(self.standin_out)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [B, T, D]`` (any float dtype) -> logits ``[B, T, G, 2]`` fp32."""
        x = hidden.to(self.compressor.weight.dtype)
        if self.standardized:
            x = (x - self.input_mean) * self.input_inv_std
        logits = self.router(self.compressor(x))
        return logits.view(*hidden.shape[:-1], self.num_groups, 2)


def apply_standin(out: torch.Tensor, execute: torch.Tensor, standin: torch.Tensor | None,
                  x: torch.Tensor | None = None, standin_in: torch.Tensor | None = None,
                  standin_out: torch.Tensor | None = None) -> torch.Tensor:
    """Add the stand-ins of the skipped groups to a module output.

    Args:
        out: ``[..., D]`` the module output with skipped groups contributing zero.
        execute: ``[..., G]`` (1 = execute; float with STE gradients, or bool).
        standin: ``[G, D]`` or None (no stand-ins: ``out`` is returned unchanged, no work done).
        x: ``[..., D_in]`` the module's normed input (read only with the low-rank maps).
        standin_in, standin_out: ``[G, R, D_in]`` and ``[G, R, D]`` (``lowrank:R``), or None.
    Returns:
        ``out + sum_g (1 - execute_g) * (standin_g + (x @ standin_in_g^T) @ standin_out_g)``, computed
        in fp32 and returned in ``out``'s dtype.
    """
    if standin is None:
        return out
    skipped = 1.0 - execute.to(torch.float32)
    add = skipped @ standin.to(torch.float32)
    if standin_in is not None:
        G, R, D_in = standin_in.shape
        z = x.to(torch.float32) @ standin_in.reshape(G * R, D_in).to(torch.float32).T  # [..., G * R]
        z = z * skipped.repeat_interleave(R, dim=-1)
        add = add + z @ standin_out.reshape(G * R, -1).to(torch.float32)
    return out + add.to(out.dtype)


def router_standin(router) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(standin, standin_in, standin_out)`` of a router module (each None where absent)."""
    return tuple(getattr(router, n, None) for n in ("standin", "standin_in", "standin_out"))


class StaticRouter(nn.Module):
    """Input-independent routing: the same groups execute for every token.

    Buffer ``keep``: ``[G]`` bool, True = execute. ``forward`` returns logits
    ``[B, T, G, 2]`` fp32 whose argmax equals ``keep`` (+1/-1 margins), so the rest of the stack
    treats it like a learned router.
    """

    def __init__(self, num_groups: int, keep: torch.Tensor | None = None):
        super().__init__()
        self.num_groups = num_groups
        k = torch.ones(num_groups, dtype=torch.bool) if keep is None else keep.to(torch.bool).clone()
        if k.shape != (num_groups,):
            raise ValueError(f"keep mask shape {tuple(k.shape)} != ({num_groups},)")
        self.register_buffer("keep", k)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sign = self.keep.to(torch.float32) * 2.0 - 1.0  # +1 execute, -1 skip
        logits = torch.stack([sign, -sign], dim=-1)  # [G, 2]
        return logits.expand(*hidden.shape[:-1], self.num_groups, 2)
