"""The runtime: routed prefill and decode over its own KV cache (``generation.py`` runs batched
generation on it; ``layer_meta.py`` holds what it keeps of each layer, ``sparsity.py`` counts its
decisions).

``Runtime`` reads a model into backend-neutral ``ModelWeights`` (``runtime/checkpoint.py`` rules:
Hugging Face tensor names, per-layer sizes from the tensors), hands each layer to a backend, and
runs the decoder itself: embeddings, RMSNorms, routers, RoPE, cache, residual adds and LM head in
PyTorch; the routed work through the backend. No Hugging Face modeling code runs at inference.
Gemma 3's layer differs only in what ``ModelWeights`` carries (``runtime/checkpoint.py``): RMSNorm
weights folded to ``1 + w`` in fp32, GELU-tanh gating, scaled embeddings, a query scale and a RoPE
per layer, and sandwich norms on the block outputs (``_residual_add``).

Routing (DESIGN.md §1, ``routing/layer.py``): the attention router reads the residual stream
entering the layer, the FFN router the residual stream after the attention add; a group executes
iff logit0 >= logit1. K/V are computed and cached for every token (a later token may attend to a
head this one skipped). Padding tokens skip every group (their outputs are never visible) and are
not counted in the measured sparsity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from wide_cli.routing.router import apply_standin
from wide_cli.runtime import cpu_prefill, generation
from wide_cli.runtime.backend import Backend, Counter, ModelWeights, get_backend
from wide_cli.runtime.checkpoint import weights_from_export, weights_from_model, weights_from_tensors
from wide_cli.runtime.generation import GenerationResult
from wide_cli.runtime.kv_cache import KVCache
from wide_cli.runtime.layer_meta import LayerMeta, layer_meta
from wide_cli.runtime.sparsity import SparsityStats


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``LlamaRMSNorm``: statistics in fp32, scale in the input dtype; with an fp32
    ``weight`` and a bf16 / fp16 ``x``, ``Gemma3RMSNorm`` (``weight`` = ``1 + w`` folded): the fp32
    normalised value times the fp32 weight, cast once. In fp32 the weight is folded into the
    per-row scale first (fewer full-width ops on the decode path; same math, ~1e-7 apart).
    ``F.rms_norm`` was slower on CPU with 2 threads (20 vs 13 us per row).

    Args:
        x: ``[..., n]``; weight: ``[n]``. Returns ``[..., n]`` in ``x``'s dtype."""
    if x.dtype == torch.float32:
        return x * (torch.rsqrt(torch.mean(x * x, -1, keepdim=True) + eps) * weight)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def rope_tables_for(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
    """``positions [B, T]`` -> ``(cos, sin_signed)`` each ``[B, T, 1, d]`` in ``dtype``.

    ``cos``/``sin`` are computed as Hugging Face's rotary embedding does (fp32, then cast);
    ``sin_signed = cat(-sin_half, sin_half)`` folds ``rotate_half``'s sign into the table so that
    ``apply_rope`` is ``x * cos + roll(x, d/2) * sin_signed`` -- bitwise the same as HF's
    ``x * cos + rotate_half(x) * sin`` (negating a factor is exact), in 4 ops instead of 8.
    """
    freqs = positions[..., None].float() * inv_freq  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scale).to(dtype)
    sin = (emb.sin() * scale).to(dtype)
    h = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)
    return cos.unsqueeze(2), sin_signed.unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x [B, T, heads, d]`` with tables from ``rope_tables_for`` -> rotated ``x``."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


@dataclass
class _Step:
    """Per-step values shared by every layer.

    valid ``[B, T]`` bool (all_valid: no padding in the block), n_valid (0-d), start (first slot
    of the block), ropes: per ``Runtime.ropes`` entry its ``(cos, sin)`` ``[B, T, 1, d]`` RoPE
    tables (None where no layer uses it), key_valid ``[B, start + T]`` bool.
    """

    valid: torch.Tensor
    all_valid: bool
    n_valid: torch.Tensor
    start: int
    ropes: list
    key_valid: torch.Tensor


class Runtime:
    """A loaded model ready for routed prefill/decode on one backend.

    Build with ``from_export`` (an export directory), ``from_model`` (an in-memory routed or
    plain Hugging Face model) or ``from_tensors`` (HF-named tensors + config).

    Args:
        weights: the model in backend-neutral form.
        backend: a backend instance or a name from ``BACKENDS``.
        dtype: compute dtype (fp32 or bf16; fp16 on CPU is upcast, see ``resolve_dtype``).
        tokenizer: for ``generate`` on strings (optional otherwise).
        routing: False runs every group (the runtime's dense mode).

    Attributes:
        forced: ``{(layer, module): mask}`` decisions that replace the routers (tests, benchmarks):
            a ``[G]`` bool mask for every token, or ``[B, S_max, G]`` bool indexed by cache slot.
        stats: ``SparsityStats`` of every step since the last ``stats.reset()``.
    """

    def __init__(
        self,
        weights: ModelWeights,
        backend: Backend | str = "cpu",
        *,
        dtype: torch.dtype | str | None = None,
        tokenizer=None,
        routing: bool = True,
        weight_format: str | None = None,
    ):
        from wide_cli.models.loader import resolve_dtype
        from wide_cli.runtime.quant import COMPUTE_DTYPE, QUANTIZED_FORMATS, check_format, fake_quantize

        fmt = weight_format or weights.extra.get("weight_format")
        if fmt is not None:
            fmt = check_format(fmt)
            want = COMPUTE_DTYPE[fmt]
            if dtype is not None and resolve_dtype(dtype) != want:
                from wide_cli.errors import ConfigError

                raise ConfigError(
                    f"--weights {fmt} computes in {str(want).removeprefix('torch.')}, not {dtype}",
                    "drop --dtype (the weight format sets it)",
                )
            dtype = want
        if isinstance(backend, str):
            backend = get_backend(backend)
        self.backend = backend
        dev = self.backend.device
        self.device = dev
        self.dtype = resolve_dtype(dtype, dev)
        if fmt is None:
            fmt = "bf16" if self.dtype == torch.bfloat16 else "fp32"
        self.weight_format = fmt
        if hasattr(self.backend, "weights"):
            self.backend.weights = fmt
        elif fmt in QUANTIZED_FORMATS:
            # Backends without int8 / int4 kernels run the same quantized weights dequantized (the
            # oracle of the cpu backend's kernels).
            weights = fake_quantize(weights, fmt)
        self.tokenizer = tokenizer
        self.routing = routing
        self.forced: dict[tuple[int, str], torch.Tensor] = {}
        self.eps = weights.rms_eps
        self.eos_token_ids = tuple(weights.eos_token_ids)
        self.vocab_size = weights.embed.shape[0]
        self.hidden_size = weights.embed.shape[1]
        embed = weights.embed
        if fmt in QUANTIZED_FORMATS:  # the embedding rows a quantized export stores, for lookups too
            from wide_cli.quant import values

            embed = values(embed, fmt)
        self.embed = embed.to(dev, self.dtype)
        self.counter = getattr(self.backend, "counter", None) or Counter()
        # The LM head in the backend's weight format when it has one (int8 on cpu), else dense.
        self.head = None
        self.max_positions = weights.max_positions
        self.lm_head = self.embed if weights.tied else weights.lm_head.to(dev, self.dtype)
        if hasattr(self.backend, "prepare_head"):
            # float formats keep sharing the tied embedding (the Proj holds the same tensor)
            if fmt in QUANTIZED_FORMATS:  # quantized from the stored float values, not from their bf16 copy
                self.head = self.backend.prepare_head(embed if weights.tied else weights.lm_head, self.dtype)
                self.lm_head = None
            else:
                self.head = self.backend.prepare_head(self.lm_head, self.dtype)
        # Gemma 3 scales the embeddings by sqrt(D) in the weight dtype (transformers'
        # Gemma3TextScaledWordEmbedding); the tied LM head reads the unscaled rows.
        self.embed_scale = (None if weights.embed_scale is None else
                            torch.tensor(weights.embed_scale, dtype=torch.float32).to(dev, self.dtype))
        #: the RMSNorm weights are fp32, applied before the cast (``ModelWeights.norm_fp32``: Gemma 3)
        self.norm_fp32 = bool(weights.norm_fp32)
        self.final_norm = weights.final_norm.to(dev, torch.float32 if self.norm_fp32 else self.dtype)
        self.inv_freq = weights.inv_freq.to(dev, torch.float32)
        self.rope_scale = float(weights.rope_scale)
        #: ``(inv_freq [d/2] fp32, attention_scaling)`` of each RoPE: the model's first, then the
        #: layers' own (Gemma 3: one per layer type); ``LayerMeta.rope`` indexes it
        self.ropes: list[tuple[torch.Tensor, float]] = [(self.inv_freq, self.rope_scale)]
        rope_index: list[int] = []
        seen: dict[int, int] = {}
        for lw in weights.layers:
            if lw.rope is None:
                rope_index.append(0)
                continue
            if id(lw.rope[0]) not in seen:
                seen[id(lw.rope[0])] = len(self.ropes)
                self.ropes.append((lw.rope[0].to(dev, torch.float32), float(lw.rope[1])))
            rope_index.append(seen[id(lw.rope[0])])
        self.meta = [layer_meta(lw, dev, self.dtype, norm_fp32=weights.norm_fp32, rope=r)
                     for lw, r in zip(weights.layers, rope_index)]
        self._ropes_used = frozenset(rope_index)
        self.layers = [self.backend.prepare_layer(lw, self.dtype) for lw in weights.layers]
        self.stats = SparsityStats(len(self.layers), dev)
        # The native decode step (1-64 rows) is used where it can run (``_native_for``); False keeps
        # every step on the PyTorch path (the oracle in tests, ``wide bench``'s torch rows).
        self.native_decode = getattr(self.backend, "name", None) == "cpu"
        # The native elementwise ops of bf16 prefill (``runtime/cpu_prefill.py``) on the cpu
        # backend; the reference backend keeps PyTorch's (it is the oracle).
        self.native_prefill_ops = getattr(self.backend, "name", None) == "cpu" and self.dtype == torch.bfloat16
        # Its routers of prefill steps (bf16 or fp32): PyTorch's GEMM runs their few output columns
        # slowly (``cpu_prefill.router``)
        self.native_routers = getattr(self.backend, "name", None) == "cpu"
        #: the export's features (``wide_cli.features``) when loaded from an export, else None;
        #: the native step refuses those it does not run (``NativeDecoder.ineligible``)
        self.export_features = weights.extra.get("export_features")
        self._native = None
        self.layer_shapes = [(lw.num_heads, lw.num_kv_heads, lw.head_dim, lw.intermediate_size) for lw in weights.layers]

    # ------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_export(cls, path, *, backend: Backend | str = "cpu", dtype=None, routing: bool = True,
                    verify: bool = True, allow_extra: bool = False, weight_format: str | None = None) -> Runtime:
        """Load an export directory (manifest verified first; strict tensor names, so a
        misnamed tensor is an error rather than a weight left random; a tied model needs no
        ``lm_head.weight``).

        ``weight_format`` (``fp32``, ``bf16``, ``int8``, ``int4``) defaults to the export's stored format
        (``fp32`` for a float export, unless ``dtype`` is bf16).

        Raises:
            CheckpointError: missing/corrupt files, missing or unexpected tensors (listed),
                shapes that do not fit together, an untied model without ``lm_head.weight``,
                a quantized weight without its scale tensor (or with a mismatched one).
            ConfigError: an unknown weight format, int8 / int4 for widths the kernels cannot take.
            UnsupportedFeature: an export feature the backend does not run (``wide_cli.features``),
                before the weights are read.
        """
        from wide_cli.features import SUPPORT, check_export
        from wide_cli.models.loader import load_tokenizer

        name = backend if isinstance(backend, str) else getattr(backend, "name", None)
        features = check_export(Path(path), name) if name in SUPPORT else None
        weights = weights_from_export(Path(path), verify=verify, allow_extra=allow_extra)
        if features is not None:
            weights.extra["export_features"] = features
        tok = load_tokenizer(path)
        return cls(weights, backend, dtype=dtype, tokenizer=tok, routing=routing, weight_format=weight_format)

    @classmethod
    def from_target(cls, target, *, backend: Backend | str = "cpu", dtype=None, routing: bool = True,
                    weight_format: str | None = None, importance: dict | None = None) -> Runtime:
        """An export directory (``from_export``), or any model spec ``load_model`` accepts (alias
        such as ``smollm2-135m``, local Hugging Face directory, ``.gguf``), run dense.
        ``importance``: see ``from_model`` (not for an export, whose int4 values are stored).

        Raises:
            CheckpointError: a broken export. ModelSourceError: an unknown or unsupported model.
            ConfigError: ``importance`` for an export, or without ``weight_format="int4"``.
        """
        from wide_cli.export import is_export

        if is_export(target):
            if importance is not None:
                from wide_cli.errors import ConfigError

                raise ConfigError(f"{target} is an export: its int4 scales were chosen when it was written",
                                  "export with `wide export --weights int4` (importance on by default) instead")
            return cls.from_export(target, backend=backend, dtype=dtype, routing=routing, weight_format=weight_format)
        from wide_cli.models.loader import load_model

        lm = load_model(str(target), dtype=torch.float32)
        if weight_format is None:
            dtype = dtype or torch.float32
        return cls.from_model(lm.model, lm.tokenizer, backend=backend, dtype=dtype, routing=False,
                              weight_format=weight_format, importance=importance)

    @classmethod
    def from_model(cls, model, tokenizer=None, *, backend: Backend | str = "cpu", dtype=None,
                   routing: bool | None = None, weight_format: str | None = None,
                   importance: dict | None = None) -> Runtime:
        """Read an in-memory Hugging Face model (routed by ``attach_routers`` or plain).

        ``routing=None`` follows the model: routed unless it has no routers or its routing mode
        is ``dense``. The dtype defaults to the model's. ``importance`` (HF weight name -> ``[K]``
        mean squared input, ``calibrate.importance.collect_importance`` on training data) chooses
        the int4 scales of the tensors it names by the importance-weighted error
        (``quant.quantize_int4``); None keeps the plain rule.

        Raises:
            ConfigError: ``importance`` without ``weight_format="int4"``.
            ValueError: an ``importance`` entry that does not fit its tensor, or names no tensor.
        """
        if importance is not None and weight_format != "int4":
            from wide_cli.errors import ConfigError

            raise ConfigError(f"importance weights int4 scales; weight_format is {weight_format!r}",
                              "pass weight_format='int4', or drop importance")
        weights, routed = weights_from_model(model, importance)
        if dtype is None and weight_format is None:
            dtype = next(model.parameters()).dtype
        return cls(weights, backend, dtype=dtype, tokenizer=tokenizer, routing=routed if routing is None else routing,
                   weight_format=weight_format)

    @classmethod
    def from_tensors(cls, config, tensors: dict, *, routers: dict | None = None, wide_config: dict | None = None,
                     backend: Backend | str = "cpu", dtype=None, tokenizer=None, routing: bool = True,
                     allow_extra: bool = False) -> Runtime:
        """Build from HF-named ``tensors`` and a HF ``config`` (e.g. a physically pruned layer:
        sizes come from the tensors, not the config)."""
        weights = weights_from_tensors(config, tensors, routers or {}, wide_config, allow_extra=allow_extra)
        return cls(weights, backend, dtype=dtype, tokenizer=tokenizer, routing=routing)

    def shape(self):
        """The ``ModelShape`` of the loaded model (for ``wide_cli.cost``), read from layer 0."""
        from wide_cli.models.arch import ModelShape

        m = self.meta[0]
        return ModelShape(num_layers=len(self.meta), hidden_size=self.embed.shape[1], num_heads=m.num_heads,
                          num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                          intermediate_size=m.ffn_groups * m.ffn_group_size, vocab_size=self.vocab_size,
                          model_type="llama")

    # ------------------------------------------------------------------------------------------
    # the forward pass

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for ``batch`` rows and ``max_len`` slots, one buffer pair per layer with
        that layer's KV-head count (a pruned layer may have fewer)."""
        return KVCache(
            batch, max_len, [m.num_kv_heads for m in self.meta], [m.head_dim for m in self.meta],
            dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def _decide(self, m: LayerMeta, module: str, x: torch.Tensor, ctx: _Step):
        """Execute decisions ``[B, T, G]`` bool (False on padding) or None (module runs dense)."""
        if not self.routing:
            return None
        B, T, _ = x.shape
        G = m.attn_groups if module == "attention" else m.ffn_groups
        forced = self.forced.get((m.index, module))
        if forced is not None:
            f = forced.to(self.device, torch.bool)
            ex = f.expand(B, T, G) if f.dim() == 1 else f[:, ctx.start : ctx.start + T]
        elif m.routers[module] is not None:
            # fp32 router, as trained: execute iff logit0 >= logit1. The router has no activation,
            # so logit0 - logit1 is one affine map of x, folded at load (see ``_fold_router``).
            w, b = m.routers[module]
            self.counter.router_macs += B * T * w.numel()
            ex = cpu_prefill.router(x, w, b) if self.native_routers and B * T >= cpu_prefill.MIN_TOKENS else None
            if ex is None:
                xf = x if x.dtype == torch.float32 else x.float()
                if B * T == 1:
                    ex = (torch.addmv(b, w, xf.view(-1)) >= 0).view(1, 1, G)
                else:
                    ex = F.linear(xf, w, b) >= 0
        elif m.keeps[module] is not None:
            ex = m.keeps[module].expand(B, T, G)
        else:
            return None
        if not ctx.all_valid:
            ex = ex & ctx.valid[:, :, None]
        self.stats.add(m.index, module, ex, ctx.n_valid)
        return ex

    def _layer(self, i: int, x: torch.Tensor, ctx: _Step, cache: KVCache) -> torch.Tensor:
        m, p, be = self.meta[i], self.layers[i], self.backend
        B, T, D = x.shape
        M = B * T
        H, Hkv, d = m.num_heads, m.num_kv_heads, m.head_dim
        # --- attention: router on the residual stream entering the layer
        ex = self._decide(m, "attention", x, ctx)
        mflat = None if ex is None else ex.reshape(M, -1)
        fast = self.native_prefill_ops and M >= cpu_prefill.MIN_TOKENS
        h = self._norm(x, m.ln_attn, fast).reshape(M, D)
        q, k, v = be.attn_in(p, h, mflat)
        q, k, v = q.reshape(B, T, H, d), k.reshape(B, T, Hkv, d), v.reshape(B, T, Hkv, d)
        if m.q_norm is not None:  # Qwen3, Gemma 3: per-head RMSNorm before RoPE
            q, k = self._norm(q, m.q_norm, fast), self._norm(k, m.k_norm, fast)
        cos, sin = ctx.ropes[m.rope]
        q, k = self._rope(q, cos, sin, fast), self._rope(k, cos, sin, fast)
        cache.write(i, k, v, ctx.start)  # every token, whatever its routing: later tokens read it
        head_mask = None if ex is None else ex.repeat_interleave(m.attn_group_size, dim=-1)  # [B, T, H]
        scale = m.attn_scale
        if T == 1:
            o = be.attention_decode(
                q[:, 0], cache.k[i], cache.v[i], None if head_mask is None else head_mask[:, 0],
                ctx.key_valid, scale=scale, window=m.window,
            )  # fmt: skip
        else:
            kk, vv = cache.view(i, ctx.start + T)
            o = be.attention_prefill(
                q, kk, vv, head_mask, key_valid=ctx.key_valid, q_offset=ctx.start, scale=scale, window=m.window
            )
        y = be.attn_out(p, o.reshape(M, H * d), mflat).view(B, T, D)
        x = self._residual_add(m, "attention", x, y, ex, h, m.ln_attn_out)
        # --- FFN: router on the residual stream after the attention add
        ex = self._decide(m, "ffn", x, ctx)
        h = self._norm(x, m.ln_ffn, fast).reshape(M, D)
        y = be.mlp(p, h, None if ex is None else ex.reshape(M, -1)).view(B, T, D)
        return self._residual_add(m, "ffn", x, y, ex, h, m.ln_ffn_out)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, fast: bool) -> torch.Tensor:
        """``rms_norm(x, weight)``, natively for a bf16 prefill step on the cpu backend (``fast``)."""
        out = cpu_prefill.rms_norm(x, weight, self.eps) if fast else None
        return rms_norm(x, weight, self.eps) if out is None else out

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fast: bool) -> torch.Tensor:
        """``apply_rope(x, cos, sin)``, natively and in place for a bf16 prefill step (``fast``)."""
        out = cpu_prefill.rope_(x, cos, sin) if fast else None
        return apply_rope(x, cos, sin) if out is None else out

    def _residual_add(self, m: LayerMeta, module: str, x: torch.Tensor, y: torch.Tensor,
                      execute: torch.Tensor | None, h: torch.Tensor, out_norm: torch.Tensor | None) -> torch.Tensor:
        """``x [B, T, D]`` plus block output ``y [B, T, D]`` and the stand-ins of the skipped groups
        (``execute [B, T, G]`` or None, ``h [B * T, D]`` the block's normed input).

        With an output norm (``out_norm [D]``, Gemma 3's sandwich norms, as ``routing/layer.py``'s
        ``sublayer_output``): ``x + norm(y + stand-ins)``, and exactly ``x`` for a token that
        executes none of the block's groups."""
        if out_norm is None:
            if self.native_prefill_ops and h.shape[0] >= cpu_prefill.MIN_TOKENS and m.standin_maps[module] is None:
                out = cpu_prefill.residual(x, y, execute, m.standins[module])
                if out is not None:
                    return out
            return _add_standin(m, module, x + y, execute, h, self.counter)
        y = rms_norm(_add_standin(m, module, y, execute, h, self.counter), out_norm, self.eps)
        if execute is not None:
            y = y * execute.any(dim=-1, keepdim=True).to(y.dtype)
        return x + y

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, valid: torch.Tensor | None, cache: KVCache, *,
             logits: str = "last") -> torch.Tensor:
        """Run a block of tokens through the model and append them to ``cache``.

        Args:
            input_ids: ``[B, T]`` int64 (T = 1 is a decode step).
            valid: ``[B, T]`` bool, False for padding (left or right); None = all real.
            cache: from ``new_cache``; each row's positions continue from the real tokens
                it holds.
            logits: ``last`` -> ``[B, V]`` at each row's last real token of the block, ``all`` ->
                ``[B, T, V]``, ``none`` -> None.

        Returns:
            fp32 logits.

        Raises:
            DataError: a token id outside the vocabulary (an embedding lookup would
                read out of bounds).
        """
        from wide_cli.models.loader import check_token_ids

        B, T = input_ids.shape
        if T == 1 and logits != "all":
            native = self._native_for(cache)
            if native is not None:
                tokens = input_ids[:, 0].tolist()
                if not all(0 <= t < self.vocab_size for t in tokens):
                    check_token_ids(input_ids, self.vocab_size)  # raises the same DataError as below
                out = native.step(tokens, cache, valid)
                return None if logits == "none" else out
        input_ids = input_ids.to(self.device)
        check_token_ids(input_ids, self.vocab_size)
        valid = torch.ones(B, T, dtype=torch.bool, device=self.device) if valid is None else valid.to(self.device).bool()
        start, positions = cache.append_slots(valid)
        ropes = [rope_tables_for(positions, inv, sc, self.dtype) if r in self._ropes_used else None
                 for r, (inv, sc) in enumerate(self.ropes)]
        n_valid = valid.sum()
        ctx = _Step(
            valid=valid, all_valid=bool(n_valid == B * T), n_valid=n_valid, start=start, ropes=ropes,
            key_valid=cache.key_valid[:, : start + T],
        )  # fmt: skip
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for i in range(self.num_layers):
            x = self._layer(i, x, ctx, cache)
        if logits == "none":
            return None
        if logits == "last":
            ar = torch.arange(T, device=self.device)
            last = torch.where(valid, ar, -1).max(dim=1).values
            last = torch.where(last < 0, T - 1, last)
            x = x[torch.arange(B, device=self.device), last][:, None]  # [B, 1, D]
        x = rms_norm(x, self.final_norm, self.eps)
        if self.head is not None:
            out = self.backend.head(self.head, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1).float()
        else:
            self.counter.macs += x.shape[0] * x.shape[1] * self.lm_head.numel()
            out = F.linear(x, self.lm_head).float()
        return out[:, 0] if logits == "last" else out

    def _native_for(self, cache: KVCache):
        """The native decode step (``runtime/cpu_native.py``) when it can run this call: the cpu
        backend, no byte tracing, a cache of at most ``cpu_native.MAX_BATCH`` rows; else None."""
        if self.counter.trace is not None or not self.native_decode:
            return None
        nd = self._native
        if nd is None:
            from wide_cli.runtime import cpu_native

            lib = cpu_native.library()
            why = cpu_native.NativeDecoder.ineligible(self) if lib is not None else cpu_native.unavailable_reason()
            if why is not None:
                self._native = False
                return None
            nd = self._native = cpu_native.NativeDecoder(self, lib)
        elif nd is False:
            return None
        return nd if nd.usable(cache) else None

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, cache: KVCache, *,
                chunk: int | None = None) -> torch.Tensor:
        """``step`` over a prompt in chunks of ``chunk`` tokens; returns ``[B, V]`` logits at each
        row's last real token (a row whose last real token lies in an earlier chunk keeps that
        chunk's logits: right padding)."""
        T = input_ids.shape[1]
        if chunk is None or chunk >= T:
            return self.step(input_ids, valid, cache)
        if chunk < 1:
            raise ValueError(f"prefill chunk {chunk} must be >= 1")
        if valid is None:
            valid = torch.ones(input_ids.shape, dtype=torch.bool)
        logits = None
        for c0 in range(0, T, chunk):
            v = valid[:, c0 : c0 + chunk].to(self.device)
            new = self.step(input_ids[:, c0 : c0 + chunk], v, cache)
            logits = new if logits is None else torch.where(v.any(dim=1)[:, None], new, logits)
        return logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One full pass with a fresh cache: ``[B, T]`` -> logits ``[B, T, V]`` fp32."""
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        return self.step(input_ids, attention_mask, cache, logits="all")

    # ------------------------------------------------------------------------------------------
    # generation

    def batch(self, prompts: list[list[int]], padding_side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
        """Pad token-id lists into ``input_ids [B, T]`` and ``valid [B, T]`` (pad = pad/EOS id)."""
        pad = generation.pad_token_id(self.tokenizer, self.eos_token_ids)
        return generation.pad_batch(prompts, pad, padding_side)

    def generate(self, prompts, *, max_new_tokens: int = 64, sampling=None, stop: tuple[str, ...] = (),
                 ignore_eos: bool = False, padding_side: str = "left", on_text=None,
                 prefill_chunk: int | None = 2048) -> GenerationResult:
        """Generate continuations of a batch of prompts of any lengths (``generation.generate``
        documents the arguments)."""
        return generation.generate(self, prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                   ignore_eos=ignore_eos, padding_side=padding_side, on_text=on_text,
                                   prefill_chunk=prefill_chunk)  # fmt: skip


def _add_standin(m, module: str, x: torch.Tensor, execute: torch.Tensor | None, h: torch.Tensor,
                 counter: Counter) -> torch.Tensor:
    """``x [B, T, D]`` plus the stand-ins of ``module``'s skipped groups (``routing.router.apply_standin``,
    the routed HF layer's own function: fp32 products), reading the module's normed input ``h
    [B * T, D]`` for low-rank stand-ins; ``x`` untouched when the module has no stand-ins or ran dense.
    Low-rank maps run for every group and token and are masked afterwards, so ``counter`` gets
    their multiply-adds and fp32 bytes in full."""
    standin = m.standins[module]
    if standin is None or execute is None:
        return x
    maps = m.standin_maps[module]
    if maps is None:
        return apply_standin(x, execute, standin)
    counter.macs += 2 * h.shape[0] * maps[0].numel()
    counter.weight_bytes += 2 * maps[0].numel() * maps[0].element_size()
    return apply_standin(x, execute, standin, h.view(x.shape), *maps)
