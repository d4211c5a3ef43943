"""Per-unit activation statistics of the dense model, the input of static-width pruning and of
router initialisation (DESIGN.md §1 "Baselines", §2 ``calibrate``).

Units are what a router group is made of: query heads (attention) and SwiGLU intermediate channels
(FFN). Their scores are read where a skip acts (DESIGN.md §1 "What a skip removes"):

- attention: the input of ``self_attn.o_proj``, ``[B, T, H * d]``, head-major, i.e. the
  concatenated per-head attention outputs; score = mean over tokens of each head's L2 norm.
- FFN: the input of ``mlp.down_proj``, ``act(gate) * up``, ``[B, T, F]``; score = mean over
  tokens of each channel's absolute value.

A group's importance is the sum of its units' scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.models.arch import ROUTED_MODULES

FORMAT = "wide-group-statistics"
FORMAT_VERSION = "1"
MODULES = ROUTED_MODULES


@dataclass
class GroupStatistics:
    """Mean per-unit activation magnitudes over calibration tokens.

    Attributes:
        attn_head_norm: ``[L, H]`` float32, mean over tokens of the L2 norm of each query head's
            attention output (before ``o_proj``).
        ffn_channel_norm: ``[L, F]`` float32, mean over tokens of ``|act(gate) * up|`` per channel.
        tokens: number of tokens averaged over.
        attn_input_mean: ``[L, H * d]`` float32, mean over tokens of the ``o_proj`` input (signed);
            None in files written before it existed.
        ffn_input_mean: ``[L, F]`` float32, mean over tokens of ``act(gate) * up`` (signed), or None.
            Both give the stand-in of a skipped group (``standin_vectors``).
    """

    attn_head_norm: torch.Tensor
    ffn_channel_norm: torch.Tensor
    tokens: int
    attn_input_mean: torch.Tensor | None = None
    ffn_input_mean: torch.Tensor | None = None

    def __post_init__(self):
        a, f = self.attn_head_norm, self.ffn_channel_norm
        assert a.dim() == 2 and f.dim() == 2 and a.shape[0] == f.shape[0], (a.shape, f.shape)

    @property
    def num_layers(self) -> int:
        return int(self.attn_head_norm.shape[0])

    def group_importance(self, module: str, group_size: int) -> torch.Tensor:
        """Sum of the unit scores in each contiguous group.

        Args:
            module: ``attention`` (units = query heads) or ``ffn`` (units = channels).
            group_size: units per group; must divide the unit count.

        Returns:
            ``[L, G]`` float32 with ``G = units / group_size``.

        Raises:
            ConfigError: unknown module, or a group size that does not divide the unit count.
        """
        if module == "attention":
            scores, what, flag = self.attn_head_norm, "query heads", "attn-group-size"
        elif module == "ffn":
            scores, what, flag = self.ffn_channel_norm, "FFN channels", "ffn-group-size"
        else:
            raise ConfigError(f"unknown module {module!r}", f"choose one of {', '.join(MODULES)}")
        L, units = scores.shape
        if group_size < 1 or units % group_size:
            raise ConfigError(f"{flag} {group_size} does not divide {units} {what}",
                              f"use a divisor of {units}")
        return scores.reshape(L, units // group_size, group_size).sum(dim=-1)

    def save(self, path: str | Path) -> None:
        """Write a safetensors file atomically (temp file in the same directory + rename)."""
        from wide_cli.atomic import atomic_save_safetensors

        tensors = {"attn_head_norm": self.attn_head_norm, "ffn_channel_norm": self.ffn_channel_norm}
        if self.attn_input_mean is not None and self.ffn_input_mean is not None:
            tensors.update(attn_input_mean=self.attn_input_mean, ffn_input_mean=self.ffn_input_mean)
        atomic_save_safetensors(
            Path(path),
            {k: v.float().contiguous().cpu() for k, v in tensors.items()},
            metadata={"format": FORMAT, "version": FORMAT_VERSION, "tokens": str(int(self.tokens))},
        )

    @classmethod
    def load(cls, path: str | Path) -> GroupStatistics:
        """Read a file written by ``save``.

        Raises:
            CheckpointError: missing, unreadable or not a statistics file.
        """
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        hint = "re-run `wide calibrate` to rebuild it"
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise CheckpointError(f"{path} is not a wide statistics file", hint)
                names = set(f.keys())  # safe_open has keys(), no __contains__
                means = [f.get_tensor(k) if k in names else None for k in ("attn_input_mean", "ffn_input_mean")]
                return cls(f.get_tensor("attn_head_norm"), f.get_tensor("ffn_channel_norm"), int(meta["tokens"]),
                           *means)
        except (OSError, SafetensorError, KeyError, ValueError) as e:
            raise CheckpointError(f"cannot read calibration statistics {path}: {e}", hint) from None


def _backbone(model):
    """The decoder stack (``model.model``), also under a PEFT wrapper: running it instead of the
    CausalLM skips ``lm_head``, whose ``[B, T, vocab]`` logits would dominate memory."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


@torch.no_grad()
def calibration_pass(model, batches: torch.Tensor, hooks, *, batch_size: int = 4, max_batches: int | None = None,
                     progress: Callable[[int, int], None] | None = None, forward=None) -> int:
    """Run ``model`` in eval mode, without gradients, over ``batches`` with forward pre-hooks
    attached, then remove them and restore its training mode (the loop every calibration
    collector shares).

    Args:
        model: the model (its device is where the batches go).
        batches: ``[N, T]`` int64 token ids. batch_size: sequences per forward pass.
        hooks: ``(module, fn)`` pairs, ``fn(module, args)`` registered as forward pre-hooks.
        max_batches: use at most this many forward passes (the first ones), None = all.
        progress: called as ``progress(done, total)`` after each forward pass.
        forward: ``forward(chunk [B, T])`` runs one pass; default the decoder stack alone
            (``_backbone``: no ``[B, T, vocab]`` logits).

    Returns:
        The number of tokens run.
    """
    handles = [m.register_forward_pre_hook(fn) for m, fn in hooks]
    device = next(model.parameters()).device
    run = forward or (lambda chunk: _backbone(model)(input_ids=chunk, use_cache=False))
    starts = list(range(0, batches.shape[0], batch_size))
    if max_batches is not None:
        starts = starts[: max(0, int(max_batches))]
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        for done, s in enumerate(starts, start=1):
            chunk = batches[s : s + batch_size].to(device)
            run(chunk)
            tokens += chunk.numel()
            if progress is not None:
                progress(done, len(starts))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return tokens


@torch.no_grad()
def collect_statistics(
    model,
    batches: torch.Tensor,
    *,
    batch_size: int = 4,
    max_batches: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> GroupStatistics:
    """Run the DENSE model over ``batches`` and average per-unit activation magnitudes.

    Args:
        model: a supported ``*ForCausalLM`` without routers (any dtype/device; statistics are
            accumulated in float64 on the CPU).
        batches: ``[N, T]`` int64 token ids, every position a real token (packed data: no padding).
        batch_size: sequences per forward pass.
        max_batches: use at most this many forward passes (the first ones), None = all of ``N``.
        progress: called as ``progress(done, total)`` after each forward pass.

    Returns:
        ``GroupStatistics`` with token-weighted means over all sequences used.

    Raises:
        ModelSourceError: unsupported architecture. ValueError: empty ``batches``.
    """
    from wide_cli.models.arch import model_shape
    from wide_cli.routing.model import decoder_layers

    if batches.dim() != 2 or batches.shape[0] == 0:
        raise ValueError(f"batches must be a non-empty [N, T] tensor, got shape {tuple(batches.shape)}")
    shape = model_shape(model.config)
    L, H, d, F = shape.num_layers, shape.num_heads, shape.head_dim, shape.intermediate_size
    attn_sum = torch.zeros(L, H, dtype=torch.float64)
    ffn_sum = torch.zeros(L, F, dtype=torch.float64)
    attn_mean = torch.zeros(L, H * d, dtype=torch.float64)
    ffn_mean = torch.zeros(L, F, dtype=torch.float64)

    def attn_hook(i):
        def hook(module, args):
            x = args[0]  # [B, T, H * d], head h in columns h*d:(h+1)*d
            assert x.shape[-1] == H * d, (x.shape, H, d)
            norms = x.float().reshape(-1, H, d).norm(dim=-1)  # [B*T, H]
            attn_sum[i] += norms.sum(dim=0).double().cpu()
            attn_mean[i] += x.float().reshape(-1, H * d).sum(dim=0).double().cpu()

        return hook

    def ffn_hook(i):
        def hook(module, args):
            x = args[0]  # [B, T, F] = act(gate) * up
            assert x.shape[-1] == F, (x.shape, F)
            ffn_sum[i] += x.float().abs().reshape(-1, F).sum(dim=0).double().cpu()
            ffn_mean[i] += x.float().reshape(-1, F).sum(dim=0).double().cpu()

        return hook

    hooks = []
    for i, layer in enumerate(decoder_layers(model)):
        hooks += [(layer.self_attn.o_proj, attn_hook(i)), (layer.mlp.down_proj, ffn_hook(i))]
    tokens = calibration_pass(model, batches, hooks, batch_size=batch_size, max_batches=max_batches,
                              progress=progress)
    denom = max(tokens, 1)
    return GroupStatistics((attn_sum / denom).float(), (ffn_sum / denom).float(), tokens,
                           (attn_mean / denom).float(), (ffn_mean / denom).float())


def standin_vectors(stats: GroupStatistics, model, module: str, group_size: int) -> torch.Tensor:
    """The stand-in of every group: what the group adds to the module output on average over the
    calibration tokens (FLAP's bias compensation, per group; Informed Routing, arXiv 2510.13831).

    Attention group ``g`` (query heads ``g*s .. (g+1)*s - 1``): ``W_o[:, cols_g] @ mean(o_in[cols_g])``;
    FFN group ``g`` (channels ``cols_g``): ``W_down[:, cols_g] @ mean((act(gate) * up)[cols_g])``.

    Args:
        stats: statistics with ``attn_input_mean`` / ``ffn_input_mean``.
        model: the dense model the statistics were collected on (its ``o_proj`` / ``down_proj``).
        module: ``attention`` or ``ffn``; group_size: heads or channels per group.

    Returns:
        ``[L, G, D]`` float32.

    Raises:
        CheckpointError: statistics written before the means were collected.
    """
    from wide_cli.routing.model import decoder_layers

    mean = stats.attn_input_mean if module == "attention" else stats.ffn_input_mean
    if mean is None:
        raise CheckpointError("the calibration statistics hold no activation means (written by an older wide)",
                              "re-run `wide calibrate` to rebuild them")
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        lin = layer.self_attn.o_proj if module == "attention" else layer.mlp.down_proj
        W = lin.weight.detach().float().cpu()  # [D, K]
        unit = W.shape[1] // (stats.attn_head_norm.shape[1] if module == "attention" else W.shape[1]) * group_size
        G = W.shape[1] // unit
        m = mean[i].float()
        out.append(torch.stack([W[:, g * unit:(g + 1) * unit] @ m[g * unit:(g + 1) * unit] for g in range(G)]))
    return torch.stack(out)


def router_input_moments(model, batches: torch.Tensor, *, batch_size: int = 4, max_batches: int | None = None
                         ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Per-channel mean and standard deviation of what each router reads, on the dense model.

    The attention router reads the layer's input residual stream (what ``input_layernorm``
    normalises), the FFN router the residual after the attention block (what the FFN's input norm,
    ``pre_feedforward_layernorm`` with sandwich norms, else ``post_attention_layernorm``, normalises).
    Routing is switched off for the pass (``RoutingState`` mode ``dense``), so the moments are the
    dense model's.

    Args:
        model: a routed model (``attach_routers``; a PEFT wrapper is fine).
        batches: ``[N, T]`` int64 token ids. batch_size / max_batches: as ``calibration_pass``.

    Returns:
        ``{(layer, module): (mean [D], std [D])}`` fp32 for every layer and ``ROUTED_MODULES``
        module; ``std`` is floored at 1e-6 of its largest channel (a constant channel carries no
        information, and must not divide by zero).

    Raises:
        ConfigError: no tokens in ``batches``.
    """
    from wide_cli.routing.model import decoder_layers

    layers = decoder_layers(model)
    sums: dict[tuple[int, str], list[torch.Tensor]] = {}

    def hook(key):
        def fn(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            s = sums.setdefault(key, [torch.zeros(x.shape[-1], dtype=torch.float64),
                                      torch.zeros(x.shape[-1], dtype=torch.float64)])
            s[0] += x.sum(0).cpu()
            s[1] += (x * x).sum(0).cpu()

        return fn

    hooks = []
    for i, layer in enumerate(layers):
        # the FFN's input norm, chosen as the routed layer chooses it (routing/layer.py)
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        ffn_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        hooks += [(layer.input_layernorm, hook((i, "attention"))), (ffn_norm, hook((i, "ffn")))]
    state = getattr(model, "wide_routing", None)
    mode = state.mode if state is not None else None
    if state is not None:
        state.set_mode("dense")
    try:
        tokens = calibration_pass(model, batches, hooks, batch_size=batch_size, max_batches=max_batches)
    finally:
        if state is not None:
            state.set_mode(mode)
    if tokens == 0:
        raise ConfigError("no tokens reached the router input statistics", "give the run training data")
    out = {}
    for key, (s1, s2) in sums.items():
        mean = s1 / tokens
        std = (s2 / tokens - mean * mean).clamp_min(0.0).sqrt()
        std = std.clamp_min(1e-6 * float(std.max().clamp_min(1e-30)))
        out[key] = (mean.float(), std.float())
    return out
