"""The dense work a ``wide bench`` row is compared with, from ``wide_cli.cost``: multiply-adds of
a timed run and weight bytes read per decode token, for a model held as runtime weights."""

from __future__ import annotations

from wide_cli.runtime.backend import ModelWeights


def _routing_kw(weights: ModelWeights) -> dict:
    """``cost_model``'s group sizes and low-rank stand-in rank, read from the first layer's
    weights (a skipped group's stand-in maps are charged against what it saves)."""
    lw = weights.layers[0]
    rank = 0
    for rw in (lw.router_attention, lw.router_ffn):
        if rw is not None and rw.standin_in is not None:
            rank = int(rw.standin_in.shape[1])
    return {"attn_group_size": lw.attn_group_size, "ffn_group_size": lw.ffn_group_size, "standin_rank": rank}


def decode_cost(weights: ModelWeights, itemsize: float | None = None):
    """The ``decode_bytes`` cost model (``wide_cli.cost``) of a model held as runtime weights, in
    units of one weight of ``itemsize`` bytes (the fp32 stand-in maps weigh ``4 / itemsize`` each;
    None: as fp32 weights)."""
    from wide_cli.cost import cost_model, shape_of_layers

    shape = shape_of_layers(weights.layers, weights.embed.shape[0], weights.embed.shape[1])
    return cost_model(shape, metric="decode_bytes", weight_itemsize=itemsize, **_routing_kw(weights))


def flops_cost(weights: ModelWeights, context_len: float):
    """The ``flops`` cost model (``wide_cli.cost``) at mean attended context ``context_len``."""
    from wide_cli.cost import cost_model, shape_of_layers

    shape = shape_of_layers(weights.layers, weights.embed.shape[0], weights.embed.shape[1])
    return cost_model(shape, metric="flops", context_len=context_len, **_routing_kw(weights))


def dense_macs(weights: ModelWeights, phase: str, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Dense multiply-adds of one timed run (``wide_cli.cost`` FLOPs / 2): decode = ``batch *
    new_tokens`` tokens at mean context ``prompt_len + (new_tokens + 1) / 2`` (step i reads
    ``prompt_len + i + 1`` keys); prefill = ``prompt_len`` tokens at context ``(L + 1) / 2`` and
    one LM head (last-token logits)."""
    if phase == "decode":
        cm = flops_cost(weights, prompt_len + (new_tokens + 1) / 2)
        return batch * new_tokens * cm.dense_total / 2
    cm = flops_cost(weights, (prompt_len + 1) / 2)
    return batch * (prompt_len * (cm.dense_total - cm.model_floor) + cm.model_floor) / 2


def weight_bytes(weights: ModelWeights, itemsize: float) -> dict:
    """Dense weight bytes read per decode token, split by what routing can skip
    (``wide_cli.cost``, ``decode_bytes``): ``{attention_routed, ffn_routed, dense}``."""
    cm = decode_cost(weights)
    L = cm.num_layers
    dense = cm.model_floor + L * cm.layer_floor  # a dense step runs no stand-in
    return {"attention_routed": L * cm.module_cost("attention") * itemsize,
            "ffn_routed": L * cm.module_cost("ffn") * itemsize, "dense": dense * itemsize}
