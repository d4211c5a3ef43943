"""WikiText-2 (raw, v1) from the local raw files: dataset-name resolution, the two views of the
split that the two perplexity protocols use, and lm-eval's detokenizer.

Local layout: ``<data_dir>/wikitext-2-raw/wiki.{test,valid}.raw`` (the canonical raw files, one
paragraph or heading per line; see shared/data/PROVENANCE.md).

Two views of one raw file, rebuilt exactly as the Hugging Face loading scripts build them:

- *rows* (HF ``wikitext`` / ``wikitext-2-raw-v1``, the view pruning papers join with ``"\\n\\n"``):
  one row per line of the file, newline kept; whitespace-only lines become ``""``.
- *pages* (HF ``EleutherAI/wikitext_document_level`` / ``wikitext-2-raw-v1``, the dataset lm-eval's
  ``wikitext`` task reads, field ``page``): the file is split on ``"\\n"``; a new page starts at
  every line that, after ``"= = =" -> "==="`` and ``"= =" -> "=="`` and stripping, starts with
  ``"= "`` and ends with ``" ="`` (a level-1 title such as `` = Robert Boulter = ``); a page is the
  ``"\\n"``-join of its lines, empty pages are skipped, the last page is always kept. The test split
  gives 62 pages (the harness's document count).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from wide_cli.errors import DataError

logger = logging.getLogger("wide.eval")

CANONICAL = "wikitext-2-raw-v1"
SPLIT_FILES = {"test": "wiki.test.raw", "validation": "wiki.valid.raw"}

# Names we accept for WikiText-2 raw v1, and whether accepting them needs a log line (ambiguous).
_ALIASES: dict[str, bool] = {
    "wikitext-2-raw-v1": False,
    "wikitext2": False,
    "wikitext-2": False,
    "wikitext-2-raw": False,
    "wikitext": True,  # lm-eval's task name; could also mean WikiText-103 to a reader
}
_REFUSED = re.compile(r"^wikitext-?103|^wikitext-2-v1$")


def resolve_dataset(name: str) -> str:
    """Map a user's dataset name to ``wikitext-2-raw-v1`` or refuse it.

    ``wikitext`` is resolved with an explicit log line; WikiText-103 and the tokenized
    ``wikitext-2-v1`` (with ``<unk>``) are refused: a different dataset gives perplexities that
    look like model bugs (e.g. 333 vs 83 windows).

    Raises:
        DataError: an unknown or refused name, listing the accepted ones.
    """
    key = name.strip().lower()
    if key in _ALIASES:
        if _ALIASES[key]:
            logger.warning("dataset %r resolved to %s (WikiText-2, raw, v1; lm-eval's `wikitext` task), "
                           "not WikiText-103", name, CANONICAL)
        return CANONICAL
    if _REFUSED.match(key):
        raise DataError(f"dataset {name!r} is not WikiText-2 raw v1 and is not available locally",
                        f"use {CANONICAL} (papers' WikiText-2 perplexity); WikiText-103 gives other numbers")
    raise DataError(f"unknown perplexity dataset {name!r}",
                    f"accepted: {', '.join(_ALIASES)} (all mean {CANONICAL})")


def raw_path(data_dir: Path, split: str = "test") -> Path:
    """Path of the raw file of ``split`` under ``data_dir``.

    Raises:
        DataError: unknown split, or the file is missing.
    """
    if split not in SPLIT_FILES:
        raise DataError(f"unknown WikiText-2 split {split!r}", f"use one of {', '.join(SPLIT_FILES)}")
    p = Path(data_dir) / "wikitext-2-raw" / SPLIT_FILES[split]
    if not p.is_file():
        raise DataError(f"WikiText-2 raw file {p} not found",
                        "pass --data-dir pointing at shared/data (it holds wikitext-2-raw/)")
    return p


def read_raw(data_dir: Path, split: str = "test") -> str:
    """The raw file's text (UTF-8, LF)."""
    return raw_path(data_dir, split).read_text(encoding="utf-8")


def _is_title(line: str) -> bool:
    r = line.replace("= = =", "===").replace("= =", "==").strip()
    return r.startswith("= ") and r.endswith(" =")


def page_spans(raw: str) -> list[tuple[int, int]]:
    """Pages as ``[start, end)`` ranges of ``raw.split("\n")`` (see the module docstring)."""
    lines = raw.split("\n")
    spans: list[tuple[int, int]] = []
    start = 0
    for i, line in enumerate(lines):
        if _is_title(line):
            if "\n".join(lines[start:i]).strip():
                spans.append((start, i))
            start = i
    spans.append((start, len(lines)))
    return spans


def documents(raw: str, limit: int | None = None) -> list[str]:
    """lm-eval's ``wikitext`` documents (field ``page``): the first ``limit`` pages, or all."""
    lines = raw.split("\n")
    spans = page_spans(raw)
    if limit is not None:
        spans = spans[:limit]
    return ["\n".join(lines[a:b]) for a, b in spans]


def rows(raw: str, limit_documents: int | None = None) -> list[str]:
    """HF ``wikitext-2-raw-v1`` rows (``text``): each line with its newline, blank lines ``""``.

    With ``limit_documents``, only the lines before the page after the first that many pages.
    """
    lines = raw.split("\n")
    if raw.endswith("\n"):
        lines = lines[:-1]  # the empty piece after the file's final newline is not a line
    spans = page_spans(raw)
    if limit_documents is not None and limit_documents < len(spans):
        lines = lines[:spans[limit_documents][0]]
    return [ln + "\n" if ln.strip() else "" for ln in lines]


def wikitext_detokenizer(page: str) -> str:
    """lm-eval's ``preprocess_wikitext.wikitext_detokenizer`` (task version 2.0), on a page string."""
    s = page
    # contractions
    s = s.replace("s '", "s'")
    s = re.sub(r"/' [0-9]/", r"/'[0-9]/", s)
    # number separators
    s = s.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    # punctuation
    for p in (":", ";", ".", "!", "?", ","):
        s = s.replace(f" {p} ", f"{p} ")
    # brackets and quotes
    s = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", s)
    s = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", s)
    s = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", s)
    s = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', s)
    s = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", s)
    # miscellaneous
    s = s.replace("= = = =", "====").replace("= = =", "===").replace("= =", "==")
    s = s.replace(" " + chr(176) + " ", chr(176))
    s = s.replace(" \n", "\n").replace("\n ", "\n")
    s = s.replace(" N ", " 1 ")
    s = s.replace(" 's", "'s")
    return s


PROTOCOLS = ("token", "harness")


def evaluate_wikitext(
    model,
    tokenizer,
    *,
    data_dir: Path,
    dataset: str = "wikitext",
    split: str = "test",
    limit: int | None = None,
    seq_len: int,
    stride: int | None = None,
    batch_size: int = 4,
    device=None,
    protocols: tuple[str, ...] = PROTOCOLS,
    meter=None,
) -> dict:
    """WikiText-2 raw v1 perplexity under both protocols (see ``wide_cli.eval.perplexity``).

    Args:
        dataset: a name accepted by ``resolve_dataset`` (``wikitext`` is resolved with a log line).
        split: ``test`` (default) or ``validation``.
        limit: only the first ``limit`` pages (both protocols use the same text); None = all 62.
        seq_len: token-level window length, and the rolling window length of the harness protocol.
        stride: token-level stride (None = non-overlapping windows).
        protocols: ``token`` (pruning papers: rows joined with ``"\\n\\n"``, tokenized once with the
            tokenizer's default special tokens) and/or ``harness`` (lm-eval ``wikitext``).
        meter: a ``SparsityMeter`` that the routing decisions of every forward are added to.

    Returns:
        ``{task, dataset: {name, requested, split, file, n_documents, n_documents_total, limit},
        token_level: {...token_perplexity..., bos_policy, text}, harness: {...rolling_perplexity...},
        summary_metric, summary_value, sparsity}``; ``summary_value`` is the token-level perplexity
        when computed, else the harness's word perplexity.
    """
    import torch

    from wide_cli.eval.perplexity import rolling_perplexity, token_perplexity
    from wide_cli.eval.tasks import check_limit
    from wide_cli.routing.measure import SparsityMeter

    check_limit(limit)
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad or not protocols:
        raise DataError(f"unknown perplexity protocol(s) {bad}", f"use {', '.join(PROTOCOLS)}")
    name = resolve_dataset(dataset)
    path = raw_path(data_dir, split)
    raw = read_raw(data_dir, split)
    n_total = len(page_spans(raw))
    docs = documents(raw, limit)
    res: dict = {
        "task": "wikitext",
        "dataset": {
            "name": name,
            "requested": dataset,
            "split": split,
            "file": str(path),
            "n_documents": len(docs),
            "n_documents_total": n_total,
            "limit": limit,
        },
    }
    meter = meter if meter is not None else SparsityMeter()
    if "token" in protocols:
        text = "\n\n".join(rows(raw, limit))
        ids = tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"]
        bos = tokenizer.bos_token_id
        added = bos is not None and len(ids) > 0 and ids[0] == bos and not text.startswith(tokenizer.bos_token)
        sub = SparsityMeter()
        tl = token_perplexity(model, torch.tensor(ids, dtype=torch.long), seq_len=seq_len, stride=stride,
                              batch_size=batch_size, device=device, meter=sub)
        meter.merge(sub)
        tl["bos_policy"] = (f"tokenizer default special tokens on the whole joined text: one BOS "
                            f"({tokenizer.bos_token!r}) at the start" if added else
                            "tokenizer default special tokens on the whole joined text: no BOS added")
        tl["text"] = "HF wikitext-2-raw-v1 rows (field text) joined with '\\n\\n'"
        res["token_level"] = tl
    if "harness" in protocols:
        sub = SparsityMeter()
        hr = rolling_perplexity(model, tokenizer, docs, max_length=seq_len, batch_size=batch_size,
                                detokenize=wikitext_detokenizer, device=device, meter=sub)
        meter.merge(sub)
        hr.pop("per_document_loglikelihood", None)
        hr["dataset_view"] = "EleutherAI/wikitext_document_level wikitext-2-raw-v1 (field page)"
        res["harness"] = hr
    if "token_level" in res:
        res["summary_metric"], res["summary_value"] = "token_level.perplexity", res["token_level"]["perplexity"]
    else:
        res["summary_metric"], res["summary_value"] = "harness.word_perplexity", res["harness"]["word_perplexity"]
    res["sparsity"] = meter.summary()
    return res

