"""Attention of the cpu backend, skipping the head groups a token does not execute.

Prefill runs, per row and head group, only the executing query tokens, in chunks whose key range
ends at the chunk's last query (so causal work is not wasted; in bf16 on a CPU with AMX or AVX512-BF16, one call
of ``cpu_gather.attention`` for all of them), or, when most (token, head) pairs execute, one causal
SDPA then the mask; decode reads the KV heads of the
active head groups only (the union over rows when ``B > 1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wide_cli.runtime import cpu_gather, ops
from wide_cli.runtime.cpu_plan import (
    SMALL_M,
    active_runs,
    dense_then_mask,
    group_counts,
    mask_state,
    skip_plan,
)

# Query tokens per attention chunk in routed prefill.
ATTN_CHUNK = 128


def _sdpa_heads(q, k, v, h0: int, h1: int, hpk: int, attn_mask, scale: float):
    """Attention for query heads ``[h0, h1)``.

    q: ``[b, h1-h0, n, d]``; k, v: ``[b, H_kv, S, d]`` (all KV heads of the layer).
    Returns ``[b, h1-h0, n, d]``. Runs of heads that cover whole KV groups (or lie inside one) use
    the KV heads as views with GQA; other runs gather the KV heads they need.
    """
    kv0, kv1 = h0 // hpk, (h1 - 1) // hpk + 1
    nkv = kv1 - kv0
    if nkv == 1 or (h0 % hpk == 0 and h1 % hpk == 0):
        ks, vs = k[:, kv0:kv1], v[:, kv0:kv1]
    else:  # a run straddling KV groups unevenly: one KV head per query head
        kvi = torch.arange(h0, h1, device=q.device) // hpk
        ks, vs = k.index_select(1, kvi), v.index_select(1, kvi)
    return F.scaled_dot_product_attention(
        q, ks, vs, attn_mask=attn_mask, scale=scale, enable_gqa=ks.shape[1] != q.shape[1]
    )


def attention_prefill(q, k, v, head_mask, *, key_valid=None, q_offset=0, scale, window=None, counter=None):
    """Work-skipping ``ops.attention_prefill`` (same signature and result); ``counter`` (a
    ``Counter``) receives the multiply-adds of the SDPA calls issued."""
    B, T, H, d = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    hpk = H // Hkv
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, S, d]; views of the cache
    qt = q.transpose(1, 2)  # [B, H, T, d]
    counts = None if head_mask is None else group_counts(head_mask)  # per head, its executing tokens
    state = mask_state(head_mask, counts)
    all_valid = key_valid is None or bool(key_valid[:, :S].all())
    causal = all_valid and window is None and q_offset == 0 and S == T
    if state != "none" and cpu_gather.isa() == cpu_gather.ISA_VDP:
        # With AVX512-BF16 only, the native kernel ran causal attention 1.7-2.5x faster than
        # PyTorch's SDPA with every pair executed (SmolLM2-135M heads, 128-4,096 tokens, bf16,
        # 1 thread, Zen 4 EPYC), and it computes only the executing pairs: it runs every call.
        got = cpu_gather.attention(q, k, v, None if state == "dense" else head_mask, key_valid=key_valid,
                                   q_offset=q_offset, scale=scale, window=window)  # fmt: skip
        if got is not None:
            if counter is not None:
                counter.attn_macs += got[1] * d * 2
            return got[0]
    # Most (token, head) pairs active: one causal SDPA over every head, then the skipped pairs
    # zeroed, beats per-run SDPAs with explicit masks (the projections' rule, cpu_plan).
    dense_enough = causal and state == "sparse" and dense_then_mask(head_mask, counts)
    if causal and (state == "dense" or dense_enough):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=hpk > 1)
        if counter is not None:  # causal: query t reads t + 1 keys
            counter.attn_macs += B * H * d * 2 * (T * (T + 1) // 2)
        out = out.transpose(1, 2)
        return out if state == "dense" else out.mul_(head_mask[..., None])
    if state == "dense":
        vis = ops.key_visibility(B, T, S, q_offset, key_valid, window, q.device)  # [B, T, S]
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=vis[:, None], scale=scale, enable_gqa=hpk > 1
        )
        out = torch.where(vis.any(-1)[:, None, :, None], out, torch.zeros((), dtype=out.dtype))
        if counter is not None:  # a masked SDPA computes every (query, key) pair
            counter.attn_macs += B * H * d * 2 * T * S
        return out.transpose(1, 2)
    if state == "none":
        return torch.zeros(B, T, H, d, dtype=q.dtype, device=q.device)
    tiles = cpu_gather.attention(q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale, window=window)
    if tiles is not None:  # bf16 with AMX or AVX512-BF16: the executing pairs only, in one native call
        if counter is not None:
            counter.attn_macs += tiles[1] * d * 2
        return tiles[0]
    out = torch.zeros(B, T, H, d, dtype=q.dtype, device=q.device)
    slots_all = torch.arange(S, device=q.device)
    for b in range(B):
        hm = head_mask[b]  # [T, H]
        # Heads with identical token lists are processed together: runs of adjacent heads whose
        # columns in hm are equal (routing decides per head group, so groups form such runs).
        cols = hm.t()  # [H, T]
        h = 0
        while h < H:
            e = h + 1
            while e < H and torch.equal(cols[e], cols[h]):
                e += 1
            idx = cols[h].nonzero().flatten()
            n = idx.numel()
            for c0 in range(0, n, ATTN_CHUNK):
                ci = idx[c0 : c0 + ATTN_CHUNK]
                qs = q_offset + ci  # query slots
                Sc = int(qs[-1]) + 1
                vis = slots_all[None, :Sc] <= qs[:, None]  # [n, Sc]
                if window is not None:
                    vis = vis & (qs[:, None] - slots_all[None, :Sc] < window)
                if key_valid is not None:
                    vis = vis & key_valid[b, None, :Sc]
                qsel = qt[b, h:e].index_select(1, ci)[None]  # [1, e-h, n, d]
                o = _sdpa_heads(qsel, kt[b : b + 1, :, :Sc], vt[b : b + 1, :, :Sc], h, e, hpk, vis[None, None], scale)
                if counter is not None:
                    counter.attn_macs += (e - h) * d * 2 * ci.numel() * Sc
                o = torch.where(vis.any(-1)[None, None, :, None], o, torch.zeros((), dtype=o.dtype))
                out[b, :, h:e].index_copy_(0, ci, o[0].transpose(0, 1))
            h = e
    return out


def _decode_heads(q, k, v, h0: int, h1: int, hpk: int, vis, scale: float):
    """Decode attention for query heads ``[h0, h1)``: q ``[B, h1-h0, d]``, k/v ``[B, H_kv, S, d]``
    (all KV heads), vis ``[B, 1, 1, S]`` bool or None. Returns ``[B, h1-h0, d]``.

    Query heads that share a KV head are passed to SDPA as that KV head's "query tokens"
    (``[B, n_kv, heads_per_kv, d]``), so GQA needs no K/V expansion (SDPA's ``enable_gqa`` copies
    K/V here). Runs that straddle KV groups unevenly fall back to ``_sdpa_heads``.
    """
    B, nh, d = q.shape
    kv0, kv1 = h0 // hpk, (h1 - 1) // hpk + 1
    nkv = kv1 - kv0
    if nkv == 1 or (h0 % hpk == 0 and h1 % hpk == 0):
        o = F.scaled_dot_product_attention(
            q.reshape(B, nkv, nh // nkv, d), k[:, kv0:kv1], v[:, kv0:kv1], attn_mask=vis, scale=scale
        )
        return o.reshape(B, nh, d)
    return _sdpa_heads(q[:, :, None], k, v, h0, h1, hpk, vis, scale)[:, :, 0]


# Below this many K/V bytes per layer (all rows), decode attention runs dense and masks the
# skipped heads afterwards: the per-run calls cost more than the cache reads they save. Measured
# on SmolLM2-135M shapes (9 heads, 3 KV heads, d=64): routed wins from about 192 slots.
DENSE_DECODE_KV_BYTES = 192 * 3 * 64 * 4 * 2


def attention_decode(q, k_cache, v_cache, head_mask, key_valid, *, scale, window=None, counter=None):
    """Work-skipping ``ops.attention_decode``: only KV heads of active head runs are read (for
    ``B > 1``, the union of the rows' active heads; other rows' skipped heads are zeroed). Short
    caches (``DENSE_DECODE_KV_BYTES``) are read whole; skipped heads are still exact zeros.
    ``counter`` (a ``Counter``) receives the multiply-adds of the heads computed."""
    B, H, d = q.shape
    Hkv = k_cache.shape[1]
    S = key_valid.shape[1]
    hpk = H // Hkv
    kt, vt = k_cache[:, :, :S], v_cache[:, :, :S]
    need_mask = window is not None or not bool(key_valid.all())
    vis = None
    if need_mask:
        vis = ops.key_visibility(B, 1, S, S - 1, key_valid, window, q.device)[:, None]  # [B,1,1,S]
    state, runs, uniform = skip_plan(head_mask)
    if state == "none":
        return torch.zeros(B, H, d, dtype=q.dtype, device=q.device)
    zero = torch.zeros((), dtype=q.dtype)
    short = state == "sparse" and B * Hkv * S * d * q.element_size() * 2 <= DENSE_DECODE_KV_BYTES
    if state == "dense" or short:
        out = _decode_heads(q, kt, vt, 0, H, hpk, vis, scale)
        if counter is not None:
            counter.attn_macs += B * H * d * 2 * S
    else:
        out = torch.zeros(B, H, d, dtype=q.dtype, device=q.device)
        if B > SMALL_M:
            runs, uniform = active_runs(head_mask.any(dim=0).tolist()), False
        for h0, h1 in runs:
            out[:, h0:h1] = _decode_heads(q[:, h0:h1], kt, vt, h0, h1, hpk, vis, scale)
            if counter is not None:
                counter.attn_macs += B * (h1 - h0) * d * 2 * S
    if need_mask:
        out = torch.where(vis[:, 0, 0].any(-1)[:, None, None], out, zero)
    if short or not uniform:
        out = torch.where(head_mask[..., None], out, zero)  # where, not *: a skipped head may be NaN
    return out
