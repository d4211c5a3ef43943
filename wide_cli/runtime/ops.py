"""Routed operators: the PyTorch reference implementations (DESIGN.md §3).

This module is the *contract*. Every backend implements these five operators with identical
signatures and semantics; ``reference`` calls these functions directly, ``cpu`` has its own
work-skipping versions in ``runtime/cpu_proj.py`` and ``runtime/cpu_attention.py``, and the CuPy
kernels implement the same thing on the GPU. Each operator here is written as "compute dense, then
mask" so that it is obviously right; it saves no work.

Conventions shared by every operator
------------------------------------
- Masks are ``bool``, ``True`` = execute, ``False`` = skip. ``None`` means "every group
  executes" (the dense path; a backend may dispatch it to a plain GEMM).
- A group mask has one column per group: ``mask[m, j]`` covers units ``j*group_size ..
  (j+1)*group_size - 1`` of the routed axis (output columns for ``gemm_mn``, reduction
  channels for ``gemm_k``). The routed axis must be a multiple of ``group_size``.
- Dtypes: activations, weights and biases share one float dtype (fp32, bf16 or fp16); outputs
  have that dtype. Accumulation is fp32 (what ``torch.matmul`` does for bf16 on CPU and cuBLAS
  does on GPU). Attention softmax is computed in fp32.
- Skipped outputs are **exact zeros**, bias included (no bias leaks through a skipped
  group).
- Inputs may be non-contiguous views: a transposed activation, a slice of the KV cache. An
  implementation that needs particular strides must copy, never misread.
- Every shape is valid: ``M`` (tokens) is any size >= 1 (1 = decode, 129 = an odd prefill), not
  only batch 1 / one token.

KV-cache layout (``runtime/kv_cache.py``)
-----------------------------------------
Per layer ``k_cache, v_cache: [B, H_kv, S_max, d]`` (contiguous; head-major so that one
(row, KV head) is a contiguous ``[S, d]`` block, the unit decode reads or skips). A batch shares
*slots*: all rows write slot ``s`` at the same step; rows that are shorter (left padding) or that
have holes (right-padded prompts continued by generation) mark those slots invalid in
``key_valid [B, S]``. Causality is in slots: the query at slot ``s`` sees keys at slots ``<= s``
that are valid. RoPE positions are per row (cumulative sum of the attention mask, so left padding does not shift them) and are
applied to q/k *before* these operators; the operators never see positions.

GQA: query head ``h`` reads KV head ``h // (H // H_kv)``.
"""

from __future__ import annotations

import torch

__all__ = [
    "attention_decode",
    "attention_prefill",
    "expand_mask",
    "gate_act",
    "gemm_k",
    "gemm_mn",
    "gemm_mn_swiglu",
    "group_token_lists",
    "key_visibility",
]


# ----------------------------------------------------------------------------------------------
# helpers (pure functions, shared by all backends)


def expand_mask(mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group decisions ``[..., G]`` bool -> unit decisions ``[..., G * group_size]`` bool."""
    return mask.repeat_interleave(group_size, dim=-1)


def _check_groups(n: int, mask: torch.Tensor | None, group_size: int, what: str, rows: int) -> None:
    if n % group_size:
        raise ValueError(f"{what} width {n} is not a multiple of group_size {group_size}")
    if mask is not None:
        want = (rows, n // group_size)
        if tuple(mask.shape) != want:
            raise ValueError(f"{what} mask shape {tuple(mask.shape)} != {want}")
        if mask.dtype != torch.bool:
            raise ValueError(f"{what} mask dtype {mask.dtype} is not torch.bool")


def group_token_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask reordering (DESIGN.md §3, step 1): per group, the executing tokens first.

    Args:
        mask: ``[M, G]`` bool, True = token ``m`` executes group ``g``.

    Returns:
        ``(order, counts)``: ``order [G, M]`` int64, for each group a stable permutation of the
        token indices with executing tokens first (in increasing token order), then skipped
        ones; ``counts [G]`` int64, the number of executing tokens per group, so
        ``order[g, :counts[g]]`` are the tokens that execute group ``g``.
    """
    m = mask.t().to(torch.int8)  # [G, M]
    order = torch.argsort(-m, dim=1, stable=True)  # 1s (execute) first, stable within each class
    counts = mask.sum(dim=0, dtype=torch.int64)
    return order, counts


def key_visibility(
    batch: int,
    num_queries: int,
    num_keys: int,
    q_offset: int,
    key_valid: torch.Tensor | None,
    window: int | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Which key slots each query may attend to.

    Query ``t`` sits at slot ``q_offset + t``; key slot ``j`` is visible iff ``j <= q_offset + t``
    (causal), ``key_valid[b, j]`` (not padding), and, with a sliding window,
    ``q_offset + t - j < window`` (Hugging Face's convention, in slots).

    Returns:
        ``[B, T, S]`` bool.
    """
    q_slot = torch.arange(num_queries, device=device) + q_offset  # [T]
    k_slot = torch.arange(num_keys, device=device)  # [S]
    vis = k_slot[None, :] <= q_slot[:, None]  # [T, S]
    if window is not None:
        vis = vis & (q_slot[:, None] - k_slot[None, :] < window)
    vis = vis.unsqueeze(0).expand(batch, num_queries, num_keys)
    if key_valid is not None:
        vis = vis & key_valid[:, None, :num_keys].bool()
    return vis


# ----------------------------------------------------------------------------------------------
# GEMMs


def gemm_mn(
    a: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed GEMM over *output* groups (Q projection): ``out = a @ w.T + bias``, masked.

    Args:
        a: ``[M, K]`` activations.
        w: ``[N, K]`` weight (the Hugging Face ``Linear.weight`` layout); output column ``n``
            belongs to group ``n // group_size``.
        mask: ``[M, N // group_size]`` bool or None (all execute).
        group_size: output columns per group.
        bias: ``[N]`` or None.

    Returns:
        ``[M, N]``, dtype of ``a``; ``out[m, n] = a[m] . w[n] + bias[n]`` where
        ``mask[m, n // group_size]``, exactly ``0`` elsewhere (bias too).
    """
    M, K = a.shape
    N = w.shape[0]
    assert w.shape[1] == K, f"w {tuple(w.shape)} vs a {tuple(a.shape)}"
    _check_groups(N, mask, group_size, "gemm_mn output", M)
    out = torch.nn.functional.linear(a, w, bias)
    if mask is not None:
        out = out * expand_mask(mask, group_size).to(out.dtype)
    return out


def gate_act(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The FFN's gating activation: ``silu`` (SwiGLU) or ``gelu_tanh`` (GELU, tanh approximation:
    Gemma 3's ``gelu_pytorch_tanh``), in ``x``'s dtype."""
    if act == "silu":
        return torch.nn.functional.silu(x)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    raise ValueError(f"unknown FFN activation {act!r}")


def gemm_mn_swiglu(
    a: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    mask: torch.Tensor | None,
    group_size: int,
    act: str = "silu",
) -> torch.Tensor:
    """Routed gated up-projection (Gate/Up with a fused ``act(gate) * up`` epilogue; SwiGLU by
    default).

    Args:
        a: ``[M, K]`` normed hidden states (K = D).
        w_gate, w_up: ``[N, K]`` each (N = F intermediate channels).
        mask: ``[M, N // group_size]`` bool or None; channel ``n`` is in group ``n // group_size``.
        group_size: channels per group.
        act: ``silu`` or ``gelu_tanh`` (``gate_act``).

    Returns:
        ``[M, N]``, dtype of ``a``: ``act(a @ w_gate.T) * (a @ w_up.T)`` on executing channels,
        exactly ``0`` on skipped ones. (The projections carry no bias in the supported models.)
    """
    M, K = a.shape
    N = w_gate.shape[0]
    assert w_gate.shape == w_up.shape and w_gate.shape[1] == K
    _check_groups(N, mask, group_size, "gemm_mn_swiglu output", M)
    h = gate_act(torch.nn.functional.linear(a, w_gate), act) * torch.nn.functional.linear(a, w_up)
    if mask is not None:
        h = h * expand_mask(mask, group_size).to(h.dtype)
    return h


def gemm_k(
    a: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed GEMM over *reduction* groups (O and Down projections).

    Args:
        a: ``[M, K]`` activations; channel ``k`` belongs to group ``k // group_size``.
        w: ``[N, K]`` weight (Hugging Face layout).
        mask: ``[M, K // group_size]`` bool or None.
        group_size: reduction channels per group.
        bias: ``[N]`` or None, added to every row (it is not routed).

    Returns:
        ``[M, N]``: ``out[m] = sum over executing groups j of a[m, Kj] @ w[:, Kj].T + bias``.
        Values of ``a`` on skipped channels are ignored (they need not be zero).
    """
    M, K = a.shape
    assert w.shape[1] == K, f"w {tuple(w.shape)} vs a {tuple(a.shape)}"
    _check_groups(K, mask, group_size, "gemm_k reduction", M)
    if mask is not None:
        a = a * expand_mask(mask, group_size).to(a.dtype)
    return torch.nn.functional.linear(a, w, bias)


# ----------------------------------------------------------------------------------------------
# attention


def check_prefill_shapes(q, k, v, head_mask, q_offset: int) -> None:
    """Assert the shapes ``attention_prefill`` takes (every backend checks the same things):
    ``q [B, T, H, d]``, ``k``/``v [B, S, H_kv, d]`` with ``H_kv`` dividing ``H`` and
    ``S >= q_offset + T``, ``head_mask [B, T, H]`` or None."""
    B, T, H, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    assert H % Hkv == 0, f"{H} query heads vs {Hkv} KV heads"
    assert S >= q_offset + T, f"{S} key slots < q_offset {q_offset} + {T} queries"
    assert v.shape == k.shape
    if head_mask is not None:
        assert tuple(head_mask.shape) == (B, T, H), f"head_mask {tuple(head_mask.shape)} != {(B, T, H)}"


def check_decode_shapes(q, k_cache, head_mask, key_valid) -> None:
    """Assert the shapes ``attention_decode`` takes: ``q [B, H, d]``, ``k_cache [B, H_kv, S_max,
    d]`` with ``H_kv`` dividing ``H``, ``key_valid [B, S]`` with ``S <= S_max``, ``head_mask [B, H]``
    or None."""
    B, H, _ = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    assert key_valid.shape[1] <= S_max and H % Hkv == 0
    if head_mask is not None:
        assert tuple(head_mask.shape) == (B, H)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``[B, H, T, d]``, k/v ``[B, H_kv, S, d]``, vis ``[B, T, S]`` -> ``[B, H, T, d]`` fp32."""
    H, Hkv = q.shape[1], k.shape[1]
    rep = H // Hkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [B, H, T, S]
    scores = scores.masked_fill(~vis[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(vis[:, None].any(dim=-1, keepdim=True), p, torch.zeros_like(p))  # no key -> 0
    return torch.matmul(p, vf)


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_mask: torch.Tensor | None,
    *,
    key_valid: torch.Tensor | None = None,
    q_offset: int = 0,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Routed causal attention for a block of ``T`` query tokens (prefill, or a chunk of it).

    Args:
        q: ``[B, T, H, d]`` queries, RoPE applied. Rows of skipped (token, head) pairs may hold
            anything (``gemm_mn`` makes them zero).
        k, v: ``[B, S, H_kv, d]`` keys/values of slots ``0 .. S-1``, RoPE applied to k, with
            ``S >= q_offset + T`` (the block's own K/V already written). The runtime passes
            ``cache.k[:, :, :S].transpose(1, 2)``, a non-contiguous view of the cache.
        head_mask: ``[B, T, H]`` bool, True = compute this (token, head); None = all.
        key_valid: ``[B, S]`` bool, False for padding slots; None = all valid.
        q_offset: slot of query 0 (0 for a fresh prompt; the cache length for a chunk).
        scale: softmax scale, normally ``d ** -0.5``.
        window: sliding-window size in slots (Mistral; ``q_slot - k_slot < window``) or None.

    Returns:
        ``[B, T, H, d]``, dtype of ``q``: ``softmax(q k^T * scale over visible keys) v`` for
        executing (token, head) pairs; exact zeros for skipped pairs and for queries that see no
        valid key (padding queries).
    """
    check_prefill_shapes(q, k, v, head_mask, q_offset)
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    vis = key_visibility(B, T, S, q_offset, key_valid, window, q.device)
    out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis, scale)  # [B, H, T, d]
    out = out.transpose(1, 2)  # [B, T, H, d]
    if head_mask is not None:
        out = out * head_mask.unsqueeze(-1).to(out.dtype)
    return out.to(q.dtype)


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    head_mask: torch.Tensor | None,
    key_valid: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Routed attention for one new token per row (decode, ``T = 1``).

    Args:
        q: ``[B, H, d]`` query of the token at slot ``S - 1``, RoPE applied.
        k_cache, v_cache: ``[B, H_kv, S_max, d]`` the layer's cache; the new token's K/V are
            already written at slot ``S - 1``. Only slots ``< S`` are read.
        head_mask: ``[B, H]`` bool or None. A KV head whose query heads are all skipped for a
            row needs no cache read for that row (the point of KV-aligned groups).
        key_valid: ``[B, S]`` bool, False for padding slots (defines ``S``).
        scale: softmax scale.
        window: sliding window in slots, or None.

    Returns:
        ``[B, H, d]``, dtype of ``q``; exact zeros for skipped (row, head) pairs.
    """
    check_decode_shapes(q, k_cache, head_mask, key_valid)
    B, S = q.shape[0], key_valid.shape[1]
    vis = key_visibility(B, 1, S, S - 1, key_valid, window, q.device)  # [B, 1, S]
    out = _attend(q.unsqueeze(2), k_cache[:, :, :S], v_cache[:, :, :S], vis, scale)  # [B, H, 1, d]
    out = out.squeeze(2)
    if head_mask is not None:
        out = out * head_mask.unsqueeze(-1).to(out.dtype)
    return out.to(q.dtype)
