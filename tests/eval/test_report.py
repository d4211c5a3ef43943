"""evaluate_targets on tiny saved models and exports: rows, reference, warnings, files (every
number says its dataset, unit and metric)."""

from __future__ import annotations

import json

import pytest
import torch

from wide_cli.errors import ConfigError, DataError
from wide_cli.eval.report import SCHEMA, to_markdown
from wide_cli.eval.run import evaluate_targets


def _routed_export(path, source: dict):
    from wide_cli.export import export_model
    from wide_cli.models.tiny import char_tokenizer, tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers

    cfg = RoutingConfig(attn_group_size=2, ffn_group_size=32)
    m = tiny_model(seed=0)
    attach_routers(m, cfg)
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if ".router_" in n:
                p.normal_(0.0, 0.5)
    export_model(m, char_tokenizer(), path, wide_config={
        "method": "wide", "routing": cfg.to_dict(), "source_model": source,
        "measured_sparsity": {"attention": 0.5, "ffn": 0.5, "total": 0.5}})
    return path


@pytest.fixture
def saved_dense(tmp_path):
    from wide_cli.models.tiny import char_tokenizer, tiny_model

    d = tmp_path / "dense"
    tiny_model(seed=0).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


@pytest.mark.real_data
def test_report_rows_reference_and_files(tmp_path, saved_dense, data_dir):
    exp = _routed_export(tmp_path / "exp", {"spec": str(saved_dense), "resolved": "x", "revision": None})
    other = _routed_export(tmp_path / "other", {"spec": "smollm2-135m", "resolved": "y", "revision": None})
    out = tmp_path / "report"
    rep = evaluate_targets([str(saved_dense), str(exp), str(other)],
                           tasks=["wikitext", "arc_easy", "boolq"], data_dir=data_dir, limit=1,
                           seq_len=64, batch_size=4, out_dir=out)
    assert rep["schema"] == SCHEMA and rep["reference"] == str(saved_dense)
    dense, pruned, mism = rep["rows"]
    assert (dense["kind"], pruned["kind"]) == ("dense", "pruned")
    assert dense["sparsity"] is None and dense["flops"]["relative"] == 1.0
    assert dense["percent_of_dense"] == pytest.approx(100.0)
    assert 0.0 < pruned["sparsity"]["total"] < 1.0 and pruned["flops"]["relative"] < 1.0
    assert len(pruned["sparsity"]["per_layer"]["attention"]) == 2
    assert pruned["decode_speedup_bound"] > 1.0
    # dataset, split, counts, unit on the wikitext result (a perplexity is meaningless without them)
    w = dense["results"]["wikitext"]
    assert w["dataset"]["name"] == "wikitext-2-raw-v1" and w["dataset"]["split"] == "test"
    assert w["dataset"]["n_documents"] == 1 and w["dataset"]["n_documents_total"] == 62
    assert w["token_level"]["unit"] == "token-level perplexity" and w["token_level"]["seq_len"] == 64
    assert w["token_level"]["n_windows"] > 0 and w["token_level"]["n_tokens"] > 0
    assert w["harness"]["unit"].startswith("word-level")
    # explicit metric keys and the fixed summary table (acc vs acc_norm is stated, never guessed)
    assert rep["summary_metrics"] == {"arc_easy": "acc_norm", "boolq": "acc"}
    assert set(dense["results"]["arc_easy"]["metrics"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    avg = (dense["results"]["arc_easy"]["metrics"]["acc_norm"] + dense["results"]["boolq"]["metrics"]["acc"]) / 2
    assert dense["average"] == pytest.approx(avg)
    # the export made from another model is flagged, and only that one
    assert pruned["warnings"] == [] and len(mism["warnings"]) == 1
    assert "smollm2-135m" in mism["warnings"][0] and rep["warnings"] == mism["warnings"]
    # files
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["rows"][1]["plot"] == pruned["plot"] and (out / pruned["plot"]).stat().st_size > 1000
    assert dense["plot"] is None
    md = (out / "report.md").read_text()
    assert "wikitext2 ppl (token)" in md and "arc\\_easy" not in md and "arc_easy acc_norm\\*" in md
    assert "WARNING" in md
    assert "accuracy" not in md.lower()  # no unlabelled accuracy column (acc or acc_norm, always named)


def test_settings_checked_before_loading(tmp_path, monkeypatch):
    from wide_cli.eval import run

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(run, "load_target", boom)
    with pytest.raises(ConfigError, match="unknown task 'mmlu'"):
        evaluate_targets(["tiny-llama"], tasks=["mmlu"], data_dir=tmp_path)
    with pytest.raises(ConfigError, match="limit -1"):
        evaluate_targets(["tiny-llama"], tasks=["piqa"], data_dir=tmp_path, limit=-1)
    with pytest.raises(DataError, match="wikitext-103"):
        evaluate_targets(["tiny-llama"], tasks=["wikitext-103"], data_dir=tmp_path)
    with pytest.raises(DataError, match="piqa.jsonl not found"):
        evaluate_targets(["tiny-llama"], tasks=["piqa"], data_dir=tmp_path)
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        evaluate_targets(["tiny-llama"], tasks=[], data_dir=tmp_path)
    with pytest.raises(ConfigError, match="no target"):
        evaluate_targets([], tasks=["piqa"], data_dir=tmp_path)


def test_eval_data_file_and_seq_len_cap(tmp_path, saved_dense):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rep = evaluate_targets([str(saved_dense)], tasks=[], data_dir=None, eval_data=text, seq_len=128)
    r = rep["rows"][0]["results"]["eval_data"]
    assert r["unit"] == "token-level perplexity" and r["n_windows"] == len(text.read_text()) // 128
    assert rep["rows"][0]["summary"]["eval_data_ppl"] == r["perplexity"]
    assert "eval-data ppl" in to_markdown(rep)
    with pytest.raises(ConfigError, match="seq-len 4096 exceeds the model's context length 512"):
        evaluate_targets([str(saved_dense)], tasks=[], data_dir=None, eval_data=text, seq_len=4096)
