"""wide never executes code shipped in an export it reads: an ``--format hf`` export loads into
wide's own classes, a modeling file that differs from what this wide generates is refused (one
line naming the file, exit 2), and only ``--trust-remote-code`` runs the shipped file."""

from __future__ import annotations

import json

import pytest
import torch

from tests._exports import tiny_export
from wide_cli.errors import CheckpointError
from wide_cli.export import load_pruned
from wide_cli.export.manifest import write_manifest

IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _hf_export(out):
    return tiny_export(out, "hf", skipping_routers=True)


def _plant_marker(export, marker):
    """Append one line that writes ``marker`` to the shipped modeling file and re-hash the
    manifest, as whoever edits a downloaded export would."""
    f = export / "modeling_wide.py"
    f.write_text(f.read_text() + f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    export_id = json.loads((export / "manifest.json").read_text())["export_id"]
    write_manifest(export, export_id=export_id)


@pytest.fixture
def planted(tmp_path):
    exp = tmp_path / "exp"
    _hf_export(exp)
    marker = tmp_path / "MARKER"
    _plant_marker(exp, marker)
    return exp, marker


def test_load_pruned_refuses_an_edited_modeling_file_without_running_it(planted):
    exp, marker = planted
    with pytest.raises(CheckpointError, match="modeling_wide.py") as e:
        load_pruned(exp)
    assert "--trust-remote-code" in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("command", [
    ["eval", "{exp}", "--seq-len", "64", "--eval-data", "{text}"],
    ["inspect", "{exp}", "--text", "{text}"],
    ["generate", "{exp}", "-p", "Hello", "--max-new-tokens", "2"],
    ["bench", "{exp}"],
])
def test_no_command_runs_code_shipped_in_an_export(planted, text_file, capsys, command):
    from wide_cli.cli.app import main

    exp, marker = planted
    args = [a.format(exp=exp, text=text_file) for a in command]
    code = main(args)
    err = capsys.readouterr().err
    assert not marker.exists(), f"`wide {command[0]}` executed the export's modeling_wide.py"
    if command[0] in ("eval", "inspect"):  # these load the model through transformers classes
        assert code == 2 and "modeling_wide.py" in err and len(err.strip().splitlines()) == 1, err


def test_trust_remote_code_runs_the_shipped_file(planted, text_file):
    from wide_cli.export.hf_format import load_hf_export

    exp, marker = planted
    load_hf_export(exp, trust_remote_code=True)
    assert marker.exists()


def test_intact_hf_export_loads_into_wides_own_classes_with_the_same_logits(tmp_path):
    exp = tmp_path / "exp"
    ref = _hf_export(exp)
    ref.wide_routing.set_mode("argmax")
    pm = load_pruned(exp)
    assert type(pm.model).__module__.startswith("wide_cli.")
    with torch.no_grad():
        torch.testing.assert_close(pm.model(IDS).logits, ref(IDS).logits, atol=1e-5, rtol=0)
