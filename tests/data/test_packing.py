"""Packing documents into fixed-length rows, held-out split, and the on-disk cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from wide_cli.data.packing import load_or_build, pack_documents, token_stream
from wide_cli.errors import ConfigError, DataError
from wide_cli.models.tiny import char_tokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared"  # <repo>/../shared
CORPUS = SHARED / "data" / "corpus"
EOS = 2
A, B, C, D, E = 15, 16, 17, 18, 19  # char ids: 5 specials, then "0123456789abcde..."


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(with_pad=False)


def test_char_ids_are_what_the_tests_assume(tok):
    assert tok("abcde", add_special_tokens=False)["input_ids"] == [A, B, C, D, E]
    assert tok.eos_token_id == EOS


def test_exact_layout_with_eos_after_each_document(tok):
    p = pack_documents(["ab", "c", "", "de", "a"], tok, 3, heldout_fraction=0.3, seed=None)
    # stream: a b EOS c EOS d e EOS a EOS (10 tokens) -> 3 rows of 3, tail [EOS] dropped
    assert p.train.tolist() == [[A, B, EOS], [C, EOS, D]]
    assert p.heldout.tolist() == [[E, EOS, A]]
    assert p.train.dtype == torch.long
    m = p.meta
    assert (m["n_documents"], m["n_tokens"], m["n_tokens_dropped"], m["n_train"], m["n_heldout"]) == (4, 10, 1, 2, 1)
    assert (m["eos_id"], m["seq_len"], m["heldout_fraction"], m["vocab_size"]) == (EOS, 3, 0.3, len(tok))


@pytest.mark.parametrize(
    "rows, fraction, heldout",
    [(10, 0.1, 1), (10, 0.3, 3), (10, 0.25, 3), (3, 0.01, 1), (10, 0.0, 0), (2, 0.9, 1), (7, 0.5, 4)],
)
def test_heldout_is_last_ceil_fraction_rows(tok, rows, fraction, heldout):
    seq_len = 4
    doc = "abcde" * rows
    p = pack_documents([doc[: rows * seq_len - 1]], tok, seq_len, heldout_fraction=fraction, seed=None)
    assert (p.train.shape, p.heldout.shape) == ((rows - heldout, seq_len), (heldout, seq_len))
    whole = torch.cat([p.train, p.heldout]).reshape(-1)
    assert whole[-1] == EOS and len(whole) == rows * seq_len


def test_seed_shuffles_documents_deterministically(tok):
    docs = [c * 3 for c in "abcdefghij"]
    p0, p0b = (pack_documents(docs, tok, 4, heldout_fraction=0.2, seed=0) for _ in range(2))
    p1 = pack_documents(docs, tok, 4, heldout_fraction=0.2, seed=1)
    ordered = pack_documents(docs, tok, 4, heldout_fraction=0.2, seed=None)
    assert torch.equal(p0.train, p0b.train) and torch.equal(p0.heldout, p0b.heldout)
    assert not torch.equal(p0.train, ordered.train) and not torch.equal(p0.train, p1.train)
    assert sorted(torch.cat([p0.train, p0.heldout]).flatten().tolist()) == sorted(
        torch.cat([ordered.train, ordered.heldout]).flatten().tolist())


def test_max_tokens_caps_the_stream(tok):
    p = pack_documents(["abcd"] * 100, tok, 5, heldout_fraction=0.1, max_tokens=23, seed=None)
    assert p.meta["n_tokens"] == 23 and p.meta["n_documents"] == 5
    assert p.train.shape[0] + p.heldout.shape[0] == 4


def test_too_short_data_names_counts(tok):
    with pytest.raises(DataError) as e:
        pack_documents(["abcd"], tok, 8, heldout_fraction=0.0)
    msg = str(e.value)
    assert "only 5 tokens" in msg and "seq-len 8" in msg and "smaller --seq-len or more data" in msg
    with pytest.raises(DataError, match="only 9 tokens .* one training and one held-out sequence of seq-len 8"):
        pack_documents(["abcdefgh"], tok, 8, heldout_fraction=0.1)


def test_bad_settings(tok):
    with pytest.raises(ConfigError, match="heldout fraction 1.0"):
        pack_documents(["abc"], tok, 2, heldout_fraction=1.0)
    with pytest.raises(ConfigError, match="seq-len 1"):
        pack_documents(["abc"], tok, 1)


def test_token_stream(tok):
    ids = token_stream("ab\nc", tok)
    assert ids.dtype == torch.long and ids.tolist() == [A, B, tok.convert_tokens_to_ids("\n"), C]


def _jsonl(path: Path, n: int) -> str:
    path.write_text("".join(json.dumps({"text": f"document number {i} " * 3}) + "\n" for i in range(n)))
    return str(path)


def test_cache_hit_is_identical_and_changes_miss(tok, tmp_path, monkeypatch, caplog):
    src = _jsonl(tmp_path / "d.jsonl", 40)
    cache = tmp_path / "cache"
    first = load_or_build(src, tok, 16, cache_dir=cache)
    assert first.meta["source"] == src and first.meta["cache_key"]
    assert len(list(cache.glob("packed-*.safetensors"))) == 1

    from wide_cli.data import packing

    def no_read(_):
        raise AssertionError("cache hit expected: documents must not be read again")

    monkeypatch.setattr(packing, "read_documents", no_read)
    with caplog.at_level(logging.INFO, logger="wide"):
        again = load_or_build(src, tok, 16, cache_dir=cache)
    assert "cache hit" in caplog.text
    assert torch.equal(again.train, first.train) and torch.equal(again.heldout, first.heldout)
    assert again.meta == first.meta
    monkeypatch.undo()

    other = load_or_build(src, tok, 8, cache_dir=cache)  # seq_len change: a miss
    assert other.train.shape[1] == 8 and other.meta["cache_key"] != first.meta["cache_key"]
    load_or_build(src, tok, 16, cache_dir=cache, heldout_fraction=0.2)
    load_or_build(src, tok, 16, cache_dir=cache, max_tokens=200)
    assert len(list(cache.glob("packed-*.safetensors"))) == 4
    _jsonl(Path(src), 41)  # the source changed: a miss
    assert load_or_build(src, tok, 16, cache_dir=cache).meta["cache_key"] != first.meta["cache_key"]
    assert not list(cache.glob(".*"))  # no temp files left


def test_torn_cache_entry_is_rebuilt(tok, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 40)
    cache = tmp_path / "cache"
    first = load_or_build(src, tok, 16, cache_dir=cache)
    (tensors,) = cache.glob("packed-*.safetensors")
    tensors.write_bytes(b"garbage")
    again = load_or_build(src, tok, 16, cache_dir=cache)
    assert torch.equal(again.train, first.train)


def test_zero_heldout_round_trips_through_cache(tok, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 10)
    a = load_or_build(src, tok, 16, cache_dir=tmp_path / "c", heldout_fraction=0.0)
    b = load_or_build(src, tok, 16, cache_dir=tmp_path / "c", heldout_fraction=0.0)
    assert a.heldout.shape == b.heldout.shape == (0, 16)


@pytest.mark.real_data
@pytest.mark.skipif(not CORPUS.is_dir(), reason=f"{SHARED / 'data'} is absent")
def test_real_corpus_packs(tok, tmp_path):
    p = load_or_build(str(CORPUS), tok, 64, cache_dir=tmp_path, max_tokens=64 * 50)
    assert p.train.shape == (45, 64) and p.heldout.shape == (5, 64)
    assert int(p.train.max()) < len(tok)
