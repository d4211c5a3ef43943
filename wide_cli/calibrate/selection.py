"""Decisions made from the calibration statistics alone, as pure tensor functions: which groups
static width keeps, and where learned routers start.

Both take a module's group importance ``[L, G]`` (``GroupStatistics.group_importance``: per layer
``L`` and group ``G``, larger = more important) and return tensors; the pipeline (``pipeline/
stages.py``) reads the statistics and settings and writes the results into the routers.
"""

from __future__ import annotations

import math

import torch


def static_width_keep(importance: torch.Tensor, target: float) -> torch.Tensor:
    """Static-width selection of one module: drop the least important groups so that the
    module's sparsity is ``target`` as closely as the group count allows.

    ``K = round(target * G * L)`` groups are dropped: ``floor(target * G)`` in every layer, the
    remaining ``K - L * floor(target * G)`` in the layers whose next-lowest group is least
    important, with importance normalised by the layer's total (so layers of different scale
    compare).

    Args:
        importance: ``[L, G]`` non-negative group importance.
        target: fraction of the module's groups to drop, in ``[0, 1]``.

    Returns:
        ``[L, G]`` bool, True = kept.
    """
    L, G = importance.shape
    total = round(target * G * L)
    base = min(math.floor(target * G), G)
    norm = importance / importance.sum(dim=1, keepdim=True).clamp_min(1e-12)
    order = norm.argsort(dim=1)  # ascending importance
    drops = [base] * L
    extra = total - base * L
    if extra > 0:
        cand = torch.tensor([norm[i, order[i, base]].item() if base < G else math.inf for i in range(L)])
        for i in cand.argsort()[:extra].tolist():
            drops[i] += 1
    keep = torch.ones(L, G, dtype=torch.bool)
    for i in range(L):
        keep[i, order[i, : drops[i]]] = False
    return keep


def router_init_bias(importance: torch.Tensor, skip_rate: float, *, strength: float = 1.0) -> torch.Tensor:
    """Initial router bias of one module from its group importance: each group's execute logit
    minus skip logit is ``strength * z + logit(1 - skip_rate)``, where ``z`` is the group's
    standardised log-importance within its layer (0 with one group per layer), so unimportant
    groups start closer to skipping and the initial skip rate is near ``skip_rate``.

    Args:
        importance: ``[L, G]`` non-negative group importance.
        skip_rate: wanted initial skip fraction; clamped to ``[1e-3, 1 - 1e-3]``.
        strength: scale of the importance term.

    Returns:
        ``[L, 2 * G]`` float32 router biases, interleaved ``(execute, skip)`` per group as the
        router's logits are laid out (``[.., G, 2]``): ``+d/2`` and ``-d/2``.
    """
    imp = importance.float().clamp_min(1e-12).log()
    if imp.shape[1] == 1:  # one group per module (dynamic depth): only the offset applies
        z = torch.zeros_like(imp)
    else:
        z = (imp - imp.mean(1, keepdim=True)) / imp.std(1, keepdim=True).nan_to_num(1.0).clamp_min(1e-6)
    t = min(max(skip_rate, 1e-3), 1 - 1e-3)
    d = strength * z + math.log((1 - t) / t)  # [L, G]: execute - skip
    return torch.stack([d / 2, -d / 2], dim=-1).reshape(imp.shape[0], -1)
