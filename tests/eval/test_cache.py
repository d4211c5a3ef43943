"""`wide eval --cache-dir`: a model's row is reused only when model, data, settings and code match."""

from __future__ import annotations

import os

import pytest

from tests.eval.test_report import _routed_export
from wide_cli.eval import run
from wide_cli.eval.run import evaluate_targets

PAGES = "".join(
    f" = Page {i} = \n \n The page number {i} talks about things and more things , again and again . \n \n"
    for i in range(6)
)


@pytest.fixture
def small_data(tmp_path):
    d = tmp_path / "data"
    (d / "wikitext-2-raw").mkdir(parents=True)
    (d / "wikitext-2-raw" / "wiki.test.raw").write_text(PAGES)
    return d


def _eval(exp, data, cache, **kw):
    args = {"tasks": ["wikitext"], "data_dir": data, "seq_len": 16, "batch_size": 2, "cache_dir": cache}
    args.update(kw)
    return evaluate_targets([str(exp)], **args)


def test_rows_are_reused_only_when_everything_matches(tmp_path, small_data, monkeypatch):
    exp = _routed_export(tmp_path / "exp", {"spec": "tiny", "resolved": "x", "revision": None})
    cache = tmp_path / "cache"
    first = _eval(exp, small_data, cache)
    assert len(list(cache.glob("*.json"))) == 1
    calls = []
    real = run.evaluate_model
    monkeypatch.setattr(run, "evaluate_model", lambda t, p: calls.append(p) or real(t, p))
    again = _eval(exp, small_data, cache)
    assert calls == [] and again["rows"] == first["rows"]
    # another setting, changed data, another export: each is a miss, evaluated and stored
    _eval(exp, small_data, cache, seq_len=8)
    assert len(calls) == 1
    raw = small_data / "wikitext-2-raw" / "wiki.test.raw"
    raw.write_text(PAGES + " = Page 7 = \n \n More text here . \n \n")
    _eval(exp, small_data, cache)
    assert len(calls) == 2
    other = _routed_export(tmp_path / "exp2", {"spec": "tiny", "resolved": "x", "revision": None})
    _eval(other, small_data, cache)
    assert len(calls) == 3
    assert len(list(cache.glob("*.json"))) == 4
    os.utime(raw, ns=(0, 0))  # same bytes, other mtime: treated as changed data
    _eval(other, small_data, cache)
    assert len(calls) == 4


def test_code_and_library_versions_are_part_of_the_key(tmp_path, small_data, monkeypatch):
    import transformers

    from wide_cli.eval import cache

    exp = _routed_export(tmp_path / "exp", {"spec": "tiny", "resolved": "x", "revision": None})
    store = tmp_path / "cache"
    _eval(exp, small_data, store)
    calls = []
    real = run.evaluate_model
    monkeypatch.setattr(run, "evaluate_model", lambda t, p: calls.append(p) or real(t, p))
    cache.code_fingerprint.cache_clear()
    monkeypatch.setattr(transformers, "__version__", "0.0.0-other")
    _eval(exp, small_data, store)
    assert len(calls) == 1 and len(list(store.glob("*.json"))) == 2
    cache.code_fingerprint.cache_clear()
