"""`wide generate` on edge inputs: one line `error: ...` and exit 2 for bad values, the same
context-length rule as `wide eval`, tiny temperatures decode greedily."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from wide_cli.cli.app import app, main
from wide_cli.runtime.sampling import Sampler, SamplingConfig


def _main(capsys, args):
    code = main(args)
    return code, capsys.readouterr()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_new_tokens_below_one_is_a_one_line_error_with_exit_2(tiny_export, capsys, value):
    code, out = _main(capsys, ["generate", str(tiny_export), "-p", "hello", "--max-new-tokens", value])
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --max-new-tokens") and value in lines[0]
    assert "ValueError" not in out.err


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bad_temperature_is_a_one_line_error_with_exit_2(tiny_export, capsys, value):
    code, out = _main(capsys, ["generate", str(tiny_export), "-p", "hello", "--temperature", value])
    assert code == 2 and out.err.startswith("error: temperature") and len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize("t", [1e-40, 1e-30, 1e-6])
def test_tiny_temperatures_decode_greedily(t):
    """Below 1e-5 (vLLM's rule) sampling is greedy: logits / 1e-40 overflow to inf and softmax
    gives NaN probabilities."""
    cfg = SamplingConfig(temperature=t, seed=0)
    assert cfg.greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    assert torch.equal(Sampler(cfg)(logits), logits.argmax(-1))


def test_tiny_temperature_generates_the_greedy_tokens(tiny_export):
    def tokens(*extra):
        r = CliRunner().invoke(app, ["generate", str(tiny_export), "-p", "hello", "--max-new-tokens", "6",
                                     "--ignore-eos", "--threads", "1", "--json", *extra], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["tokens"]

    assert tokens("--temperature", "1e-40", "--seed", "1") == tokens()


def test_prompt_longer_than_the_context_is_refused_naming_both_numbers(tiny_export, capsys):
    """tiny-llama has 512 positions; a 630-token prompt is refused like `wide eval` refuses a
    630-token window (the char tokenizer makes one token per character)."""
    code, out = _main(capsys, ["generate", str(tiny_export), "-p", "a" * 630, "--max-new-tokens", "4"])
    assert code == 2, out.err
    assert out.err.startswith("error: ") and "630" in out.err and "512" in out.err
    assert len(out.err.strip().splitlines()) == 1


def test_prompt_plus_new_tokens_beyond_the_context_is_refused(tiny_export, capsys):
    code, out = _main(capsys, ["generate", str(tiny_export), "-p", "a" * 500, "--max-new-tokens", "20"])
    assert code == 2 and "500" in out.err and "520" in out.err and "512" in out.err, out.err
    code, out = _main(capsys, ["generate", str(tiny_export), "-p", "a" * 500, "--max-new-tokens", "12",
                               "--ignore-eos", "--threads", "1"])
    assert code == 0, out.err


@pytest.mark.parametrize("prompts,message", [
    ([""], "error: --prompt is empty (give a non-empty prompt)"),
    (["hello", ""], "error: --prompt 2 of 2 is empty (give a non-empty prompt)"),
])
def test_an_empty_prompt_is_a_one_line_error_with_exit_2(tiny_export, capsys, prompts, message):
    args = [a for p in prompts for a in ("-p", p)]
    code, out = _main(capsys, ["generate", str(tiny_export), *args, "--max-new-tokens", "2"])
    assert code == 2, out.err
    assert out.err.strip().splitlines() == [message]
    code, out = _main(capsys, ["generate", str(tiny_export), str(tiny_export), *args, "--max-new-tokens", "2"])
    assert code == 2 and out.err.strip().splitlines() == [message]


def test_a_prompt_of_no_tokens_is_refused_by_generation_naming_it():
    from types import SimpleNamespace

    from wide_cli.errors import ConfigError
    from wide_cli.models.tiny import char_tokenizer
    from wide_cli.runtime.generation import generate

    rt = SimpleNamespace(tokenizer=char_tokenizer())
    with pytest.raises(ConfigError, match=r"^prompt 2 of 2 has no tokens \(give a non-empty prompt\)$"):
        generate(rt, [[5, 6], []], max_new_tokens=2)
