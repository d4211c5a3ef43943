"""The routed decoder layer: reference (masking) semantics of DESIGN.md §1.

Skipped query-head groups contribute zero before ``o_proj``; skipped FFN channel groups are zero
in ``act(gate) * up`` before ``down_proj``; with stand-ins (``RoutingConfig.standin``) each skipped
group's stand-in (a vector, plus a low-rank map of the module's normed input with ``lowrank:R``)
is added to the module output instead. K/V projections, the KV cache, norms and residual
adds stay dense. Submodules are called through their attributes, so PEFT-wrapped projections
(LoRA) see the same masking.

Sandwich-norm layers (Gemma 3: each block's output is RMS-normalised again before the residual
add) route the block before its output norm: the norm sees the executed groups plus the
stand-ins, so a partly skipped block is renormalised to the dense block's scale, and a token that
executes none of a block's groups adds nothing to the residual stream (``sublayer_output``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from wide_cli.routing.router import apply_standin, router_standin


def expand_groups(execute: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B, T, G]`` group decisions -> ``[B, T, G * group_size]`` per-unit decisions."""
    return execute.repeat_interleave(group_size, dim=-1)


def _sliding_window(attn) -> int | None:
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    if getattr(attn.config, "model_type", None) == "mistral":
        return getattr(attn.config, "sliding_window", None)
    return None


def routed_attention(
    attn,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache,
    head_execute: torch.Tensor | None,
    **kwargs,
) -> torch.Tensor:
    """Self-attention with per-token query-head masking.

    Args:
        attn: a Hugging Face Llama/Mistral/Qwen2/Qwen3/Gemma3 attention module.
        hidden_states: ``[B, T, D]`` normed input.
        position_embeddings: ``(cos, sin)`` each ``[B, T, d]``.
        attention_mask: the mask the decoder layer received (4-D or None).
        cache: HF ``Cache`` or None; K/V of every token are written (never thinned).
        head_execute: ``[B, T, H]`` (1 = execute; float for STE, or bool) or None for dense.

    Returns:
        ``[B, T, D]`` attention output after ``o_proj``.
    """
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(hidden_shape)
    k = attn.k_proj(hidden_states).view(hidden_shape)
    v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: per-head RMSNorm before RoPE
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, d], [B, H_kv, T, d]
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, eager_attention_forward
    )
    sw = _sliding_window(attn)
    extra = {"sliding_window": sw} if sw is not None else {}
    out, _ = interface(
        attn,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        **extra,
        **kwargs,
    )  # [B, T, H, d]
    if head_execute is not None:
        out = out * head_execute.to(out.dtype).unsqueeze(-1)
    out = out.reshape(*input_shape, -1).contiguous()
    return attn.o_proj(out)


def routed_mlp(mlp, hidden_states: torch.Tensor, channel_execute: torch.Tensor | None) -> torch.Tensor:
    """Gated MLP (SwiGLU; GELU-tanh gating for Gemma 3) with per-token channel masking.

    Args:
        mlp: HF MLP with ``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``.
        hidden_states: ``[B, T, D]`` normed input.
        channel_execute: ``[B, T, F]`` (1 = execute) or None for dense.
    Returns:
        ``[B, T, D]``.
    """
    h = mlp.act_fn(mlp.gate_proj(hidden_states)) * mlp.up_proj(hidden_states)
    if channel_execute is not None:
        h = h * channel_execute.to(h.dtype)
    return mlp.down_proj(h)


def routed_layer_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """Forward of a routed decoder layer (replaces the HF layer's forward; same signature).

    ``hidden_states``: ``[B, T, D]`` residual stream entering the layer. Returns ``[B, T, D]``.
    With ``state.grad_checkpointing`` in training, the layer runs under non-reentrant activation
    checkpointing (``checkpointed_call``).
    """
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    else:
        kwargs.pop("past_key_values", None)
    state = self._wide_state
    if state.grad_checkpointing and self.training and torch.is_grad_enabled():
        if cache is not None:  # the replay would write this step's K/V into the cache a second time
            raise RuntimeError("gradient checkpointing needs use_cache=False (a KV cache was passed)")
        return checkpointed_call(state, lambda h: _routed_layer_body(
            self, h, attention_mask, position_ids, None, position_embeddings, **kwargs), hidden_states)
    return _routed_layer_body(self, hidden_states, attention_mask, position_ids, cache, position_embeddings, **kwargs)


def checkpointed_call(state, fn: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
    """``fn(hidden_states)`` under ``torch.utils.checkpoint`` (non-reentrant): only the input is
    kept; the layer is recomputed during backward.

    The recomputation must take the same routing decisions as the forward: the Gumbel noise comes
    from ``state.generator`` (not the global RNG that ``preserve_rng_state`` restores), so its
    state is rewound to where this layer's forward started and put back afterwards, and the
    replay appends no sparsity records (the loss already used the forward's). Dropout (LoRA)
    draws from the global RNG, which checkpoint itself restores.
    """
    from torch.utils.checkpoint import checkpoint

    gen = state.generator
    before = gen.get_state() if gen is not None else None
    calls = [0]

    def run(h):
        calls[0] += 1
        if calls[0] == 1:
            return fn(h)
        after = gen.get_state() if gen is not None else None
        if gen is not None:
            gen.set_state(before)
        state.recomputing = True
        try:
            return fn(h)
        finally:
            state.recomputing = False
            if gen is not None:
                gen.set_state(after)

    return checkpoint(run, hidden_states, use_reentrant=False, preserve_rng_state=True)


def _routed_layer_body(self, hidden_states, attention_mask, position_ids, cache, position_embeddings, **kwargs):
    state = self._wide_state
    idx = self.self_attn.layer_idx

    residual = hidden_states
    attn_exec = state.decide(self, idx, "attention", residual)  # [B, T, G_a] or None
    head_exec = None if attn_exec is None else expand_groups(attn_exec, state.layout.attn_group_size)
    sandwich = hasattr(self, "pre_feedforward_layernorm")
    x = self.input_layernorm(hidden_states)
    h = routed_attention(
        self.self_attn, x, position_embeddings, attention_mask, cache, head_exec, position_ids=position_ids, **kwargs
    )
    if attn_exec is not None:
        st, st_in, st_out = router_standin(getattr(self, "router_attention", None))
        h = apply_standin(h, attn_exec, st, x, st_in, st_out)
    if sandwich:
        h = sublayer_output(self.post_attention_layernorm, h, attn_exec)
    hidden_states = residual + h

    residual = hidden_states
    ffn_exec = state.decide(self, idx, "ffn", residual)  # [B, T, G_f] or None
    chan_exec = None if ffn_exec is None else expand_groups(ffn_exec, state.layout.ffn_group_size)
    x = (self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm)(hidden_states)
    h = routed_mlp(self.mlp, x, chan_exec)
    if ffn_exec is not None:
        st, st_in, st_out = router_standin(getattr(self, "router_ffn", None))
        h = apply_standin(h, ffn_exec, st, x, st_in, st_out)
    if sandwich:
        h = sublayer_output(self.post_feedforward_layernorm, h, ffn_exec)
    return residual + h


def sublayer_output(norm, h: torch.Tensor, execute: torch.Tensor | None) -> torch.Tensor:
    """A sandwich-norm block's contribution to the residual stream (Gemma 3).

    Args:
        norm: the block's output RMSNorm (``post_attention_layernorm`` / ``post_feedforward_layernorm``).
        h: ``[B, T, D]`` the routed block output (executed groups plus stand-ins).
        execute: ``[B, T, G]`` the block's group decisions (1 = execute; float with STE gradients,
            or bool), or None for a dense block.
    Returns:
        ``[B, T, D]``: ``norm(h)``, and exactly zero for tokens that execute no group (a skipped
        block adds nothing; RMSNorm would otherwise scale the stand-ins up to a full block's size).
        ``1 - prod_g (1 - e_g)`` is 1 when any group runs and keeps the decisions' gradients.
    """
    out = norm(h)
    if execute is None:
        return out
    ran = 1.0 - torch.prod(1.0 - execute.to(torch.float32), dim=-1, keepdim=True)
    return out * ran.to(out.dtype)


_ROUTED_CLASSES: dict[type, type] = {}


def routed_layer_class(cls: type) -> type:
    """A subclass of the HF decoder-layer class ``cls`` whose forward routes (cached per class)."""
    if cls not in _ROUTED_CLASSES:
        _ROUTED_CLASSES[cls] = type(f"Routed{cls.__name__}", (cls,), {"forward": routed_layer_forward})
    return _ROUTED_CLASSES[cls]
