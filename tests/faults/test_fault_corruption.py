"""Damaged exports: truncated or bit-flipped files, a missing tokenizer file, a manifest copied
from another export. Every loader refuses with the damaged file's name; ``wide inspect`` too."""

from __future__ import annotations

import shutil

import pytest

from tests._exports import routed_tiny_llama
from wide_cli.errors import CheckpointError
from wide_cli.export import export_model, load_pruned
from wide_cli.export.hf_format import load_hf_export
from wide_cli.models.tiny import char_tokenizer

LOADERS = {"wide": load_pruned, "hf": load_hf_export}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One pristine export per format, plus a second wide export (for its manifest)."""
    root = tmp_path_factory.mktemp("faults-exports")
    out = {}
    for name, fmt in (("wide", "wide"), ("hf", "hf"), ("other", "wide")):
        model, cfg = routed_tiny_llama(seed=1 if name == "other" else 0)
        out[name] = export_model(model, char_tokenizer(), root / f"c_{name}",
                                 wide_config={"method": cfg.method, "routing": cfg.to_dict()},
                                 export_format=fmt).path
    return out


def _copy(exports, fmt, tmp_path):
    return shutil.copytree(exports[fmt], tmp_path / f"x_{fmt}")


def _short(msg, out) -> str:
    """The message without the export's temp path, cut to fit the summary table."""
    s = str(msg).replace(f"{out}/", "").replace(str(out), "<export>")
    return s if len(s) <= 75 else s[:74] + "…"


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p):
    data = bytearray(p.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01  # one bit, inside the tensor data
    p.write_bytes(bytes(data))


CASES = [
    ("wide", "model.safetensors", _truncate, "has .* bytes, the manifest says"),
    ("wide", "model.safetensors", _flip, "fails its sha256 check"),
    ("wide", "routers.safetensors", _flip, "fails its sha256 check"),
    ("wide", "tokenizer.json", lambda p: p.unlink(), "is listed in the manifest but missing"),
    ("hf", "model.safetensors", _truncate, "has .* bytes, the manifest says"),
    ("hf", "model.safetensors", _flip, "fails its sha256 check"),
    ("hf", "modeling_wide.py", _flip, "fails its sha256 check"),
    ("hf", "tokenizer.json", lambda p: p.unlink(), "is listed in the manifest but missing"),
]


@pytest.mark.parametrize("fmt,name,damage,message", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2].__name__.strip('_')}" for c in CASES])
def test_damaged_file_is_refused_naming_it(tmp_path, exports, fault, fmt, name, damage, message):
    out = _copy(exports, fmt, tmp_path)
    damage(out / name)
    with pytest.raises(CheckpointError, match=f"{name} {message}") as e:
        LOADERS[fmt](out)
    how = {"_truncate": "truncated", "_flip": "bit-flipped"}.get(damage.__name__, "missing")
    fault(f"{how} {name} ({fmt})", "refused: " + _short(e.value, out), True)


@pytest.mark.parametrize("fmt", ["wide", "hf"])
def test_truncated_weights_refused_even_without_the_manifest_check(tmp_path, exports, fault, fmt):
    out = _copy(exports, fmt, tmp_path)
    _truncate(out / "model.safetensors")
    with pytest.raises(CheckpointError, match="cannot load the weights of .*: model.safetensors: ") as e:
        LOADERS[fmt](out, verify=False)
    fault(f"truncated model.safetensors, verify=False ({fmt})", "refused: " + _short(e.value, out), True)


def test_manifest_from_another_export_is_refused(tmp_path, exports, fault):
    for fmt in ("wide", "hf"):
        out = _copy(exports, fmt, tmp_path)
        shutil.copy(exports["other"] / "manifest.json", out / "manifest.json")
        with pytest.raises(CheckpointError, match="manifest.json belongs to another export") as e:
            LOADERS[fmt](out)
    fault("manifest from another export", "refused: " + _short(e.value, out), True)


def test_inspect_refuses_a_damaged_export_in_one_line(tmp_path, exports, capsys, fault):
    from wide_cli.cli.app import main

    out = _copy(exports, "hf", tmp_path)
    _flip(out / "model.safetensors")
    code = main(["inspect", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    fault("bit-flipped weights under `wide inspect`", f"exit {code}: " + _short(err[-1] if err else "", out), True)
    assert code == 2 and len(err) == 1 and "model.safetensors fails its sha256 check" in err[0]
