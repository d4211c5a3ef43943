"""Gemma 3 (text) through `wide prune` with every method on tiny-gemma3 (sandwich norms, MQA, a
sliding-window and a global layer), each export then run by the runtime's cpu backend (native
decode step) and matching the reference backend's greedy tokens."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from wide_cli.cli.app import app

TINY = ["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--ffn-group-size", "32",
        "--eval-max-tokens", "1024"]

METHODS = {
    "hybrid-standins": ["--method", "wide", "--attn-group-size", "1", "--drop-layers", "1", "--standin", "trained"],
    "wide-standardized": ["--method", "wide", "--attn-group-size", "1", "--router-input", "standardized",
                          "--standin", "trained"],
    "wide-lowrank": ["--method", "wide", "--attn-group-size", "2", "--standin", "lowrank:4"],
    "dynamic-depth": ["--method", "dynamic-depth"],
    "static-width": ["--method", "static-width", "--sparsity", "0.5", "--attn-group-size", "1"],
    "static-depth": ["--method", "static-depth", "--cost-target", "0.8", "--lora", "--lora-steps", "2"],
}


@pytest.mark.parametrize("method", list(METHODS))
def test_prune_gemma3_every_method_exports_and_generates(tmp_path, text_file, method):
    from wide_cli.runtime.engine import Runtime

    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["prune", "tiny-gemma3", "--data", str(text_file), "--run-dir", str(run), *TINY,
                                 *METHODS[method], "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    export = run / "export"
    assert json.loads((export / "config.json").read_text())["model_type"] == "gemma3_text"
    # every method records the model's provenance (what `wide bench`'s llama.cpp row checks the
    # original GGUF against), not only its spec
    source = json.loads((export / "wide_config.json").read_text())["source_model"]
    assert source["id"] == source["spec"] == "tiny-gemma3"
    pruned, dense = res["eval"]["pruned"]["perplexity"], res["eval"]["dense"]["perplexity"]
    assert 1.0 < dense < 1e4 and 1.0 < pruned < 1e4
    prompt = [5, 17, 33, 60, 61, 62, 90, 12, 40, 41, 42]  # longer than the sliding window of 8
    tokens = {}
    for backend in ("reference", "cpu"):
        rt = Runtime.from_export(export, backend=backend)
        tokens[backend] = rt.generate([prompt], max_new_tokens=6, ignore_eos=True).tokens[0]
    assert len(tokens["cpu"]) == 6
    assert tokens["cpu"] == tokens["reference"]
