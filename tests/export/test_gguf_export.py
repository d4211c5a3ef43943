"""``wide export --format gguf``: a run without routers (static depth) as one llama.cpp GGUF file
holding its export's weights; routed runs refused with the reason before anything is loaded; the
file llama.cpp loads gives the runtime's logits (within F16 rounding) and greedy tokens (skipped
without the optional ``llama`` extra)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli._invoke import ok
from wide_cli.cli.app import main

CAL = ["--seq-len", "32", "--batch-size", "2"]


@pytest.fixture(scope="module")
def static_depth_run(tmp_path_factory):
    """A calibrated and trained static-depth run of tiny-llama (one of its two layers removed)."""
    import pydoc_data.topics as t

    root = tmp_path_factory.mktemp("gguf")
    text = root / "train.txt"
    text.write_text("\n\n".join(v[:2000] for _, v in sorted(t.topics.items())[:3]))
    run = root / "run"
    ok(["calibrate", "tiny-llama", "--data", str(text), "--run-dir", str(run), "--method", "static-depth",
        "--cost-target", "0.7", *CAL])
    ok(["train", "--run-dir", str(run)])
    ok(["export", "--run-dir", str(run), "--out", str(root / "export")])
    return run, root / "export"


@pytest.mark.parametrize("weights,gtype", [("fp32", "F16"), ("int8", "Q8_0"), ("int4", "Q4_0")])
def test_static_depth_run_exports_one_gguf_file_with_its_weights(static_depth_run, tmp_path, weights, gtype):
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    run, export = static_depth_run
    out = tmp_path / "m.gguf"
    r = ok(["export", "--run-dir", str(run), "--out", str(out), "--format", "gguf", "--weights", weights, "--json"])
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info == {"export_file": str(out), "bytes": out.stat().st_size, "gguf_type": gtype}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temp files left beside it
    reader = gguf.GGUFReader(str(out))
    assert int(reader.fields["llama.block_count"].contents()) == 1  # the layer-pruned model
    tensors = {t.name: t for t in reader.tensors}
    st = load_file(str(export / "model.safetensors"))
    t = tensors["blk.0.ffn_down.weight"]
    want = st["model.layers.0.mlp.down_proj.weight"]
    got = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(want.shape).copy())
    # F16 rounding; half a step of the block's scale for Q8_0 (max |w| / 127); up to a whole step
    # for Q4_0 (max |w| / 8), whose +8 clips to 7
    tol = {"F16": 2e-3, "Q8_0": 0.6 * float(want.abs().max()) / 127, "Q4_0": 1.1 * float(want.abs().max()) / 8}[gtype]
    assert float((got - want).abs().max()) <= tol


def test_gguf_replaces_only_a_gguf_file(static_depth_run, tmp_path, capsys):
    run, _ = static_depth_run
    other = tmp_path / "notes.gguf"
    other.write_text("my notes")
    assert main(["export", "--run-dir", str(run), "--out", str(other), "--format", "gguf"]) == 2
    assert "exists and is not a GGUF file" in capsys.readouterr().err.strip().splitlines()[-1]
    assert other.read_text() == "my notes"
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "m.bin"), "--format", "gguf"]) == 2
    assert "a GGUF export is one file named *.gguf" in capsys.readouterr().err
    good = tmp_path / "m.gguf"
    ok(["export", "--run-dir", str(run), "--out", str(good), "--format", "gguf"])
    first = good.stat().st_size
    ok(["export", "--run-dir", str(run), "--out", str(good), "--format", "gguf"])  # a GGUF file is replaced
    assert good.stat().st_size == first


def test_routed_run_is_refused_before_anything_is_loaded(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--attn-group-size", "2",
        "--ffn-group-size", "32", *CAL])
    out = tmp_path / "m.gguf"
    assert main(["export", "--run-dir", str(run), "--out", str(out), "--format", "gguf"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"error: run {run}: per-token routers (method wide / dynamic-depth) [routers] is not supported "
                    "by llama.cpp (GGUF) (export with --format wide or hf: llama.cpp runs no per-token routing)")
    assert not out.exists() and not list(tmp_path.glob(".m.gguf*"))


def test_gemma3_run_is_refused_by_its_layer_before_anything_is_loaded(tmp_path, text_file, capsys, monkeypatch):
    """The GGUF writer writes llama.cpp's plain ``llama`` graph; a Gemma 3 run (here static depth,
    which has no routers) is refused by the layer, read from the run's recorded model config, in
    one line naming what runs it instead, before the model is loaded, and nothing is written."""
    from wide_cli.features import FEATURES
    from wide_cli.pipeline import stages

    run = tmp_path / "run"
    ok(["calibrate", "tiny-gemma3", "--data", str(text_file), "--run-dir", str(run), "--method", "static-depth",
        "--cost-target", "0.7", *CAL])

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(stages, "export", no_loading)
    out = tmp_path / "m.gguf"
    assert main(["export", "--run-dir", str(run), "--out", str(out), "--format", "gguf"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    what, _ = FEATURES["gemma3_layer"]
    assert lines[-1] == (f"error: run {run}: {what} [gemma3_layer] is not supported by llama.cpp (GGUF) (export "
                         "with --format wide or hf and run it with `wide generate`: wide writes GGUF files of "
                         "llama.cpp's plain Llama graph only)")
    assert not out.exists() and not list(tmp_path.glob(".m.gguf*"))


def test_llama_cpp_runs_the_gguf_with_the_runtimes_greedy_tokens(static_depth_run, tmp_path):
    """llama.cpp on the F16 GGUF, teacher-forced on the runtime's greedy tokens: logits within
    F16 rounding of the runtime's (fp32) at every step, and the same greedy token at every step
    whose top-2 margin is wider than that rounding (a near-tie of this untrained tiny model may go
    either way in F16)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional `llama` extra) is not installed")
    from wide_cli.bench.systems import LlamaCppSystem
    from wide_cli.runtime.engine import Runtime

    run, export = static_depth_run
    out = tmp_path / "m.gguf"
    ok(["export", "--run-dir", str(run), "--out", str(out), "--format", "gguf"])
    prompt, steps = [5, 17, 33, 60, 61, 62, 90, 12], 12
    rt = Runtime.from_export(export, backend="reference")
    want = rt.generate([prompt], max_new_tokens=steps, ignore_eos=True).tokens[0]
    cache = rt.new_cache(1, len(prompt) + steps)
    ref = [rt.step(torch.tensor([prompt]), None, cache)[0]]  # [V]: the last position
    ref += [rt.step(torch.tensor([[t]]), None, cache)[0] for t in want[:-1]]
    llm = LlamaCppSystem(out, threads=1, n_ctx=64)
    try:
        llm.llm.reset()
        llm.llm.eval(prompt)
        got = [torch.from_numpy(llm._last_logits().copy())]
        for t in want[:-1]:
            llm.llm.eval([t])
            got.append(torch.from_numpy(llm._last_logits().copy()))
    finally:
        llm.close()
    ref, got = torch.stack(ref).float(), torch.stack(got).float()
    tol = 2e-3 * float(ref.abs().max())  # F16 weights and activations: ~3 significant digits (1e-3 seen)
    torch.testing.assert_close(got, ref, atol=tol, rtol=0)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert int(clear.sum()) >= steps // 2, "too few clear greedy steps to compare"
    assert got.argmax(-1)[clear].tolist() == torch.tensor(want)[clear].tolist()
