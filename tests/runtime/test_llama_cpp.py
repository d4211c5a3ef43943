"""GGUF written from an export (``runtime/gguf_writer.py``) and llama.cpp rows of ``wide bench``.

The llama.cpp checks need the optional ``llama`` extra (``llama-cpp-python``, compiled from
source); they skip with that reason where it is not installed. The GGUF file itself is checked
with the ``gguf`` package's reader everywhere.
"""

from __future__ import annotations

import pytest
import torch

from wide_cli.errors import ConfigError


def _dense_hf(model):
    """The export's backbone as a plain HF model (what llama.cpp runs: no routers)."""
    from wide_cli.models.tiny import tiny_model

    plain = tiny_model("llama")
    sd = {k: v for k, v in model.state_dict().items() if "router" not in k}
    plain.load_state_dict(sd)
    return plain


@pytest.mark.parametrize("gtype", ["F16", "Q8_0", "Q4_0"])
def test_gguf_holds_the_export_weights(gtype, tiny_export, tmp_path):
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from wide_cli.runtime.gguf_writer import _permute_rope, write_gguf

    path = write_gguf(tiny_export, tmp_path / "m.gguf", gtype)
    r = gguf.GGUFReader(str(path))
    names = {t.name: t for t in r.tensors}
    assert len(names) == 3 + 2 * 9  # embed, norm, output + 9 per layer
    st = load_file(str(tiny_export / "model.safetensors"))
    t = names["blk.1.attn_q.weight"]
    got = dequantize(t.data, t.tensor_type).reshape(64, 64)
    want = _permute_rope(st["model.layers.1.self_attn.q_proj.weight"], 4).numpy()
    # half a step of the block's scale (max |w| / 127 for Q8_0, max |w| / 8 for Q4_0) plus f16 rounding
    tol = {"F16": 2e-3, "Q8_0": 0.6 * float(abs(want).max()) / 127, "Q4_0": 0.6 * float(abs(want).max()) / 8}[gtype]
    assert abs(got - want).max() <= tol
    assert str(r.fields["general.architecture"].contents()) == "llama"


def test_gguf_refuses_models_llama_cpp_cannot_run(routed_model, write_export, tmp_path):
    from wide_cli.runtime.gguf_writer import write_gguf

    write_export(routed_model("qwen2"), tmp_path / "q")
    with pytest.raises(ConfigError, match="plain Llama"):
        write_gguf(tmp_path / "q", tmp_path / "q.gguf")
    with pytest.raises(ConfigError, match="unknown GGUF type"):
        write_gguf(tmp_path / "q", tmp_path / "q.gguf", "Q4_K")


@pytest.mark.parametrize("gtype", ["F16", "Q8_0", "Q4_0"])
def test_llama_cpp_greedy_tokens_match_transformers(gtype, routed_model, write_export, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional `llama` extra) is not installed")
    from wide_cli.bench.systems import LlamaCppSystem
    from wide_cli.runtime.gguf_writer import write_gguf

    model = routed_model("llama")
    write_export(model, tmp_path / "exp")
    path = write_gguf(tmp_path / "exp", tmp_path / "m.gguf", gtype)
    plain = _dense_hf(model)
    prompt = [5, 17, 33, 60, 61, 62, 90, 12]
    with torch.no_grad():
        want = plain.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    llm = LlamaCppSystem(path, threads=1, n_ctx=64)
    got = llm.greedy(prompt, 12)
    llm.close()
    if gtype == "F16":
        assert got == want
    elif gtype == "Q8_0":  # rounds weights (and activations) to 8 bits: the first tokens must agree
        assert got[:4] == want[:4]
    else:  # 4-bit weights on a random tiny model: the first token must agree
        assert got[:1] == want[:1]


def test_bench_has_a_row_per_llama_cpp_type(tiny_export, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional `llama` extra) is not installed")
    import json

    from wide_cli.cli.app import main

    out = tmp_path / "b.json"
    assert main(["bench", str(tiny_export), "--systems", "dense,llama.cpp", "--weights", "int8", "--llama-cpp-types", "F16,Q8_0,Q4_0",
                 "--prefill-lengths", "8", "--decode-batches", "1", "--new-tokens", "2", "--decode-prompt-len", "4",
                 "--repeats", "1", "--warmup", "0", "--json-out", str(out)]) == 0  # fmt: skip
    rows = {(r["system"], r["phase"]): r for r in json.loads(out.read_text())["results"]}
    for t in ("F16", "Q8_0", "Q4_0"):
        for phase in ("prefill", "decode"):
            r = rows[(f"llama.cpp {t}", phase)]
            assert r["tokens_per_s"] > 0 and r["speedup_vs_dense"] is not None  # against the runtime's dense int8
