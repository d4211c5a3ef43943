"""What `wide generate` feeds the model and where it stops: `--chat` gives exactly the ids of
``apply_chat_template(..., tokenize=True)`` (no second BOS), and a stop string that is a special
token stops generation like transformers' ``stop_strings``."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from wide_cli.cli.app import app
from wide_cli.models.tiny import char_tokenizer

CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _bos_tokenizer():
    """The char tokenizer, adding BOS like Llama's, with a Llama-3-style chat template."""
    from tokenizers import processors

    tok = char_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.chat_template = CHAT
    assert tok("hi").input_ids[0] == tok.bos_token_id
    return tok


def _export(path, model, tok, write_export):
    from wide_cli.export import export_model

    wc = {"method": "wide", "routing": model.wide_routing.cfg.to_dict(), "measured_sparsity": {},
          "source_model": {"spec": "tiny-llama"}}
    export_model(model, tok, path, wide_config=wc)


def _generate(export, *extra):
    r = CliRunner().invoke(app, ["generate", str(export), "--threads", "1", "--json", *extra], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_chat_prompt_is_exactly_the_chat_template_ids_with_one_bos(tmp_path, routed_model, write_export):
    from wide_cli.runtime.engine import Runtime

    tok = _bos_tokenizer()
    model = routed_model("llama")
    exp = tmp_path / "exp"
    _export(exp, model, tok, write_export)
    want = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
    assert want.count(tok.bos_token_id) == 1
    doc = _generate(exp, "-p", "Hello", "--chat", "--max-new-tokens", "6", "--ignore-eos")
    assert doc["prompt_tokens"] == len(want)
    ref = Runtime.from_export(exp, backend="cpu").generate([want], max_new_tokens=6, ignore_eos=True)
    assert doc["tokens"] == ref.tokens


def _eot_model(routed_model, eot: int):
    """A tiny routed Llama whose greedy next token is always ``eot``: residual dimension 0 is a
    constant 1 (set by the embedding, written by no layer), and only ``eot``'s output row reads it."""
    model = routed_model("llama", routers="execute")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[eot, 0] = 5.0
    return model


def test_stop_string_that_is_a_special_token_stops_generation(tmp_path, routed_model, write_export):
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    eot = tok.convert_tokens_to_ids("<|eot|>")
    assert eot < 128
    exp = tmp_path / "exp"
    _export(exp, _eot_model(routed_model, eot), tok, write_export)
    free = _generate(exp, "-p", "Hello", "--max-new-tokens", "5", "--ignore-eos")
    assert free["tokens"] == [[eot] * 5]  # greedy decoding emits <|eot|>
    doc = _generate(exp, "-p", "Hello", "--max-new-tokens", "5", "--ignore-eos", "--stop", "<|eot|>")
    assert doc["finish_reasons"] == ["stop"] and doc["tokens"] == [[eot]] and doc["texts"] == [""]
