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
