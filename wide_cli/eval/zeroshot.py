"""Zero-shot multiple-choice scoring with lm-evaluation-harness 0.4 metrics.

For every item each choice is scored as ``loglikelihood(context, continuation)`` (batched,
right-padded; ``wide_cli.eval.scoring``). Then, exactly as the harness's ``process_results``:

- ``acc``: 1 if ``argmax_i ll_i`` is the gold index (first index on ties);
- ``acc_norm``: 1 if ``argmax_i ll_i / len(choice_i)`` is gold, where ``len`` counts the
  characters of the harness's ``doc_to_choice`` string (without the leading delimiter; equal to
  the byte length for ASCII text);
- ``*_stderr``: the harness's ``mean_stderr``, sample standard deviation / sqrt(n), which for a
  0/1 metric is sqrt(p (1 - p) / (n - 1)).
"""

from __future__ import annotations

import math
from pathlib import Path

from wide_cli.eval.scoring import (
    encode_pair,
    loglikelihoods,
    model_vocab_size,
    pad_id_for,
    resolve_max_length,
)
from wide_cli.eval.tasks import TASKS, MCDoc, get_task, load_docs
from wide_cli.routing.measure import SparsityMeter, count_sparsity


def mean_stderr(values: list[float]) -> float | None:
    """Standard error of the mean as the harness computes it (None for fewer than 2 values)."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def _argmax(vals: list[float]) -> int:
    return max(range(len(vals)), key=lambda i: (vals[i], -i))


def score_docs(
    model,
    tokenizer,
    docs: list[MCDoc],
    *,
    batch_size: int = 4,
    max_length: int | None = None,
    device=None,
    meter: SparsityMeter | None = None,
) -> list[list[float]]:
    """Log-likelihood (nats, summed over continuation tokens) of every choice of every doc.

    Args:
        docs: items from ``load_docs`` (or built by hand).
        max_length: model input length; None resolves it like the harness (config, tokenizer, 2048).
        meter: when given, routing decisions of these forwards are counted into it.

    Returns:
        ``[n_docs][n_choices]`` log-likelihoods.
    """
    max_length = max_length or resolve_max_length(model, tokenizer)
    requests, owner = [], []
    for d, doc in enumerate(docs):
        for ctx, cont in zip(doc.contexts, doc.continuations):
            requests.append(encode_pair(tokenizer, ctx, cont))
            owner.append(d)
    with count_sparsity(model, meter) as m:
        scored = loglikelihoods(model, requests, max_length=max_length, batch_size=batch_size,
                                pad_id=pad_id_for(tokenizer, model_vocab_size(model)), device=device)
        m.tokens_measured += sum(min(len(c) + len(t) - 1, max_length) for c, t in requests)
    out: list[list[float]] = [[] for _ in docs]
    for d, s in zip(owner, scored):
        out[d].append(s.logprob)
    return out


def mc_metrics(docs: list[MCDoc], lls: list[list[float]], metrics=("acc", "acc_norm")) -> dict:
    """Harness metrics from per-choice log-likelihoods.

    Returns:
        ``{metric: value, metric_stderr: value, ..., "n": n, "items": [{line, gold, pred, pred_norm}]}``
        for each requested metric (``acc``, ``acc_norm``).
    """
    acc, acc_norm, items = [], [], []
    for doc, ll in zip(docs, lls):
        pred = _argmax(ll)
        normed = [v / len(c) if len(c) else float("-inf") for v, c in zip(ll, doc.choices)]
        pred_norm = _argmax(normed)
        acc.append(1.0 if pred == doc.gold else 0.0)
        acc_norm.append(1.0 if pred_norm == doc.gold else 0.0)
        items.append({"line": doc.line, "gold": doc.gold, "pred": pred, "pred_norm": pred_norm, "lls": ll})
    out: dict = {"n": len(docs)}
    series = {"acc": acc, "acc_norm": acc_norm}
    for m in metrics:
        vals = series[m]
        out[m] = sum(vals) / len(vals) if vals else None
        out[f"{m}_stderr"] = mean_stderr(vals)
    out["items"] = items
    return out


def evaluate_task(
    model,
    tokenizer,
    task: str,
    *,
    data_dir: Path,
    limit: int | None = None,
    batch_size: int = 4,
    max_length: int | None = None,
    device=None,
    keep_items: bool = False,
    meter: SparsityMeter | None = None,
) -> dict:
    """Run one zero-shot task from ``<data_dir>/zeroshot/<task>.jsonl``.

    Args:
        task: a name from ``wide_cli.eval.tasks.TASKS``.
        limit: score only the first ``limit`` items (deterministic); None = all.
        keep_items: include per-item predictions and log-likelihoods under ``items``.
        meter: routing decisions are added to this ``SparsityMeter`` (a new one when None).

    Returns:
        ``{task, harness_task, dataset: {file, split, n_items, n_total, limit}, metrics: {acc,
        acc_stderr[, acc_norm, acc_norm_stderr]}, summary_metric, summary_value, n_requests,
        max_length, protocol, sparsity}``.

    Raises:
        ConfigError: unknown task, limit <= 0, batch_size < 1.
        DataError: missing/malformed task file (``file:line`` and the field).
    """
    spec = get_task(task)
    docs, n_total = load_docs(task, data_dir, limit)
    max_length = max_length or resolve_max_length(model, tokenizer)
    meter = meter if meter is not None else SparsityMeter()
    lls = score_docs(model, tokenizer, docs, batch_size=batch_size, max_length=max_length,
                     device=device, meter=meter)
    m = mc_metrics(docs, lls, spec.metrics)
    items = m.pop("items")
    n = m.pop("n")
    res = {
        "task": task,
        "harness_task": spec.harness,
        "dataset": {
            "file": str(Path(data_dir) / "zeroshot" / spec.file),
            "split": spec.split,
            "n_items": n,
            "n_total": n_total,
            "limit": limit,
        },
        "metrics": m,
        "summary_metric": spec.summary_metric,
        "summary_value": m[spec.summary_metric],
        "n_requests": sum(len(d.continuations) for d in docs),
        "max_length": max_length,
        "protocol": ("zero-shot, lm-eval 0.4 prompt format of " + spec.harness
                     + f"; target delimiter ' '; first {n} items in file order"),
        "sparsity": meter.summary(),
    }
    if keep_items:
        res["items"] = items
    return res


__all__ = ["TASKS", "evaluate_task", "mc_metrics", "mean_stderr", "score_docs"]
