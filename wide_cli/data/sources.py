"""Read raw text documents from a data source (DESIGN.md §2).

A source is one of:

- a ``.txt`` file: documents separated by blank lines. A WikiText-style raw file (``.raw``, or
  `` = Title = `` heading lines) is kept whole as one document, since its blank lines separate
  paragraphs of one article stream, not documents;
- a ``.jsonl`` file: one JSON object per line with a ``text`` field (``content`` also accepted),
  like every file in ``../shared/data/corpus``; a bare JSON string per line also works;
- a ``.parquet`` file with a ``text`` (or ``content``) column;
- a directory of such files (recursive, sorted by relative path, hidden files skipped);
- ``builtin:pydoc``: CPython's ``pydoc_data.topics`` (~65k words of English prose, no network);
- a Hugging Face dataset id ``name[:config]`` (``train`` split), read from the local datasets
  cache when the Hub cannot be reached.

Documents are returned in a deterministic order; whitespace-only documents are dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from wide_cli.errors import DataError

TEXT_FIELDS = ("text", "content")
FILE_SUFFIXES = (".txt", ".raw", ".jsonl", ".parquet")
BUILTINS = {"builtin:pydoc": "CPython's pydoc_data.topics (~65k words of English prose)"}

_WIKITEXT_HEADING = re.compile(r"^ = [^=\n].* = $", re.MULTILINE)
_HUB_DATASET = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")
_LOCAL_HINT = "pass a local .txt/.jsonl/.parquet file or directory, or builtin:pydoc"


def read_documents(source: str, *, text_field: str | None = None) -> list[str]:
    """Read the documents of ``source`` (see the module docstring for the accepted forms).

    Args:
        source: path, ``builtin:NAME`` or Hugging Face dataset id ``name[:config]``.
        text_field: JSONL field / parquet or dataset column to read; None tries ``text`` then
            ``content``.

    Returns:
        Non-empty document strings, in a deterministic order.

    Raises:
        DataError: a missing path, a malformed JSONL line (naming ``file:line``), a missing text
            field, an unknown builtin, a dataset that cannot be loaded, or no text at all.
    """
    docs = _read(source, text_field)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"data source {source!r} contains no text", _LOCAL_HINT)
    return docs


def source_fingerprint(source: str) -> dict:
    """What identifies the content of ``source`` for caching, without reading it.

    Files: resolved path, size and mtime (ns) of every file; builtins: the Python version;
    Hugging Face ids: the id itself.
    """
    if source in BUILTINS:
        return {"builtin": source, "python": sys.version.split()[0]}
    path = Path(source).expanduser()
    if path.exists():
        files = _files_under(path) if path.is_dir() else [path]
        return {
            "path": str(path.resolve()),
            "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        }
    return {"dataset": source}


# ----------------------------------------------------------------------------------------------


def _read(source: str, text_field: str | None) -> list[str]:
    if source.startswith("builtin:"):
        if source not in BUILTINS:
            raise DataError(f"unknown builtin data source {source!r}", f"choose one of {', '.join(BUILTINS)}")
        return _read_pydoc()
    path = Path(source).expanduser()
    if path.is_dir():
        files = _files_under(path)
        if not files:
            raise DataError(f"data directory {source!r} has no {'/'.join(FILE_SUFFIXES)} files", _LOCAL_HINT)
        return [doc for f in files for doc in _read_file(f, text_field)]
    if path.is_file():
        return _read_file(path, text_field)
    looks_like_path = path.suffix.lower() in FILE_SUFFIXES + (".json", ".gz", ".csv") or source.startswith(
        (".", "/", "~")
    )
    if looks_like_path or not _HUB_DATASET.match(source):
        raise DataError(f"data path {source!r} does not exist", _LOCAL_HINT)
    return _read_hub(source, text_field)


def _files_under(root: Path) -> list[Path]:
    files = [
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in FILE_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_file(path: Path, text_field: str | None) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, text_field)
    if suffix == ".parquet":
        return _read_parquet(path, text_field)
    if suffix in (".txt", ".raw"):
        text = _read_text(path)
        if suffix == ".raw" or _WIKITEXT_HEADING.search(text):
            return [text]
        return [chunk.strip() for chunk in re.split(r"\n[ \t]*\n", text)]
    raise DataError(f"unsupported data file {str(path)!r}", f"use one of {', '.join(FILE_SUFFIXES)}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start})", "convert it to UTF-8") from None


def _pick_field(keys, text_field: str | None) -> str | None:
    for name in (text_field,) if text_field else TEXT_FIELDS:
        if name in keys:
            return name
    return None


def _read_jsonl(path: Path, text_field: str | None) -> list[str]:
    wanted = repr(text_field) if text_field else " or ".join(repr(f) for f in TEXT_FIELDS)
    hint = f"each line must be a JSON object with a {wanted} string field"
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg}, column {e.colno})", hint) from None
            if isinstance(obj, str):
                docs.append(obj)
                continue
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}", hint)
            key = _pick_field(obj, text_field)
            if key is None:
                raise DataError(f"{path}:{lineno}: no {wanted} field (keys: {', '.join(sorted(obj)) or 'none'})",
                                hint)
            if not isinstance(obj[key], str):
                raise DataError(f"{path}:{lineno}: field {key!r} is {type(obj[key]).__name__}, not a string", hint)
            docs.append(obj[key])
    return docs


def _read_parquet(path: Path, text_field: str | None) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"cannot read parquet file {str(path)!r}: {e}", "check that the file is complete") from None
    col = _pick_field(table.column_names, text_field)
    if col is None:
        raise DataError(f"{path}: no {text_field or 'text'!r} column (columns: {', '.join(table.column_names)})",
                        "pass text_field= with the column that holds the text")
    return [t for t in table.column(col).to_pylist() if isinstance(t, str)]


def _read_pydoc() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _hub_reachable(timeout: float = 2.0) -> bool:
    """A quick TCP probe of the Hub endpoint, so offline machines skip ~25 s of HTTP retries."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline_hub():
    """Put datasets + huggingface_hub in offline mode (cache only) for the duration of the block."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _read_hub(source: str, text_field: str | None) -> list[str]:
    import datasets

    name, _, config = source.partition(":")
    online = _hub_reachable()
    ctx = contextlib.nullcontext() if online else _offline_hub()
    try:
        with ctx:
            ds = datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError)
        where = "" if online else " (the Hugging Face Hub is unreachable and it is not in the local datasets cache)"
        raise DataError(
            f"data source {source!r} is not a local path and could not be loaded as a Hugging Face "
            f"dataset{where}: {type(e).__name__}",
            _LOCAL_HINT,
        ) from e
    col = _pick_field(ds.column_names, text_field)
    if col is None:
        raise DataError(f"dataset {source!r} has no {text_field or 'text'!r} column "
                        f"(columns: {', '.join(ds.column_names)})",
                        "pass text_field= with the column that holds the text")
    return [t for t in ds[col] if isinstance(t, str)]
