"""What the engine keeps of each layer itself (the backend keeps the big weights): sizes, norm
weights, the routers folded to one decision function, stand-ins and static keep masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wide_cli.runtime.backend import LayerWeights


@dataclass
class LayerMeta:
    """What the engine itself needs of a layer (the backend keeps the big weights)."""

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_group_size: int
    ffn_group_size: int
    attn_groups: int
    ffn_groups: int
    ln_attn: torch.Tensor
    ln_ffn: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    routers: dict  # module -> (w [G, D], b [G]) fp32 from fold_router, or None
    standins: dict  # module -> [G, D] fp32 stand-in of each skipped group, or None
    standin_maps: dict  # module -> (w_in [G, R, D], w_out [G, R, D]) fp32 low-rank stand-in maps, or None
    keeps: dict  # module -> [G] bool, or None
    window: int | None
    ln_attn_out: torch.Tensor | None = None  # sandwich norms of the block outputs (Gemma 3), or None
    ln_ffn_out: torch.Tensor | None = None
    attn_scale: float = 1.0  # softmax scale of the attention scores
    rope: int = 0  # index of this layer's RoPE tables in ``Runtime.ropes``


def layer_meta(lw: LayerWeights, device: torch.device, dtype: torch.dtype, *, norm_fp32: bool = False,
               rope: int = 0) -> LayerMeta:
    """``lw``'s ``LayerMeta`` on ``device``: norms in the compute ``dtype`` (fp32 with
    ``norm_fp32``: ``ModelWeights.norm_fp32``), routers and stand-ins in fp32 (as trained), keep
    masks as bool; ``rope``: the index of the layer's RoPE in ``Runtime.ropes``."""
    ndt = torch.float32 if norm_fp32 else dtype

    def n(w):
        return None if w is None else w.to(device, ndt)

    def r(rw):
        if rw is None:
            return None
        return tuple(t.to(device, torch.float32).contiguous() for t in fold_router(rw))

    def k(keep):
        return None if keep is None else keep.to(device, torch.bool)

    return LayerMeta(
        index=lw.index, num_heads=lw.num_heads, num_kv_heads=lw.num_kv_heads, head_dim=lw.head_dim,
        attn_group_size=lw.attn_group_size, ffn_group_size=lw.ffn_group_size,
        attn_groups=lw.attn_groups, ffn_groups=lw.ffn_groups,
        ln_attn=n(lw.ln_attn), ln_ffn=n(lw.ln_ffn), q_norm=n(lw.q_norm), k_norm=n(lw.k_norm),
        routers={"attention": r(lw.router_attention), "ffn": r(lw.router_ffn)},
        standins={mod: None if rw is None or rw.standin is None else rw.standin.to(device, torch.float32)
                  for mod, rw in (("attention", lw.router_attention), ("ffn", lw.router_ffn))},
        standin_maps={mod: None if rw is None or rw.standin_in is None else
                      (rw.standin_in.to(device, torch.float32).contiguous(),
                       rw.standin_out.to(device, torch.float32).contiguous())
                      for mod, rw in (("attention", lw.router_attention), ("ffn", lw.router_ffn))},
        keeps={"attention": k(lw.keep_attention), "ffn": k(lw.keep_ffn)},
        window=lw.window, ln_attn_out=n(lw.ln_attn_out), ln_ffn_out=n(lw.ln_ffn_out),
        attn_scale=lw.head_dim**-0.5 if lw.attn_scale is None else float(lw.attn_scale), rope=rope,
    )  # fmt: skip


def fold_router(rw) -> tuple[torch.Tensor, torch.Tensor]:
    """``Linear(D, r) -> Linear(r, 2G)`` with no activation, reduced to the decision function:
    ``w [G, D], b [G]`` with ``x @ w.T + b = logit0 - logit1`` (folded in float64, stored fp32).

    Same decisions as the two-layer router except at near-ties (|logit0 - logit1| at the level of
    fp32 rounding), where any change of summation order -- another BLAS, a GPU -- can flip them.
    """
    wc, bc, wr, br = (t.double() for t in (rw.wc, rw.bc, rw.wr, rw.br))
    wd, bd = wr[0::2] - wr[1::2], br[0::2] - br[1::2]  # [G, r], [G]
    return (wd @ wc).float(), (wd @ bc + bd).float()
