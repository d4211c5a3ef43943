"""Model-cache entries are published atomically (``wide_cli.atomic``): complete or absent."""

from __future__ import annotations

import json

import pytest

from wide_cli.models import loader


def _entries(parent):
    return sorted(p.name for p in parent.iterdir())


def _writer(payload: str):
    def build(tmp):
        (tmp / "config.json").write_text(payload)
        (tmp / loader._SOURCE_FILE).write_text(json.dumps({"payload": payload}))

    return build


def test_a_failed_build_publishes_nothing(tmp_path):
    final = tmp_path / "models" / "m"

    def build(tmp):
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        loader._build_cache_entry(final, build)
    assert _entries(final.parent) == []  # neither the entry nor a temp directory


def test_a_stale_entry_is_replaced_whole(tmp_path):
    final = tmp_path / "m"
    loader._build_cache_entry(final, _writer("old"))
    (final / "extra.bin").write_text("from the old build")
    loader._build_cache_entry(final, _writer("new"))
    assert _entries(final) == sorted(["config.json", loader._SOURCE_FILE])
    assert (final / "config.json").read_text() == "new" and _entries(tmp_path) == ["m"]


def test_an_entry_published_meanwhile_by_another_process(tmp_path):
    final = tmp_path / "m"

    def build(tmp):
        theirs = final.parent / "theirs"  # another process finishes first
        theirs.mkdir()
        _writer("theirs")(theirs)
        theirs.rename(final)
        _writer("ours")(tmp)

    loader._build_cache_entry(final, build)
    assert json.loads((final / loader._SOURCE_FILE).read_text())["payload"] in ("ours", "theirs")
    assert _entries(tmp_path) == ["m"]  # no temp or moved-aside copy left behind
