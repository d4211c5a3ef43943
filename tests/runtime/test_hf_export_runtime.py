"""`wide generate` runs an `--format hf` export (read as data: config into wide's own class,
routers from the shared weight files) and produces the tokens of the wide-format export."""

from __future__ import annotations

import json

from tests.cli._invoke import ok as _ok

H4 = ["--attn-group-size", "2", "--ffn-group-size", "32", "--steps", "5", "--seq-len", "64", "--batch-size", "2",
      "--eval-max-tokens", "512"]


def test_generate_on_an_hf_export_gives_the_tokens_of_the_wide_export(tmp_path, text_file):
    run = tmp_path / "run"
    _ok(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), *H4])
    _ok(["export", "--run-dir", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"])

    def tokens(export, backend):
        r = _ok(["generate", str(export), "-p", "Hello", "--max-new-tokens", "12", "--ignore-eos", "--backend",
                 backend, "--threads", "1", "--json"])
        doc = json.loads(r.stdout)
        return doc["tokens"], doc["sparsity"]["total"]

    for backend in ("reference", "cpu"):
        wide_tokens, wide_sp = tokens(run / "export", backend)
        hf_tokens, hf_sp = tokens(tmp_path / "hf", backend)
        assert hf_tokens == wide_tokens and hf_sp == wide_sp and len(hf_tokens[0]) == 12
