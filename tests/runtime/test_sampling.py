"""Sampling (temperature, top-p, seed) and stop handling."""

from __future__ import annotations

import pytest
import torch

from wide_cli.errors import ConfigError
from wide_cli.models.tiny import char_tokenizer
from wide_cli.runtime.engine import Runtime
from wide_cli.runtime.sampling import Sampler, SamplingConfig, TextTracker, top_p_filter


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(top_p_filter(logits, 0.01))
    assert kept.tolist() == [[True, False, False, False]]  # the top token always stays
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(4, 50)
    a = Sampler(SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
    b = Sampler(SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
    assert all(torch.equal(a(logits), b(logits)) for _ in range(5))
    assert torch.equal(Sampler(SamplingConfig())(logits), logits.argmax(-1))


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_settings(kw):
    with pytest.raises(ConfigError):
        SamplingConfig(**kw)


def test_text_tracker_holds_back_partial_stop_strings():
    tok = char_tokenizer()
    tr = TextTracker(tok, ("lo w",))
    shown = "".join(tr.push(tok.convert_tokens_to_ids(c)) for c in "hello")
    assert shown == "hel"  # "lo" could still become "lo w"
    shown += tr.push(tok.convert_tokens_to_ids(" "))
    shown += tr.push(tok.convert_tokens_to_ids("w"))
    assert tr.stopped and tr.text == "hel" and shown == "hel"


def test_generate_stops_on_stop_string_and_streams(routed_model):
    model = routed_model("llama")
    rt = Runtime.from_model(model, tokenizer=char_tokenizer(), backend="cpu")
    free = rt.generate(["hello"], max_new_tokens=12, ignore_eos=True)
    text = free.texts[0]
    stop = text[3:5]
    cut = text.find(stop)
    streamed = []
    res = rt.generate(["hello"], max_new_tokens=12, ignore_eos=True, stop=(stop,), on_text=lambda b, t: streamed.append(t))
    assert res.texts[0] == text[:cut] == "".join(streamed)
    assert res.finish_reasons == ["stop"]


def test_eos_ends_a_row_and_sampling_uses_the_seed(routed_model):
    model = routed_model("llama")
    rt = Runtime.from_model(model, tokenizer=char_tokenizer(), backend="cpu")
    g = rt.generate(["ab"], max_new_tokens=6, ignore_eos=True)
    rt.eos_token_ids = (g.tokens[0][2],)
    res = rt.generate(["ab"], max_new_tokens=6)
    assert res.finish_reasons == ["eos"] and res.tokens[0] == g.tokens[0][: g.tokens[0].index(g.tokens[0][2]) + 1]
    cfg = SamplingConfig(temperature=1.5, top_p=0.95, seed=1)
    s1 = rt.generate(["ab", "cde"], max_new_tokens=8, sampling=cfg, ignore_eos=True)
    s2 = rt.generate(["ab", "cde"], max_new_tokens=8, sampling=cfg, ignore_eos=True)
    assert s1.tokens == s2.tokens
