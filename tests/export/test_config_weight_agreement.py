"""A config.json that disagrees with the tensors (a hand edit, manifest re-hashed) is one wide
error naming the field, both numbers and the file, exit 2, in every loader: the runtime
(`wide generate`), `load_pruned` / `wide eval` on exports of both formats, and `wide prune` /
`wide eval` on a model directory."""

from __future__ import annotations

import json

import pytest

from tests._exports import tiny_export
from wide_cli.cli.app import main
from wide_cli.errors import WideError
from wide_cli.export import load_pruned
from wide_cli.export.manifest import write_manifest
from wide_cli.models.tiny import char_tokenizer, tiny_model


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    if (d / "manifest.json").is_file():
        write_manifest(d, export_id=json.loads((d / "manifest.json").read_text())["export_id"])


def _export(out, fmt):
    tiny_export(out, fmt)
    return out


def _says_both_numbers(msg: str):
    assert "config.json says num_key_value_heads 4" in msg, msg
    assert "k_proj.weight" in msg and "32 rows = 2 KV heads of head_dim 16" in msg, msg


@pytest.fixture(params=["wide", "hf"])
def edited_export(request, tmp_path):
    exp = _export(tmp_path / f"exp_{request.param}", request.param)
    _edit_config(exp, num_key_value_heads=4)
    return exp


def test_runtime_refuses_an_export_whose_config_disagrees_with_its_tensors(edited_export):
    from wide_cli.runtime.engine import Runtime

    with pytest.raises(WideError) as e:
        Runtime.from_export(edited_export, backend="reference")
    assert e.value.exit_code == 2
    _says_both_numbers(str(e.value))


def test_load_pruned_names_the_disagreeing_field(edited_export):
    with pytest.raises(WideError) as e:
        load_pruned(edited_export)
    assert e.value.exit_code == 2
    _says_both_numbers(str(e.value))


@pytest.mark.parametrize("command", [["generate", "{exp}", "-p", "Hello", "--max-new-tokens", "2"],
                                     ["eval", "{exp}", "--eval-data", "{text}", "--seq-len", "64"]])
def test_commands_exit_2_with_one_line_on_an_edited_config(edited_export, text_file, capsys, command):
    code = main([a.format(exp=edited_export, text=text_file) for a in command])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    _says_both_numbers(err)


@pytest.fixture
def edited_model_dir(tmp_path):
    d = tmp_path / "model"
    tiny_model("llama").save_pretrained(d)
    char_tokenizer(with_pad=False).save_pretrained(d)
    _edit_config(d, num_key_value_heads=4)
    return d


@pytest.mark.parametrize("command", [
    ["prune", "{model}", "--data", "{text}", "--run-dir", "{run}", "--steps", "1", "--seq-len", "32"],
    ["eval", "{model}", "--eval-data", "{text}", "--seq-len", "64"],
])
def test_model_directory_with_an_inconsistent_config_is_exit_2_not_a_runtime_error(
        edited_model_dir, text_file, tmp_path, capsys, command):
    code = main([a.format(model=edited_model_dir, text=text_file, run=tmp_path / "run") for a in command])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "RuntimeError" not in err and len(err.strip().splitlines()) == 1, err
    _says_both_numbers(err)
    assert not (tmp_path / "run" / "stage1").exists()
