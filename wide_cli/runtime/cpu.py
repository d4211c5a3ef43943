"""The ``cpu`` backend: routed work is actually skipped (DESIGN.md §3), with PyTorch on CPU.

Weight layout, built once in ``prepare_layer`` (no weight slice is copied per step):
- ``wqkv [(H + 2 H_kv) d, D]``: Q rows then K, V rows. A head group's Q rows are a contiguous row
  block (a view); the dense path is one GEMM.
- ``wo_t [H d, D]``: O projection transposed, so a head group's reduction channels are a
  contiguous row block.
- ``w_gu [G_f, 2 g, D]``: per FFN group its gate rows then its up rows (group-major), so a run of
  adjacent groups is one contiguous block and one GEMM yields both halves.
- ``w_down_t [F, D]``: down projection transposed (a group's channels are contiguous rows).

Two ways to skip, chosen by the number of tokens ``M`` in the call:
- ``M <= SMALL_M`` (decode): *union runs*. The groups that any token executes are merged into runs
  of adjacent groups; each run is one GEMM on a weight view; rows of tokens that skip a group are
  zeroed afterwards. Decode is memory-bound, so reading only the union of active weights is what
  matters (at batch 1 the union is the token's own groups).
- ``M > SMALL_M`` (prefill): *mask reordering*. Per group, the executing tokens are gathered
  (``ops.group_token_lists``), multiplied by the group's weights and scattered back
  (``index_add_``), so compute follows the sparsity. The FFN keeps each group's intermediate
  activations compact between the gate/up and down GEMMs.

Attention prefill runs, per row and head group, only the executing query tokens, in chunks whose
key range ends at the chunk's last query (so causal work is not wasted); decode reads the KV heads
of the active head groups only (the union over rows when ``B > 1``).

Measured on a shared 2-core Xeon (AVX-512, no bf16 units), SmolLM2-135M shapes, fp32, one thread
(other jobs running, so +-15 %):
- 30 FFN layers at batch 1 with 5 of 12 groups active: 12 ms vs 25 ms dense (ideal 10.4 ms); a
  gather-then-GEMM variant (``index_select`` of the weights every step) was slower than dense
  (28 ms). What is left above the ideal is per-GEMV cost: ~3.4 runs per layer, two GEMVs each.
- Whole model, random routers at 50 %: decode batch 1 is 1.22x the runtime's dense mode (ideal
  1.59x), prefill of 1024 tokens 1.48x; decode batch 8 is at parity with dense (the union of 8
  tokens' groups is nearly everything; then dense GEMMs + masking are used).
- With 2 threads the dense GEMVs gain more from the second core than the short routed ones, and
  on a loaded machine OpenMP barriers dominate; ``wide bench`` defaults to one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from wide_cli.runtime import ops
from wide_cli.runtime.backend import LayerWeights

# Calls with at most this many tokens use union runs, larger ones mask reordering. Measured on
# SmolLM2-135M FFN shapes (fp32, 1 thread, independent 50 % masks): from 4 to 64 tokens both are
# within noise of each other and of dense -- the union of the tokens' groups is nearly everything
# and the GEMMs are memory-bound -- so the threshold matters little; reordering pays off in
# prefill (1.48x dense at 1024 tokens), union runs at batch 1 (one token's own groups).
SMALL_M = 16
# Query tokens per attention chunk in routed prefill.
ATTN_CHUNK = 128


def _runs(active: list[bool]) -> list[tuple[int, int]]:
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


def _plan(mask: torch.Tensor | None) -> tuple[str, list[tuple[int, int]], bool]:
    """Analyse a group mask ``[M, G]`` once: ``(state, runs, uniform)``.

    state: ``dense`` (None, or every token executes every group), ``none`` (nothing executes) or
    ``sparse``. For ``M <= SMALL_M``: runs = runs of groups that any token executes, uniform =
    every token has the same mask; the mask is read with one ``tolist`` (cheaper than several
    small tensor ops on the decode path). For larger M only the state is computed.
    """
    if mask is None:
        return "dense", [], True
    M, G = mask.shape
    if M > SMALL_M:
        n = int(mask.sum())
        return ("dense" if n == M * G else "none" if n == 0 else "sparse"), [], False
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
    return "sparse", _runs(any_g), uniform


def _mask_state(mask: torch.Tensor | None) -> str:
    """'dense' (None or all execute), 'none' (nothing executes) or 'sparse'."""
    if mask is None:
        return "dense"
    n = int(mask.sum())
    if n == mask.numel():
        return "dense"
    return "none" if n == 0 else "sparse"


# ----------------------------------------------------------------------------------------------
# routed GEMMs on a prepared layout (the backend's hot path)


def gemm_mn_rows(a: torch.Tensor, w: torch.Tensor, mask, group_size: int, bias=None, plan=None) -> torch.Tensor:
    """``ops.gemm_mn`` where ``w [N, K]`` has contiguous row groups (HF layout or a row view)."""
    state, runs, uniform = plan or _plan(mask)
    if state == "dense":
        return F.linear(a, w, bias)
    M, N = a.shape[0], w.shape[0]
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device)
    if state == "none":
        return out
    g = group_size
    if M <= SMALL_M and runs == [(0, N // g)]:  # union is everything: dense GEMM, then mask
        return F.linear(a, w, bias).mul_(ops.expand_mask(mask, g).to(a.dtype))
    if M <= SMALL_M:
        for s, e in runs:
            out[:, s * g : e * g] = F.linear(a, w[s * g : e * g], None if bias is None else bias[s * g : e * g])
        if not uniform:
            out.mul_(ops.expand_mask(mask, g).to(out.dtype))
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        wj = w[j * g : (j + 1) * g]
        bj = None if bias is None else bias[j * g : (j + 1) * g]
        if n == M:
            out[:, j * g : (j + 1) * g] = F.linear(a, wj, bj)
        else:
            idx = order[j, :n]
            out[:, j * g : (j + 1) * g].index_copy_(0, idx, F.linear(a.index_select(0, idx), wj, bj))
    return out


def gemm_k_rows(a: torch.Tensor, w_t: torch.Tensor, mask, group_size: int, bias=None, plan=None) -> torch.Tensor:
    """``ops.gemm_k`` with the weight given transposed: ``w_t [K, N]`` (contiguous row groups)."""
    state, runs, uniform = plan or _plan(mask)
    M, N = a.shape[0], w_t.shape[1]
    if state == "dense":
        out = a @ w_t
        return out if bias is None else out.add_(bias)
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device) if bias is None else bias.expand(M, N).clone()
    if state == "none":
        return out
    g = group_size
    if M <= SMALL_M and runs == [(0, a.shape[1] // g)]:  # union is everything: mask, then dense GEMM
        out.addmm_(a * ops.expand_mask(mask, g).to(a.dtype), w_t)
        return out
    if M <= SMALL_M:
        if not uniform:
            a = a * ops.expand_mask(mask, g).to(a.dtype)
        for s, e in runs:
            out.addmm_(a[:, s * g : e * g], w_t[s * g : e * g])
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        aj, wj = a[:, j * g : (j + 1) * g], w_t[j * g : (j + 1) * g]
        if n == M:
            out.addmm_(aj, wj)
        else:
            idx = order[j, :n]
            out.index_add_(0, idx, aj.index_select(0, idx) @ wj)
    return out


def _swiglu(gu: torch.Tensor, g: int) -> torch.Tensor:
    """``gu [..., 2g]`` (gate | up) -> ``silu(gate) * up [..., g]``."""
    return F.silu(gu[..., :g]) * gu[..., g:]


def ffn_grouped(
    x: torch.Tensor, w_gu: torch.Tensor, w_down_t: torch.Tensor, mask, group_size: int, plan=None
) -> torch.Tensor:
    """Routed SwiGLU FFN on the grouped layout.

    Args:
        x: ``[M, D]``. w_gu: ``[G, 2g, D]`` (per group gate rows then up rows).
        w_down_t: ``[F, D]``. mask: ``[M, G]`` bool or None. group_size: g.
    Returns:
        ``[M, D]`` = ``gemm_k(gemm_mn_swiglu(x, ...), down, mask)``.
    """
    G, g2, D = w_gu.shape
    g = g2 // 2
    M = x.shape[0]
    state, runs, uniform = plan or _plan(mask)
    if state == "dense":
        h = _swiglu((x @ w_gu.view(-1, D).t()).view(M, G, g2), g)
        return h.reshape(M, G * g) @ w_down_t
    out = torch.zeros(M, w_down_t.shape[1], dtype=x.dtype, device=x.device)
    if state == "none":
        return out
    if M <= SMALL_M and runs == [(0, G)]:
        # The union of the tokens' groups is everything (typical for a decode batch): the dense
        # GEMMs, with the skipped (token, group) activations zeroed in between.
        h = _swiglu((x @ w_gu.view(-1, D).t()).view(M, G, g2), g) * mask[:, :, None].to(x.dtype)
        return h.reshape(M, G * g) @ w_down_t
    if M <= SMALL_M:
        # Union runs. Gate/up of all runs land in one buffer (transposed, [rows, M], so that each
        # run's GEMM writes a contiguous block), one SwiGLU over it, then one addmm per run.
        nact = sum(e - s for s, e in runs)
        xt = x.t()
        gu = torch.empty(nact * g2, M, dtype=x.dtype, device=x.device)
        off = 0
        for s, e in runs:
            n = (e - s) * g2
            torch.mm(w_gu[s:e].view(n, D), xt, out=gu[off : off + n])
            off += n
        gu = gu.view(nact, 2, g, M)
        h = F.silu(gu[:, 0]) * gu[:, 1]  # [nact, g, M]
        if not uniform:
            idx = torch.tensor([j for s, e in runs for j in range(s, e)], device=x.device)
            h.mul_(mask.index_select(1, idx).t()[:, None, :].to(h.dtype))
        h = h.view(nact * g, M)
        off = 0
        for s, e in runs:
            n = (e - s) * g
            out.addmm_(h[off : off + n].t(), w_down_t[s * g : e * g])
            off += n
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        wd = w_down_t[j * g : (j + 1) * g]
        if n == M:
            out.addmm_(_swiglu(x @ w_gu[j].t(), g), wd)
        else:
            idx = order[j, :n]
            h = _swiglu(x.index_select(0, idx) @ w_gu[j].t(), g)  # [n, g], kept compact
            out.index_add_(0, idx, h @ wd)
    return out


# ----------------------------------------------------------------------------------------------
# the operator contract (ops.py signatures, HF weight layout); used by tests and by callers that
# hold HF-layout weights. The backend itself calls the *_rows / ffn_grouped forms above.


def gemm_mn(a, w, mask, group_size, bias=None):
    """Work-skipping ``ops.gemm_mn`` (same signature and result)."""
    return gemm_mn_rows(a, w, mask, group_size, bias)


def gemm_k(a, w, mask, group_size, bias=None):
    """Work-skipping ``ops.gemm_k``; ``w [N, K]`` is used through a transposed view."""
    return gemm_k_rows(a, w.t(), mask, group_size, bias)


def gemm_mn_swiglu(a, w_gate, w_up, mask, group_size):
    """Work-skipping ``ops.gemm_mn_swiglu``. This entry point regroups the weights on every call
    (a copy); the backend does that once at load."""
    N, K = w_gate.shape
    G, g = N // group_size, group_size
    w_gu = torch.stack([w_gate.reshape(G, g, K), w_up.reshape(G, g, K)], dim=1).view(G, 2 * g, K)
    state = _mask_state(mask)
    M = a.shape[0]
    if state == "dense":
        return _swiglu((a @ w_gu.view(-1, K).t()).view(M, G, 2 * g), g).reshape(M, N)
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device)
    if state == "none":
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n:
            idx = order[j, :n]
            out[:, j * g : (j + 1) * g].index_copy_(0, idx, _swiglu(a.index_select(0, idx) @ w_gu[j].t(), g))
    return out


# ----------------------------------------------------------------------------------------------
# attention


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


def attention_prefill(q, k, v, head_mask, *, key_valid=None, q_offset=0, scale, window=None):
    """Work-skipping ``ops.attention_prefill`` (same signature and result)."""
    B, T, H, d = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    hpk = H // Hkv
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, S, d]; views of the cache
    qt = q.transpose(1, 2)  # [B, H, T, d]
    state = _mask_state(head_mask)
    all_valid = key_valid is None or bool(key_valid[:, :S].all())
    if state == "dense":
        if all_valid and window is None and q_offset == 0 and S == T:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=hpk > 1)
            return out.transpose(1, 2)
        vis = ops.key_visibility(B, T, S, q_offset, key_valid, window, q.device)  # [B, T, S]
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=vis[:, None], scale=scale, enable_gqa=hpk > 1
        )
        out = torch.where(vis.any(-1)[:, None, :, None], out, torch.zeros((), dtype=out.dtype))
        return out.transpose(1, 2)
    out = torch.zeros(B, T, H, d, dtype=q.dtype, device=q.device)
    if state == "none":
        return out
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


def attention_decode(q, k_cache, v_cache, head_mask, key_valid, *, scale, window=None):
    """Work-skipping ``ops.attention_decode``: only KV heads of active head runs are read (for
    ``B > 1``, the union of the rows' active heads; other rows' skipped heads are zeroed). Short
    caches (``DENSE_DECODE_KV_BYTES``) are read whole; skipped heads are still exact zeros."""
    B, H, d = q.shape
    Hkv = k_cache.shape[1]
    S = key_valid.shape[1]
    hpk = H // Hkv
    kt, vt = k_cache[:, :, :S], v_cache[:, :, :S]
    need_mask = window is not None or not bool(key_valid.all())
    vis = None
    if need_mask:
        vis = ops.key_visibility(B, 1, S, S - 1, key_valid, window, q.device)[:, None]  # [B,1,1,S]
    state, runs, uniform = _plan(head_mask)
    if state == "none":
        return torch.zeros(B, H, d, dtype=q.dtype, device=q.device)
    zero = torch.zeros((), dtype=q.dtype)
    short = state == "sparse" and B * Hkv * S * d * q.element_size() * 2 <= DENSE_DECODE_KV_BYTES
    if state == "dense" or short:
        out = _decode_heads(q, kt, vt, 0, H, hpk, vis, scale)
    else:
        out = torch.zeros(B, H, d, dtype=q.dtype, device=q.device)
        if B > SMALL_M:
            runs, uniform = _runs(head_mask.any(dim=0).tolist()), False
        for h0, h1 in runs:
            out[:, h0:h1] = _decode_heads(q[:, h0:h1], kt, vt, h0, h1, hpk, vis, scale)
    if need_mask:
        out = torch.where(vis[:, 0, 0].any(-1)[:, None, None], out, zero)
    if short or not uniform:
        out = torch.where(head_mask[..., None], out, zero)  # where, not *: a skipped head may be NaN
    return out


# ----------------------------------------------------------------------------------------------
# the backend


@dataclass
class _CpuLayer:
    wqkv: torch.Tensor  # [(H + 2 H_kv) d, D]
    bqkv: torch.Tensor | None
    q_rows: int  # H d
    wo_t: torch.Tensor  # [H d, D]
    bo: torch.Tensor | None
    w_gu: torch.Tensor  # [G_f, 2 g, D]
    w_down_t: torch.Tensor  # [F, D]
    attn_cols: int  # heads per group * d
    ffn_group_size: int
    # Weight views of runs of groups, built on first use (at most G (G + 1) / 2 per table): the
    # decode hot path then calls one BLAS routine per run and slices nothing.
    _views: dict = field(default_factory=dict, repr=False)

    def view(self, kind: str, s: int, e: int):
        key = (kind, s, e)
        v = self._views.get(key)
        if v is None:
            c, g = self.attn_cols, self.ffn_group_size
            if kind == "q":  # (W [n, D], bias [n] or None) for addmv
                b = None if self.bqkv is None else self.bqkv[s * c : e * c]
                v = (self.wqkv[s * c : e * c], b)
            elif kind == "kv":  # dense K/V rows: (W [2 H_kv d, D], bias or None)
                nq = self.q_rows
                v = (self.wqkv[nq:], None if self.bqkv is None else self.bqkv[nq:])
            elif kind == "o":  # [D, n] for addmv
                v = self.wo_t[s * c : e * c].t()
            elif kind == "gu":  # [n, D]
                v = self.w_gu[s:e].view(-1, self.w_gu.shape[2])
            else:  # "down": [D, n]
                v = self.w_down_t[s * g : e * g].t()
            self._views[key] = v
        return v


def _attn_in_one(p: _CpuLayer, x: torch.Tensor, runs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed Q + dense K/V for one token (``x [1, D]``): one GEMV per run of head groups."""
    nq = p.q_rows
    xv = x.reshape(-1)
    wkv, bkv = p.view("kv", 0, 0)
    kv = torch.mv(wkv, xv) if bkv is None else torch.addmv(bkv, wkv, xv)
    q = torch.zeros(nq, dtype=x.dtype, device=x.device)
    c = p.attn_cols
    for s, e in runs:
        w, b = p.view("q", s, e)
        if b is None:
            torch.mv(w, xv, out=q[s * c : e * c])
        else:
            torch.addmv(b, w, xv, out=q[s * c : e * c])
    nkv = kv.shape[0] // 2
    return q.view(1, -1), kv[:nkv].view(1, -1), kv[nkv:].view(1, -1)


def _attn_out_one(p: _CpuLayer, o: torch.Tensor, runs) -> torch.Tensor:
    """O projection of one token over the active runs of head groups: ``o [1, H d] -> [1, D]``."""
    D = p.wo_t.shape[1]
    out = torch.zeros(D, dtype=o.dtype, device=o.device) if p.bo is None else p.bo.clone()
    ov = o.reshape(-1)
    c = p.attn_cols
    for s, e in runs:
        out.addmv_(p.view("o", s, e), ov[s * c : e * c])
    return out.view(1, D)


def _ffn_one(p: _CpuLayer, x: torch.Tensor, runs) -> torch.Tensor:
    """Routed SwiGLU FFN of one token: per run one GEMV into a shared gate/up buffer, one SwiGLU,
    per run one GEMV of the down projection. ``x [1, D] -> [1, D]``."""
    g = p.ffn_group_size
    D = p.w_gu.shape[2]
    sizes = [e - s for s, e in runs]
    nact = sum(sizes)
    xv = x.reshape(-1)
    gu = torch.empty(nact * 2 * g, dtype=x.dtype, device=x.device)
    for (s, e), piece in zip(runs, gu.split([k * 2 * g for k in sizes])):
        torch.mv(p.view("gu", s, e), xv, out=piece)
    gu = gu.view(nact, 2, g)
    h = (F.silu(gu[:, 0]) * gu[:, 1]).view(-1)
    out = torch.zeros(D, dtype=x.dtype, device=x.device)
    for (s, e), piece in zip(runs, h.split([k * g for k in sizes])):
        out.addmv_(p.view("down", s, e), piece)
    return out.view(1, D)


class CpuBackend:
    """Skips routed work on CPU (see the module docstring for layout and strategy)."""

    name = "cpu"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        if self.device.type != "cpu":
            from wide_cli.errors import ConfigError

            raise ConfigError(f"backend 'cpu' runs on the CPU, not {self.device}", "use --backend cupy on a GPU")

    def prepare_layer(self, layer: LayerWeights, dtype: torch.dtype) -> _CpuLayer:
        def t(x):
            return x.to(device=self.device, dtype=dtype)

        D = layer.wq.shape[1]
        g = layer.ffn_group_size
        G = layer.intermediate_size // g
        bqkv = None
        if any(b is not None for b in (layer.bq, layer.bk, layer.bv)):
            parts = [
                b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
                for b, w in ((layer.bq, layer.wq), (layer.bk, layer.wk), (layer.bv, layer.wv))
            ]
            bqkv = t(torch.cat(parts)).contiguous()
        w_gu = torch.stack([t(layer.w_gate).view(G, g, D), t(layer.w_up).view(G, g, D)], dim=1)
        return _CpuLayer(
            wqkv=t(torch.cat([layer.wq, layer.wk, layer.wv])).contiguous(),
            bqkv=bqkv,
            q_rows=layer.wq.shape[0],
            wo_t=t(layer.wo).t().contiguous(),
            bo=None if layer.bo is None else t(layer.bo).contiguous(),
            w_gu=w_gu.reshape(G, 2 * g, D).contiguous(),
            w_down_t=t(layer.w_down).t().contiguous(),
            attn_cols=layer.attn_group_size * layer.head_dim,
            ffn_group_size=g,
        )

    def attn_in(self, p: _CpuLayer, x, mask):
        nq = p.q_rows
        plan = _plan(mask)
        if plan[0] == "sparse" and x.shape[0] == 1:
            return _attn_in_one(p, x, plan[1])
        if plan[0] == "dense":
            qkv = F.linear(x, p.wqkv, p.bqkv)
            kv = qkv[:, nq:]
            nkv = kv.shape[1] // 2
            return qkv[:, :nq], kv[:, :nkv], kv[:, nkv:]
        bq = bkv = None
        if p.bqkv is not None:
            bq, bkv = p.bqkv[:nq], p.bqkv[nq:]
        kv = F.linear(x, p.wqkv[nq:], bkv)  # dense: every token's K/V (B06)
        q = gemm_mn_rows(x, p.wqkv[:nq], mask, p.attn_cols, bq, plan)
        nkv = kv.shape[1] // 2
        return q, kv[:, :nkv], kv[:, nkv:]

    def attn_out(self, p: _CpuLayer, o, mask):
        plan = _plan(mask)
        if plan[0] == "sparse" and o.shape[0] == 1:
            return _attn_out_one(p, o, plan[1])
        return gemm_k_rows(o, p.wo_t, mask, p.attn_cols, p.bo, plan)

    def mlp(self, p: _CpuLayer, x, mask):
        plan = _plan(mask)
        if plan[0] == "sparse" and x.shape[0] == 1:
            return _ffn_one(p, x, plan[1])
        return ffn_grouped(x, p.w_gu, p.w_down_t, mask, p.ffn_group_size, plan)

    def attention_prefill(self, q, k, v, head_mask, *, key_valid, q_offset, scale, window):
        return attention_prefill(q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale, window=window)

    def attention_decode(self, q, k_cache, v_cache, head_mask, key_valid, *, scale, window):
        return attention_decode(q, k_cache, v_cache, head_mask, key_valid, scale=scale, window=window)
