"""The int8 weight scheme of exports and the runtime: symmetric int8 in blocks of ``INT8_BLOCK`` (32)
reduction channels, one scale per (output row, block), as llama.cpp's Q8_0.

Measured on the SmolLM2-135M demo export (WikiText-2, first 2048 test tokens, fp32 activations):
one scale per row cost +2.6 % perplexity over fp32, blocks of 64 +1.9 %, blocks of 32 +0.24 %.
A routed group of O / down (a multiple of the block) holds whole blocks, so a skipped group reads
neither its weights nor its scales. Scales are rounded to bf16-representable values before
quantizing: the weight is then exactly ``q * scale`` in the runtime's kernels (bf16 scales), and
the quantization error of every element is at most ``scale / 2``.

A leaf module (torch and the error types only): the export writer quantizes with it, the
runtime's checkpoint reader dequantizes with it, and ``runtime/quant.py`` builds the runtime's
weight formats on it.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale"
# What an int8 export's wide_config says of its weights.
INT8_BLOCK = 32  # reduction channels per scale
INT8_SCHEME = ("symmetric int8 in blocks of 32 reduction channels, one scale per output row and block (q/k/v/o, "
               "gate/up/down, embeddings, lm_head); NAME_scale [N, K / 32] fp32, weight = q * scale")


def quantize_int8(w: torch.Tensor, group_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row and per group of ``group_k`` reduction channels.

    Args:
        w: ``[N, K]`` float weight (HF ``Linear.weight`` layout).
        group_k: reduction channels per scale (None = K: one scale per row); must divide K.
    Returns:
        ``q [N, K]`` int8 in ``[-127, 127]`` and ``scale [N, K // group_k]`` fp32, every value
        bf16-representable, with ``|w - q * scale| <= scale / 2`` elementwise (per its group).
        All-zero groups get scale 1 (and q = 0).
    """
    N, K = w.shape
    gk = K if group_k is None else group_k
    if gk <= 0 or K % gk:
        raise ValueError(f"group_k {gk} does not divide K={K}")
    wg = w.detach().float().reshape(N, K // gk, gk)
    amax = wg.abs().amax(-1)  # [N, G]
    # bf16 rounding moves the scale by at most 2^-9: the largest element lands within 127 +- 0.25
    # steps, so it quantizes to +-127 (clipped when above; error < scale / 4) and re-quantizing the
    # dequantized weights reproduces q and scale exactly.
    s = (amax / 127).to(torch.bfloat16).float()
    scale = torch.where(amax > 0, s, torch.ones_like(amax))
    q = torch.round(wg / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(N, K), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_int8``: ``q [N, K]`` int8, ``scale [N, G]`` -> fp32 ``[N, K]``."""
    N, K = q.shape
    G = scale.shape[1]
    return (q.float().reshape(N, G, K // G) * scale.float()[..., None]).reshape(N, K)


# Quantized exports: ``NAME`` int8 plus ``NAME_scale`` fp32 in model.safetensors.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def export_groups(name: str, *, attn_cols: int, ffn_group_size: int) -> int | None:
    """Reduction channels per scale for the HF tensor ``name`` in an int8 export: ``INT8_BLOCK``
    for projections, embeddings and the LM head, None for a tensor that stays float. (The routed
    group sizes are accepted for the callers; blocks never straddle a group, see
    ``runtime.quant.check_int8_width``.)"""
    del attn_cols, ffn_group_size
    if not name.endswith(".weight"):
        return None
    mod = name.rsplit(".", 2)[-2]
    if mod in _PROJECTIONS or name in ("lm_head.weight", "model.embed_tokens.weight"):
        return INT8_BLOCK
    return None


def quantize_state_dict(sd: dict[str, torch.Tensor], *, attn_cols: int, ffn_group_size: int) -> dict[str, torch.Tensor]:
    """HF-named float tensors -> the same names with projections (and embeddings / LM head) as int8
    plus ``NAME_scale [N, K // group]`` fp32; norms and biases unchanged."""
    out = {}
    for name, t in sd.items():
        gk = export_groups(name, attn_cols=attn_cols, ffn_group_size=ffn_group_size) if t.dim() == 2 else None
        if gk is None:
            out[name] = t.contiguous()
            continue
        q, s = quantize_int8(t, gk or None)
        out[name], out[name + SCALE_SUFFIX] = q, s
    return out


def dequantize_state_dict(tensors: dict[str, torch.Tensor], where: str) -> tuple[dict[str, torch.Tensor], bool]:
    """Inverse of ``quantize_state_dict``: ``(float tensors, any_int8)``.

    Raises:
        CheckpointError: an int8 tensor without its ``_scale`` tensor, a scale whose shape does
            not fit its tensor (``[N, G]`` with G dividing K), or a scale without its tensor.
    """
    from wide_cli.errors import CheckpointError

    hint = "the quantized export is incomplete or was edited; re-run `wide export --weights int8`"
    out, any_q = {}, False
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base not in tensors or tensors[base].dtype != torch.int8:
                raise CheckpointError(f"{where}: scale tensor {name} has no int8 tensor {base}", hint)
            continue
        if t.dtype != torch.int8:
            out[name] = t
            continue
        any_q = True
        s = tensors.get(name + SCALE_SUFFIX)
        if s is None:
            raise CheckpointError(f"{where}: int8 tensor {name} has no scale tensor {name + SCALE_SUFFIX}", hint)
        if t.dim() != 2 or s.dim() != 2 or s.shape[0] != t.shape[0] or s.shape[1] < 1 or t.shape[1] % s.shape[1]:
            raise CheckpointError(
                f"{where}: scale {name + SCALE_SUFFIX} has shape {tuple(s.shape)}, which does not fit "
                f"{name} {tuple(t.shape)} (expected [{t.shape[0]}, G] with G dividing {t.shape[1]})", hint)  # fmt: skip
        if not s.is_floating_point() or not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
            raise CheckpointError(f"{where}: scale {name + SCALE_SUFFIX} has non-positive or non-finite values", hint)
        out[name] = dequantize_int8(t, s)
    return out, any_q
