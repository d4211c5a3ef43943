"""README.md model card: written by every export (both formats), covered by the manifest, and
saying only what wide_config.json holds."""

from __future__ import annotations

import json

import pytest
import torch

from wide_cli.errors import CheckpointError
from wide_cli.export import export_model, load_pruned
from wide_cli.export.model_card import metrics_table, render_model_card
from wide_cli.models.tiny import char_tokenizer, tiny_model
from wide_cli.routing import RoutingConfig, attach_routers

CFG = RoutingConfig(attn_group_size=2, ffn_group_size=32, sparsity=0.4)
WC = {
    "method": "wide",
    "routing": CFG.to_dict(),
    "layout": {"attn_group_size": 2, "ffn_group_size": 32, "attn_groups": 2, "ffn_groups": 4, "kv_aligned": True},
    "measured_sparsity": {"attention": 0.625, "ffn": 0.25, "total": 0.4375, "tokens": 4096,
                          "per_layer": {"attention": [0.5, 0.75], "ffn": [0.125, 0.375]},
                          "data": "held-out split of builtin:pydoc"},
    "source_model": {"spec": "HuggingFaceTB/SmolLM2-135M-Instruct", "resolved": "hub cache", "revision": "abc123"},
    "settings": {"train": {"steps": 7, "batch_size": 2, "grad_accum": 3, "seq_len": 64, "lr": 0.002, "seed": 1,
                           "dtype": "fp32"}, "data": {"train": "builtin:pydoc"}},
    "lora": {"merged": True, "rank": 16, "alpha": 32.0},
}


@pytest.mark.parametrize("fmt", ["wide", "hf"])
def test_every_export_writes_a_card_in_its_manifest(tmp_path, fmt):
    model = tiny_model("llama")
    attach_routers(model, CFG)
    out = tmp_path / f"card_{fmt}"
    export_model(model, char_tokenizer(), out, wide_config={**WC, "metrics": {}}, export_format=fmt)
    card = (out / "README.md").read_text()
    assert "README.md" in json.loads((out / "manifest.json").read_text())["files"]
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in card and "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "62.5 %" in card and "25.0 %" in card and "43.8 %" in card  # measured, not the 0.4 target
    assert "| 1 | 75.0 % | 37.5 % |" in card  # per layer
    assert "## Evaluation" not in card  # no metrics, no table
    assert "merged (r=16, alpha=32.0)" in card and "7 x 6 x 64" in card
    assert "model.safetensors" in card  # file list
    if fmt == "hf":
        assert f'from_pretrained("card_{fmt}", trust_remote_code=True)' in card
        assert "pretrained=card_hf,trust_remote_code=True" in card
    else:
        assert "load_pruned" in card and "dense backbone only" in card
    (out / "README.md").write_text(card + "edited\n")
    with pytest.raises(CheckpointError, match="README.md has .* bytes"):
        if fmt == "wide":
            load_pruned(out)
        else:
            from wide_cli.export.hf_format import load_hf_export

            load_hf_export(out)


def test_eval_table_when_metrics_present():
    metrics = {"dense": {"perplexity": 12.5, "n_windows": 3}, "pruned": {"perplexity": 14.25, "n_windows": 3},
               "percent_of_dense": 88.0}
    card = render_model_card({**WC, "metrics": metrics}, export_format="wide", name="x")
    assert "## Evaluation" in card
    assert "| dense | 12.5 | 3 |" in card and "| pruned | 14.25 | 3 |" in card
    assert "| percent_of_dense | 88 |" in card


def test_metrics_table_shapes():
    assert metrics_table({}) == []
    assert metrics_table({"note": "text only"}) == []
    assert metrics_table({"acc": 0.5})[2] == "| acc | 0.5 |"
    rows = metrics_table({"wide": {"ppl": 3.0, "tag": "x"}, "dense": {"ppl": 2.0, "acc": 0.7}})
    assert rows[0] == "|  | ppl | acc |" and rows[3] == "| dense | 2 | 0.7 |"


def test_dense_and_local_source_card():
    wc = {"method": "dense", "routing": RoutingConfig(method="dense").to_dict(), "source_model": {"spec": "tiny-llama"}}
    card = render_model_card(wc, export_format="wide", name="d")
    assert "base_model:" not in card  # not a hub id
    assert "None: every group runs" in card


def test_static_hf_card_mentions_physical_sizes():
    wc = {**WC, "method": "static-width", "static": {"kept_heads": [[0, 1], [2]], "intermediate_sizes": [64, 96]}}
    card = render_model_card(wc, export_format="hf", name="s")
    assert "kept query heads per layer: [2, 1]" in card and "[64, 96]" in card


def test_card_is_written_before_the_manifest_and_does_not_need_torch_state(tmp_path):
    # the card lists the files written before it; the manifest hashes the card
    model = tiny_model("llama")
    attach_routers(model, CFG)
    with torch.no_grad():
        model.model.layers[0].router_ffn.router.bias.fill_(0.0)
    res = export_model(model, char_tokenizer(), tmp_path / "c", wide_config=WC)
    card = (tmp_path / "c" / "README.md").read_text()
    assert "| routers.safetensors |" in card and "| manifest.json |" not in card
    assert "README.md" in res.files
