"""Discrete decisions for routers: hard Gumbel-softmax with a straight-through estimator,
the temperature schedule, and the sparsity objective (DESIGN.md §1; Jang et al. 2017,
"Categorical Reparameterization with Gumbel-Softmax").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hard_gumbel_execute(
    logits: torch.Tensor,
    tau: float,
    generator: torch.Generator | None = None,
    *,
    world: int = 1,
    rank: int = 0,
) -> torch.Tensor:
    """Sample execute decisions with a hard Gumbel-softmax and straight-through gradients.

    Args:
        logits: ``[B, ..., G, 2]`` float, logit 0 = execute, logit 1 = skip.
        tau: temperature (> 0).
        generator: optional RNG for the Gumbel noise.
        world, rank: data-parallel layout. Noise is drawn for the global batch ``[world*B, ...]``
            from a generator seeded alike on every rank, and rank ``r`` uses rows ``[r*B, (r+1)*B)``,
            so W processes with batch B draw exactly the noise of one process with batch W*B.

    Returns:
        ``[..., G]`` same dtype as ``logits``; forward values exactly 0.0 or 1.0 (1 = execute),
        gradient of the soft sample ``softmax((logits + g) / tau)[..., 0]``.

    The noise and the softmax are fp32 whatever the logits' dtype: under fp16 autocast,
    ``clamp_min(1e-20)`` would round to 0 and ``-log(0)`` makes NaN decisions, and bf16/fp16
    uniforms are coarse (many exact zeros), which biases the Gumbel distribution.
    """
    b = logits.shape[0]
    u = torch.rand((world * b, *logits.shape[1:]), generator=generator, device=logits.device, dtype=torch.float32)
    u = u[rank * b : (rank + 1) * b]
    exp_noise = (-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20)  # Exp(1) samples
    gumbels = -torch.log(exp_noise)
    soft = F.softmax((logits.float() + gumbels) / tau, dim=-1)
    index = soft.argmax(dim=-1, keepdim=True)
    hard = torch.zeros_like(soft).scatter_(-1, index, 1.0)
    y = hard - soft.detach() + soft
    return y[..., 0].to(logits.dtype)


def argmax_execute(logits: torch.Tensor) -> torch.Tensor:
    """Deterministic inference decision: execute iff logit0 >= logit1.

    Args:
        logits: ``[..., G, 2]``.
    Returns:
        ``[..., G]`` bool, True = execute.
    """
    return logits[..., 0] >= logits[..., 1]


def temperature_at(step: int, total_steps: int, tau_start: float, tau_end: float) -> float:
    """Linear temperature anneal: ``tau_start`` at step 0, ``tau_end`` at the last optimizer step.

    Args:
        step: 0-based optimizer step.
        total_steps: number of optimizer steps (>= 1).
    """
    if total_steps <= 1:
        return float(tau_end)
    frac = min(max(step / (total_steps - 1), 0.0), 1.0)
    return float(tau_start + (tau_end - tau_start) * frac)


def skip_fraction(execute: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Fraction of (valid token, group) decisions that skip; differentiable through ``execute``.

    Args:
        execute: ``[B, T, G]`` float (0/1, STE gradients) or bool.
        valid: ``[B, T]`` bool, False for padding; None = all valid.

    Returns:
        0-dim float tensor in [0, 1]. Zero when no token is valid.
    """
    skip = 1.0 - execute.float()
    if valid is None:
        return skip.mean()
    w = valid.to(skip.dtype).unsqueeze(-1)
    denom = w.sum() * skip.shape[-1]
    return (skip * w).sum() / denom.clamp_min(1.0)


def sparsity_loss(
    s_hat: dict[str, torch.Tensor], targets: dict[str, float], per_module: bool
) -> torch.Tensor:
    """The sparsity term of DESIGN.md §1 (multiply by lambda outside).

    Args:
        s_hat: measured skip fraction per active module (``attention``, ``ffn``), each the mean
            over layers, 0-dim tensors.
        targets: target per module.
        per_module: True -> mean over modules of ``|t_m - s_m|``; False -> ``|t - mean_m s_m|``
            with the shared target ``t``.
    """
    names = sorted(s_hat)
    if per_module:
        return torch.stack([(targets[m] - s_hat[m]).abs() for m in names]).mean()
    mean = torch.stack([s_hat[m] for m in names]).mean()
    return (targets[names[0]] - mean).abs()


def cost_loss(s_weighted: torch.Tensor, target_skip: float) -> torch.Tensor:
    """The sparsity term with a cost target (multiply by lambda outside): ``|target - s_w|``.

    Args:
        s_weighted: the cost-weighted skip fraction of the step's decisions, a 0-dim tensor
            (``CostModel.weighted_skip`` of the per-(layer, module) skip fractions; gradients kept).
        target_skip: the weighted skip fraction to reach (``SkipTarget.skip``, times the warm-up
            ramp).
    """
    return (target_skip - s_weighted).abs()
