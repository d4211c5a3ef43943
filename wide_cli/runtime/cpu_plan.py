"""Which groups a routed call runs, read once per call: the cpu backend's skip plan.

A call with at most ``SMALL_M`` tokens (decode) skips by *union runs* (one GEMM per run of
adjacent groups that any token executes), a larger one (prefill) by *mask reordering* (per group,
the executing tokens gathered), or, when it executes most pairs, runs dense and masks
(``DENSE_MASKED_FRACTION``); see ``runtime/cpu.py`` for the measurements behind the choice.
"""

from __future__ import annotations

import torch

# Calls with at most this many tokens use union runs, larger ones mask reordering. Measured on
# SmolLM2-135M FFN shapes (fp32, 1 thread, independent 50 % masks): from 4 to 64 tokens both are
# within noise of each other and of dense -- the union of the tokens' groups is nearly everything
# and the GEMMs are memory-bound -- so the threshold matters little; reordering pays off in
# prefill (1.48x dense at 1024 tokens), union runs at batch 1 (one token's own groups).
SMALL_M = 16

# A call of more than SMALL_M tokens whose tokens execute at least this fraction of its (token,
# group) pairs runs the dense GEMMs and zeroes the skipped pairs instead of gathering each group's
# tokens: the gathered GEMMs are smaller and cost a gather and scatter each. Measured on
# SmolLM2-135M prefill of 128 tokens (1 thread, 2-core AVX2 EPYC, every format): at 0.39 of the
# pairs executed the gathered path took 0.55-0.66 of dense's time, at 0.93 it took 1.06-1.19;
# a line through those crosses dense at about 0.8.
DENSE_MASKED_FRACTION = 0.8

# The same choice for the AMX prefill kernels (``cpu_gather``, bf16), which gather inside one native
# call and so cost little more than their executed multiply-adds: the routed gated FFN took 1.10x
# PyTorch's dense bf16 GEMMs (oneDNN, also on the tiles) with every pair executed, and 0.63x at
# half of them (SmolLM2-135M FFN shapes, 256 tokens, 1 thread, Xeon with AMX); a line through
# those crosses dense at about 0.9.
AMX_DENSE_MASKED_FRACTION = 0.9

# The same kernels on AVX512-BF16 (vdpbf16ps, CPUs without AMX) ran as fast as PyTorch's dense
# bf16 GEMMs (oneDNN) with every pair executed, and faster at any skipped pair: the routed gated FFN
# 1.08x / 1.26x dense at 128 / 1,024 tokens with all pairs, 1.17x / 1.34x at 0.9 of them; Q-shaped
# and O-shaped projections 0.95-1.01x with all pairs, 1.19-1.23x at 0.8 (SmolLM2-135M shapes,
# 1 thread, AMD EPYC Zen 4). So they gather whenever a pair is skipped.
VDP_DENSE_MASKED_FRACTION = 1.0


def active_runs(active: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of True in ``active``."""
    runs, start = [], None
    for i, a in enumerate(active):
        if a and start is None:
            start = i
        elif not a and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(active)))
    return runs


def group_counts(mask: torch.Tensor) -> list[int]:
    """Per group of ``mask [..., G]`` bool the number of tokens that execute it (``[G]`` ints):
    one reduction and one read, from which every question below about a large mask is answered.
    A routed prefill asks about 8 questions per layer; a ``[128, 12]`` mask took 3.8 us this way
    against 7.5 us as a ``sum`` and an ``any(0).all()``, each read with ``item`` (1 thread, Xeon)."""
    return mask.reshape(-1, mask.shape[-1]).sum(0).tolist()


def dense_then_mask(mask: torch.Tensor, counts: list[int] | None = None) -> bool:
    """Whether a large call with ``mask [..., G]`` bool (``counts`` = ``group_counts(mask)`` if
    known) runs every group for every token and zeroes the skipped pairs: at least
    ``DENSE_MASKED_FRACTION`` of the pairs execute, and every group by some token (otherwise the
    dense GEMM would compute groups no token executes, e.g. a static keep mask, where gathering
    runs the fully used groups as plain GEMMs)."""
    c = group_counts(mask) if counts is None else counts
    return sum(c) >= DENSE_MASKED_FRACTION * mask.numel() and min(c) > 0


def gather_pays(mask: torch.Tensor, tiles: bool = True) -> bool:
    """Whether a large routed bf16 call with ``mask [M, G]`` runs on the gather kernels
    (``cpu_gather``; ``tiles``: on AMX, else on AVX512-BF16) rather than as dense GEMMs then the
    mask: fewer than ``AMX_DENSE_MASKED_FRACTION`` (``VDP_DENSE_MASKED_FRACTION``) of its pairs
    execute, or some group executes for no token (dense would compute it for nothing)."""
    c = group_counts(mask)
    frac = AMX_DENSE_MASKED_FRACTION if tiles else VDP_DENSE_MASKED_FRACTION
    return sum(c) < frac * mask.numel() or min(c) == 0


def skip_plan(mask: torch.Tensor | None) -> tuple[str, list[tuple[int, int]], bool]:
    """Analyse a group mask ``[M, G]`` once: ``(state, runs, uniform)``.

    state: ``dense`` (None, or every token executes every group), ``none`` (nothing executes) or
    ``sparse``. For ``M <= SMALL_M``: runs = runs of groups that any token executes, uniform =
    every token has the same mask; the mask is read with one ``tolist`` (cheaper than several
    small tensor ops on the decode path). For larger M: runs = ``[(0, G)]`` when the tokens
    execute at least ``DENSE_MASKED_FRACTION`` of the (token, group) pairs and every group is
    executed by some token (the callers then run every group for every token and zero the skipped
    pairs), else empty (gather per group).
    """
    if mask is None:
        return "dense", [], True
    M, G = mask.shape
    if M > SMALL_M:
        counts = group_counts(mask)
        n = sum(counts)
        if n == M * G:
            return "dense", [], True
        if n == 0:
            return "none", [], False
        return "sparse", ([(0, G)] if dense_then_mask(mask, counts) else []), False
    rows = mask.tolist()
    first = rows[0]
    if M == 1:
        any_g, uniform = first, True
    else:
        any_g = [any(col) for col in zip(*rows)]
        uniform = all(r == first for r in rows)
    n = sum(any_g)
    if n == 0:
        return "none", [], True
    if uniform and n == G:
        return "dense", [], True
    return "sparse", active_runs(any_g), uniform


def mask_state(mask: torch.Tensor | None, counts: list[int] | None = None) -> str:
    """'dense' (None or all execute), 'none' (nothing executes) or 'sparse' (``counts`` =
    ``group_counts(mask)`` if known)."""
    if mask is None:
        return "dense"
    n = int(mask.sum()) if counts is None else sum(counts)
    if n == mask.numel():
        return "dense"
    return "none" if n == 0 else "sparse"
