"""Self-generated training data: chat transcripts and plain-text documents written by the dense model
(``data/self_generated.py``) and their place in a run's packed data (``pipeline.common``)."""

from __future__ import annotations

import json

import pytest
import torch

from wide_cli.data.self_generated import (
    chat_turn_prefixes,
    generate_chat_documents,
    generate_text_documents,
    text_start,
)
from wide_cli.errors import ConfigError, DataError
from wide_cli.models.tiny import char_tokenizer, tiny_model

# ChatML, as SmolLM2-Instruct and Qwen use it (a default system prompt included)
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = CHATML
    return tok


def test_turn_prefixes_follow_the_template():
    before, after = chat_turn_prefixes(_chat_tokenizer())
    assert before == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert after == "<|im_end|>\n<|im_start|>assistant\n"


def test_a_model_without_chat_template_is_refused():
    with pytest.raises(ConfigError, match="needs a chat model") as e:
        chat_turn_prefixes(char_tokenizer())
    assert "self_generated = 0" in e.value.hint


def test_documents_are_whole_transcripts_and_seeded():
    model, tok = tiny_model("llama", seed=0), _chat_tokenizer()
    a = generate_chat_documents(model, tok, n=3, max_new_tokens=6, seed=1, batch_size=2)
    b = generate_chat_documents(model, tok, n=3, max_new_tokens=6, seed=1, batch_size=2)
    c = generate_chat_documents(model, tok, n=3, max_new_tokens=6, seed=2, batch_size=2)
    before, after = chat_turn_prefixes(tok)
    assert a == b and a != c and len(a) == 3
    for d in a:
        assert d.startswith(before) and d.endswith("<|im_end|>")
        assert after in d  # user request, then the assistant turn


def test_run_keeps_the_transcripts_and_packs_them_first(tmp_path):
    from wide_cli.pipeline import common
    from wide_cli.pipeline.rundir import RunDir
    from wide_cli.pipeline.settings import settings_from_dict

    data = tmp_path / "plain.txt"
    data.write_text("plain text document number one.\n\nanother plain document here.\n")
    settings = settings_from_dict({"data": {"train": str(data), "self_generated": 2, "self_generated_tokens": 4,
                                            "heldout_fraction": 0.0, "shuffle_documents": False},
                                   "train": {"seq_len": 16}})  # fmt: skip
    run = RunDir(tmp_path / "run")
    tok = _chat_tokenizer()
    with pytest.raises(DataError, match="is missing"):
        common.packed_data(settings, tok, run)  # no model: the calibrate stage writes the file
    packed = common.packed_data(settings, tok, run, model=tiny_model("llama", seed=0))
    path = common.self_generated_file(settings, tok, run)  # found, not regenerated: no model needed
    docs = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(docs) == 2
    assert packed.meta["extra_source"] == str(path) and packed.meta["n_documents"] == 4
    first = tok(docs[0], add_special_tokens=False).input_ids[:16]
    assert torch.equal(packed.train.flatten()[:16], torch.tensor(first))


def test_text_documents_start_from_the_start_token_and_are_seeded():
    model, tok = tiny_model("llama", seed=0), char_tokenizer()  # no chat template: plain text needs none
    assert text_start(tok) == "<s>"
    a = generate_text_documents(model, tok, n=3, max_new_tokens=8, seed=1, batch_size=2)
    b = generate_text_documents(model, tok, n=3, max_new_tokens=8, seed=1, batch_size=2)
    c = generate_text_documents(model, tok, n=3, max_new_tokens=8, seed=2, batch_size=2)
    assert a == b and a != c and 1 <= len(a) <= 3
    assert all(d and not d.startswith("<s>") for d in a)
    with pytest.raises(ConfigError, match="must be >= 1"):
        generate_text_documents(model, tok, n=0, max_new_tokens=8, seed=1)


def test_text_documents_join_the_transcripts_in_one_keyed_file(tmp_path):
    from wide_cli.pipeline import common
    from wide_cli.pipeline.rundir import RunDir
    from wide_cli.pipeline.settings import settings_from_dict

    data = tmp_path / "plain.txt"
    data.write_text("plain text document number one.\n\nanother plain document here.\n")

    def settings(text):
        return settings_from_dict({"data": {"train": str(data), "self_generated": 2, "self_generated_text": text,
                                            "self_generated_tokens": 4, "heldout_fraction": 0.0,
                                            "shuffle_documents": False}, "train": {"seq_len": 16}})  # fmt: skip

    run, tok, model = RunDir(tmp_path / "run"), _chat_tokenizer(), tiny_model("llama", seed=0)
    chat_only = common.self_generated_file(settings(0), tok, run, model)
    both = common.self_generated_file(settings(3), tok, run, model)
    assert chat_only != both  # the count of text documents is part of the key
    docs = [json.loads(line)["text"] for line in both.read_text().splitlines()]
    chat = [json.loads(line)["text"] for line in chat_only.read_text().splitlines()]
    assert docs[:2] == chat and 3 <= len(docs) <= 5  # the transcripts, then the text documents
    assert not any(d.startswith("<|im_start|>") for d in docs[2:])


def test_a_negative_count_of_text_documents_is_refused():
    from wide_cli.pipeline.settings import settings_from_dict

    with pytest.raises(ConfigError, match="self_generated_text -1 must be >= 0"):
        settings_from_dict({"data": {"self_generated_text": -1}})
