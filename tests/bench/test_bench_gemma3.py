"""``wide bench`` on a Gemma 3 export: the GGUF writer has no Gemma 3 graph, so the llama.cpp
system runs the model's original GGUF (the embedded ``gemma3-270m`` Q4_K_M file) where the export
was converted from it, and refuses any other Gemma 3 export in one line before anything is loaded.
A tiny stand-in GGUF and a stand-in llama.cpp system keep these tests free of the real model and
of llama-cpp-python."""

from __future__ import annotations

import hashlib
import sys
import types

import pytest

from tests._exports import feature_model
from wide_cli.bench import run as bench_run
from wide_cli.bench import systems
from wide_cli.bench.config import BenchConfig
from wide_cli.cli.app import main
from wide_cli.errors import ConfigError
from wide_cli.export import export_model
from wide_cli.models.tiny import char_tokenizer

QUICK = {"prefill_lengths": (8,), "decode_batches": (1,), "new_tokens": 2, "decode_prompt_len": 4, "repeats": 1,
         "warmup": 0}


def _gemma3_export(path, source: dict):
    model, wc = feature_model("gemma3")
    return export_model(model, char_tokenizer(), path, wide_config={**wc, "source_model": source}).path


def _fake_gguf(path):
    """A GGUF file with Gemma 3's header fields, file type Q4_K_M and two matrices (Q8_0, F32)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    q = quantize(np.ones((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", np.ones((2, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


OPENED: list = []  # the files the stand-in llama.cpp system opened


class _FakeLlamaCpp:
    """Stands in for ``LlamaCppSystem`` (llama-cpp-python is an optional extra): records the file."""

    routed = False

    def __init__(self, gguf_path, threads, n_ctx):
        OPENED.append(gguf_path)

    def prefill(self, ids):
        return 0.01

    def decode(self, ids, steps):
        return 0.01

    def close(self):
        pass


def test_llama_cpp_runs_the_original_gguf_of_an_export_converted_from_it(tmp_path, monkeypatch):
    from wide_cli.models import loader

    gg = _fake_gguf(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    digest = hashlib.sha256(gg.read_bytes()).hexdigest()
    export = _gemma3_export(tmp_path / "e", {"id": "gemma3-270m", "alias": "gemma3-270m", "spec": "gemma3-270m",
                                             "gguf_file": gg.name, "gguf_sha256": digest})
    monkeypatch.setattr(loader, "gemma3_gguf", lambda: (gg, "1.0.0"))

    def no_writing(*a, **k):
        raise AssertionError("a GGUF was written for a Gemma 3 export")

    monkeypatch.setattr("wide_cli.runtime.gguf_writer.write_gguf", no_writing)
    monkeypatch.setattr(bench_run, "LlamaCppSystem", _FakeLlamaCpp)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="stand-in", Llama=None))
    OPENED.clear()
    report = bench_run.run_bench(export, BenchConfig(systems=("dense", "llama.cpp"), **QUICK))
    assert OPENED == [gg]
    rows = [e for e in report.entries if e.kind == "llama.cpp"]
    assert {e.system for e in rows} == {"llama.cpp Q4_K_M"} and {e.batch for e in rows} == {1}
    matrices = 4 * 68 + 2 * 32 * 4  # Q8_0: 34 bytes per 32 weights; F32: 4 bytes
    assert all(e.weight_bytes_per_step == matrices for e in rows)
    assert any("original GGUF gemma-3-270m-q4_k_m.gguf (Q4_K_M" in n for n in report.notes)

    other = tmp_path / "other.gguf"  # the installed package holds another file than the export's
    other.write_bytes(gg.read_bytes() + b"\0")
    monkeypatch.setattr(loader, "gemma3_gguf", lambda: (other, "1.0.1"))
    with pytest.raises(ConfigError, match="is not the GGUF the export .* was converted from"):
        systems.original_gguf(export)


def test_llama_cpp_on_a_gemma3_export_of_another_source_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    export = _gemma3_export(tmp_path / "e", {"id": "tiny-gemma3", "alias": "tiny-gemma3", "spec": "tiny-gemma3"})

    def no_loading(*a, **k):
        raise AssertionError("the export was loaded")

    monkeypatch.setattr("wide_cli.runtime.checkpoint.weights_from_export", no_loading)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=None))  # installed or not
    assert main(["bench", str(export), "--systems", "dense,llama.cpp", "--quick"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"error: system 'llama.cpp' on the Gemma 3 export {export}: wide writes GGUF files of "
                         "llama.cpp's plain Llama graph only, and runs a Gemma 3 model's original GGUF only for the "
                         "embedded gemma3-270m (this export's model is 'tiny-gemma3') (drop llama.cpp from --systems)")


def test_llama_cpp_without_llama_cpp_python_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    model, wc = feature_model("llama")
    export = export_model(model, char_tokenizer(), tmp_path / "l", wide_config=wc).path

    def no_loading(*a, **k):
        raise AssertionError("the export was loaded")

    monkeypatch.setattr("wide_cli.runtime.checkpoint.weights_from_export", no_loading)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails, as where it is not installed
    assert main(["bench", str(export), "--systems", "dense,llama.cpp", "--quick"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: system 'llama.cpp' needs llama-cpp-python, which is not installed (install the llama extra")


def test_a_llama_export_still_gets_its_weights_written_as_gguf(tmp_path):
    model, wc = feature_model("llama")
    export = export_model(model, char_tokenizer(), tmp_path / "l", wide_config=wc).path
    assert systems.original_gguf(export) is None
