"""The quantized weight schemes of exports and the runtime, both in blocks of 32 reduction channels
with one scale per (output row, block), so that a routed group (a multiple of the block) owns its
bytes and scales:

- ``int8``: symmetric int8, as llama.cpp's Q8_0 (``quantize_int8``).
- ``int4``: 4-bit, as llama.cpp's Q4_0 (values ``-8 .. 7`` times the scale, two per byte) with a
  scale chosen per block between two rules for the least squared error (``quantize_int4``); or,
  given an importance matrix (per input channel the mean squared activation on calibration data,
  ``calibrate/importance.py``), the scale with the least importance-weighted error, in the same
  bytes (``quantize_int4(w, importance=...)``).

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
    # a block too small for a bf16 scale (all-zero, or |w| below ~1e-38) gets scale 1 and q = 0
    scale = torch.where(s > 0, s, torch.ones_like(amax))
    q = torch.round(wg / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(N, K), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_int8``: ``q [N, K]`` int8, ``scale [N, G]`` -> fp32 ``[N, K]``."""
    N, K = q.shape
    G = scale.shape[1]
    return (q.float().reshape(N, G, K // G) * scale.float()[..., None]).reshape(N, K)


INT4_BLOCK = 32  # reduction channels per scale (and per 16 packed bytes)
INT4_SCHEME = ("4-bit in blocks of 32 reduction channels, one scale per output row and block, as llama.cpp's "
               "Q4_0 (q/k/v/o, gate/up/down, embeddings, lm_head); NAME uint8 [N, K / 2]: in block b, byte j "
               "holds channel 32b + j (low nibble) and 32b + 16 + j (high nibble) as q + 8; NAME_scale "
               "[N, K / 32] bf16, weight = q * scale, q in -8..7")
# Divisors tried per block: scale = m / c for the block's largest-magnitude value m. Q4_0 takes
# c = -8 (m -> -8; a value of the other sign as large as m clips from +8 to 7); c = 7 (m -> 7) clips
# nothing. Per block the one with the least squared error wins. Measured on SmolLM2-135M
# (WikiText-2, 2,048 tokens, every matrix 4-bit): Q4_0's rule 41.3, these two 40.0 (fp32 30.96);
# adding divisors that clip the extreme itself (|c| > 8) lowered the squared error but raised the
# perplexity (43.1 with ten divisors up to 9). Quantizing dequantized values gives the same values
# back (the scales are bf16, q * scale is exact in fp32), and the same bytes except where two rules
# tie at zero error (then the first wins). With an importance matrix the same two, each also
# refitted (``quantize_int4``), gave 30.4 on 1,024 tokens (fp32 28.2); 42 divisors from 7 to 9 of
# both signs, refitted, lowered the weighted error further but gave 31.8.
INT4_DIVISORS = (-8.0, 7.0)


def check_importance(importance: torch.Tensor, K: int, what: str = "weight") -> torch.Tensor:
    """``importance`` as fp32 ``[K]`` after checking it: one finite, non-negative value per
    reduction channel. Zeros are allowed (a channel whose input is always zero, e.g. a head group
    a router always skips): where a whole block has zero importance, the unweighted error decides.

    Raises:
        ValueError: a shape other than ``[K]``, a non-floating dtype, or a negative or non-finite
            value (naming ``what``).
    """
    if not isinstance(importance, torch.Tensor) or importance.dim() != 1 or importance.shape[0] != K:
        shape = tuple(importance.shape) if isinstance(importance, torch.Tensor) else type(importance).__name__
        raise ValueError(f"importance of {what} has shape {shape}, expected [{K}] (one value per input channel); "
                         "collect it on the same model")
    if not importance.is_floating_point():
        raise ValueError(f"importance of {what} has dtype {importance.dtype}, expected a floating dtype")
    imp = importance.detach().float().cpu()
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise ValueError(f"importance of {what} has negative or non-finite values (it is a mean of squares); "
                         "re-collect it")
    return imp


def quantize_int4(w: torch.Tensor, divisors: tuple[float, ...] = INT4_DIVISORS, *,
                  importance: torch.Tensor | None = None, refit: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit per output row and block of ``INT4_BLOCK`` reduction channels.

    Without ``importance`` each block takes the candidate scale with the least squared error. With
    it (an importance matrix, as llama.cpp's ``llama-imatrix``: per input channel k the mean over
    calibration tokens of ``x_k ** 2``, x the input this weight multiplies), the error of channel k
    is weighted by ``importance[k]``, so that a block spends its 16 levels on the channels whose
    inputs are large; and each candidate's scale is also refitted to the weighted least-squares
    scale of its ``q`` (``refit``). The stored format does not change.

    Args:
        w: ``[N, K]`` float weight, K a multiple of 32.
        divisors: the candidate divisors ``c`` of ``scale = m / c`` (``(-8.0,)`` is llama.cpp's Q4_0
            rule); per block the candidate with the least (weighted) squared error wins (the
            unweighted error, then the first, on ties).
        importance: ``[K]`` finite, non-negative weights of the squared error per reduction channel
            (``check_importance``), or None (all equal).
        refit: also try per candidate the scale ``sum(imp w q) / sum(imp q^2)`` (rounded to bf16) and
            its own ``q``; None = when ``importance`` is given. Measured on SmolLM2-135M (1,024
            WikiText-2 tokens, prefill): importance without refit 33.9, with it 30.4, refit without
            importance 35.9 (plain 35.6, fp32 28.2).
    Returns:
        ``packed [N, K / 2]`` uint8 (``INT4_SCHEME``'s nibble order) and ``scale [N, K / 32]`` fp32,
        every value bf16-representable and non-zero (negative only where a q is -8). The error
        of an element is at most ``|scale| / 2``, except where its ``q`` clips at -8 or 7. Every
        non-zero block has a ``|q|`` of 7 or 8, so that the plain rule re-quantizes the
        dequantized values to themselves (the checkpoint reader and the runtime re-quantize them
        that way). All-zero blocks get scale 1, q = 0.
    Raises:
        ValueError: K not a multiple of 32; a bad ``importance`` (``check_importance``).
    """
    N, K = w.shape
    if K % INT4_BLOCK:
        raise ValueError(f"int4 needs K a multiple of {INT4_BLOCK}, got {K}")
    G = K // INT4_BLOCK
    x = w.detach().float().reshape(N, G, INT4_BLOCK)
    imp = None if importance is None else check_importance(importance, K).reshape(G, INT4_BLOCK)
    refit = imp is not None if refit is None else refit
    m = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # [N, G, 1] signed extreme
    zero = m == 0
    best: list[torch.Tensor] = []  # weighted error, error, q, scale of the best candidate so far

    def consider(s: torch.Tensor) -> torch.Tensor:
        s = torch.where(s != 0, s, torch.ones_like(s))  # all-zero or below bf16's range: scale 1, q = 0
        q = torch.round(x / s).clamp_(-8, 7)
        e2 = (x - q * s).square()
        err = e2.sum(-1, keepdim=True)
        werr = err if imp is None else (e2 * imp).sum(-1, keepdim=True)
        # a refitted scale can leave every |q| <= 6: the plain rule would then re-quantize the
        # values onto another grid, so such a candidate never wins
        ok = zero | (q.abs().amax(-1, keepdim=True) >= 7)
        werr = torch.where(ok, werr, torch.full_like(werr, float("inf")))
        if not best:
            best[:] = [werr, err, q, s]
        else:
            bw, be, bq, bs = best
            better = (werr < bw) | ((werr == bw) & (err < be))
            best[:] = [torch.where(better, werr, bw), torch.where(better, err, be), torch.where(better, q, bq),
                       torch.where(better, s, bs)]
        return q

    for c in divisors:
        s = (m / c).to(torch.bfloat16).float()
        q = consider(s)
        if refit:
            wq = q if imp is None else q * imp
            num, den = (wq * x).sum(-1, keepdim=True), (wq * q).sum(-1, keepdim=True)
            consider(torch.where(den > 0, num / den.clamp_min(1e-30), s).to(torch.bfloat16).float())
    best_q, best_s = best[2], best[3]
    # one canonical form per set of values: where no q is -8, (q, s) and (-q, -s) are the same
    # values; keep s > 0 there, so that re-quantizing reproduces the bytes, not only the values
    flip = (best_s < 0) & (best_q.amin(-1, keepdim=True) > -8)
    best_q = torch.where(flip, -best_q, best_q)
    best_s = torch.where(flip, -best_s, best_s)
    u = (best_q + 8).to(torch.uint8)  # [N, G, 32] in 0..15
    packed = u[..., :16] | (u[..., 16:] << 4)
    return packed.reshape(N, K // 2), best_s.reshape(N, G)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``packed [N, K / 2]`` uint8 -> ``q [N, K]`` int8 in -8..7 (``INT4_SCHEME``'s order)."""
    N, half = packed.shape
    b = packed.reshape(N, half // 16, 16)
    q = torch.cat([b & 0x0F, b >> 4], -1).to(torch.int8) - 8
    return q.reshape(N, 2 * half)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_int4``: ``packed [N, K / 2]`` uint8, ``scale [N, K / 32]`` -> fp32 ``[N, K]``."""
    q = unpack_int4(packed)
    N, K = q.shape
    return (q.float().reshape(N, K // INT4_BLOCK, INT4_BLOCK) * scale.float()[..., None]).reshape(N, K)


# The stored dtype of each quantized format's weight tensor (how a reader tells them apart).
STORED_DTYPE = {"int8": torch.int8, "int4": torch.uint8}
SCHEMES = {"int8": INT8_SCHEME, "int4": INT4_SCHEME}


def quantize(w: torch.Tensor, fmt: str, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` in the quantized format ``fmt`` (``int8`` / ``int4``), blocks of 32:
    ``(stored weight, scale)`` as the export stores them. ``importance [K]`` (int4 only) weights
    the choice of each block's scale (``quantize_int4``).

    Raises:
        ValueError: ``importance`` with int8 (whose error costs nothing measurable), or a bad one.
    """
    if fmt == "int4":
        return quantize_int4(w) if importance is None else quantize_int4(w, importance=importance)
    if importance is not None:
        raise ValueError("importance weights only int4 quantization; int8 takes none")
    return quantize_int8(w, INT8_BLOCK)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize`` (the format read from ``q``'s dtype) -> fp32 ``[N, K]``."""
    return dequantize_int4(q, scale) if q.dtype == torch.uint8 else dequantize_int8(q, scale)


def values(w: torch.Tensor, fmt: str, importance: torch.Tensor | None = None) -> torch.Tensor:
    """``w [N, K]`` as the format represents it: ``dequantize(quantize(w, fmt, importance))``, fp32."""
    return dequantize(*quantize(w, fmt, importance))


def importance_for(importance: dict[str, torch.Tensor] | None, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The importance ``[K]`` of the HF tensor ``name`` (shape ``[N, K]``) in ``importance`` (HF
    weight name -> ``[K]``, ``calibrate/importance.py``), or None where it has none.

    Raises:
        ValueError: an entry whose shape does not fit the tensor (``check_importance``).
    """
    if importance is None or name not in importance:
        return None
    return check_importance(importance[name], shape[1], name)


def int4_values_state_dict(sd: dict[str, torch.Tensor], importance: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named float tensors with every tensor that has an entry in ``importance`` replaced by its
    importance-weighted int4 values (fp32 ``[N, K]``), the others unchanged. The plain rule, which
    the runtime quantizes with, maps these values to themselves, so a runtime built from them runs
    the calibrated int4 weights.

    Raises:
        ValueError: an ``importance`` name that is not in ``sd``, or a bad entry.
    """
    unknown = sorted(set(importance) - set(sd))
    if unknown:
        raise ValueError(f"importance names {unknown[:3]} are not tensors of this model; collect it on the same model")
    return {n: values(t, "int4", importance_for(importance, n, tuple(t.shape))) if n in importance else t
            for n, t in sd.items()}


# Quantized exports: ``NAME`` (int8, or packed uint8 for int4) plus ``NAME_scale`` in model.safetensors.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def export_groups(name: str, *, attn_cols: int, ffn_group_size: int) -> int | None:
    """Reduction channels per scale for the HF tensor ``name`` in a quantized export: 32
    for projections, embeddings and the LM head, None for a tensor that stays float. (The routed
    group sizes are accepted for the callers; blocks never straddle a group, see
    ``runtime.quant.check_quant_width``.)"""
    del attn_cols, ffn_group_size
    if not name.endswith(".weight"):
        return None
    mod = name.rsplit(".", 2)[-2]
    if mod in _PROJECTIONS or name in ("lm_head.weight", "model.embed_tokens.weight"):
        return INT8_BLOCK
    return None


def quantize_state_dict(sd: dict[str, torch.Tensor], *, attn_cols: int, ffn_group_size: int,
                        fmt: str = "int8", importance: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """HF-named float tensors -> the same names with projections (and embeddings / LM head) in
    ``fmt`` (``int8``: int8 ``[N, K]`` plus fp32 ``NAME_scale [N, K / 32]``; ``int4``: uint8
    ``[N, K / 2]`` plus bf16 ``NAME_scale [N, K / 32]``); norms and biases unchanged.
    ``importance`` (int4 only; HF weight name -> ``[K]``, ``calibrate/importance.py``) weights the
    scales of the tensors it names; the others take the plain rule.

    Raises:
        ValueError: ``importance`` with int8, or an entry that does not fit its tensor.
    """
    if importance is not None and fmt != "int4":
        raise ValueError("importance weights only int4 quantization; int8 takes none")
    out = {}
    for name, t in sd.items():
        gk = export_groups(name, attn_cols=attn_cols, ffn_group_size=ffn_group_size) if t.dim() == 2 else None
        if gk is None:
            out[name] = t.contiguous()
            continue
        q, sc = quantize(t, fmt, importance_for(importance, name, tuple(t.shape)))
        # int4 scales are bf16-representable: stored in bf16 they cost what Q4_0's fp16 ones do
        out[name], out[name + SCALE_SUFFIX] = q, (sc.to(torch.bfloat16) if fmt == "int4" else sc)
    return out


def dequantize_state_dict(tensors: dict[str, torch.Tensor], where: str) -> tuple[dict[str, torch.Tensor], str | None]:
    """Inverse of ``quantize_state_dict``: ``(float tensors, the quantized format or None)``; the
    format of each tensor is read from its dtype (int8: ``int8``, uint8: ``int4``).

    Raises:
        CheckpointError: a quantized tensor without its ``_scale`` tensor, a scale whose shape does
            not fit its tensor (int8 ``[N, G]`` with G dividing K; int4 ``[N, 2 K' / 32]`` for
            ``[N, K']`` bytes), a zero or non-finite scale, a scale without its tensor, or two
            quantized formats in one file.
    """
    from wide_cli.errors import CheckpointError

    quantized = {dt: f for f, dt in STORED_DTYPE.items()}
    fmts = {quantized[t.dtype] for n, t in tensors.items() if t.dtype in quantized and not n.endswith(SCALE_SUFFIX)}
    hint = f"the quantized export is incomplete or was edited; re-run `wide export --weights {min(fmts) if fmts else 'int8'}`"
    if len(fmts) > 1:
        raise CheckpointError(f"{where}: holds both int8 and int4 tensors", hint)
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base not in tensors or tensors[base].dtype not in quantized:
                raise CheckpointError(f"{where}: scale tensor {name} has no quantized tensor {base}", hint)
            continue
        fmt = quantized.get(t.dtype)
        if fmt is None:
            out[name] = t
            continue
        s = tensors.get(name + SCALE_SUFFIX)
        if s is None:
            raise CheckpointError(f"{where}: {fmt} tensor {name} has no scale tensor {name + SCALE_SUFFIX}", hint)
        if fmt == "int4":
            ok = t.dim() == 2 and s.dim() == 2 and s.shape[0] == t.shape[0] and 2 * t.shape[1] == s.shape[1] * INT4_BLOCK
            want = f"[{t.shape[0]}, {2 * t.shape[1] // INT4_BLOCK}]" if t.dim() == 2 else "[N, 2 K / 32]"
        else:
            ok = t.dim() == 2 and s.dim() == 2 and s.shape[0] == t.shape[0] and s.shape[1] >= 1 and t.shape[1] % s.shape[1] == 0
            want = f"[{t.shape[0]}, G] with G dividing {t.shape[1]}" if t.dim() == 2 else "[N, G]"
        if not ok:
            raise CheckpointError(
                f"{where}: scale {name + SCALE_SUFFIX} has shape {tuple(s.shape)}, which does not fit "
                f"{fmt} {name} {tuple(t.shape)} (expected {want})", hint)  # fmt: skip
        # int4 scales carry the block's sign (Q4_0's rule); int8 ones are positive
        bad = (s == 0) if fmt == "int4" else (s <= 0)
        if not s.is_floating_point() or not bool(torch.isfinite(s).all()) or bool(bad.any()):
            raise CheckpointError(f"{where}: scale {name + SCALE_SUFFIX} has {'zero' if fmt == 'int4' else 'non-positive'} "
                                  "or non-finite values", hint)  # fmt: skip
        out[name] = dequantize(t, s)
    return out, (fmts.pop() if fmts else None)
