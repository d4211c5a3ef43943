"""`wide eval`: --json contract, flag plumbing (library call patched), errors on one line."""

from __future__ import annotations

import inspect
import json

import pytest
from typer.testing import CliRunner

from wide_cli.cli.app import app, main
from wide_cli.cli.commands.eval import eval_cmd


@pytest.fixture
def saved_tiny(tmp_path):
    from wide_cli.models.tiny import char_tokenizer, tiny_model

    d = tmp_path / "tiny"
    tiny_model(seed=0).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


def test_every_flag_reaches_the_library(monkeypatch, tmp_path):
    """Each option changes the evaluate_targets call (no flag accepted and dropped)."""
    from wide_cli.eval import run

    seen = {}

    def fake(targets, **kw):
        seen.update(kw, targets=targets)
        return {"schema": "wide.eval.report", "settings": {"tasks": [], "eval_data": None}, "rows": [],
                "summary_metrics": {}, "reference": None, "warnings": []}

    monkeypatch.setattr(run, "evaluate_targets", fake)
    text = tmp_path / "t.txt"
    text.write_text("x")
    args = ["eval", "a", "b", "--tasks", "wikitext2,piqa", "--data-dir", str(tmp_path), "--limit", "7",
            "--seq-len", "256", "--stride", "128", "--batch-size", "3", "--dtype", "bf16", "--device", "cpu",
            "--eval-data", str(text), "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"), "--trust-remote-code", "--json"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert seen == {"targets": ["a", "b"], "tasks": ["wikitext2", "piqa"], "data_dir": tmp_path, "limit": 7,
                    "seq_len": 256, "stride": 128, "batch_size": 3, "dtype": "bf16", "device": "cpu",
                    "eval_data": text, "out_dir": tmp_path / "o", "cache_dir": tmp_path / "c",
                    "trust_remote_code": True}
    assert json.loads(r.stdout)["schema"] == "wide.eval.report"
    params = set(inspect.signature(eval_cmd).parameters) - {"json_out", "run_dir"}  # run_dir: tests/cli
    assert params == {"targets", "tasks", "data_dir", "limit", "seq_len", "stride", "batch_size", "dtype",
                      "device", "eval_data", "out", "cache_dir", "trust_remote_code", "threads"}


def test_json_is_one_object_on_stdout(saved_tiny, tmp_path, data_dir):
    out = tmp_path / "rep"
    r = CliRunner().invoke(app, ["eval", str(saved_tiny), "--tasks", "arc_easy,winogrande", "--limit", "2",
                                 "--data-dir", str(data_dir), "--batch-size", "4", "--out", str(out), "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)  # exactly one JSON object, nothing else on stdout
    assert r.stdout.strip().count("\n") == 0
    row = rep["rows"][0]
    assert row["results"]["arc_easy"]["dataset"]["n_items"] == 2
    assert rep["summary_metrics"] == {"arc_easy": "acc_norm", "winogrande": "acc"}
    assert (out / "report.json").is_file() and (out / "report.md").is_file()
    assert "wide eval" in r.stderr  # the table goes to stderr


@pytest.mark.parametrize("args, message", [
    (["--tasks", "mmlu"], "error: unknown task 'mmlu' (known tasks: wikitext, arc_easy"),
    (["--tasks", "piqa", "--limit", "0"], "error: limit 0 must be >= 1"),
    (["--tasks", "wikitext-103"], "error: dataset 'wikitext-103' is not WikiText-2 raw v1"),
])
def test_errors_are_one_line(saved_tiny, tmp_path, capsys, args, message):
    code = main(["eval", str(saved_tiny), "--data-dir", str(tmp_path), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(message)


def test_eval_data_alone_evaluates_just_that_file(saved_tiny, text_file, tmp_path, monkeypatch):
    """`wide eval MODEL --eval-data FILE` without --tasks scores the file only: it needs no task
    data (a user's clone has no ../shared) and does not start the eight default tasks."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)  # no ../shared/data next to the working directory
    r = CliRunner().invoke(app, ["eval", str(saved_tiny), "--eval-data", str(text_file), "--seq-len", "64",
                                 "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["settings"]["tasks"] == []
    res = rep["rows"][0]["results"]
    assert list(res) == ["eval_data"]
    assert res["eval_data"]["dataset"]["file"] == str(text_file) and res["eval_data"]["perplexity"] > 1
