"""`wide compare`: rows with the acceptance keys, speedups against the dense row of the same
rounds, the Pareto plot, progress with an ETA on stderr (stdout stays one JSON object)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from wide_cli.cli.app import app, main
from wide_cli.eval import compare as cmp
from wide_cli.eval import progress

KEYS = {"method", "cost_target", "wikitext_ppl", "task_avg", "flops", "decode_speedup", "prefill_speedup"}


def _eval_report():
    def row(name, kind, method, ppl, avg, rel, **extra):
        return {"name": name, "kind": kind, "method": method, "summary": {"wikitext_ppl": ppl, "piqa": avg},
                "average": avg, "flops": {"relative": rel}, "sparsity": None, "decode_speedup_bound": 1.0,
                "routing": extra.pop("routing", None), **extra}
    return {"rows": [
        row("dense-model", "dense", "dense", 40.0, 0.5, 1.0),
        row("sd", "pruned", "static-depth", 140.0, 0.45, 0.79,
            static_depth={"cost_target": 0.79, "cost_metric": "flops"}, lora={"merged": True}),
        row("w", "pruned", "wide", 260.0, 0.41, 0.70, routing={"sparsity": 0.5}),
    ]}


def test_rows_have_the_acceptance_keys_and_speedups_against_dense(tmp_path):
    speed = {"dense-model": {"decode_tokens_per_s": 20.0, "prefill_tokens_per_s": 400.0},
             "sd": {"decode_tokens_per_s": 25.0, "prefill_tokens_per_s": 500.0},
             "w": {"decode_tokens_per_s": 24.0, "prefill_tokens_per_s": 380.0}}
    rows = cmp.compare_rows(_eval_report(), speed)
    assert all(KEYS <= set(r) for r in rows)
    d, sd, w = rows
    assert d["decode_speedup"] == 1.0 and d["cost_target"] == 1.0
    assert sd["decode_speedup"] == pytest.approx(1.25) and sd["prefill_speedup"] == pytest.approx(1.25)
    assert w["prefill_speedup"] == pytest.approx(0.95)
    assert sd["cost_target"] == 0.79 and sd["lora"] and sd["label"] == "static-depth cost 0.79 +LoRA"
    assert w["cost_target"] is None and w["sparsity_target"] == 0.5 and w["label"] == "wide s 0.50"
    assert sd["task_avg"] == 0.45 and sd["tasks"] == {"piqa": 0.45}
    png = cmp.pareto_plot(rows, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_lines_carry_an_eta_and_are_silent_when_off(capsys, monkeypatch):
    from rich.console import Console

    with progress.tracker(10) as bar:  # off: nothing printed
        bar.advance(5)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    console = Console(stderr=True, force_terminal=False, width=200)
    with progress.enabled(console), progress.label("m: piqa"), progress.tracker(100) as bar:
        bar.advance(25)
        bar.advance(25)
    err = capsys.readouterr()
    assert err.out == ""
    assert "m: piqa: 25/100 tokens (25 %)" in err.err and "ETA" in err.err and "m: piqa: 50/100 tokens" in err.err


def test_compare_end_to_end_on_tiny_models(tmp_path, text_file, data_dir):
    run = tmp_path / "sd"
    r = CliRunner().invoke(app, ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run),
                                 "--method", "static-depth", "--cost-target", "0.7", "--seq-len", "32",
                                 "--batch-size", "2", "--eval-max-tokens", "512"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = tmp_path / "cmp"
    r = CliRunner().invoke(app, ["compare", "tiny-llama", str(run / "export"), "--tasks", "wikitext,arc_easy",
                                 "--limit", "2", "--data-dir", str(data_dir), "--seq-len", "64", "--new-tokens", "4",
                                 "--prefill-len", "32", "--repeats", "1", "--warmup", "0", "--out", str(out),
                                 "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert r.stdout.strip().count("\n") == 0
    dense, sd = doc["rows"]
    assert dense["method"] == "dense" and dense["decode_speedup"] == 1.0
    assert sd["method"] == "static-depth" and sd["cost_target"] == 0.7 and sd["decode_speedup"] > 0
    assert sd["flops"] < 1.0 and sd["wikitext_ppl"] > 1.0 and sd["task_avg"] is not None
    wt = doc["eval"]["rows"][0]["results"]["wikitext"]  # token-level only unless --word-perplexity
    assert wt["token_level"]["perplexity"] == dense["wikitext_ppl"] and not wt.get("harness")
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "pareto.png"}
    assert json.loads((out / "report.json").read_text())["rows"][1]["cost_target"] == 0.7


@pytest.mark.parametrize("argv, message", [
    (["compare", "tiny-llama"], "wide compare needs the dense model and at least one export (got 1)"),
    (["compare", "tiny-llama", "tiny-llama"], "target tiny-llama is given twice"),
    (["compare", "tiny-llama", "x", "--repeats", "0"], "repeats 0 must be >= 1"),
])
def test_compare_errors_are_one_line(argv, message, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err


def test_a_hybrid_export_is_its_own_method_on_the_plane():
    rep = _eval_report()
    rep["rows"].append({**rep["rows"][2], "name": "h", "routing": {"cost_target": 0.69, "cost_metric": "flops",
                                                                    "drop_layers": 8}})
    rows = cmp.compare_rows(rep, {})
    h = rows[-1]
    assert h["method"] == "wide+depth" and h["drop_layers"] == 8 and h["cost_target"] == 0.69
    assert rows[2]["method"] == "wide" and rows[2]["drop_layers"] == 0
    assert h["label"] == "wide+depth cost 0.69"


def test_a_static_width_row_is_labelled_by_its_group_fraction_not_a_recipe_cost_target():
    # static width keeps a fixed fraction of groups and ignores cost_target (RoutingConfig skips its
    # check); a recipe's cost_target left in its wide_config must not name the row's cost point
    rep = _eval_report()
    rep["rows"].append({**rep["rows"][2], "name": "sw", "method": "static-width",
                        "routing": {"sparsity": 0.42, "cost_target": 0.78, "cost_metric": "flops"}})
    sw = cmp.compare_rows(rep, {})[-1]
    assert sw["cost_target"] is None and sw["sparsity_target"] == 0.42
    assert sw["label"] == "static-width s 0.42"
