"""Routing settings: method, group sizes, router rank, sparsity targets (DESIGN.md §1)."""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from wide_cli.errors import ConfigError, refuse_non_finite
from wide_cli.models.arch import ModelShape

if TYPE_CHECKING:
    from wide_cli.cost import CostModel

METHODS = ("wide", "dynamic-depth", "static-width", "static-depth", "dense")
#: What ``cost_target`` is a fraction of: dense per-token FLOPs or decode weight bytes read
#: (``wide_cli.cost.METRICS``).
COST_METRICS = ("flops", "decode_bytes")
#: What a skipped group contributes: nothing, or a fixed stand-in (its calibration-mean output),
#: or the same stand-in trained with the routers; ``lowrank:R`` adds a trained rank-R map of the
#: module's input to the trained stand-in (``LOWRANK_PREFIX``).
STANDINS = ("none", "mean", "trained")
#: What a router reads: the raw residual stream, or the residual standardised per channel by its
#: calibration mean and standard deviation (``Router.standardize_input``; folded at export).
ROUTER_INPUTS = ("residual", "standardized")
LOWRANK_PREFIX = "lowrank:"


def parse_standin(value: str) -> tuple[str, int]:
    """``(kind, rank)`` of a ``standin`` setting: ``none`` / ``mean`` / ``trained`` with rank 0, or
    ``lowrank:R`` -> ``("lowrank", R)``.

    Raises:
        ConfigError: anything else, or a rank that is not an integer >= 1.
    """
    v = str(value)
    if v in STANDINS:
        return v, 0
    if v.startswith(LOWRANK_PREFIX):
        r = v[len(LOWRANK_PREFIX):]
        if not re.fullmatch(r"[0-9]+", r) or int(r) < 1:
            raise ConfigError(f"standin {v!r} needs a rank >= 1 after {LOWRANK_PREFIX!r}", "use e.g. lowrank:8")
        return "lowrank", int(r)
    raise ConfigError(f"unknown standin {v!r}", f"choose one of {', '.join(STANDINS)} or lowrank:R (e.g. lowrank:8)")


@dataclass(frozen=True)
class RoutingConfig:
    """How a model is routed.

    Attributes:
        method: ``wide`` (token-level head/channel groups), ``dynamic-depth`` (token-level
            skip of a whole block: one group spanning the full width), ``static-width``
            (input-independent group removal), ``static-depth`` (whole decoder layers removed by
            Block Influence, ShortGPT; the export is a plain smaller model) or ``dense``.
        attn_group_size: query heads per attention group; must divide H. None (the default)
            means the model's heads per KV head (one group per KV head), which divides H in
            every GQA/MHA model and lets decode skip a KV head's cache reads.
        ffn_group_size: intermediate channels per FFN group; must divide F.
        router_rank: bottleneck width r of each router MLP.
        router_input: ``residual`` (the router reads the residual stream, the paper) or
            ``standardized`` (the residual minus its per-channel calibration mean, over its
            per-channel standard deviation; for residual streams whose scale and shared component
            make raw router logits token-independent, as Gemma 3's). Exports store the folded
            map either way, so it changes training only.
        sparsity: shared target fraction of skipped (token, group) decisions, in [0, 1).
        sparsity_attention / sparsity_ffn: per-module targets (set both or neither);
            they replace ``sparsity`` in the loss.
        sparsity_weight: lambda in ``loss = CE + lambda * |s_target - s_hat|``.
        route_attention / route_ffn: which modules get routers.
        tau_start / tau_end: Gumbel-softmax temperature, annealed linearly over optimizer steps.
        cost_target: the per-token cost to reach, a fraction of dense in (0, 1), as
            ``cost_metric`` measures it (``wide_cli.cost``): ``flops`` (dense per-token FLOPs) or
            ``decode_bytes`` (weight bytes a batch-1 decode step reads). When set, the sparsity
            loss drives the cost-weighted skip fraction to ``1 - cost_target`` and replaces the
            ``sparsity`` targets (which stay the paper's unweighted group fraction).
        sparsity_warmup: fraction of the training steps over which the sparsity target ramps
            linearly from 0 to its value (0 = the full target from step 1).
        standin: what a skipped group contributes: ``none`` (zero, the paper), ``mean`` (its
            calibration-mean output, a bias vector per group; FLAP / Informed Routing), or
            ``trained`` (that vector, trained with the routers), or ``lowrank:R``: the trained
            vector plus a rank-R linear map of the module's normed input, ``x @ V_g^T @ U_g`` with
            ``V_g, U_g [R, D]`` (initialised as the best rank-R linear prediction of the group's
            output on calibration tokens, then trained; R-Sparse / SoLA's low-rank remainder, per
            group). Its multiply-adds are charged to every skipped group by the cost model.
            For static-depth, the cost layer removal reaches (None = 0.75).
        drop_layers: hybrid depth + width (``wide`` / ``dynamic-depth`` only): first remove this
            many whole decoder layers, the least influential by Block Influence (ShortGPT, as
            ``static-depth`` ranks them), then route width in the layers that remain. 0 = none.
            ``cost_target`` still counts the whole source model: the routers make up what the
            removed layers do not save (``routed_cost_target``).
    """

    method: str = "wide"
    attn_group_size: int | None = None
    ffn_group_size: int = 128
    router_rank: int = 32
    router_input: str = "residual"
    sparsity: float = 0.5
    sparsity_attention: float | None = None
    sparsity_ffn: float | None = None
    sparsity_weight: float = 20.0
    route_attention: bool = True
    route_ffn: bool = True
    tau_start: float = 5.0
    tau_end: float = 0.5
    cost_target: float | None = None
    cost_metric: str = "flops"
    sparsity_warmup: float = 0.0
    standin: str = "none"
    drop_layers: int = 0

    def __post_init__(self):
        refuse_non_finite(self)
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}", f"choose one of {', '.join(METHODS)}")
        for name in ("sparsity", "sparsity_attention", "sparsity_ffn"):
            v = getattr(self, name)
            if v is not None and not (0.0 <= float(v) < 1.0):
                raise ConfigError(f"{name.replace('_', '-')} {v} is outside [0, 1)", "use e.g. 0.5 for 50 % sparsity")
        if (self.sparsity_attention is None) != (self.sparsity_ffn is None):
            raise ConfigError(
                "sparsity-attention and sparsity-ffn must be set together",
                "set both per-module targets, or neither to use --sparsity",
            )
        if self.router_rank < 1:
            raise ConfigError(f"router-rank {self.router_rank} must be >= 1")
        if self.router_input not in ROUTER_INPUTS:
            raise ConfigError(f"unknown router-input {self.router_input!r}", f"choose one of {', '.join(ROUTER_INPUTS)}")
        if (self.attn_group_size is not None and self.attn_group_size < 1) or self.ffn_group_size < 1:
            raise ConfigError(
                f"group sizes must be >= 1 (got attn {self.attn_group_size}, ffn {self.ffn_group_size})"
            )
        if not (self.tau_start > 0 and self.tau_end > 0):
            raise ConfigError(f"temperatures must be > 0 (got {self.tau_start} -> {self.tau_end})")
        if self.sparsity_weight < 0:
            raise ConfigError(f"sparsity-weight {self.sparsity_weight} must be >= 0")
        if self.cost_target is not None and not (0.0 < float(self.cost_target) < 1.0):
            raise ConfigError(f"cost-target {self.cost_target} is outside (0, 1)",
                              "use e.g. 0.75 for 75 % of the dense model's per-token cost")
        if self.cost_metric not in COST_METRICS:
            raise ConfigError(f"unknown cost-metric {self.cost_metric!r}", f"choose one of {', '.join(COST_METRICS)}")
        if not 0.0 <= self.sparsity_warmup < 1.0:
            raise ConfigError(f"sparsity-warmup {self.sparsity_warmup} must be in [0, 1)",
                              "a fraction of the training steps, e.g. 0.2")
        parse_standin(self.standin)
        if int(self.drop_layers) < 0:
            raise ConfigError(f"drop-layers {self.drop_layers} must be >= 0", "the number of decoder layers to remove")
        if self.drop_layers and self.method not in ("wide", "dynamic-depth"):
            raise ConfigError(f"drop-layers {self.drop_layers} applies to --method wide or dynamic-depth, "
                              f"not {self.method}",
                              "use --method static-depth --cost-target C to only remove layers, or --method wide")
        if not (self.route_attention or self.route_ffn) and self.method != "dense":
            raise ConfigError("at least one of attention / ffn must be routed")

    @property
    def standin_kind(self) -> str:
        """``none``, ``mean``, ``trained`` or ``lowrank`` (``parse_standin``)."""
        return parse_standin(self.standin)[0]

    @property
    def standin_rank(self) -> int:
        """R of ``lowrank:R`` stand-ins, 0 for every other kind."""
        return parse_standin(self.standin)[1]

    @property
    def standin_trained(self) -> bool:
        """True when the stand-ins train with the routers (``trained`` and ``lowrank:R``)."""
        return self.standin_kind in ("trained", "lowrank")

    @property
    def per_module_targets(self) -> bool:
        """True when per-module targets replace the shared one."""
        return self.sparsity_attention is not None

    def cost_model(self, shape: ModelShape, seq_len: int | None = None):
        """The ``wide_cli.cost`` model of ``cost_metric`` for this routing on ``shape``."""
        from wide_cli.cost import cost_model

        layout = resolve_groups(self, shape, warn=False)
        return cost_model(shape, metric=self.cost_metric, attn_group_size=layout.attn_group_size,
                          ffn_group_size=layout.ffn_group_size, seq_len=seq_len, standin_rank=self.standin_rank)

    def check_reachable(self, shape: ModelShape, seq_len: int | None = None) -> None:
        """Raise ConfigError (naming the value and the reachable range) when ``cost_target`` is
        below the dense floor (K/V projections, norms, embeddings, lm_head) of ``shape`` (the
        source model, before ``drop_layers`` are removed), or when ``drop_layers`` leaves no layer
        or already costs less than ``cost_target``."""
        if self.drop_layers:
            if self.drop_layers >= shape.num_layers:
                raise ConfigError(f"drop-layers {self.drop_layers} would remove every layer of a "
                                  f"{shape.num_layers}-layer model", f"choose 0 to {shape.num_layers - 1}")
            kept = kept_shape(shape, self.drop_layers)
            depth = self.depth_fraction(kept, seq_len)
            if self.cost_target is None:
                return
            lo = depth * self.cost_model(kept, seq_len).floor_fraction
            if not lo < float(self.cost_target) < depth:
                raise ConfigError(
                    f"cost-target {self.cost_target} ({self.cost_metric}) is not reachable with drop-layers "
                    f"{self.drop_layers}: removing {self.drop_layers} of {shape.num_layers} layers costs {depth:.3f} "
                    f"of dense, and routing the rest reaches ({lo:.3f}, {depth:.3f})",
                    "choose a cost-target inside that range, or fewer --drop-layers for a higher one")
            return
        if self.cost_target is None or self.method in ("dense", "static-width"):
            return
        try:
            self.cost_model(shape, seq_len).check_cost_target(float(self.cost_target), what="cost-target")
        except ValueError as e:
            raise ConfigError(str(e), "choose a cost-target inside that range") from None

    def depth_fraction(self, shape: ModelShape, seq_len: int | None = None) -> float:
        """Cost of the layer-pruned model ``shape`` (``drop_layers`` already removed) as a fraction
        of its source model's dense cost (``shape`` with ``drop_layers`` more layers), in
        ``cost_metric``; 1.0 without ``drop_layers``."""
        if not self.drop_layers:
            return 1.0
        from wide_cli.cost import cost_model

        kept = cost_model(shape, metric=self.cost_metric, seq_len=seq_len).dense_total
        full = cost_model(kept_shape(shape, -self.drop_layers), metric=self.cost_metric, seq_len=seq_len).dense_total
        return kept / full

    def routed_cost_target(self, shape: ModelShape, seq_len: int | None = None) -> float | None:
        """``cost_target`` as a fraction of the routed model's own dense cost: ``shape`` is the
        model the routers sit in (``drop_layers`` already removed), so the whole-model target
        ``c`` becomes ``c / depth_fraction``. None without a cost target."""
        if self.cost_target is None:
            return None
        return float(self.cost_target) / self.depth_fraction(shape, seq_len)

    def skip_target(self, shape: ModelShape, seq_len: int) -> SkipTarget | None:
        """What ``cost_target`` asks of the routers of ``shape`` (the model they sit in,
        ``drop_layers`` already removed) trained on sequences of ``seq_len`` tokens: the one
        conversion the router initialisation, the cost loss and the skip-logit offset all read.
        None without a cost target.

        Args:
            shape: the routed model's shape. seq_len: training sequence length in tokens (the
                attention core's FLOPs count a mean context of ``(seq_len + 1) / 2``).
        """
        if self.cost_target is None:
            return None
        return SkipTarget(self.cost_model(shape, seq_len), 1.0 - self.routed_cost_target(shape, seq_len))

    def target_for(self, module: str) -> float:
        """Sparsity target of ``module`` ('attention' or 'ffn')."""
        if self.per_module_targets:
            return float(self.sparsity_attention if module == "attention" else self.sparsity_ffn)
        return float(self.sparsity)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SkipTarget:
    """A cost target converted for one routed model and training sequence length
    (``RoutingConfig.skip_target``).

    Attributes:
        cost: the ``wide_cli.cost.CostModel`` of the routed model in ``cost_metric``, its
            attention core at the training sequence length.
        skip: the cost-weighted skip fraction to reach, a fraction of the routed model's dense
            cost: ``1 - cost_target / depth_fraction``. The cost loss drives the measured weighted
            skip to it and the skip-logit offset lands the argmax decisions on it.
    """

    cost: CostModel
    skip: float

    @property
    def uniform_skip(self) -> float:
        """The skip rate that, taken by every routed group alike, removes ``skip`` of the dense
        cost (where router initialisation starts): ``skip / (1 - floor_fraction)``."""
        return self.skip / (1.0 - self.cost.floor_fraction)


def kept_shape(shape: ModelShape, drop_layers: int) -> ModelShape:
    """``shape`` with ``drop_layers`` fewer decoder layers (negative: more)."""
    from dataclasses import replace

    return replace(shape, num_layers=shape.num_layers - int(drop_layers))


@dataclass(frozen=True)
class GroupLayout:
    """Resolved group counts for one model.

    Attributes:
        attn_group_size: query heads per group (H for dynamic-depth).
        ffn_group_size: channels per group (F for dynamic-depth).
        attn_groups: G_a = H / attn_group_size.
        ffn_groups: G_f = F / ffn_group_size.
        kv_aligned: True when every attention group covers whole KV-head groups, or lies inside
            one (then decode can skip a KV head's cache reads when all its query heads skip).
    """

    attn_group_size: int
    ffn_group_size: int
    attn_groups: int
    ffn_groups: int
    kv_aligned: bool


def resolve_groups(cfg: RoutingConfig, shape: ModelShape, *, warn: bool = True) -> GroupLayout:
    """Check group sizes against the model and return the layout (an unset attention group size
    becomes the model's heads per KV head).

    Raises:
        ConfigError: a group size that does not divide its axis, naming both numbers, e.g.
            "attn-group-size 2 does not divide 9 query heads".
    """
    if cfg.method == "dynamic-depth":
        a, f = shape.num_heads, shape.intermediate_size
    else:
        a, f = cfg.attn_group_size or shape.heads_per_kv, cfg.ffn_group_size
    if shape.num_heads % a:
        divs = [k for k in range(1, shape.num_heads + 1) if shape.num_heads % k == 0]
        raise ConfigError(
            f"attn-group-size {a} does not divide {shape.num_heads} query heads "
            f"({shape.num_kv_heads} KV heads)",
            f"use one of {divs}",
        )
    if shape.intermediate_size % f:
        raise ConfigError(
            f"ffn-group-size {f} does not divide intermediate size {shape.intermediate_size}",
            "use a divisor such as "
            + ", ".join(str(k) for k in (32, 64, 128, 256) if shape.intermediate_size % k == 0)
            or "use a divisor of the intermediate size",
        )
    rank = cfg.standin_rank
    if rank:
        # a group's output has rank at most its width (the columns of o_proj / down_proj it owns),
        # so a map of that rank or more costs as much as the group and approximates nothing better
        attn_what = f"attention groups of {a} heads x {shape.head_dim} dims"
        for on, width, what in ((cfg.route_attention, a * shape.head_dim, attn_what),
                                (cfg.route_ffn, f, f"FFN groups of {f} channels")):
            if on and rank >= width:
                raise ConfigError(f"standin {cfg.standin} does not fit the {what} (rank must be below {width})",
                                  f"use lowrank:R with R < {width}, e.g. lowrank:{max(1, width // 8)}")
    hpk = shape.heads_per_kv
    aligned = (a % hpk == 0) or (hpk % a == 0)
    if warn and not aligned and cfg.method == "wide":
        warnings.warn(
            f"attn-group-size {a} straddles KV-head groups ({shape.num_heads} query heads share "
            f"{shape.num_kv_heads} KV heads, {hpk} each): routing is correct, but decode cannot skip "
            f"KV-cache reads; a multiple or divisor of {hpk} is faster",
            stacklevel=2,
        )
    return GroupLayout(a, f, shape.num_heads // a, shape.intermediate_size // f, aligned)
