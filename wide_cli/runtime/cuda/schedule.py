"""Mask reordering and tile schedules of the CuPy kernels, in pure PyTorch (DESIGN.md §3).

These functions state, on any device, exactly what the CUDA kernels in ``kernels/``
do: the executable specification of the kernels' schedules, kept beside the tile tables of
``builds.py``. Nothing at run time calls them; the kernel tests do, so the schedule logic is
unit-tested on a CPU and the kernels' own reorder output is checked against it on a GPU:

- ``reorder_mask``: per group, a stable partition of the token indices (executing tokens first),
  with counts. Same result as ``ops.group_token_lists`` and the ``wide_reorder`` kernel, int32.
- ``active_tiles`` / ``tile_rows``: which ``(group, tile)`` blocks of ``gemm_mn`` (and, per
  ``(batch row, head)``, of attention prefill) do work, and which token rows each one loads and
  stores (block-level and intra-block skipping).
- ``pack_mask`` / ``gemm_k_tile_groups``: the execute bits ``gemm_k`` reads and the groups each
  token tile walks.
- ``kv_heads_read``: which KV heads decode attention reads per batch row.
- ``schedule_stats``: how much of the dense schedule a mask leaves (for benchmarks).

Masks are ``bool``, True = execute.
"""

from __future__ import annotations

import torch


def reorder_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group stable partition of token indices, executing tokens first.

    Args:
        mask: ``[M, G]`` or batched ``[B, M, G]`` bool (token ``m`` executes group ``g``).

    Returns:
        ``(order, counts)``: ``order [G, M]`` (``[B, G, M]``) int32, each row a permutation of
        ``0..M-1`` with the executing tokens first and then the skipped ones, both in increasing
        order; ``counts [G]`` (``[B, G]``) int32, the number of executing tokens per group.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask dtype {mask.dtype} is not torch.bool")
    if mask.dim() not in (2, 3):
        raise ValueError(f"mask must be [M, G] or [B, M, G], got shape {tuple(mask.shape)}")
    m = mask.transpose(-1, -2).to(torch.int32)  # [..., G, M]
    counts = m.sum(dim=-1, dtype=torch.int32)  # [..., G]
    run_e = torch.cumsum(m, dim=-1, dtype=torch.int32)  # executing tokens up to and incl. m
    run_s = torch.cumsum(1 - m, dim=-1, dtype=torch.int32)
    # destination of each token: its rank among its class, skipped ones after all executing ones
    pos = torch.where(m.bool(), run_e - 1, counts.unsqueeze(-1) + run_s - 1)
    tokens = torch.arange(m.shape[-1], device=mask.device, dtype=torch.int32).expand_as(pos)
    order = torch.empty_like(pos).scatter_(-1, pos.long(), tokens)
    return order, counts


def num_tiles(num_tokens: int, block_m: int) -> int:
    """Tiles of ``block_m`` sorted positions covering ``num_tokens`` tokens (the grid's y size)."""
    return -(-num_tokens // block_m)


def active_tiles(counts: torch.Tensor, num_tokens: int, block_m: int) -> torch.Tensor:
    """The ``(group, tile)`` blocks that do work (block-level skipping).

    Tile ``t`` of group ``g`` covers sorted positions ``[t*block_m, (t+1)*block_m)`` of
    ``order[g]``; it runs iff ``t * block_m < counts[g]``. Every other block of the
    ``G x num_tiles`` grid loads nothing (it only writes zeros for its skipped rows).

    Args:
        counts: ``[G]`` executing tokens per group.
    Returns:
        ``[n_active, 2]`` int64 rows ``(group, tile)``, in the kernel's launch order (group-major:
        ``blockIdx.x`` is the tile, the fastest grid index, ``blockIdx.y`` the group's column tile).
    """
    T = num_tiles(num_tokens, block_m)
    t = torch.arange(T, device=counts.device)
    live = (t[None, :] * block_m) < counts[:, None].long()  # [G, T]
    group, tile = live.nonzero(as_tuple=True)
    return torch.stack([group, tile], dim=1)


def tile_rows(
    order: torch.Tensor, counts: torch.Tensor, group: int, tile: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows one ``(group, tile)`` block touches (intra-block skipping).

    Returns:
        ``(executing, skipped)`` int tensors: the tokens whose activation rows the block loads and
        whose outputs it computes, and the tokens of the tile's remaining positions (never loaded;
        their outputs are written as zeros by ``gemm_mn`` and attention, not touched otherwise).
    """
    lo = tile * block_m
    hi = min(lo + block_m, order.shape[-1])
    c = int(counts[group])
    row = order[group]
    return row[lo : min(hi, max(c, lo))], row[max(lo, c) : hi]


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Execute bits per 32-token word, as ``wide_pack_mask`` writes them for ``gemm_k``.

    Args:
        mask: ``[M, G]`` bool.
    Returns:
        ``[ceil(M/32), G]`` int64: bit ``r`` of word ``(w, g)`` is ``mask[32*w + r, g]`` (rows past
        ``M`` are 0). (int64 only because torch has no uint32 arithmetic; values fit in 32 bits.)
    """
    M, G = mask.shape
    W = num_tiles(M, 32)
    padded = torch.zeros(W * 32, G, dtype=torch.int64, device=mask.device)
    padded[:M] = mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    return (padded.view(W, 32, G) * weights[None, :, None]).sum(dim=1)


def gemm_k_block_order(
    num_tokens: int, num_out: int, block_m: int, block_n: int, group_m: int = 8
) -> torch.Tensor:
    """``gemm_k``'s GROUP_M-swizzled launch order: row ``pid`` is the ``(token tile, weight tile)``
    block number ``pid`` computes; ``[tiles_m * tiles_n, 2]`` int64, a permutation of all pairs."""
    tm, tn = num_tiles(num_tokens, block_m), num_tiles(num_out, block_n)
    pid = torch.arange(tm * tn)
    per_group = group_m * tn
    first_m = (pid // per_group) * group_m
    rows_m = torch.clamp(tm - first_m, max=group_m)
    return torch.stack([first_m + (pid % per_group) % rows_m, (pid % per_group) // rows_m], dim=1)


def gemm_k_tile_groups(mask: torch.Tensor, block_m: int) -> list[list[int]]:
    """For each tile of ``block_m`` consecutive tokens, the groups ``gemm_k`` walks (block-level
    skipping along the reduction): those that at least one token of the tile executes, ascending.

    Args:
        mask: ``[M, G]`` bool.
    """
    M, _ = mask.shape
    out = []
    for t in range(num_tiles(M, block_m)):
        any_g = mask[t * block_m : (t + 1) * block_m].any(dim=0)
        out.append(any_g.nonzero().flatten().tolist())
    return out


def gemm_k_live_fragments(mask: torch.Tensor, block_m: int, frag: int = 16) -> torch.Tensor:
    """Fraction of (16-row fragment, group) MMA blocks ``gemm_k`` executes (fragment skipping).

    A warp skips the tensor-core work of a 16-row fragment for group ``g`` when no row of it
    executes ``g``. Returns a 0-dim float tensor in ``[0, 1]``.
    """
    M, G = mask.shape
    Mp = num_tiles(M, frag) * frag
    padded = torch.zeros(Mp, G, dtype=torch.bool, device=mask.device)
    padded[:M] = mask
    live = padded.view(-1, frag, G).any(dim=1)  # [M/frag, G]
    return live.float().mean()


def kv_heads_read(
    head_mask: torch.Tensor | None, num_kv_heads: int, batch: int | None = None
) -> torch.Tensor:
    """Which ``(batch row, KV head)`` caches decode attention reads.

    Args:
        head_mask: ``[B, H]`` bool or None (every head executes).
    Returns:
        ``[B, H_kv]`` bool: KV head ``k`` of row ``b`` is read iff one of its query heads
        ``k*H/H_kv .. (k+1)*H/H_kv - 1`` executes for that row.
    """
    if head_mask is None:
        if batch is None:
            raise ValueError("batch is required when head_mask is None")
        return torch.ones(batch, num_kv_heads, dtype=torch.bool)
    B, H = head_mask.shape
    if H % num_kv_heads:
        raise ValueError(f"{H} query heads do not divide into {num_kv_heads} KV heads")
    return head_mask.view(B, num_kv_heads, H // num_kv_heads).any(dim=-1)


def schedule_stats(mask: torch.Tensor, block_m: int) -> dict[str, float]:
    """How much of the dense ``gemm_mn`` schedule a ``[M, G]`` mask leaves.

    Returns:
        ``tiles_dense`` (G x tiles), ``tiles_active`` (blocks that compute),
        ``rows_active`` (token rows loaded = executing pairs), ``density`` (executing fraction),
        ``padding`` (share of computed rows that are padding inside partly active tiles).
    """
    M, G = mask.shape
    _, counts = reorder_mask(mask)
    T = num_tiles(M, block_m)
    tiles_active = int(((counts.long() + block_m - 1) // block_m).sum())
    rows = int(counts.sum())
    computed = tiles_active * block_m
    return {
        "tiles_dense": float(G * T),
        "tiles_active": float(tiles_active),
        "rows_active": float(rows),
        "density": rows / max(1, M * G),
        "padding": 0.0 if computed == 0 else 1.0 - rows / computed,
    }
