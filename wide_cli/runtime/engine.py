"""The runtime: routed prefill and decode over its own KV cache, and batched generation.

``Runtime`` reads a model into backend-neutral ``ModelWeights`` (``runtime/checkpoint.py`` rules:
Hugging Face tensor names, per-layer sizes from the tensors), hands each layer to a backend, and
runs the decoder itself: embeddings, RMSNorms, routers, RoPE, cache, residual adds and LM head in
PyTorch; the routed work through the backend. No Hugging Face modeling code runs at inference.

Routing (DESIGN.md §1, ``routing/layer.py``): the attention router reads the residual stream
entering the layer, the FFN router the residual stream after the attention add; a group executes
iff logit0 >= logit1. K/V are computed and cached for every token (B06). Padding tokens skip every
group (their outputs are never visible) and are not counted in the measured sparsity (B09).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from wide_cli.errors import ConfigError
from wide_cli.runtime.backend import Backend, Counter, LayerWeights, ModelWeights, get_backend
from wide_cli.runtime.checkpoint import weights_from_export, weights_from_model, weights_from_tensors
from wide_cli.runtime.kv_cache import KVCache
from wide_cli.runtime.sampling import Sampler, SamplingConfig, TextTracker

MODULES = ("attention", "ffn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``LlamaRMSNorm``: statistics in fp32, scale in the input dtype. In fp32 the
    weight is folded into the per-row scale first (fewer full-width ops on the decode path; same
    math, ~1e-7 apart). ``F.rms_norm`` was slower on CPU with 2 threads (20 vs 13 us per row)."""
    if x.dtype == torch.float32:
        return x * (torch.rsqrt(torch.mean(x * x, -1, keepdim=True) + eps) * weight)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
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


class SparsityStats:
    """Measured sparsity of the runtime's own decisions: skipped / total (valid token, group)
    decisions per layer and module, accumulated as device tensors (no sync per layer)."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.skipped = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)
        self.decisions = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)

        self._pending: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []

    def reset(self) -> None:
        self.skipped.zero_()
        self.decisions.zero_()
        self._pending.clear()

    def add(self, layer: int, module: str, execute: torch.Tensor, n_valid: torch.Tensor) -> None:
        """Record ``execute [B, T, G]`` bool (already False on padding) of a block with ``n_valid``
        (0-d tensor) real tokens. Counted lazily, in batches (a decode step stays cheap)."""
        self._pending.append((layer, MODULES.index(module), execute, n_valid))
        if len(self._pending) >= 4096:
            self.flush()

    def flush(self) -> None:
        """Fold the pending records into the counts, one stacked reduction per mask shape."""
        by_shape: dict = {}
        for rec in self._pending:
            by_shape.setdefault(tuple(rec[2].shape), []).append(rec)
        self._pending.clear()
        for shape, recs in by_shape.items():
            idx = torch.tensor([r[0] * 2 + r[1] for r in recs], device=self.skipped.device)
            executed = torch.stack([r[2] for r in recs]).flatten(1).sum(1).double()  # [n]
            decided = torch.stack([r[3] for r in recs]).double() * shape[-1]  # [n]
            self.decisions.view(-1).index_add_(0, idx, decided)
            self.skipped.view(-1).index_add_(0, idx, decided - executed)

    def summary(self) -> dict:
        """``{attention, ffn, total, per_layer}`` like ``routing.SparsityCounter.summary``: per
        module the mean over layers of the per-layer skip fraction; None where not routed."""
        from wide_cli.routing.state import SparsityCounter

        self.flush()
        c = SparsityCounter(self.num_layers)
        sk, de = self.skipped.tolist(), self.decisions.tolist()
        for m, name in enumerate(MODULES):
            c.skipped[name] = [row[m] for row in sk]
            c.decisions[name] = [row[m] for row in de]
        return c.summary()


@dataclass
class _Step:
    """Per-step values shared by every layer.

    valid ``[B, T]`` bool (all_valid: no padding in the block), n_valid (0-d), start (first slot
    of the block), cos / sin ``[B, T, 1, d]`` RoPE tables, key_valid ``[B, start + T]`` bool.
    """

    valid: torch.Tensor
    all_valid: bool
    n_valid: torch.Tensor
    start: int
    cos: torch.Tensor
    sin: torch.Tensor
    key_valid: torch.Tensor


@dataclass
class _LayerMeta:
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
    routers: dict  # module -> (w [G, D], b [G]) fp32 from _fold_router, or None
    standins: dict  # module -> [G, D] fp32 stand-in of each skipped group, or None
    keeps: dict  # module -> [G] bool, or None
    window: int | None


@dataclass
class GenerationResult:
    """Outcome of ``Runtime.generate``.

    Attributes:
        texts: generated text per prompt (stop string excluded).
        tokens: generated token ids per prompt (EOS / stop-string tokens included).
        finish_reasons: per prompt ``eos``, ``stop`` or ``length``.
        prompt_tokens: real (non-padding) prompt tokens, all prompts.
        new_tokens: generated tokens counted until each row finished.
        prefill_s, decode_s: wall time of the prompt forward and of the decode steps, seconds.
        sparsity: measured sparsity of this run (``SparsityStats.summary``).
    """

    texts: list[str]
    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    sparsity: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decode time (the first token comes from the prefill)."""
        steps = max(self.new_tokens - len(self.texts), 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "texts": self.texts,
            "tokens": self.tokens,
            "finish_reasons": self.finish_reasons,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "sparsity": self.sparsity,
        }


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
        from wide_cli.runtime.quant import COMPUTE_DTYPE, check_format

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
        elif fmt == "int8":
            # Backends without int8 kernels run the same int8 weights dequantized (the oracle of
            # the cpu backend's int8 kernels).
            weights = fake_quantize(weights)
        self.tokenizer = tokenizer
        self.routing = routing
        self.forced: dict[tuple[int, str], torch.Tensor] = {}
        self.eps = weights.rms_eps
        self.eos_token_ids = tuple(weights.eos_token_ids)
        self.vocab_size = weights.embed.shape[0]
        self.hidden_size = weights.embed.shape[1]
        embed = weights.embed
        if fmt == "int8":  # the embedding rows an int8 export stores (per-row int8), for lookups too
            from wide_cli.runtime.quant import dequantize_int8, quantize_int8

            embed = dequantize_int8(*quantize_int8(embed))
        self.embed = embed.to(dev, self.dtype)
        self.counter = getattr(self.backend, "counter", None) or Counter()
        # The LM head in the backend's weight format when it has one (int8 on cpu), else dense.
        self.head = None
        self.max_positions = weights.max_positions
        self.lm_head = self.embed if weights.tied else weights.lm_head.to(dev, self.dtype)
        if hasattr(self.backend, "prepare_head"):
            # float formats keep sharing the tied embedding (the Proj holds the same tensor)
            if fmt == "int8":  # quantized from the stored float values, not from their bf16 copy
                self.head = self.backend.prepare_head(embed if weights.tied else weights.lm_head, self.dtype)
                self.lm_head = None
            else:
                self.head = self.backend.prepare_head(self.lm_head, self.dtype)
        self.final_norm = weights.final_norm.to(dev, self.dtype)
        self.inv_freq = weights.inv_freq.to(dev, torch.float32)
        self.rope_scale = float(weights.rope_scale)
        self.meta = [self._meta(lw) for lw in weights.layers]
        self.layers = [self.backend.prepare_layer(lw, self.dtype) for lw in weights.layers]
        self.stats = SparsityStats(len(self.layers), dev)
        self.layer_shapes = [(lw.num_heads, lw.num_kv_heads, lw.head_dim, lw.intermediate_size) for lw in weights.layers]

    # ------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_export(cls, path, *, backend: Backend | str = "cpu", dtype=None, routing: bool = True,
                    verify: bool = True, allow_extra: bool = False, weight_format: str | None = None) -> Runtime:
        """Load an export directory (manifest verified first, strict tensor names; B14, B30).

        ``weight_format`` (``fp32``, ``bf16``, ``int8``) defaults to the export's stored format
        (``fp32`` for a float export, unless ``dtype`` is bf16).

        Raises:
            CheckpointError: missing/corrupt files, missing or unexpected tensors (listed),
                shapes that do not fit together, an untied model without ``lm_head.weight``,
                a quantized weight without its scale tensor (or with a mismatched one).
            ConfigError: an unknown weight format, int8 for widths the kernel cannot take.
        """
        from wide_cli.models.loader import load_tokenizer

        weights = weights_from_export(Path(path), verify=verify, allow_extra=allow_extra)
        tok = load_tokenizer(path)
        return cls(weights, backend, dtype=dtype, tokenizer=tok, routing=routing, weight_format=weight_format)

    @classmethod
    def from_target(cls, target, *, backend: Backend | str = "cpu", dtype=None, routing: bool = True,
                    weight_format: str | None = None) -> Runtime:
        """An export directory (``from_export``), or any model spec ``load_model`` accepts (alias
        such as ``smollm2-135m``, local Hugging Face directory, ``.gguf``), run dense.

        Raises:
            CheckpointError: a broken export. ModelSourceError: an unknown or unsupported model.
        """
        from wide_cli.export import is_export

        if is_export(target):
            return cls.from_export(target, backend=backend, dtype=dtype, routing=routing, weight_format=weight_format)
        from wide_cli.models.loader import load_model

        lm = load_model(str(target), dtype=torch.float32)
        if weight_format is None:
            dtype = dtype or torch.float32
        return cls.from_model(lm.model, lm.tokenizer, backend=backend, dtype=dtype, routing=False,
                              weight_format=weight_format)

    @classmethod
    def from_model(cls, model, tokenizer=None, *, backend: Backend | str = "cpu", dtype=None,
                   routing: bool | None = None, weight_format: str | None = None) -> Runtime:
        """Read an in-memory Hugging Face model (routed by ``attach_routers`` or plain).

        ``routing=None`` follows the model: routed unless it has no routers or its routing mode
        is ``dense``. The dtype defaults to the model's.
        """
        weights, routed = weights_from_model(model)
        if dtype is None and weight_format is None:
            dtype = next(model.parameters()).dtype
        return cls(weights, backend, dtype=dtype, tokenizer=tokenizer, routing=routed if routing is None else routing,
                   weight_format=weight_format)

    @classmethod
    def from_tensors(cls, config, tensors: dict, *, routers: dict | None = None, wide_config: dict | None = None,
                     backend: Backend | str = "cpu", dtype=None, tokenizer=None, routing: bool = True,
                     allow_extra: bool = False) -> Runtime:
        """Build from HF-named ``tensors`` and a HF ``config`` (e.g. a physically pruned layer, B05)."""
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

    def _meta(self, lw: LayerWeights) -> _LayerMeta:
        dev = self.device

        def r(rw):
            if rw is None:
                return None
            return tuple(t.to(dev, torch.float32).contiguous() for t in _fold_router(rw))

        def k(keep):
            return None if keep is None else keep.to(dev, torch.bool)

        return _LayerMeta(
            index=lw.index, num_heads=lw.num_heads, num_kv_heads=lw.num_kv_heads, head_dim=lw.head_dim,
            attn_group_size=lw.attn_group_size, ffn_group_size=lw.ffn_group_size,
            attn_groups=lw.attn_groups, ffn_groups=lw.ffn_groups,
            ln_attn=lw.ln_attn.to(dev, self.dtype), ln_ffn=lw.ln_ffn.to(dev, self.dtype),
            q_norm=None if lw.q_norm is None else lw.q_norm.to(dev, self.dtype),
            k_norm=None if lw.k_norm is None else lw.k_norm.to(dev, self.dtype),
            routers={"attention": r(lw.router_attention), "ffn": r(lw.router_ffn)},
            standins={mod: None if rw is None or rw.standin is None else rw.standin.to(dev, torch.float32)
                      for mod, rw in (("attention", lw.router_attention), ("ffn", lw.router_ffn))},
            keeps={"attention": k(lw.keep_attention), "ffn": k(lw.keep_ffn)},
            window=lw.window,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------
    # the forward pass

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for ``batch`` rows and ``max_len`` slots, one buffer pair per layer with
        that layer's KV-head count (B06)."""
        return KVCache(
            batch, max_len, [m.num_kv_heads for m in self.meta], [m.head_dim for m in self.meta],
            dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def _decide(self, m: _LayerMeta, module: str, x: torch.Tensor, ctx: _Step):
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
        h = rms_norm(x, m.ln_attn, self.eps).reshape(M, D)
        q, k, v = be.attn_in(p, h, mflat)
        q, k, v = q.reshape(B, T, H, d), k.reshape(B, T, Hkv, d), v.reshape(B, T, Hkv, d)
        if m.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE (B16)
            q, k = rms_norm(q, m.q_norm, self.eps), rms_norm(k, m.k_norm, self.eps)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        cache.write(i, k, v, ctx.start)  # every token, whatever its routing (B06)
        head_mask = None if ex is None else ex.repeat_interleave(m.attn_group_size, dim=-1)  # [B, T, H]
        scale = d**-0.5
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
        x = x + be.attn_out(p, o.reshape(M, H * d), mflat).view(B, T, D)
        x = _add_standin(x, ex, m.standins["attention"])
        # --- FFN: router on the residual stream after the attention add
        ex = self._decide(m, "ffn", x, ctx)
        h = rms_norm(x, m.ln_ffn, self.eps).reshape(M, D)
        x = x + be.mlp(p, h, None if ex is None else ex.reshape(M, -1)).view(B, T, D)
        return _add_standin(x, ex, m.standins["ffn"])

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, valid: torch.Tensor | None, cache: KVCache, *,
             logits: str = "last") -> torch.Tensor:
        """Run a block of tokens through the model and append them to ``cache``.

        Args:
            input_ids: ``[B, T]`` int64 (T = 1 is a decode step).
            valid: ``[B, T]`` bool, False for padding (left or right); None = all real.
            cache: from ``new_cache``; positions continue from what it holds (B09).
            logits: ``last`` -> ``[B, V]`` at each row's last real token of the block, ``all`` ->
                ``[B, T, V]``, ``none`` -> None.

        Returns:
            fp32 logits.

        Raises:
            DataError: a token id outside the vocabulary (B23).
        """
        from wide_cli.models.loader import check_token_ids

        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        check_token_ids(input_ids, self.vocab_size)
        valid = torch.ones(B, T, dtype=torch.bool, device=self.device) if valid is None else valid.to(self.device).bool()
        start, positions = cache.append_slots(valid)
        cos, sin = rope_tables_for(positions, self.inv_freq, self.rope_scale, self.dtype)
        n_valid = valid.sum()
        ctx = _Step(
            valid=valid, all_valid=bool(n_valid == B * T), n_valid=n_valid, start=start, cos=cos, sin=sin,
            key_valid=cache.key_valid[:, : start + T],
        )  # fmt: skip
        x = F.embedding(input_ids, self.embed)
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

    def _encode(self, prompts) -> list[list[int]]:
        if all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids or a tokenizer")
            return [list(self.tokenizer(p).input_ids) for p in prompts]
        return [list(map(int, p)) for p in prompts]

    def _pad_id(self) -> int:
        tok = self.tokenizer
        for cand in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None), *self.eos_token_ids):
            if cand is not None:
                return int(cand)
        return 0

    def batch(self, prompts: list[list[int]], padding_side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
        """Pad token-id lists into ``input_ids [B, T]`` and ``valid [B, T]`` (pad = pad/EOS id)."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side {padding_side!r} is not 'left' or 'right'")
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), self._pad_id(), dtype=torch.long)
        valid = torch.zeros(len(prompts), T, dtype=torch.bool)
        for b, p in enumerate(prompts):
            sl = slice(T - len(p), T) if padding_side == "left" else slice(0, len(p))
            ids[b, sl] = torch.tensor(p, dtype=torch.long)
            valid[b, sl] = True
        return ids, valid

    def generate(
        self,
        prompts,
        *,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        padding_side: str = "left",
        on_text: Callable[[int, str], None] | None = None,
        prefill_chunk: int | None = 2048,
    ) -> GenerationResult:
        """Generate continuations of a batch of prompts of any lengths.

        Args:
            prompts: strings (needs the tokenizer) or lists of token ids.
            max_new_tokens: upper bound of generated tokens per prompt.
            sampling: greedy by default.
            stop: stop strings; the text is cut before the first one (needs the tokenizer).
            ignore_eos: keep generating through EOS (benchmarks).
            padding_side: ``left`` or ``right``; results do not depend on it (B09).
            on_text: called as ``on_text(row, text_delta)`` while tokens stream in.
            prefill_chunk: prompt tokens per forward (bounds activation memory of long prompts;
                None = the whole prompt at once). Results do not depend on it.
        """
        from wide_cli.models.arch import check_context

        sampling = sampling or SamplingConfig()
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {max_new_tokens} must be >= 1", "ask for at least one new token")
        if not prompts:
            raise ValueError("no prompts")
        ids = self._encode(prompts)
        if any(len(p) == 0 for p in ids):
            raise ValueError("empty prompt (no tokens)")
        longest = max(len(p) for p in ids)
        check_context(longest, self.max_positions, f"a prompt of {longest} tokens",
                      "shorten the prompt (or use a model with a longer context)")
        check_context(longest + max_new_tokens, self.max_positions,
                      f"a prompt of {longest} tokens + --max-new-tokens {max_new_tokens} = {longest + max_new_tokens} tokens",
                      f"lower --max-new-tokens to {(self.max_positions or 0) - longest} or shorten the prompt")
        input_ids, valid = self.batch(ids, padding_side)
        B, T = input_ids.shape
        cache = self.new_cache(B, T + max_new_tokens)
        sampler = Sampler(sampling, self.device)
        trackers = [TextTracker(self.tokenizer, tuple(stop)) if self.tokenizer is not None else None for _ in range(B)]
        eos = set() if ignore_eos else set(self.eos_token_ids)
        out_tokens: list[list[int]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        finished = torch.zeros(B, dtype=torch.bool)
        self.stats.reset()

        t0 = time.perf_counter()
        logits = self.prefill(input_ids, valid, cache, chunk=prefill_chunk)
        t_prefill = time.perf_counter() - t0
        pad = self._pad_id()
        t1 = time.perf_counter()
        for n in range(max_new_tokens):
            nxt = sampler(logits).cpu()
            for b in range(B):
                if finished[b]:
                    continue
                tok = int(nxt[b])
                out_tokens[b].append(tok)
                if trackers[b] is not None:
                    delta = trackers[b].push(tok) if tok not in eos else ""
                    if delta and on_text is not None:
                        on_text(b, delta)
                if tok in eos:
                    finished[b], reasons[b] = True, "eos"
                elif trackers[b] is not None and trackers[b].stopped:
                    finished[b], reasons[b] = True, "stop"
            if bool(finished.all()) or n == max_new_tokens - 1:
                break
            step_ids = torch.where(finished, pad, nxt)[:, None]
            logits = self.step(step_ids, ~finished[:, None], cache)  # finished rows ride along as padding
        t_decode = time.perf_counter() - t1
        texts = []
        for b in range(B):
            tr = trackers[b]
            if tr is not None:
                tail = tr.flush()
                if tail and on_text is not None:
                    on_text(b, tail)
                texts.append(tr.text)
            else:
                texts.append("")
        return GenerationResult(
            texts=texts, tokens=out_tokens, finish_reasons=reasons, prompt_tokens=int(valid.sum()),
            new_tokens=sum(len(t) for t in out_tokens), prefill_s=t_prefill, decode_s=t_decode,
            sparsity=self.stats.summary(),
        )  # fmt: skip


def _add_standin(x: torch.Tensor, execute: torch.Tensor | None, standin: torch.Tensor | None) -> torch.Tensor:
    """``x [B, T, D] + (~execute) @ standin`` (fp32 product, like the routed HF layer), or ``x``
    untouched when the module has no stand-ins or ran dense."""
    if standin is None or execute is None:
        return x
    return x + ((~execute).to(torch.float32) @ standin).to(x.dtype)


def fake_quantize(weights: ModelWeights) -> ModelWeights:
    """A copy of ``weights`` whose projections and LM head hold the values the int8 kernels use
    (``dequantize(quantize(w))`` with the cpu backend's grouping: per row for Q/K/V, gate/up and
    the LM head, per row and routed group for O and down; the embedding is handled by Runtime)."""
    import dataclasses

    from wide_cli.runtime.quant import dequantize_int8, quantize_int8

    def fq(w, gk=None):
        return dequantize_int8(*quantize_int8(w, gk))

    layers = []
    for lw in weights.layers:
        cols = lw.attn_group_size * lw.head_dim
        layers.append(dataclasses.replace(
            lw, wq=fq(lw.wq), wk=fq(lw.wk), wv=fq(lw.wv), wo=fq(lw.wo, cols), w_gate=fq(lw.w_gate),
            w_up=fq(lw.w_up), w_down=fq(lw.w_down, lw.ffn_group_size),
        ))  # fmt: skip
    return dataclasses.replace(weights, layers=layers, lm_head=fq(weights.lm_head), tied=False)


def _fold_router(rw) -> tuple[torch.Tensor, torch.Tensor]:
    """``Linear(D, r) -> Linear(r, 2G)`` with no activation, reduced to the decision function:
    ``w [G, D], b [G]`` with ``x @ w.T + b = logit0 - logit1`` (folded in float64, stored fp32).

    Same decisions as the two-layer router except at near-ties (|logit0 - logit1| at the level of
    fp32 rounding), where any change of summation order -- another BLAS, a GPU -- can flip them.
    """
    wc, bc, wr, br = (t.double() for t in (rw.wc, rw.bc, rw.wr, rw.br))
    wd, bd = wr[0::2] - wr[1::2], br[0::2] - br[1::2]  # [G, r], [G]
    return (wd @ wc).float(), (wd @ bc + bd).float()
