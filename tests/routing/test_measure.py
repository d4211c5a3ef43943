"""One sparsity accumulator and one measuring loop (``wide_cli.routing.measure``): the meter's
summary is the counter's, the loop counts what a hand-made loop counts, modes are restored."""

from __future__ import annotations

import pytest
import torch

from tests._exports import routed_tiny_llama
from wide_cli.models.tiny import tiny_model
from wide_cli.routing.measure import SparsityMeter, batches_of, count_sparsity, measure_sparsity
from wide_cli.routing.state import SparsityCounter


def _ids(n=6, t=9, seed=0):
    return torch.randint(5, 100, (n, t), generator=torch.Generator().manual_seed(seed))


def test_meter_summary_is_the_counter_summary_and_merges():
    c = SparsityCounter(2)
    c.skipped["attention"], c.decisions["attention"] = [1.0, 3.0], [4.0, 4.0]
    c.skipped["ffn"], c.decisions["ffn"] = [0.0, 2.0], [8.0, 8.0]
    m = SparsityMeter()
    assert m.summary() is None and m.counts() is None
    m.add_counter(c)
    assert m.summary() == {**c.summary(), "tokens_measured": 0}
    assert m.summary()["attention"] == pytest.approx((0.25 + 0.75) / 2)
    other = SparsityMeter(tokens_measured=5)
    other.add_counter(c)
    m.merge(other)
    m.merge(SparsityMeter())  # a dense meter adds nothing
    s = m.summary()
    assert s["tokens_measured"] == 5 and s["per_layer"]["ffn"] == [0.0, 0.25]
    assert m.skipped["attention"] == [2.0, 6.0] and m.decisions["attention"] == [8.0, 8.0]


def test_measure_sparsity_counts_what_a_hand_loop_counts():
    model, _ = routed_tiny_llama(seed=0)
    model.eval()
    ids = _ids()
    state = model.wide_routing
    counter = state.start_counting()
    with torch.no_grad():
        for i in range(0, len(ids), 4):
            model(input_ids=ids[i : i + 4])
    state.stop_counting()
    got = measure_sparsity(model, batches_of(ids, 4))
    assert got == {**counter.summary(), "tokens": ids.numel()}
    assert 0 < got["total"] < 1  # the routers skip some groups
    assert [b.shape[0] for b in batches_of(ids, 4)] == [4, 2]


def test_count_sparsity_uses_argmax_and_restores_the_mode():
    model, _ = routed_tiny_llama(seed=1)
    state = model.wide_routing
    state.set_mode("gumbel")
    with count_sparsity(model) as meter:
        assert state.mode == "argmax" and state.counter is not None
        with torch.no_grad():
            model(input_ids=_ids(2, 5))
        with pytest.raises(RuntimeError, match="already running"), count_sparsity(model):
            pass
    assert state.mode == "gumbel" and state.counter is None and meter.routed


def test_dense_model():
    dense = tiny_model("llama", seed=0)
    with count_sparsity(dense) as meter:
        pass
    assert meter.summary() is None
    with pytest.raises(ValueError, match="needs a routed model"):
        measure_sparsity(dense, [_ids(1, 3)])


def _router_masks(model, batches):
    """Reference: the distinct masks of each router's own argmax decisions, read from its output."""
    from wide_cli.routing.gumbel import argmax_execute

    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for m in ("attention", "ffn"):
            r = getattr(layer, f"router_{m}", None)
            if r is not None:
                def fn(mod, args, out, key=(m, i)):
                    ex = argmax_execute(out).bool().reshape(-1, out.shape[-2])
                    seen.setdefault(key, set()).update(tuple(row.tolist()) for row in ex)
                hooks.append(r.register_forward_hook(fn))
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_distinct_masks_count_each_routers_decisions():
    model, _ = routed_tiny_llama(seed=0)
    model.eval()
    batches = [_ids(3, 11, seed=1), _ids(2, 7, seed=2)]  # two shapes, masks merged across them
    s = measure_sparsity(model, batches, distinct_masks=True)
    ref = _router_masks(model, batches)
    assert s["tokens"] == 3 * 11 + 2 * 7
    for m in ("attention", "ffn"):
        assert s["distinct_masks"][m] == [len(ref[(m, i)]) for i in range(2)]
    assert any(n > 1 for v in s["distinct_masks"].values() for n in v)  # random routers vary by token
    assert model.wide_routing.trace is None  # tracing is switched off afterwards
    assert "distinct_masks" not in measure_sparsity(model, batches)  # off by default
    # the sparsity itself does not depend on counting masks
    plain = measure_sparsity(model, batches)
    assert {k: v for k, v in s.items() if k != "distinct_masks"} == plain


def test_a_router_that_ignores_its_input_is_reported_static():
    from wide_cli.routing.measure import static_routers

    model, _ = routed_tiny_llama(seed=0)
    model.eval()
    r = model.model.layers[1].router_ffn
    G = model.wide_routing.layout.ffn_groups
    with torch.no_grad():  # logits = bias alone: the same partial mask for every token
        for n, p in r.named_parameters():
            p.zero_()
            if n.endswith("bias") and p.numel() == 2 * G:
                p.view(G, 2)[:, 1] = torch.tensor([1.0 if g % 2 else -1.0 for g in range(G)])
    s = measure_sparsity(model, [_ids(4, 16, seed=3)], distinct_masks=True)
    assert s["distinct_masks"]["ffn"][1] == 1
    assert ("ffn", 1) in static_routers(s["distinct_masks"], s["per_layer"])
    # one mask of all groups executed (or all skipped) is what a layer was trained to do, not a fault
    assert static_routers({"ffn": [1, 5]}, {"ffn": [0.0, 0.3]}) == []
    assert static_routers({"ffn": [1, None]}, {"ffn": [0.5, None]}) == [("ffn", 0)]
