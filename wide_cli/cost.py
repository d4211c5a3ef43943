"""The one cost model of ``wide``: what a token costs, dense and routed (DESIGN.md §3).

Every number in the project that says "FLOPs vs dense", "ideal decode speed-up", "weighted
sparsity" or "cost target" comes from here (training loss, ``wide eval``, ``wide bench``, the GPU
check, static-depth layer removal). A leaf module: it imports only torch, the standard library and
the model shape (``wide_cli.models.arch``).

Two metrics, per generated token, of one Llama-family decoder with ``L`` layers, hidden size
``D``, ``H`` query heads and ``H_kv`` KV heads of width ``d``, ``F`` SwiGLU channels, vocabulary
``V``, mean attended context ``C``:

``flops`` (2 FLOPs per multiply-add; norms, softmax, SwiGLU, residual adds not counted)::

    always dense   per layer  k_proj + v_proj            2 * 2 * D * H_kv * d
                   once       lm_head                    2 * D * V
    attention group of g heads (per layer)
                   q rows + o columns                    2 * 2 * D * g * d
                   scores QK^T + weighted sum of V       2 * 2 * g * d * C
    FFN group of c channels (per layer)
                   gate + up + down                      2 * 3 * D * c

``decode_bytes`` (weight elements read by one batch-1 decode step; a decode step is memory-bound,
so its time is taken as proportional to them; multiply by the dtype's item size for bytes)::

    always dense   per layer  k_proj, v_proj, both RMSNorm weights   2 * D * H_kv * d + 2 * D
                   once       lm_head, final norm, one embedding row V * D + 2 * D
    attention group           q rows + o columns                    2 * D * g * d
    FFN group                 gate + up + down                      3 * D * c

KV-cache reads are not counted (the ideal bound). Routers are optional overhead, counted in the
routed cost only: per router ``2 * (D * r + r * 2G)`` FLOPs, ``D * r + r * 2G`` weight elements.

Low-rank stand-ins (``lowrank:R``) run in place of a skipped group, so each skip saves the group's
cost minus its stand-in's: ``2 * 2 * R * D`` FLOPs (``x @ V_g^T``, then ``@ U_g``) and ``2 * R * D``
fp32 elements, which weigh ``4 / itemsize`` weight elements when the weights are ``itemsize``
bytes each (``weight_itemsize``; fp32 weights when not given). The constant stand-in vectors (``D``
adds per skipped group) are not counted.

Skip fractions are per (layer, module): the share of (token, group) decisions that skip. The
routed cost is linear in them, so the *cost-weighted skip fraction* of a set of masks is

    sum over (layer, module) of  s[layer, module] * G_module * (group_cost - standin_cost)_module  /  dense total

i.e. the share of the dense model's cost that routing removes; ``1 - weighted skip`` is the cost
fraction of dense (``relative``). The floor (``floor_fraction``) is what no routing can remove.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from wide_cli.models.arch import ROUTED_MODULES, ModelShape

METRICS = ("flops", "decode_bytes")
MODULES = ROUTED_MODULES


def context_for(seq_len: int) -> float:
    """Mean attended context of a causal sequence of ``seq_len`` tokens: ``(seq_len + 1) / 2``."""
    return (int(seq_len) + 1) / 2.0


@dataclass(frozen=True)
class CostModel:
    """Per-token cost of one model in one metric, split into the always-dense part and the
    per-group routed parts (see the module docstring for the formulas).

    Attributes:
        metric: ``flops`` or ``decode_bytes`` (weight elements; times the item size for bytes).
        num_layers: L.
        attn_groups, ffn_groups: G_a, G_f routed groups per layer.
        attn_group: cost of executing one attention group in one layer, for one token.
        ffn_group: cost of executing one FFN group in one layer, for one token.
        layer_floor: always-dense cost of one layer (K/V projections; plus the two norms in bytes).
        model_floor: always-dense cost outside the layers (lm_head; plus final norm and one
            embedding row in bytes).
        router_attention, router_ffn: cost of one layer's router of that module (0 when the
            router rank is not given); counted in routed costs only.
        context_len: C used for the attention core (FLOPs only; 0 for bytes).
        standin: cost of one group's low-rank stand-in, paid when the group is skipped (0
            without ``lowrank:R`` stand-ins); the same for both modules (maps ``D -> R -> D``).
    """

    metric: str
    num_layers: int
    attn_groups: int
    ffn_groups: int
    attn_group: float
    ffn_group: float
    layer_floor: float
    model_floor: float
    router_attention: float = 0.0
    router_ffn: float = 0.0
    context_len: float = 0.0
    standin: float = 0.0

    # ---------------------------------------------------------------- totals
    def module_cost(self, module: str) -> float:
        """Cost of one layer's whole ``module`` (all its groups), for one token."""
        if module == "attention":
            return self.attn_group * self.attn_groups
        if module == "ffn":
            return self.ffn_group * self.ffn_groups
        raise ValueError(f"module {module!r} not in {MODULES}")

    def group_cost(self, module: str) -> float:
        """Cost of one group of ``module`` in one layer, for one token."""
        return self.attn_group if module == "attention" else self.ffn_group

    @property
    def layer_cost(self) -> float:
        """Dense cost of one whole decoder layer (what dropping the layer removes)."""
        return self.layer_floor + self.module_cost("attention") + self.module_cost("ffn")

    @property
    def dense_total(self) -> float:
        """Dense cost per token of the whole model."""
        return self.model_floor + self.num_layers * self.layer_cost

    def skip_saving(self, module: str) -> float:
        """What skipping one group of ``module`` in one layer saves, for one token: its cost minus
        its stand-in's."""
        return self.group_cost(module) - self.standin

    @property
    def floor(self) -> float:
        """Lowest cost per token, every group skipped: the always-dense part (K/V projections,
        norms, embeddings, lm_head) plus every group's low-rank stand-in."""
        standins = self.num_layers * self.standin * (self.attn_groups + self.ffn_groups)
        return self.model_floor + self.num_layers * self.layer_floor + standins

    @property
    def floor_fraction(self) -> float:
        """The lowest cost fraction of dense routing can reach (every group skipped)."""
        return self.floor / self.dense_total

    @property
    def layer_fraction(self) -> float:
        """Share of the dense cost of one decoder layer."""
        return self.layer_cost / self.dense_total

    def module_weight(self, module: str) -> float:
        """Share of the dense total that skipping all of one layer's ``module`` removes: the weight
        of its skip fraction (the module's cost, less its stand-ins' when they are low-rank)."""
        groups = self.attn_groups if module == "attention" else self.ffn_groups
        return groups * self.skip_saving(module) / self.dense_total

    # ---------------------------------------------------------------- fractions
    def weighted_skip(self, skip: Mapping[tuple[int, str], float | torch.Tensor]):
        """Cost-weighted skip fraction from per-(layer, module) skip fractions.

        Args:
            skip: ``{(layer, module): s}``, ``s`` in [0, 1] (float or 0-dim tensor, gradients kept);
                missing pairs count as executed.
        Returns:
            ``sum s * module_weight(module)``: the share of the dense cost removed (float or tensor).
        """
        total = 0.0
        for (_, module), s in skip.items():
            total = total + s * self.module_weight(module)
        return total

    def skip_from_masks(self, masks: Mapping[tuple[int, str], torch.Tensor],
                        valid: torch.Tensor | None = None) -> float:
        """Cost-weighted skip fraction of execute masks.

        Args:
            masks: ``{(layer, module): [B, T, G] bool or 0/1}``, True / 1 = execute.
            valid: ``[B, T]`` bool (False = padding, not counted); None = all valid.
        Returns:
            float, the share of the dense cost the masks remove on the valid tokens.
        """
        skip = {}
        for key, m in masks.items():
            ex = m.to(torch.bool)
            if valid is None:
                skip[key] = float((~ex).float().mean())
            else:
                v = valid.to(torch.bool).unsqueeze(-1).expand_as(ex)
                n = int(v.sum())
                skip[key] = float(((~ex) & v).sum()) / n if n else 0.0
        return float(self.weighted_skip(skip))

    def skip_from_summary(self, sparsity: Mapping | None) -> float:
        """Cost-weighted skip fraction of a measured summary ``{attention, ffn, per_layer: {...}}``
        (per-layer values when present, else the module means; None or missing = 0)."""
        skip = {}
        for module in MODULES:
            for i, s in enumerate(per_layer_skip(sparsity, module, self.num_layers)):
                skip[(i, module)] = s
        return float(self.weighted_skip(skip))

    def relative(self, sparsity: Mapping | None, *, routers: bool = False) -> float:
        """Cost fraction of dense at a measured sparsity summary (``1 - weighted skip``), plus the
        routers' overhead when ``routers`` (only for modules the summary routes)."""
        rel = 1.0 - self.skip_from_summary(sparsity)
        if routers and sparsity is not None:
            rel += self.router_overhead(sparsity) / self.dense_total
        return rel

    def router_overhead(self, sparsity: Mapping | None) -> float:
        """Router cost per token of the modules ``sparsity`` reports as routed (non-None)."""
        if not sparsity:
            return 0.0
        out = 0.0
        if sparsity.get("attention") is not None:
            out += self.num_layers * self.router_attention
        if sparsity.get("ffn") is not None:
            out += self.num_layers * self.router_ffn
        return out

    def speedup_bound(self, sparsity: Mapping | None) -> float:
        """Ideal speed-up over dense: ``dense total / routed total`` (routers not counted)."""
        routed = self.dense_total * (1.0 - self.skip_from_summary(sparsity))
        return self.dense_total / routed if routed > 0 else math.inf

    def check_cost_target(self, cost: float, *, what: str = "cost") -> None:
        """Raise ValueError (one line naming the value and the reachable range) unless the cost
        fraction ``cost`` is in (0, 1) and above the floor."""
        lo = self.floor_fraction
        if not (0.0 < cost < 1.0) or cost <= lo:
            raise ValueError(
                f"{what} {cost:g} ({self.metric}) is not reachable: routing can reach a cost in "
                f"({lo:.3f}, 1) of dense (K/V projections, norms, embeddings and lm_head always run)"
            )

    def to_dict(self) -> dict:
        return {
            "metric": self.metric, "num_layers": self.num_layers, "attn_groups": self.attn_groups,
            "ffn_groups": self.ffn_groups, "attn_group": self.attn_group, "ffn_group": self.ffn_group,
            "layer_floor": self.layer_floor, "model_floor": self.model_floor, "layer_cost": self.layer_cost,
            "dense_total": self.dense_total, "floor_fraction": self.floor_fraction,
            "context_len": self.context_len, "standin": self.standin,
        }


def per_layer_skip(sparsity: Mapping | None, module: str, num_layers: int) -> list[float]:
    """Per-layer skip fraction of ``module`` from a summary: its ``per_layer`` list when it has
    ``num_layers`` entries (None entries = 0), else the module mean for every layer, else 0."""
    if not sparsity:
        return [0.0] * num_layers
    pl = (sparsity.get("per_layer") or {}).get(module) or []
    if len(pl) == num_layers and any(v is not None for v in pl):
        return [float(v) if v is not None else 0.0 for v in pl]
    mean = sparsity.get(module)
    return [float(mean) if mean is not None else 0.0] * num_layers


def cost_model(
    shape: ModelShape,
    *,
    metric: str = "flops",
    attn_group_size: int | None = None,
    ffn_group_size: int | None = None,
    seq_len: int | None = None,
    context_len: float | None = None,
    router_rank: int | None = None,
    standin_rank: int = 0,
    weight_itemsize: float | None = None,
) -> CostModel:
    """The cost model of ``shape`` (see the module docstring).

    Args:
        shape: ``ModelShape`` (``wide_cli.models.arch.model_shape(config)``).
        metric: ``flops`` or ``decode_bytes``.
        attn_group_size: query heads per attention group (None = all heads, one group).
        ffn_group_size: channels per FFN group (None = all channels, one group).
        seq_len / context_len: the attention core's mean context ``C`` (``context_len`` wins;
            from ``seq_len`` as ``(seq_len + 1) / 2``; neither = 0, i.e. the core is not counted).
        router_rank: router bottleneck r, to count router overhead (None = not counted).
        standin_rank: R of ``lowrank:R`` stand-ins (0 = constant or no stand-ins, free).
        weight_itemsize: bytes per weight (``decode_bytes``: the fp32 stand-in maps count
            ``4 / weight_itemsize`` weight elements each; None = 4, fp32 weights).

    Raises:
        ValueError: unknown metric, or a group size that does not divide its axis.
    """
    metric = metric.replace("-", "_")
    if metric not in METRICS:
        raise ValueError(f"cost metric {metric!r} unknown; choose one of {', '.join(METRICS)}")
    D, H, Hkv, d, F, V, L = (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                             shape.intermediate_size, shape.vocab_size, shape.num_layers)
    ga = H if attn_group_size is None else int(attn_group_size)
    gf = F if ffn_group_size is None else int(ffn_group_size)
    if H % ga or F % gf:
        raise ValueError(f"group sizes {ga} / {gf} do not divide {H} heads / {F} channels")
    Ga, Gf = H // ga, F // gf
    if context_len is None:
        context_len = context_for(seq_len) if seq_len else 0.0
    if metric == "flops":
        C = float(context_len)
        attn_group = 4.0 * D * ga * d + 4.0 * ga * d * C
        ffn_group = 6.0 * D * gf
        layer_floor = 4.0 * D * Hkv * d
        model_floor = 2.0 * D * V
        per_router = 2.0
    else:
        C = 0.0
        attn_group = 2.0 * D * ga * d
        ffn_group = 3.0 * D * gf
        layer_floor = 2.0 * D * Hkv * d + 2.0 * D
        model_floor = float(V * D + 2 * D)
        per_router = 1.0
    r_att = r_ffn = 0.0
    if router_rank:
        r = int(router_rank)
        r_att = per_router * (D * r + r * 2 * Ga)
        r_ffn = per_router * (D * r + r * 2 * Gf)
    map_weight = 4.0 / float(weight_itemsize) if weight_itemsize else 1.0  # the maps are read as fp32
    standin = (4.0 if metric == "flops" else 2.0 * map_weight) * int(standin_rank) * D
    return CostModel(metric, L, Ga, Gf, attn_group, ffn_group, layer_floor, model_floor, r_att, r_ffn, C, standin)


def _group_kw(shape: ModelShape, attn_groups: int | None, ffn_groups: int | None, standin_rank: int) -> dict:
    """``cost_model`` keywords for the group layout (when known) and low-rank stand-ins."""
    if not (attn_groups and ffn_groups):
        return {}
    return {"attn_group_size": shape.num_heads // attn_groups,
            "ffn_group_size": shape.intermediate_size // ffn_groups, "standin_rank": int(standin_rank)}


def flops_report(shape: ModelShape, sparsity: Mapping | None, *, seq_len: int, router_rank: int | None = None,
                 attn_groups: int | None = None, ffn_groups: int | None = None, standin_rank: int = 0) -> dict:
    """Routed FLOPs per token relative to dense at a measured sparsity (what ``wide eval`` reports).

    Args:
        shape: the model's shape. sparsity: measured summary (None = dense).
        seq_len: evaluation window; the attention core uses ``C = (seq_len + 1) / 2``.
        router_rank, attn_groups, ffn_groups: count router overhead when all are given.
        standin_rank: R of low-rank stand-ins, charged to every skipped group (needs the groups).

    Returns:
        ``{relative, dense_flops_per_token, routed_flops_per_token, router_flops_per_token,
        context_len, floor_fraction, formula}`` (FLOPs, 2 per multiply-add).
    """
    kw = _group_kw(shape, attn_groups, ffn_groups, standin_rank)
    if router_rank and kw:
        kw["router_rank"] = router_rank
    cm = cost_model(shape, metric="flops", seq_len=seq_len, **kw)
    router = cm.router_overhead(sparsity) if sparsity is not None else 0.0
    routed = cm.dense_total * (1.0 - cm.skip_from_summary(sparsity)) + router
    return {
        "relative": routed / cm.dense_total,
        "dense_flops_per_token": cm.dense_total,
        "routed_flops_per_token": routed,
        "router_flops_per_token": router,
        "context_len": cm.context_len,
        "floor_fraction": cm.floor_fraction,
        "formula": "wide_cli.cost (flops): per layer 4*D*H_kv*d + a*(4*D*H*d + 4*H*d*C) + f*6*D*F "
                   "+ routers, plus 2*D*V; a/f = execute fractions, C = (seq_len + 1) / 2",
    }


def decode_speedup_bound(shape: ModelShape, sparsity: Mapping | None, *, attn_groups: int | None = None,
                         ffn_groups: int | None = None, standin_rank: int = 0) -> float:
    """Ideal end-to-end batch-1 decode speed-up over dense at a measured sparsity summary: dense
    weight elements read per token / routed ones (``decode_bytes``; routers and KV cache ignored;
    low-rank stand-ins of ``standin_rank`` charged per skipped group when the group counts are given).
    SmolLM2-135M at 0.5 / 0.5: about 1.59x; Llama-3.1-8B: about 1.81x (DESIGN.md §3)."""
    kw = _group_kw(shape, attn_groups, ffn_groups, standin_rank)
    return cost_model(shape, metric="decode_bytes", **kw).speedup_bound(sparsity)


def shape_of_layers(layers: Sequence, vocab_size: int, hidden_size: int) -> ModelShape:
    """A ``ModelShape`` from runtime ``LayerWeights`` (``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``intermediate_size`` properties), for callers that hold weights, not a config."""
    lw = layers[0]
    return ModelShape(num_layers=len(layers), hidden_size=hidden_size, num_heads=lw.num_heads,
                      num_kv_heads=lw.num_kv_heads, head_dim=lw.head_dim,
                      intermediate_size=lw.intermediate_size, vocab_size=vocab_size, model_type="llama")


def fraction_after(cm: CostModel, removed: int) -> float:
    """Cost fraction of dense with ``removed`` whole decoder layers gone (their floors too)."""
    return (cm.model_floor + cm.layer_cost * (cm.num_layers - removed)) / cm.dense_total


def static_depth_export_cost(wide_config: Mapping, shape: ModelShape, *, seq_len: int) -> tuple[dict, float]:
    """Cost of a static-depth export against its source model (``shape`` is the export's, with
    fewer layers; the source's layer count and the removed layers are in
    ``wide_config["static_depth"]``).

    Returns:
        ``(flops, decode_bound)``: ``flops`` with the keys of ``flops_report`` that reports use
        (``relative``, ``dense_flops_per_token``, ``routed_flops_per_token``,
        ``router_flops_per_token``, ``context_len``); ``decode_bound`` = dense / kept decode bytes.
    """
    sel = wide_config["static_depth"]
    source = replace(shape, num_layers=int(sel["num_layers"]))
    removed = len(sel["removed"])
    f = cost_model(source, metric="flops", seq_len=seq_len)
    b = cost_model(source, metric="decode_bytes", seq_len=seq_len)
    rel = fraction_after(f, removed)
    flops = {"relative": rel, "dense_flops_per_token": f.dense_total, "routed_flops_per_token": f.dense_total * rel,
             "router_flops_per_token": 0.0, "context_len": f.context_len}
    return flops, 1.0 / fraction_after(b, removed)


def hybrid_export_cost(wide_config: Mapping, shape: ModelShape, sparsity: Mapping | None, *, seq_len: int,
                       routers: Mapping | None = None) -> tuple[dict, float]:
    """Cost of a hybrid export (``wide_config["dropped_layers"]``: whole layers removed, the rest
    routed) against its source model: the routed cost of the kept layers at ``sparsity`` over the
    source's dense cost.

    Args:
        routers: ``flops_report``'s router keywords (``router_rank``, ``attn_groups``,
            ``ffn_groups``, ``standin_rank``) to count router and stand-in overhead; None = not counted.

    Returns:
        ``(flops, decode_bound)`` like ``static_depth_export_cost``.
    """
    sel = wide_config["dropped_layers"]
    source = replace(shape, num_layers=int(sel["num_layers"]))
    kept = flops_report(shape, sparsity, seq_len=seq_len, **(routers or {}))
    full = cost_model(source, metric="flops", seq_len=seq_len).dense_total
    flops = {**kept, "relative": kept["routed_flops_per_token"] / full, "dense_flops_per_token": full}
    r = routers or {}
    b_kept = cost_model(shape, metric="decode_bytes",
                        **_group_kw(shape, r.get("attn_groups"), r.get("ffn_groups"), r.get("standin_rank", 0)))
    b_full = cost_model(source, metric="decode_bytes").dense_total
    routed_bytes = b_kept.dense_total * (1.0 - b_kept.skip_from_summary(sparsity))
    return flops, b_full / routed_bytes


def layers_to_drop(cm: CostModel, cost: float, order: Iterable[int]) -> list[int]:
    """Whole decoder layers to remove, taken from ``order`` (least important first), until the
    dense cost fraction is at most ``cost``.

    Raises:
        ValueError: ``cost`` outside (0, 1) or below what removing every layer but one reaches.
    """
    lo = (cm.model_floor + cm.layer_cost) / cm.dense_total
    if not (0.0 < cost < 1.0) or cost < lo:
        raise ValueError(f"cost {cost:g} ({cm.metric}) is not reachable by removing layers: "
                         f"choose a cost in [{lo:.3f}, 1)")
    drop, frac = [], 1.0
    for i in order:
        if frac <= cost + 1e-12:
            break
        drop.append(int(i))
        frac -= cm.layer_fraction
    return drop
