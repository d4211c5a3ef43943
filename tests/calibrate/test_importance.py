"""Importance matrix (mean squared input per channel of every quantized matrix): names, shapes,
hand-checked values, the tied head, routed models, bad input."""

from __future__ import annotations

import pytest
import torch

from wide_cli.calibrate.importance import collect_importance
from wide_cli.models.tiny import tiny_model


def _ids(n=5, t=12, seed=0):
    return torch.randint(5, 105, (n, t), generator=torch.Generator().manual_seed(seed))


def test_every_quantized_matrix_gets_one_value_per_input_channel():
    model = tiny_model("llama", seed=0)
    imp = collect_importance(model, _ids(), batch_size=2)
    sd = model.state_dict()
    want = {n for n, t in sd.items() if n.endswith("_proj.weight")} | {"lm_head.weight"}
    if model.config.tie_word_embeddings:
        want.add("model.embed_tokens.weight")
    assert set(imp) == want
    for n, v in imp.items():
        assert v.dtype == torch.float32 and v.shape == (sd[n].shape[1],), n
        assert bool(torch.isfinite(v).all()) and bool((v >= 0).all()) and float(v.sum()) > 0, n


def test_values_are_mean_squares_of_the_inputs_and_batching_does_not_change_them():
    model = tiny_model("llama", seed=0)
    ids = _ids()
    got = {}
    lyr = model.model.layers[1]
    hs = [lyr.mlp.down_proj.register_forward_pre_hook(lambda m, a: got.setdefault("down", []).append(a[0])),
          model.lm_head.register_forward_pre_hook(lambda m, a: got.setdefault("head", []).append(a[0]))]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hs:
        h.remove()
    imp = collect_importance(model, ids, batch_size=2)
    down = got["down"][0].reshape(-1, got["down"][0].shape[-1])
    head = got["head"][0].reshape(-1, got["head"][0].shape[-1])
    torch.testing.assert_close(imp["model.layers.1.mlp.down_proj.weight"], down.square().mean(0), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(imp["lm_head.weight"], head.square().mean(0), rtol=1e-5, atol=1e-7)
    whole = collect_importance(model, ids, batch_size=5)
    for n in imp:
        torch.testing.assert_close(imp[n], whole[n], rtol=1e-5, atol=1e-7)


def test_a_tied_embedding_takes_the_heads_importance():
    model = tiny_model("llama", seed=0, tie_word_embeddings=True)
    assert model.config.tie_word_embeddings
    imp = collect_importance(model, _ids(), batch_size=2)
    assert torch.equal(imp["model.embed_tokens.weight"], imp["lm_head.weight"])


def test_a_routed_model_is_measured_as_it_runs():
    from tests.runtime.conftest import _routed_model

    imp = collect_importance(_routed_model("llama", routers="skip"), _ids(), batch_size=2)
    # every attention group skipped: the o_proj input is zero (no stand-ins)
    assert float(imp["model.layers.0.self_attn.o_proj.weight"].abs().max()) == 0.0


def test_empty_batches_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        collect_importance(tiny_model("llama", seed=0), torch.zeros(0, 4, dtype=torch.long))
