"""Tokenize documents and pack them into fixed-length training sequences, with an on-disk cache.

Layout: every document is tokenized without special tokens and followed by one EOS id; the
documents are concatenated into one stream and cut into ``[N, seq_len]`` rows (the incomplete
tail is dropped). The last ``ceil(heldout_fraction * N)`` rows are the held-out split. Every
token of a row is a real token (no padding), so loss and sparsity count all of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from wide_cli.atomic import atomic_write_bytes
from wide_cli.data.sources import read_documents, source_fingerprint
from wide_cli.errors import ConfigError, DataError

logger = logging.getLogger("wide")

#: Bump when the packing layout changes: old cache entries then miss.
PACKING_VERSION = 1
_TOKENIZE_BATCH = 64  # documents per tokenizer call (fast tokenizers parallelize a batch)


@dataclass
class PackedData:
    """Packed token ids.

    Attributes:
        train: ``[N_train, seq_len]`` int64 token ids.
        heldout: ``[N_heldout, seq_len]`` int64 token ids (the last rows of the packed stream).
        meta: ``source``, ``tokenizer`` (name), ``tokenizer_hash``, ``seq_len``, ``n_documents``
            (documents packed), ``n_tokens`` (stream length incl. EOS, after ``max_tokens``),
            ``n_tokens_dropped`` (tail), ``n_train``, ``n_heldout``, ``eos_id``, ``vocab_size``,
            ``heldout_fraction``, ``max_tokens``, ``seed``, ``cache_key``.
    """

    train: torch.Tensor
    heldout: torch.Tensor
    meta: dict


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (hex, 16 chars) of the tokenizer's class name, vocabulary and EOS id."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps([type(tokenizer).__name__, tokenizer.eos_token_id, vocab], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def token_stream(text: str, tokenizer) -> torch.Tensor:
    """Tokenize one evaluation text (e.g. a whole WikiText file) as a single stream.

    Returns:
        ``[N]`` int64 token ids, no special tokens added.
    """
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _check_settings(seq_len: int, heldout_fraction: float, max_tokens: int | None) -> None:
    if int(seq_len) < 2:
        raise ConfigError(f"seq-len {seq_len} must be >= 2")
    if not (0.0 <= heldout_fraction < 1.0):
        raise ConfigError(f"heldout fraction {heldout_fraction} is outside [0, 1)", "use e.g. 0.1")
    if max_tokens is not None and max_tokens < seq_len:
        raise ConfigError(f"max-tokens {max_tokens} is smaller than seq-len {seq_len}",
                          "raise --max-tokens or lower --seq-len")


def _tokenize(docs: list[str], tokenizer, eos_id: int, max_tokens: int | None) -> tuple[list[int], int]:
    """Concatenate ``doc + [EOS]`` for each doc; stop after ``max_tokens``. Returns (stream, docs used)."""
    stream: list[int] = []
    used = 0
    for start in range(0, len(docs), _TOKENIZE_BATCH):
        batch = docs[start : start + _TOKENIZE_BATCH]
        for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(eos_id)
            used += 1
            if max_tokens is not None and len(stream) >= max_tokens:
                return stream[:max_tokens], used
    return stream, used


def pack_documents(
    docs: list[str],
    tokenizer,
    seq_len: int,
    *,
    heldout_fraction: float = 0.1,
    max_tokens: int | None = None,
    seed: int | None = 0,
) -> PackedData:
    """Pack documents into ``[N, seq_len]`` rows and split off the held-out rows.

    Args:
        docs: document strings.
        tokenizer: a Hugging Face tokenizer with an EOS token.
        seq_len: tokens per row (>= 2).
        heldout_fraction: fraction of rows held out (the last ``ceil(fraction * N)``, at least 1
            when > 0); in [0, 1).
        max_tokens: cap on the packed stream (documents are tokenized lazily up to it).
        seed: documents are shuffled with ``random.Random(seed)`` before packing, so that the
            held-out rows and a ``max_tokens`` cut are a random sample of the documents rather
            than the last files of a sorted directory; None keeps the given order.

    Returns:
        ``PackedData`` (``meta["source"]`` and ``meta["cache_key"]`` are None here).

    Raises:
        ConfigError: bad ``seq_len`` / ``heldout_fraction`` / ``max_tokens``.
        DataError: no EOS token, or fewer tokens than one row (one train + one held-out row when
            ``heldout_fraction > 0``), naming the token count and ``seq_len``.
    """
    from wide_cli.models.loader import check_token_ids

    _check_settings(seq_len, heldout_fraction, max_tokens)
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError("the tokenizer has no EOS token to separate documents", "use a model whose tokenizer has one")
    docs = [d for d in docs if d.strip()]
    if seed is not None:
        docs = list(docs)
        random.Random(seed).shuffle(docs)
    stream, n_docs = _tokenize(docs, tokenizer, eos_id, max_tokens)

    n_rows = len(stream) // seq_len
    need = 2 if heldout_fraction > 0 else 1
    if n_rows < need:
        what = "one training and one held-out sequence" if need == 2 else "one sequence"
        raise DataError(
            f"only {len(stream)} tokens from {n_docs} documents: too few for {what} of seq-len {seq_len} "
            f"(need {need * seq_len})",
            "use a smaller --seq-len or more data",
        )
    ids = torch.tensor(stream[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)
    check_token_ids(ids, len(tokenizer))
    # round(): 0.3 * 10 is 3.0000000000000004 in floats, which must not ceil to 4.
    n_heldout = 0 if heldout_fraction == 0 else min(max(1, math.ceil(round(heldout_fraction * n_rows, 9))), n_rows - 1)
    train, heldout = ids[: n_rows - n_heldout].clone(), ids[n_rows - n_heldout :].clone()
    meta = {
        "source": None,
        "tokenizer": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
        "tokenizer_hash": tokenizer_fingerprint(tokenizer),
        "seq_len": int(seq_len),
        "n_documents": n_docs,
        "n_tokens": len(stream),
        "n_tokens_dropped": len(stream) - n_rows * seq_len,
        "n_train": int(train.shape[0]),
        "n_heldout": int(heldout.shape[0]),
        "eos_id": int(eos_id),
        "vocab_size": len(tokenizer),
        "heldout_fraction": float(heldout_fraction),
        "max_tokens": max_tokens,
        "seed": seed,
        "cache_key": None,
        "version": PACKING_VERSION,
    }
    return PackedData(train=train, heldout=heldout, meta=meta)


def cache_key(source: str, tokenizer, seq_len: int, *, heldout_fraction: float, max_tokens: int | None,
              seed: int | None, extra_source: str | None = None) -> str:
    """Hex key of everything that determines the packed tensors."""
    extra = {} if extra_source is None else {"extra_source": source_fingerprint(extra_source)}
    blob = json.dumps(
        {
            **extra,
            "version": PACKING_VERSION,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "source": source_fingerprint(source),
            "seq_len": int(seq_len),
            "heldout_fraction": float(heldout_fraction),
            "max_tokens": max_tokens,
            "seed": seed,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_or_build(
    source: str,
    tokenizer,
    seq_len: int,
    *,
    cache_dir: Path,
    heldout_fraction: float = 0.1,
    max_tokens: int | None = None,
    seed: int | None = 0,
    extra_source: str | None = None,
) -> PackedData:
    """Packed data for ``source``, from ``cache_dir`` when an entry with the same key exists.
    ``extra_source``: a second source whose documents come before ``source``'s (in the key too).

    The key covers the tokenizer (class, vocab, EOS), the source (file paths, sizes, mtimes, or
    the id), ``seq_len``, ``heldout_fraction``, ``max_tokens`` and ``seed``. An entry is
    ``packed-<key>.safetensors`` (tensors ``train``, ``heldout``) + ``packed-<key>.json`` (meta),
    each written atomically; the JSON is written last and must name the key, so a torn entry
    is rebuilt.

    Raises:
        DataError / ConfigError: as ``read_documents`` and ``pack_documents``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save

    _check_settings(seq_len, heldout_fraction, max_tokens)
    cache_dir = Path(cache_dir)
    key = cache_key(source, tokenizer, seq_len, heldout_fraction=heldout_fraction, max_tokens=max_tokens,
                    seed=seed, extra_source=extra_source)
    tensors_path = cache_dir / f"packed-{key}.safetensors"
    meta_path = cache_dir / f"packed-{key}.json"
    if tensors_path.exists() and meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            tensors = load_file(str(tensors_path))
            if meta.get("cache_key") == key:
                logger.info("packed data cache hit: %s", tensors_path)
                return PackedData(train=tensors["train"], heldout=tensors["heldout"], meta=meta)
        except (OSError, ValueError, KeyError, SafetensorError) as e:  # torn or foreign entry: rebuild it
            logger.warning("ignoring unreadable packed-data cache %s (%s)", tensors_path, e)

    docs = (read_documents(extra_source) if extra_source else []) + read_documents(source)
    packed = pack_documents(docs, tokenizer, seq_len, heldout_fraction=heldout_fraction,
                            max_tokens=max_tokens, seed=seed)
    packed.meta.update(source=source, cache_key=key)
    if extra_source:
        packed.meta["extra_source"] = extra_source
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(tensors_path, save({"train": packed.train.contiguous(), "heldout": packed.heldout.contiguous()}))
    atomic_write_bytes(meta_path, (json.dumps(packed.meta, indent=2) + "\n").encode())
    logger.info("packed %d documents into %d+%d sequences of %d tokens (cached at %s)", packed.meta["n_documents"],
                packed.meta["n_train"], packed.meta["n_heldout"], seq_len, tensors_path)
    return packed
