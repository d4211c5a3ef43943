"""`wide inspect` on the command line: every option reaches the library call, --json prints one
object, the heat-map and plot appear, bad input is one error line."""

from __future__ import annotations

import inspect
import json

import pytest
from typer.testing import CliRunner

from tests._exports import routed_tiny_llama
from wide_cli.cli.app import app, main
from wide_cli.cli.commands.inspect import inspect_cmd
from wide_cli.export import export_model
from wide_cli.models.tiny import char_tokenizer


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    model, cfg = routed_tiny_llama()
    wc = {"method": "wide", "routing": cfg.to_dict(),
          "layout": {"attn_group_size": 2, "ffn_group_size": 32, "attn_groups": 2, "ffn_groups": 4, "kv_aligned": True},
          "measured_sparsity": {"attention": 0.5, "ffn": 0.25, "total": 0.375,
                                "per_layer": {"attention": [0.5, 0.5], "ffn": [0.25, 0.25]}}}
    return export_model(model, char_tokenizer(), tmp_path_factory.mktemp("icli") / "exp", wide_config=wc,
                        export_format="hf").path


def test_every_option_reaches_the_library(tmp_path, monkeypatch, export_dir):
    seen = {}

    def fake(path, **kw):
        seen.update(path=path, **kw)
        raise SystemExit(0)

    monkeypatch.setattr("wide_cli.inspection.inspect_export", fake)
    txt = tmp_path / "t.txt"
    txt.write_text("hello world")
    args = ["inspect", str(export_dir), "--text", str(txt), "--prompt", "hi", "--layer", "1", "--plot",
            str(tmp_path / "p.png"), "--seq-len", "7", "--max-tokens", "99", "--no-verify", "--trust-remote-code"]
    CliRunner().invoke(app, args, catch_exceptions=False)
    assert seen == {"path": export_dir, "text": "hello world", "text_name": str(txt), "prompt": "hi", "layer": 1,
                    "plot": tmp_path / "p.png", "seq_len": 7, "max_tokens": 99, "verify": False,
                    "trust_remote_code": True}
    # every parameter of the command is either forwarded above or is --json
    params = set(inspect.signature(inspect_cmd).parameters)
    assert params == {"export", "text", "prompt", "layer", "plot", "seq_len", "max_tokens", "verify", "trust_remote_code",
                      "json_out"}


def test_json_heatmap_and_plot(tmp_path, export_dir, capsys):
    code = main(["inspect", str(export_dir), "--prompt", "fox", "--layer", "0", "--plot", str(tmp_path / "s.png"),
                 "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    out = cap.out.strip().splitlines()
    assert len(out) == 1
    d = json.loads(out[0])
    assert d["format"] == "hf" and d["method"] == "wide" and d["plot"] == str(tmp_path / "s.png")
    assert d["prompt"]["tokens"] == ["f", "o", "x"] and d["prompt"]["layer"] == 0
    assert len(d["prompt"]["execute"]["attention"][0]) == 3 and len(d["prompt"]["execute"]["ffn"][1][0]) == 4
    assert "groups each token used, layer 0" in cap.err and "█ ran  · skipped" in cap.err
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,message", [
    (["--layer", "0"], "--layer needs --prompt"),
    (["--prompt", "x", "--layer", "9"], "--layer 9 is out of range: the model has 2 layers"),
    (["--text", "/nonexistent/t.txt"], "cannot read --text '/nonexistent/t.txt'"),
])
def test_bad_input_is_one_line(export_dir, capsys, args, message):
    code = main(["inspect", str(export_dir), *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_missing_export(tmp_path, capsys):
    code = main(["inspect", str(tmp_path / "nothing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "does not exist" in err[-1]
