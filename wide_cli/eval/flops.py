"""Routed FLOPs per token relative to dense, and the ideal decode speed-up bound (DESIGN.md §3).

FLOPs per token (1 multiply-accumulate = 2 FLOPs), per layer ``l``, with ``a_l = 1 - s_attention[l]``
and ``f_l = 1 - s_ffn[l]`` the measured execute fractions::

    q_proj                      2 * D * H*d        * a_l
    k_proj + v_proj             2 * 2 * D * H_kv*d          (dense: the KV cache is never thinned)
    scores QK^T + weighted sum  2 * 2 * H*d * C    * a_l    (C = mean attended context length)
    o_proj                      2 * H*d * D        * a_l
    gate + up + down            2 * 3 * D * F      * f_l
    routers (routed only)       2 * (D*r + r*2*G) per router, attention and FFN (overhead)
  plus once per token:
    lm_head                     2 * D * V                   (dense)

Norms, residual adds, softmax, the SwiGLU activation and the embedding lookup are not counted
(no matmul; < 1 % for the supported models). ``C`` is ``(T + 1) / 2`` for a causal sequence of
``T`` tokens (we use the evaluation's ``seq_len``). Dense FLOPs are the same sum with
``a_l = f_l = 1`` and no routers; ``relative = routed / dense``.

Decode bound: a decode step is memory-bound, so its time is taken as proportional to the weight
bytes read per token. Routed weights (q, o, gate, up, down) are read for the executing groups
only (``1 - s``); k/v projections, norms, lm_head and one embedding row are read in full. Router
weights and KV-cache reads are ignored (ideal bound). For SmolLM2-135M at s = 0.5 this gives
about 1.59x, for Llama-3.1-8B about 1.81x (DESIGN.md §3).
"""

from __future__ import annotations

from wide_cli.models.arch import ModelShape

FORMULA = (
    "per token: sum over layers of [2*D*H*d*a + 4*D*H_kv*d + 4*H*d*C*a + 2*H*d*D*a + 6*D*F*f "
    "+ router 2*(D*r + 2*r*G) per routed module] + 2*D*V; a/f = measured attention/FFN execute "
    "fraction per layer, C = (seq_len + 1) / 2; relative = routed / dense (a = f = 1, no routers)"
)


def _per_layer(sparsity: dict | None, module: str, n_layers: int) -> list[float]:
    """Per-layer skip fraction of ``module`` (0.0 where unknown or not routed)."""
    if not sparsity:
        return [0.0] * n_layers
    pl = (sparsity.get("per_layer") or {}).get(module) or []
    if len(pl) == n_layers and any(v is not None for v in pl):
        return [float(v) if v is not None else 0.0 for v in pl]
    mean = sparsity.get(module)
    return [float(mean) if mean is not None else 0.0] * n_layers


def layer_flops(shape: ModelShape, *, context_len: float, attn_keep: float = 1.0, ffn_keep: float = 1.0) -> dict:
    """FLOPs per token of one decoder layer, by operator (see the module docstring)."""
    D, H, Hkv, d, F = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size
    return {
        "q_proj": 2.0 * D * H * d * attn_keep,
        "kv_proj": 4.0 * D * Hkv * d,
        "attention": 4.0 * H * d * context_len * attn_keep,
        "o_proj": 2.0 * H * d * D * attn_keep,
        "ffn": 6.0 * D * F * ffn_keep,
    }


def routed_flops(
    shape: ModelShape,
    sparsity: dict | None,
    *,
    seq_len: int,
    router_rank: int | None = None,
    attn_groups: int | None = None,
    ffn_groups: int | None = None,
) -> dict:
    """Routed FLOPs per token relative to dense.

    Args:
        shape: the model's ``ModelShape`` (``wide_cli.models.arch.model_shape``).
        sparsity: a measured summary ``{attention, ffn, per_layer: {attention, ffn}}`` (per-layer
            values are used when present, else the module means); None = dense.
        seq_len: sequence length the attention cost is averaged over (C = (seq_len + 1) / 2).
        router_rank, attn_groups, ffn_groups: router sizes, to count router overhead (skipped
            when None).

    Returns:
        ``{dense_flops_per_token, routed_flops_per_token, relative, router_flops_per_token,
        breakdown_dense, breakdown_routed, context_len, formula}`` (FLOPs, 2 per MAC).
    """
    C = (seq_len + 1) / 2.0
    n = shape.num_layers
    s_a, s_f = _per_layer(sparsity, "attention", n), _per_layer(sparsity, "ffn", n)
    dense = layer_flops(shape, context_len=C)
    dense_b = {k: v * n for k, v in dense.items()}
    routed_b = {k: 0.0 for k in dense}
    for la, lf in zip(s_a, s_f):
        for k, v in layer_flops(shape, context_len=C, attn_keep=1.0 - la, ffn_keep=1.0 - lf).items():
            routed_b[k] += v
    head = 2.0 * shape.hidden_size * shape.vocab_size
    dense_b["lm_head"] = routed_b["lm_head"] = head
    router = 0.0
    if sparsity is not None and router_rank:
        D, r = shape.hidden_size, router_rank
        for mod, g in (("attention", attn_groups), ("ffn", ffn_groups)):
            if g and sparsity.get(mod) is not None:
                router += n * 2.0 * (D * r + r * 2 * g)
    routed_b["routers"] = router
    total_dense, total_routed = sum(dense_b.values()), sum(routed_b.values())
    return {
        "dense_flops_per_token": total_dense,
        "routed_flops_per_token": total_routed,
        "relative": total_routed / total_dense,
        "router_flops_per_token": router,
        "breakdown_dense": dense_b,
        "breakdown_routed": routed_b,
        "context_len": C,
        "formula": FORMULA,
    }


def decode_weight_elements(shape: ModelShape, *, s_attention: float = 0.0, s_ffn: float = 0.0) -> dict:
    """Weight elements read per decode token, split into routed and dense parts."""
    D, H, Hkv, d, F, n = (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                          shape.intermediate_size, shape.num_layers)
    attn = 2.0 * D * H * d * n * (1.0 - s_attention)  # q_proj + o_proj
    ffn = 3.0 * D * F * n * (1.0 - s_ffn)
    dense = n * (2.0 * D * Hkv * d + 2.0 * D) + D + shape.vocab_size * D + D  # kv, norms, final norm, lm_head, 1 row
    return {"routed_attention": attn, "routed_ffn": ffn, "dense": dense, "total": attn + ffn + dense}


def decode_speedup_bound(shape: ModelShape, *, s_attention: float, s_ffn: float) -> dict:
    """Ideal end-to-end decode speed-up at the given sparsities (weight bytes read per token).

    Returns:
        ``{bound, s_attention, s_ffn, dense_weight_elements, routed_weight_elements, routed_fraction,
        formula}``; ``routed_fraction`` is the share of dense weight reads that routing can skip.
    """
    dense = decode_weight_elements(shape)
    routed = decode_weight_elements(shape, s_attention=s_attention, s_ffn=s_ffn)
    return {
        "bound": dense["total"] / routed["total"],
        "s_attention": s_attention,
        "s_ffn": s_ffn,
        "dense_weight_elements": dense["total"],
        "routed_weight_elements": routed["total"],
        "routed_fraction": (dense["routed_attention"] + dense["routed_ffn"]) / dense["total"],
        "formula": ("bound = W_dense / W_routed, W = (q,o)*(1-s_attention) + (gate,up,down)*(1-s_ffn) "
                    "+ k,v + norms + lm_head + 1 embedding row; router weights and KV-cache reads ignored"),
    }
