"""Reading documents from files, directories, builtins and dataset ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wide_cli.data.sources import read_documents, source_fingerprint
from wide_cli.errors import DataError

SHARED = Path(__file__).resolve().parents[2].parent / "shared"  # <repo>/../shared
CORPUS = SHARED / "data" / "corpus"
WIKITEXT = SHARED / "data" / "wikitext-2-raw"


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first doc\nline two\n\n\nsecond doc\n  \nthird\n")
    assert read_documents(str(p)) == ["first doc\nline two", "second doc", "third"]


def test_wikitext_style_files_stay_whole(tmp_path):
    text = " \n = Title = \n \n Para one . \n \n = = Section = = \n \n Para two . \n"
    for name in ("w.txt", "wiki.test.raw"):
        p = tmp_path / name
        p.write_text(text)
        assert read_documents(str(p)) == [text]


def test_jsonl_text_and_content_fields(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", [{"text": "one", "url": "u"}, {"content": "two"}, "", '"three"',
                                            {"text": "   "}])
    assert read_documents(str(p)) == ["one", "two", "three"]
    q = _write_jsonl(tmp_path / "e.jsonl", [{"body": "x", "text": "y"}])
    assert read_documents(str(q), text_field="body") == ["x"]


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, "", '{"text": "broken'])
    with pytest.raises(DataError, match=rf"{p}:3: malformed JSON"):
        read_documents(str(p))
    q = _write_jsonl(tmp_path / "nofield.jsonl", [{"text": "ok"}, {"goal": "g", "sol1": "s"}])
    with pytest.raises(DataError, match=rf"{q}:2: no 'text' or 'content' field \(keys: goal, sol1\)"):
        read_documents(str(q))
    r = _write_jsonl(tmp_path / "num.jsonl", [{"text": 3}])
    with pytest.raises(DataError, match=rf"{r}:1: field 'text' is int"):
        read_documents(str(r))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["alpha", "beta"], "id": [1, 2]}), p)
    assert read_documents(str(p)) == ["alpha", "beta"]
    q = tmp_path / "x.parquet"
    pq.write_table(pa.table({"body": ["alpha"]}), q)
    with pytest.raises(DataError, match="no 'text' column"):
        read_documents(str(q))


def test_directory_is_recursive_sorted_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".hidden").mkdir()
    _write_jsonl(tmp_path / "b" / "x.jsonl", [{"text": "b/x"}])
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "a1"}, {"text": "a2"}])
    (tmp_path / "c.txt").write_text("c1\n\nc2")
    (tmp_path / "notes.md").write_text("ignored")
    _write_jsonl(tmp_path / ".hidden" / "h.jsonl", [{"text": "hidden"}])
    assert read_documents(str(tmp_path)) == ["a1", "a2", "b/x", "c1", "c2"]
    fp = source_fingerprint(str(tmp_path))
    assert [Path(f[0]).name for f in fp["files"]] == ["a.jsonl", "x.jsonl", "c.txt"]


def test_builtin_pydoc_is_large_and_deterministic():
    docs = read_documents("builtin:pydoc")
    assert sum(len(d.split()) for d in docs) > 50_000
    assert docs == read_documents("builtin:pydoc")
    with pytest.raises(DataError, match="unknown builtin data source 'builtin:nope'.*builtin:pydoc"):
        read_documents("builtin:nope")


@pytest.mark.parametrize("source", ["./no/such/dir", "missing.jsonl", "no/such/file.txt", "/abs/missing"])
def test_missing_path_is_named(source):
    with pytest.raises(DataError, match=f"data path '{source}' does not exist"):
        read_documents(source)


def test_empty_sources(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(DataError, match="contains no text"):
        read_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="has no .txt/.raw/.jsonl/.parquet files"):
        read_documents(str(tmp_path / "d"))


def test_unloadable_dataset_id_says_so():
    with pytest.raises(DataError) as e:
        read_documents("wide-test-nobody/no-such-dataset:cfg")
    msg = str(e.value)
    assert "'wide-test-nobody/no-such-dataset:cfg' is not a local path and could not be loaded" in msg
    assert "local .txt/.jsonl/.parquet file" in msg


def test_fingerprint_changes_with_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("one")
    before = source_fingerprint(str(p))
    p.write_text("one two")
    assert source_fingerprint(str(p)) != before
    assert source_fingerprint("org/name:cfg") == {"dataset": "org/name:cfg"}


@pytest.mark.real_data
@pytest.mark.skipif(not CORPUS.is_dir(), reason=f"{SHARED / 'data'} is absent")
def test_real_corpus_files():
    docs = read_documents(str(CORPUS / "c4_en_sample200.jsonl"))
    assert len(docs) == 200
    wiki = read_documents(str(CORPUS / "wikipedia_en_2024_00.jsonl"))
    assert len(wiki) == 107 and all(len(d) >= 500 for d in wiki)


@pytest.mark.real_data
@pytest.mark.skipif(not WIKITEXT.is_dir(), reason=f"{SHARED / 'data'} is absent")
def test_real_wikitext_raw_is_one_document():
    (doc,) = read_documents(str(WIKITEXT / "wiki.test.raw"))
    assert doc.startswith(" \n = Robert Boulter = \n")
