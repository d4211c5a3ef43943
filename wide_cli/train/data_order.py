"""Deterministic, resumable, rank-sharded order of training sequences."""

from __future__ import annotations

import torch


def batch_indices(n: int, batch_size: int, micro_step: int, seed: int, *, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Indices of the sequences of one micro-batch.

    The stream is the concatenation of seeded permutations of ``range(n)`` (one per epoch).
    Micro-batch ``j`` covers stream positions ``[j*B*W, (j+1)*B*W)``; rank ``r`` takes the
    ``r``-th slice of ``B``, so W ranks with batch B see exactly what one process with batch W*B
    sees, and every rank sees different data.

    Args:
        n: number of sequences (>= 1).
        batch_size: B, sequences per rank per micro-batch.
        micro_step: j, the global micro-batch counter (optimizer step * grad_accum + micro).
        seed: data-order seed.
        rank, world: data-parallel position.

    Returns:
        ``[B]`` int64 indices into the sequence tensor.
    """
    start = (micro_step * world + rank) * batch_size
    out = []
    pos = start
    while len(out) < batch_size:
        epoch, off = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g)
        take = min(batch_size - len(out), n - off)
        out.append(perm[off : off + take])
        pos += take
        if sum(len(o) for o in out) >= batch_size:
            break
    return torch.cat(out)[:batch_size]
