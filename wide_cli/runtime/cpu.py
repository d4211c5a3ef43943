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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wide_cli.runtime import ops
from wide_cli.runtime.backend import Counter, LayerWeights

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
# projections in a weight format, read block by block


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``(first byte address, nbytes)`` of a contiguous block."""
    return t.data_ptr(), t.numel() * t.element_size()


class Proj:
    """One projection ``y = x @ W^T`` (``W [N, K]``, HF layout) stored so that a block of routed
    groups is one contiguous read, in a weight format (``runtime/quant.py``).

    axis ``n`` (QKV, gate/up): blocks are row ranges ``[r0, r1)``. float: ``w [N, K]``; int8:
    ``q [N, K]`` and one bf16 scale per row ``s [N]``.
    axis ``k`` (O, down): blocks are reduction groups ``[j0, j1)`` of ``g`` channels. float:
    ``w_t [K, N]`` (a group's channels are contiguous rows); int8: ``q [G, N, g]`` and
    ``s [G, N]``, one block and one scale per (group, row): a skipped group reads neither.

    Every call adds its multiply-adds to ``counter.macs`` (and its weight spans to
    ``counter.trace`` when tracing). Views of blocks are cached (at most G (G + 1) / 2 per
    projection), so the decode hot path slices nothing.
    """

    def __init__(self, w: torch.Tensor, axis: str, fmt: str, dtype: torch.dtype, device, counter: Counter,
                 g: int | None = None, what: str = "projection"):
        from wide_cli.runtime.quant import check_int8_width, quantize_int8

        self.axis, self.fmt, self.counter = axis, fmt, counter
        self.int8 = fmt == "int8"
        self.N, self.K = w.shape
        self.g = g
        self.dtype = dtype
        self._v: dict = {}
        if self.int8:
            check_int8_width(self.K if axis == "n" else g, what)
            if axis == "n":
                q, s = quantize_int8(w)
                self.q, self.s = q.to(device).contiguous(), s[:, 0].to(device, torch.bfloat16).contiguous()
            else:
                G = self.K // g
                q, s = quantize_int8(w, g)
                self.q = q.view(self.N, G, g).permute(1, 0, 2).to(device).contiguous()  # [G, N, g]
                self.s = s.t().to(device, torch.bfloat16).contiguous()  # [G, N]
        elif axis == "n":
            self.w = w.to(device=device, dtype=dtype).contiguous()
        else:
            self.w_t = w.to(device=device, dtype=dtype).t().contiguous()

    @property
    def acc_dtype(self) -> torch.dtype:
        """Accumulator of ``acc``: fp32 for int8 (its blocks are summed one group at a time)."""
        return torch.float32 if self.int8 else self.dtype

    def nbytes(self) -> int:
        ts = (self.q, self.s) if self.int8 else (self.w if self.axis == "n" else self.w_t,)
        return sum(t.numel() * t.element_size() for t in ts)

    def rows(self, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """``x [M, K] -> [M, r1 - r0]``: output rows ``[r0, r1)`` (axis ``n``)."""
        v = self._v.get((r0, r1))
        if v is None:
            v = self._v[(r0, r1)] = (
                (self.q[r0:r1], self.s[r0:r1]) if self.int8 else (self.w[r0:r1],)
            )
        self.counter.macs += x.shape[0] * (r1 - r0) * self.K
        if self.counter.trace is not None:
            self.counter.trace.extend(_span(t) for t in v)
        if self.int8:
            return torch.ops.aten._weight_int8pack_mm(x, v[0], v[1])
        return F.linear(x, v[0])

    def acc(self, out: torch.Tensor, a: torch.Tensor, j0: int, j1: int) -> None:
        """``out [M, N] += a [M, (j1 - j0) g] @ W[:, j0 g : j1 g]^T`` (axis ``k``); ``a`` holds
        the activations of groups ``[j0, j1)`` only; ``out`` has ``acc_dtype``."""
        g = self.g
        M = a.shape[0]
        self.counter.macs += M * (j1 - j0) * g * self.N
        tr = self.counter.trace
        if not self.int8:
            w = self._v.get((j0, j1))
            if w is None:
                w = self._v[(j0, j1)] = self.w_t[j0 * g : j1 * g]
            if tr is not None:
                tr.append(_span(w))
            out.addmm_(a, w)
            return
        for j in range(j0, j1):
            aj = a[:, (j - j0) * g : (j - j0 + 1) * g]
            if M > 1:
                aj = aj.contiguous()
            if tr is not None:
                tr.extend((_span(self.q[j]), _span(self.s[j])))
            out.add_(torch.ops.aten._weight_int8pack_mm(aj, self.q[j], self.s[j]))


def gemm_mn_proj(a: torch.Tensor, p: Proj, mask, group_size: int, bias=None, plan=None) -> torch.Tensor:
    """``ops.gemm_mn`` on the first ``G * group_size`` rows of an axis-``n`` projection."""
    state, runs, uniform = plan or _plan(mask)
    M = a.shape[0]
    g = group_size
    N = (mask.shape[1] if mask is not None else p.N // g) * g
    if state == "dense":
        out = p.rows(a, 0, N)
        return out if bias is None else out.add_(bias)
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device)
    if state == "none":
        return out
    if M <= SMALL_M and runs == [(0, N // g)]:  # union is everything: dense GEMM, then mask
        out = p.rows(a, 0, N)
        if bias is not None:
            out.add_(bias)
        return out.mul_(ops.expand_mask(mask, g).to(a.dtype))
    if M <= SMALL_M:
        for s, e in runs:
            y = p.rows(a, s * g, e * g)
            out[:, s * g : e * g] = y if bias is None else y.add_(bias[s * g : e * g])
        if not uniform:
            out.mul_(ops.expand_mask(mask, g).to(out.dtype))
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        bj = None if bias is None else bias[j * g : (j + 1) * g]
        if n == M:
            y = p.rows(a, j * g, (j + 1) * g)
            out[:, j * g : (j + 1) * g] = y if bj is None else y.add_(bj)
        else:
            idx = order[j, :n]
            y = p.rows(a.index_select(0, idx), j * g, (j + 1) * g)
            out[:, j * g : (j + 1) * g].index_copy_(0, idx, y if bj is None else y.add_(bj))
    return out


def gemm_k_proj(a: torch.Tensor, p: Proj, mask, bias=None, plan=None) -> torch.Tensor:
    """``ops.gemm_k`` on an axis-``k`` projection (groups of ``p.g`` reduction channels)."""
    state, runs, uniform = plan or _plan(mask)
    M, g, G = a.shape[0], p.g, p.K // p.g
    out = torch.zeros(M, p.N, dtype=p.acc_dtype, device=a.device)
    if bias is not None:
        out.add_(bias)
    if state == "none":
        return out.to(a.dtype)
    if state == "dense":
        p.acc(out, a, 0, G)
    elif M <= SMALL_M:
        if not uniform:
            a = a * ops.expand_mask(mask, g).to(a.dtype)
        if runs == [(0, G)]:  # union is everything: masked activations, then dense GEMM
            p.acc(out, a, 0, G)
        else:
            for s, e in runs:
                p.acc(out, a[:, s * g : e * g], s, e)
    else:
        order, counts = ops.group_token_lists(mask)
        for j, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            aj = a[:, j * g : (j + 1) * g]
            if n == M:
                p.acc(out, aj, j, j + 1)
            else:
                idx = order[j, :n]
                part = torch.zeros(n, p.N, dtype=p.acc_dtype, device=a.device)
                p.acc(part, aj.index_select(0, idx), j, j + 1)
                out.index_add_(0, idx, part)
    return out.to(a.dtype)


def _swiglu(gu: torch.Tensor, g: int) -> torch.Tensor:
    """``gu [..., 2g]`` (gate | up) -> ``silu(gate) * up [..., g]``."""
    return F.silu(gu[..., :g]) * gu[..., g:]


def ffn_proj(x: torch.Tensor, gu: Proj, down: Proj, mask, plan=None) -> torch.Tensor:
    """Routed SwiGLU FFN on the grouped layout.

    Args:
        x: ``[M, D]``. gu: axis-``n`` projection ``[G * 2g, D]`` (per group its gate rows then its
            up rows). down: axis-``k`` projection ``[D, G * g]``. mask: ``[M, G]`` bool or None.
    Returns:
        ``[M, D]`` = ``gemm_k(gemm_mn_swiglu(x, ...), down, mask)``.
    """
    g = down.g
    G = down.K // g
    M = x.shape[0]
    state, runs, uniform = plan or _plan(mask)
    out = torch.zeros(M, down.N, dtype=down.acc_dtype, device=x.device)
    if state == "none":
        return out.to(x.dtype)
    if state == "dense" or (M <= SMALL_M and runs == [(0, G)]):
        # Dense, or the union of the tokens' groups is everything (typical for a decode batch):
        # the dense GEMMs, with the skipped (token, group) activations zeroed in between.
        h = _swiglu(gu.rows(x, 0, G * 2 * g).view(M, G, 2 * g), g)
        if state != "dense":
            h = h * mask[:, :, None].to(x.dtype)
        down.acc(out, h.reshape(M, G * g), 0, G)
        return out.to(x.dtype)
    if M <= SMALL_M:
        # Union runs: per run one gate/up GEMM, one SwiGLU over all of them, per run one down GEMM.
        parts = [gu.rows(x, s * 2 * g, e * 2 * g) for s, e in runs]
        nact = sum(e - s for s, e in runs)
        h = _swiglu((parts[0] if len(parts) == 1 else torch.cat(parts, 1)).view(M, nact, 2 * g), g)
        if not uniform:
            idx = torch.tensor([j for s, e in runs for j in range(s, e)], device=x.device)
            h = h * mask.index_select(1, idx)[:, :, None].to(h.dtype)
        h = h.view(M, nact * g)
        off = 0
        for s, e in runs:
            down.acc(out, h[:, off : off + (e - s) * g], s, e)
            off += (e - s) * g
        return out.to(x.dtype)
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        if n == M:
            down.acc(out, _swiglu(gu.rows(x, j * 2 * g, (j + 1) * 2 * g), g), j, j + 1)
        else:
            idx = order[j, :n]
            h = _swiglu(gu.rows(x.index_select(0, idx), j * 2 * g, (j + 1) * 2 * g), g)  # [n, g], compact
            part = torch.zeros(n, down.N, dtype=down.acc_dtype, device=x.device)
            down.acc(part, h, j, j + 1)
            out.index_add_(0, idx, part)
    return out.to(x.dtype)


def grouped_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[F, D]`` gate and up -> ``[2F, D]`` group-major: per group its gate rows, then its up rows
    (a run of adjacent groups is one contiguous block; one GEMM yields both halves)."""
    F_, D = w_gate.shape
    G = F_ // group_size
    return torch.stack([w_gate.reshape(G, group_size, D), w_up.reshape(G, group_size, D)], dim=1).reshape(2 * F_, D)


# ----------------------------------------------------------------------------------------------
# the operator contract (ops.py signatures, HF weight layout); used by tests and by callers that
# hold HF-layout weights. These entry points lay the weights out on every call (a copy); the
# backend does that once at load.


def _float_proj(w, axis, g=None) -> Proj:
    return Proj(w, axis, "float", w.dtype, w.device, Counter(), g)


def gemm_mn(a, w, mask, group_size, bias=None):
    """Work-skipping ``ops.gemm_mn`` (same signature and result)."""
    return gemm_mn_proj(a, _float_proj(w, "n"), mask, group_size, bias)


def gemm_k(a, w, mask, group_size, bias=None):
    """Work-skipping ``ops.gemm_k``."""
    return gemm_k_proj(a, _float_proj(w, "k", group_size), mask, bias)


def gemm_mn_swiglu(a, w_gate, w_up, mask, group_size):
    """Work-skipping ``ops.gemm_mn_swiglu``."""
    N = w_gate.shape[0]
    G, g = N // group_size, group_size
    p = _float_proj(grouped_gate_up(w_gate, w_up, g), "n")
    state = _mask_state(mask)
    M = a.shape[0]
    if state == "dense":
        return _swiglu(p.rows(a, 0, 2 * N).view(M, G, 2 * g), g).reshape(M, N)
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device)
    if state == "none":
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n:
            idx = order[j, :n]
            out[:, j * g : (j + 1) * g].index_copy_(0, idx, _swiglu(p.rows(a.index_select(0, idx), 2 * j * g, 2 * (j + 1) * g), g))
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


def attention_prefill(q, k, v, head_mask, *, key_valid=None, q_offset=0, scale, window=None, counter=None):
    """Work-skipping ``ops.attention_prefill`` (same signature and result); ``counter`` (a
    ``Counter``) receives the multiply-adds of the SDPA calls issued."""
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
            if counter is not None:  # causal: query t reads t + 1 keys
                counter.attn_macs += B * H * d * 2 * (T * (T + 1) // 2)
            return out.transpose(1, 2)
        vis = ops.key_visibility(B, T, S, q_offset, key_valid, window, q.device)  # [B, T, S]
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=vis[:, None], scale=scale, enable_gqa=hpk > 1
        )
        out = torch.where(vis.any(-1)[:, None, :, None], out, torch.zeros((), dtype=out.dtype))
        if counter is not None:  # a masked SDPA computes every (query, key) pair
            counter.attn_macs += B * H * d * 2 * T * S
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
    state, runs, uniform = _plan(head_mask)
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
            runs, uniform = _runs(head_mask.any(dim=0).tolist()), False
        for h0, h1 in runs:
            out[:, h0:h1] = _decode_heads(q[:, h0:h1], kt, vt, h0, h1, hpk, vis, scale)
            if counter is not None:
                counter.attn_macs += B * (h1 - h0) * d * 2 * S
    if need_mask:
        out = torch.where(vis[:, 0, 0].any(-1)[:, None, None], out, zero)
    if short or not uniform:
        out = torch.where(head_mask[..., None], out, zero)  # where, not *: a skipped head may be NaN
    return out


# ----------------------------------------------------------------------------------------------
# the backend


@dataclass
class _CpuLayer:
    qkv: Proj  # axis n, [(H + 2 H_kv) d, D]: Q rows (head groups) then K, V rows
    bqkv: torch.Tensor | None
    q_rows: int  # H d
    o: Proj  # axis k, groups of attn_cols
    bo: torch.Tensor | None
    gu: Proj  # axis n, [G_f 2 g, D] group-major gate | up
    down: Proj  # axis k, groups of ffn_group_size
    attn_cols: int  # heads per group * d
    ffn_group_size: int

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in (self.qkv, self.o, self.gu, self.down))


class CpuBackend:
    """Skips routed work on CPU (see the module docstring for layout and strategy).

    Args:
        device: ``cpu``.
        weights: weight format, ``fp32``, ``bf16`` or ``int8`` (``runtime/quant.py``); the
            activations are fp32 for fp32 weights and bf16 otherwise.

    Attributes:
        counter: ``Counter`` of executed multiply-adds (and, when tracing, weight reads).
    """

    name = "cpu"
    skips_work = True

    def __init__(self, device: str | torch.device = "cpu", weights: str = "fp32"):
        from wide_cli.runtime.quant import check_format

        self.device = torch.device(device)
        if self.device.type != "cpu":
            from wide_cli.errors import ConfigError

            raise ConfigError(f"backend 'cpu' runs on the CPU, not {self.device}", "use --backend cupy on a GPU")
        self.weights = check_format(weights)
        self.counter = Counter()

    def prepare_layer(self, layer: LayerWeights, dtype: torch.dtype) -> _CpuLayer:
        def t(x):
            return x.to(device=self.device, dtype=dtype)

        fmt, dev, c = self.weights, self.device, self.counter
        g = layer.ffn_group_size
        i = layer.index
        bqkv = None
        if any(b is not None for b in (layer.bq, layer.bk, layer.bv)):
            parts = [
                b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
                for b, w in ((layer.bq, layer.wq), (layer.bk, layer.wk), (layer.bv, layer.wv))
            ]
            bqkv = t(torch.cat(parts)).contiguous()
        cols = layer.attn_group_size * layer.head_dim
        return _CpuLayer(
            qkv=Proj(torch.cat([layer.wq, layer.wk, layer.wv]), "n", fmt, dtype, dev, c,
                     what=f"layer {i} q/k/v (hidden size)"),
            bqkv=bqkv,
            q_rows=layer.wq.shape[0],
            o=Proj(layer.wo, "k", fmt, dtype, dev, c, g=cols, what=f"layer {i} o_proj (attention group of {cols} channels)"),
            bo=None if layer.bo is None else t(layer.bo).contiguous(),
            gu=Proj(grouped_gate_up(layer.w_gate, layer.w_up, g), "n", fmt, dtype, dev, c,
                    what=f"layer {i} gate/up (hidden size)"),
            down=Proj(layer.w_down, "k", fmt, dtype, dev, c, g=g, what=f"layer {i} down_proj (FFN group size)"),
            attn_cols=cols,
            ffn_group_size=g,
        )  # fmt: skip

    def prepare_head(self, w: torch.Tensor, dtype: torch.dtype) -> Proj:
        """The LM head ``[V, D]`` in this backend's weight format."""
        return Proj(w, "n", self.weights, dtype, self.device, self.counter, what="lm_head (hidden size)")

    def head(self, p: Proj, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x [M, D] -> [M, V]`` in the compute dtype."""
        return p.rows(x, 0, p.N)

    def attn_in(self, p: _CpuLayer, x, mask):
        nq = p.q_rows
        plan = _plan(mask)
        if plan[0] == "dense":
            qkv = p.qkv.rows(x, 0, p.qkv.N)
            if p.bqkv is not None:
                qkv.add_(p.bqkv)
            kv = qkv[:, nq:]
            nkv = kv.shape[1] // 2
            return qkv[:, :nq], kv[:, :nkv], kv[:, nkv:]
        bq = bkv = None
        if p.bqkv is not None:
            bq, bkv = p.bqkv[:nq], p.bqkv[nq:]
        kv = p.qkv.rows(x, nq, p.qkv.N)  # dense: every token's K/V (B06)
        if bkv is not None:
            kv.add_(bkv)
        q = gemm_mn_proj(x, p.qkv, mask, p.attn_cols, bq, plan)
        nkv = kv.shape[1] // 2
        return q, kv[:, :nkv], kv[:, nkv:]

    def attn_out(self, p: _CpuLayer, o, mask):
        return gemm_k_proj(o, p.o, mask, p.bo, _plan(mask))

    def mlp(self, p: _CpuLayer, x, mask):
        return ffn_proj(x, p.gu, p.down, mask, _plan(mask))

    def attention_prefill(self, q, k, v, head_mask, *, key_valid, q_offset, scale, window):
        return attention_prefill(q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale,
                                 window=window, counter=self.counter)  # fmt: skip

    def attention_decode(self, q, k_cache, v_cache, head_mask, key_valid, *, scale, window):
        return attention_decode(q, k_cache, v_cache, head_mask, key_valid, scale=scale, window=window,
                                counter=self.counter)  # fmt: skip
