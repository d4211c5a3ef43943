"""The runtime's own KV cache: one buffer pair per layer, sized from that layer's weights.

Layout (the one ``runtime/ops.py`` documents):
- ``k[layer], v[layer]``: ``[B, H_kv(layer), S_max, d]``, contiguous, model dtype. Each layer has
  its own KV-head count (a cache built for one layer's layout is never reused for another).
- ``key_valid``: ``[B, S_max]`` bool, False for padding slots.
- ``positions``: ``[B]`` int64, RoPE position of each row's next token (= valid tokens so far).
- ``length``: slots written so far, shared by every row.

Every token's K/V are written, whatever its query heads' routing decided (later tokens attend to it): the cache is never
thinned.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated per-layer K/V buffers for a batch of ``batch`` rows and ``max_len`` slots.

    Args:
        batch: B.
        max_len: S_max, slots to allocate (prompt + new tokens).
        kv_heads: H_kv of each layer (from its weights).
        head_dim: d of each layer.
        dtype, device: of the buffers.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_heads: list[int],
        head_dims: list[int],
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.batch = batch
        self.max_len = max_len
        self.k = [torch.zeros(batch, h, max_len, d, dtype=dtype, device=device) for h, d in zip(kv_heads, head_dims)]
        self.v = [torch.zeros(batch, h, max_len, d, dtype=dtype, device=device) for h, d in zip(kv_heads, head_dims)]
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0
        self.all_valid = True  # no padding slot so far (the native decode step needs that)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def append_slots(self, valid: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Open ``T`` new slots for a block of tokens, before the layers run.

        Args:
            valid: ``[B, T]`` bool, True for real tokens, False for padding.

        Returns:
            ``(start, positions)``: the first new slot, and ``positions [B, T]`` int64, the RoPE
            position of each token: the row's real tokens so far plus the cumulative sum of
            ``valid`` minus one (so padding does not shift positions; padding gets a harmless clamped value).

        Raises:
            ValueError: the cache is too short (the engine sizes it up front, so this is a bug).
        """
        B, T = valid.shape
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} slots cannot take {T} more after {self.length}")
        assert B == self.batch, f"batch {B} vs cache batch {self.batch}"
        valid = valid.to(device=self.key_valid.device, dtype=torch.bool)
        start = self.length
        self.key_valid[:, start : start + T] = valid
        if self.all_valid and not bool(valid.all()):
            self.all_valid = False
        positions = (self.positions[:, None] + valid.long().cumsum(dim=1) - 1).clamp_min(0)
        self.positions += valid.sum(dim=1)
        self.length += T
        return start, positions

    def append_one(self) -> tuple[int, int]:
        """``append_slots`` for one real token in a one-row cache: ``(slot, position)`` as ints.

        Raises:
            ValueError: the cache is full, or it has more than one row.
        """
        if self.batch != 1:
            raise ValueError(f"append_one needs a one-row cache, not {self.batch} rows")
        if self.length >= self.max_len:
            raise ValueError(f"KV cache of {self.max_len} slots is full")
        slot = self.length
        pos = int(self.positions[0])
        self.key_valid[0, slot] = True
        self.positions[0] = pos + 1
        self.length += 1
        return slot, pos

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write ``k, v [B, T, H_kv, d]`` into slots ``start .. start+T-1`` of ``layer``."""
        T = k.shape[1]
        assert k.shape[2] == self.k[layer].shape[1], (
            f"layer {layer}: {k.shape[2]} KV heads vs cache {self.k[layer].shape[1]}"
        )
        self.k[layer][:, :, start : start + T] = k.transpose(1, 2)
        self.v[layer][:, :, start : start + T] = v.transpose(1, 2)

    def view(self, layer: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of slots ``0 .. num_slots-1`` as ``[B, S, H_kv, d]`` views (no copy)."""
        return (
            self.k[layer][:, :, :num_slots].transpose(1, 2),
            self.v[layer][:, :, :num_slots].transpose(1, 2),
        )

    def filled(self) -> list[tuple[int, ...]]:
        """Shape of each layer's written K part ``(B, H_kv, length, d)`` (for checks)."""
        return [(b, h, self.length, d) for (b, h, _, d) in (t.shape for t in self.k)]
