"""Routed model == dense when every group executes; == a hand-masked reference otherwise."""

import pytest
import torch

from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers

CASES = [
    ("llama", {}, 2, 32),
    ("llama", {"tie_word_embeddings": True}, 1, 64),
    ("mistral", {}, 2, 32),
    ("qwen2", {}, 2, 32),  # q/k/v biases (a skipped head adds no bias)
    ("qwen3", {"head_dim": 32}, 2, 32),  # per-head q_norm / k_norm, q width != hidden size
    # sandwich norms, MQA, a sliding window of 8 under 9-11 tokens, GELU-tanh, scaled embeddings
    ("gemma3", {}, 2, 32),
]


def _masked_reference(dense, ids, head_masks, chan_masks):
    """Independent reference: zero head outputs before o_proj and channels before down_proj
    with forward pre-hooks on a dense copy (no routing code involved).

    head_masks[i]: [B, T, H] bool; chan_masks[i]: [B, T, F] bool.
    """
    hooks = []
    for i, layer in enumerate(dense.model.layers):
        hm, cm = head_masks[i], chan_masks[i]
        d = layer.self_attn.head_dim

        def pre_o(mod, args, hm=hm, d=d):
            x = args[0]
            return (x * hm.repeat_interleave(d, dim=-1).to(x.dtype),)

        def pre_down(mod, args, cm=cm):
            return (args[0] * cm.to(args[0].dtype),)

        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(pre_o))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(pre_down))
    try:
        with torch.no_grad():
            return dense(ids).logits
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("kind,over,ags,fgs", CASES)
def test_all_execute_equals_dense(kind, over, ags, fgs):
    model = tiny_model(kind, **over)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    state = attach_routers(model, RoutingConfig(attn_group_size=ags, ffn_group_size=fgs))
    L = model.config.num_hidden_layers
    for i in range(L):
        state.forced[(i, "attention")] = torch.ones(state.layout.attn_groups, dtype=torch.bool)
        state.forced[(i, "ffn")] = torch.ones(state.layout.ffn_groups, dtype=torch.bool)
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    state.forced.clear()
    state.set_mode("dense")
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,over,ags,fgs", CASES)
def test_forced_masks_equal_hand_masked_reference(kind, over, ags, fgs):
    dense = tiny_model(kind, **over)
    model = tiny_model(kind, **over)
    B, T = 2, 9
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(2))
    state = attach_routers(model, RoutingConfig(attn_group_size=ags, ffn_group_size=fgs))
    g = torch.Generator().manual_seed(3)
    H, F = model.config.num_attention_heads, model.config.intermediate_size
    head_masks, chan_masks = [], []
    for i in range(model.config.num_hidden_layers):
        a = torch.rand(B, T, state.layout.attn_groups, generator=g) < 0.5
        f = torch.rand(B, T, state.layout.ffn_groups, generator=g) < 0.5
        state.forced[(i, "attention")] = a
        state.forced[(i, "ffn")] = f
        head_masks.append(a.repeat_interleave(ags, dim=-1))
        chan_masks.append(f.repeat_interleave(fgs, dim=-1))
        assert head_masks[-1].shape == (B, T, H) and chan_masks[-1].shape == (B, T, F)
    with torch.no_grad():
        out = model(ids).logits
    ref = _masked_reference(dense, ids, head_masks, chan_masks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # And masking changes the output (the test could fail).
    with torch.no_grad():
        assert (dense(ids).logits - out).abs().max() > 1e-3


def test_kv_projections_and_qwen3_norms_keep_their_shapes():
    model = tiny_model("qwen3", head_dim=32)
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    attn = model.model.layers[0].self_attn
    assert tuple(attn.k_proj.weight.shape) == (2 * 32, 64)
    assert tuple(attn.v_proj.weight.shape) == (2 * 32, 64)
    assert tuple(attn.q_norm.weight.shape) == (32,)
    assert tuple(attn.k_norm.weight.shape) == (32,)


def test_qwen3_head_routing_is_applied():
    """Attention routing really acts on a Qwen3 model (non-zero measured head sparsity)."""
    model = tiny_model("qwen3", head_dim=32)
    state = attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    counter = state.start_counting()
    with torch.no_grad():
        model(ids)
    s = counter.summary()
    assert s["attention"] is not None and 0.0 < s["attention"] < 1.0


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_generate_with_kv_cache_matches_full_forward(kind):
    """Greedy generate (KV cache) of a routed model equals step-by-step full forwards (for
    Gemma 3 past its sliding window of 8 tokens)."""
    model = tiny_model(kind)
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


def test_lm_loss_with_labels():
    model = tiny_model("llama")
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    ids = torch.randint(0, 128, (2, 8))
    out = model(input_ids=ids, labels=ids)
    logits = out.logits[:, :-1].reshape(-1, 128)
    ref = torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)


def _gemma3_block_reference(layer, h, execute, standin):
    """What a sandwich-norm block adds to the residual stream, written out: the post-norm of the
    executed groups' output plus the skipped groups' stand-ins, zero where no group executes."""
    out = h + (1.0 - execute.float()) @ standin
    normed = layer.post_attention_layernorm(out)
    return torch.where(execute.any(-1, keepdim=True), normed, torch.zeros_like(normed))


def test_sandwich_norm_block_skipped_entirely_adds_nothing():
    """Gemma 3: a token that skips every group of a block adds exactly zero (not the post-norm of
    its stand-ins, which RMSNorm would scale up to a full block's size); a partly skipped block is
    the post-norm of executed output plus stand-ins."""
    from wide_cli.routing.layer import sublayer_output
    from wide_cli.routing.router import apply_standin

    layer = tiny_model("gemma3").model.layers[0]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 3, 64, generator=g)
    standin = torch.randn(2, 64, generator=g)
    execute = torch.tensor([[[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]])
    with torch.no_grad():
        got = sublayer_output(layer.post_attention_layernorm, apply_standin(h, execute, standin), execute)
        ref = _gemma3_block_reference(layer, h, execute, standin)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert torch.equal(got[0, 2], torch.zeros(64))
    assert got[0, 1].abs().max() > 0.1


def test_sandwich_norm_skip_keeps_router_gradients():
    """The "any group executed" factor passes the decisions' straight-through gradients."""
    from wide_cli.routing.layer import sublayer_output

    layer = tiny_model("gemma3").model.layers[0]
    h = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(1))
    execute = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]], requires_grad=True)
    sublayer_output(layer.post_attention_layernorm, h, execute).sum().backward()
    assert execute.grad is not None and execute.grad.abs().sum() > 0
