"""Perplexity: token-level (pruning papers) and rolling word/byte perplexity (lm-eval).

Two protocols, two units; every result names its unit and protocol (numbers
of different protocols are not comparable):

- ``token_perplexity``: exp(mean NLL per token) over windows of one token stream, the number
  pruning papers print (SparseGPT/Wanda: the WikiText-2 test rows joined with ``"\\n\\n"``,
  tokenized once, cut into non-overlapping ``seq_len`` windows, trailing remainder dropped).
- ``rolling_perplexity``: lm-eval's ``wikitext`` task: per-document ``loglikelihood_rolling``,
  aggregated per word (``word_perplexity``), per byte (``byte_perplexity``) and as
  ``bits_per_byte``. Word perplexity is much larger than token perplexity; never compare the two.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from wide_cli.errors import ConfigError, DataError
from wide_cli.eval import progress
from wide_cli.eval.scoring import (
    check_ids,
    forward_logits,
    loglikelihoods,
    model_device,
    model_vocab_size,
    pad_id_for,
    prefix_token_id,
    tok_encode,
)
from wide_cli.routing.measure import SparsityMeter, count_sparsity

TOKEN_UNIT = "token-level perplexity"
WORD_UNIT = "word-level perplexity (lm-eval wikitext)"


# ----------------------------------------------------------------------------------------------
# token-level perplexity


def token_windows(n: int, seq_len: int, stride: int | None) -> list[tuple[int, int, int]]:
    """Window plan over a stream of ``n`` token ids.

    Returns ``(begin, end, first_target)`` per window: the model sees ``ids[begin:end]`` and the
    targets ``ids[first_target:end]`` are scored (each predicted from the position before it).

    - ``stride`` None or == ``seq_len``: non-overlapping windows ``[k*L, (k+1)*L)`` for
      ``k < n // L``; each scores its last ``L - 1`` tokens (its first token is context only);
      the trailing ``n % L`` tokens are dropped (the pruning papers' protocol).
    - ``stride < seq_len``: the first window is ``[0, L)`` and scores tokens 1..L-1; each later
      window ends ``stride`` tokens further (the last one possibly fewer), is ``L`` tokens long,
      and scores only the tokens not yet scored. Every token 1..n-1 is scored exactly once.

    Raises:
        ConfigError: seq_len < 2, stride < 1 or stride > seq_len.
        DataError: fewer than ``seq_len`` tokens.
    """
    if seq_len < 2:
        raise ConfigError(f"seq-len {seq_len} must be >= 2", "use e.g. --seq-len 2048")
    if stride is not None and not (1 <= stride <= seq_len):
        raise ConfigError(f"stride {stride} must be in [1, seq-len {seq_len}]",
                          "omit --stride for non-overlapping windows")
    if n < seq_len:
        raise DataError(f"only {n} tokens of evaluation text, fewer than seq-len {seq_len}",
                        "use more text or a smaller --seq-len")
    if stride is None or stride == seq_len:
        return [(k * seq_len, (k + 1) * seq_len, k * seq_len + 1) for k in range(n // seq_len)]
    plan = [(0, seq_len, 1)]
    prev_end = seq_len
    while prev_end < n:
        end = min(prev_end + stride, n)
        plan.append((end - seq_len, end, prev_end))
        prev_end = end
    return plan


def protocol_string(seq_len: int, stride: int | None, n: int) -> str:
    """Human-readable window protocol; it changes whenever seq_len or stride changes."""
    if stride is None or stride == seq_len:
        k = n // seq_len
        return (f"non-overlapping windows of {seq_len} tokens ({k} windows; the first token of each "
                f"window is context only; trailing {n - k * seq_len} tokens dropped); "
                "exp(mean NLL per scored token)")
    return (f"sliding windows of {seq_len} tokens with stride {stride}: the first window scores tokens "
            f"1..{seq_len - 1}, each later window scores its last <= {stride} new tokens with "
            f"{seq_len} tokens of input; every token 1..{n - 1} scored exactly once; "
            "exp(mean NLL per scored token)")


def token_perplexity(
    model,
    ids: torch.Tensor,
    *,
    seq_len: int,
    stride: int | None = None,
    batch_size: int = 4,
    device=None,
    meter: SparsityMeter | None = None,
) -> dict:
    """Token-level perplexity of a token stream (the unit pruning papers print).

    Args:
        model: causal LM (dense or routed), eval mode.
        ids: ``[N]`` long token ids, the whole stream (BOS policy is the caller's: the ids are
            used exactly as given).
        seq_len: window length L (model input tokens per window).
        stride: None (or L) for non-overlapping windows; < L for sliding windows that score
            each token 1..N-1 exactly once (see ``token_windows``).
        batch_size: windows per forward (all windows are L long: no padding).
        device: defaults to the model's device.
        meter: routing decisions are added to this ``SparsityMeter`` (a new one when None); the
            result's ``sparsity`` is its summary.

    Returns:
        ``{unit, seq_len, stride, n_tokens, n_tokens_scored, n_windows, nll_sum, nll_mean,
        perplexity, protocol, sparsity}``; ``nll_sum`` in nats; ``sparsity`` is the measured
        routing sparsity summary (None for a dense model).

    Raises:
        ConfigError / DataError: see ``token_windows``; token ids outside the vocabulary.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    n = int(ids.numel())
    if batch_size < 1:
        raise ConfigError(f"batch-size {batch_size} must be >= 1")
    plan = token_windows(n, seq_len, stride)
    check_ids(ids, model_vocab_size(model))
    device = device or model_device(model)
    nll_sum, scored = 0.0, 0
    meter = meter if meter is not None else SparsityMeter()
    with count_sparsity(model, meter), progress.tracker(len(plan) * seq_len) as bar:
        for b0 in range(0, len(plan), batch_size):
            chunk = plan[b0:b0 + batch_size]
            bar.advance(len(chunk) * seq_len)
            x = torch.stack([ids[b:e] for b, e, _ in chunk]).to(device)  # [B, L]
            mask = torch.ones_like(x)
            logits = forward_logits(model, x, mask)  # [B, L, V]
            for r, (b, e, t0) in enumerate(chunk):
                # logits at position p predict token p+1: targets t0..e-1 use positions t0-1..e-2
                lg = logits[r, t0 - 1 - b:e - 1 - b].float()
                tgt = x[r, t0 - b:e - b]
                nll_sum += float(F.cross_entropy(lg, tgt, reduction="sum").double())
                scored += e - t0
            meter.tokens_measured += x.numel()
            del logits
    return {
        "unit": TOKEN_UNIT,
        "seq_len": seq_len,
        "stride": seq_len if stride is None else stride,
        "n_tokens": n,
        "n_tokens_scored": scored,
        "n_windows": len(plan),
        "nll_sum": nll_sum,
        "nll_mean": nll_sum / scored,
        "perplexity": math.exp(nll_sum / scored),
        "protocol": protocol_string(seq_len, stride, n),
        "sparsity": meter.summary(),
    }


# ----------------------------------------------------------------------------------------------
# rolling (lm-eval) perplexity


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """``(context, continuation)`` windows of one document, as lm-eval's ``loglikelihood_rolling``
    builds them (``get_rolling_token_windows`` with ``context_len=1``, then ``make_disjoint_window``).

    The first window predicts ``tokens[:L]`` from ``[prefix] + tokens[:L-1]``; each later window
    predicts the next ``L`` tokens (the last one fewer), with as much preceding context as fits
    in ``L`` input tokens (one token for full windows, more for a short last window).
    """
    if max_length < 1:
        raise ConfigError(f"max length {max_length} must be >= 1")
    if not tokens:
        return []
    windows = []
    first = min(max_length, len(tokens))
    windows.append(([prefix_token] + tokens[:first - 1], tokens[:first]))
    predicted = first
    while predicted < len(tokens):
        pred_len = min(len(tokens) - predicted, max_length)
        end = predicted + pred_len
        windows.append((tokens[end - max_length - 1:end - 1], tokens[end - pred_len:end]))
        predicted += pred_len
    # make_disjoint_window: drop the context tokens that are also predicted
    return [(a[:len(a) - (len(b) - 1)], b) for a, b in windows]


def count_words(text: str) -> int:
    """Words as lm-eval's wikitext ``process_results`` counts them (on the original text)."""
    return len(re.split(r"\s+", text))


def rolling_perplexity(
    model,
    tokenizer,
    documents: list[str],
    *,
    max_length: int,
    batch_size: int = 4,
    detokenize: Callable[[str], str] | None = None,
    device=None,
    meter: SparsityMeter | None = None,
) -> dict:
    """Word/byte perplexity of documents as lm-eval's ``wikitext`` task scores them.

    Args:
        model, tokenizer: causal LM and its tokenizer.
        documents: raw documents; words and bytes are counted on these (as the harness does).
        max_length: rolling window length L (the harness's ``max_length``).
        batch_size: windows per forward.
        detokenize: applied to each document before tokenization (the harness scores
            ``doc_to_target``, e.g. ``wikitext_detokenizer``); None scores the text as is.
        device: defaults to the model's device.
        meter: routing decisions are added to this ``SparsityMeter`` (a new one when None).

    Returns:
        ``{unit, word_perplexity, byte_perplexity, bits_per_byte, token_perplexity, loglikelihood,
        n_documents, n_words, n_bytes, n_tokens_scored, n_windows, max_length, prefix_token_id,
        protocol, per_document_loglikelihood, sparsity}``. ``token_perplexity`` here is
        exp(-ll / tokens) over these windows: *not* the pruning papers' protocol.
    """
    if not documents:
        raise DataError("no documents to score", "check the dataset file")
    prefix = prefix_token_id(tokenizer)
    requests, owner = [], []
    for d, doc in enumerate(documents):
        text = detokenize(doc) if detokenize is not None else doc
        for w in rolling_windows(tok_encode(tokenizer, text), prefix, max_length):
            requests.append(w)
            owner.append(d)
    meter = meter if meter is not None else SparsityMeter()
    with count_sparsity(model, meter):
        scored = loglikelihoods(model, requests, max_length=max_length, batch_size=batch_size,
                                pad_id=pad_id_for(tokenizer, model_vocab_size(model)), device=device)
    meter.tokens_measured += sum(len((c + t)[-(max_length + 1):][:-1]) for c, t in requests)
    per_doc = [0.0] * len(documents)
    for d, s in zip(owner, scored):
        per_doc[d] += s.logprob
    ll = sum(per_doc)
    words = sum(count_words(doc) for doc in documents)
    nbytes = sum(len(doc.encode("utf-8")) for doc in documents)
    ntok = sum(s.n_tokens for s in scored)
    return {
        "unit": WORD_UNIT,
        "word_perplexity": math.exp(-ll / words),
        "byte_perplexity": math.exp(-ll / nbytes),
        "bits_per_byte": -ll / nbytes / math.log(2),
        "token_perplexity": math.exp(-ll / ntok) if ntok else None,
        "loglikelihood": ll,
        "n_documents": len(documents),
        "n_words": words,
        "n_bytes": nbytes,
        "n_tokens_scored": ntok,
        "n_windows": len(requests),
        "max_length": max_length,
        "prefix_token_id": prefix,
        "protocol": (f"lm-eval loglikelihood_rolling: per document, disjoint windows of {max_length} "
                     f"tokens, first window conditioned on prefix token {prefix}; "
                     "word_perplexity = exp(-sum ll / sum words), words and bytes counted on the "
                     "original document"),
        "per_document_loglikelihood": per_doc,
        "sparsity": meter.summary(),
    }
