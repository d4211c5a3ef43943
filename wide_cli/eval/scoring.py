"""Batched log-likelihood scoring shared by perplexity and zero-shot tasks.

The tokenization and window arithmetic follow lm-evaluation-harness 0.4 (``HFLM``) so that our
numbers can be compared with the harness's (``tests/eval/test_harness_crosscheck.py`` checks them
to 1e-6 in fp32):

- ``tok_encode``: ``tokenizer.encode(text)`` with the tokenizer's default special tokens, unless
  the text already starts with the BOS string (``HFLM.tok_encode``).
- ``encode_pair``: trailing spaces of the context move to the continuation, the whole string is
  encoded and split at the context's token count (``LM._encode_pair``, causal case).
- ``loglikelihoods``: each request's input is ``(context + continuation)[-(max_length + 1):][:-1]``,
  and the last ``len(continuation)`` positions are scored (``HFLM._loglikelihood_tokens``).

Unlike the harness we right-pad with an explicit ``attention_mask``, so routed models exclude
padding from their sparsity statistics; with right padding a causal model's
real-token logits do not depend on the padding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wide_cli.errors import ConfigError, DataError
from wide_cli.eval import progress

logger = logging.getLogger("wide.eval")

# lm-eval's default when neither the model config nor the tokenizer names a context length.
DEFAULT_MAX_LENGTH = 2048
_TOKENIZER_INFINITY = 1000000000000000019884624838656


# ----------------------------------------------------------------------------------------------
# tokenization (harness semantics)


def prefix_token_id(tokenizer) -> int:
    """The token that conditions a window with no context: BOS, else EOS (``HFLM.prefix_token_id``)."""
    if tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has neither a BOS nor an EOS token",
                          "perplexity windows need one of them as the prefix token")
    return int(tokenizer.eos_token_id)


def tok_encode(tokenizer, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """Encode ``text`` like ``HFLM.tok_encode`` (``add_bos_token`` unset).

    ``add_special_tokens=None`` keeps the tokenizer's default (Llama-2 adds BOS, GPT-2 style
    tokenizers add nothing), except when ``text`` already starts with the prefix token's string.
    """
    kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    if add_special_tokens is None and text.startswith(tokenizer.decode(prefix_token_id(tokenizer))):
        kwargs["add_special_tokens"] = False
    return list(tokenizer.encode(text, **kwargs))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``(context, continuation)`` as the harness's ``loglikelihood`` builds them.

    An empty context becomes the prefix token (BOS/EOS), as in ``LM.loglikelihood``.
    """
    if context == "":
        cont = tok_encode(tokenizer, continuation, add_special_tokens=False)
        pid = prefix_token_id(tokenizer)
        return ([pid], cont) if not cont or cont[0] != pid else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok_encode(tokenizer, context + continuation)
    ctx = tok_encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def resolve_max_length(model, tokenizer=None) -> int:
    """The model's context length as lm-eval resolves it: config ``n_positions`` /
    ``max_position_embeddings`` / ``n_ctx``, else ``tokenizer.model_max_length``, else 2048."""
    from wide_cli.models.arch import context_length

    n = context_length(model.config)
    if n is not None:
        return n
    mml = getattr(tokenizer, "model_max_length", None)
    if mml is not None and mml != _TOKENIZER_INFINITY:
        return int(mml)
    return DEFAULT_MAX_LENGTH


# ----------------------------------------------------------------------------------------------
# forward helpers


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def model_vocab_size(model) -> int:
    emb = model.get_input_embeddings()
    return int(emb.weight.shape[0]) if emb is not None else int(model.config.vocab_size)


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise DataError when a token id has no embedding row (an index error deep in the
    model otherwise)."""
    if ids.numel() == 0:
        return
    hi, lo = int(ids.max()), int(ids.min())
    if hi >= vocab_size or lo < 0:
        raise DataError(
            f"token id {hi if hi >= vocab_size else lo} is outside the model's vocabulary of {vocab_size}",
            "the tokenizer does not belong to this model (or added a token without resizing embeddings)",
        )


def pad_id_for(tokenizer, vocab_size: int) -> int:
    """A pad id that adds no new token: the tokenizer's pad, else EOS, else 0 (adding a pad
    token would need an embedding row the model does not have).

    Padded positions are masked out and never scored, so the id only has to be a valid row.
    """
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if tid is not None and 0 <= int(tid) < vocab_size:
            return int(tid)
    return 0


def forward_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` long ids and ``[B, T]`` mask (1 = real token) -> ``[B, T, V]`` logits (model dtype).

    Position ids are the per-row cumulative sum of the mask (right padding: 0..len-1).
    """
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    return out.logits


@dataclass(frozen=True)
class Scored:
    """Log-likelihood of one request: ``logprob`` (sum over continuation tokens, natural log),
    ``n_tokens`` scored, and ``is_greedy`` (every continuation token is the argmax)."""

    logprob: float
    n_tokens: int
    is_greedy: bool


def loglikelihoods(
    model,
    requests: list[tuple[list[int], list[int]]],
    *,
    max_length: int,
    batch_size: int = 4,
    pad_id: int = 0,
    device=None,
) -> list[Scored]:
    """Score ``(context_ids, continuation_ids)`` pairs in right-padded batches.

    Args:
        model: a causal LM (dense or routed); called under ``torch.no_grad``.
        requests: token id lists; the context must be non-empty, the continuation non-empty and
            at most ``max_length`` tokens.
        max_length: model input length; longer requests are truncated from the left.
        batch_size: requests per forward. Requests are sorted by length (longest first) to cut
            padding; results come back in request order. Padding does not change results
            beyond float rounding (batch 1 vs 4 agree to ~1e-6 in fp32).
        pad_id: id written at padded positions (masked out, never scored).
        device: defaults to the model's device.

    Returns:
        One ``Scored`` per request, in order. Log-softmax is computed in fp32.

    Raises:
        ConfigError: batch_size or max_length < 1. DataError: empty context/continuation, or
            token ids outside the model's vocabulary.
    """
    if batch_size < 1:
        raise ConfigError(f"batch-size {batch_size} must be >= 1")
    if max_length < 1:
        raise ConfigError(f"max length {max_length} must be >= 1")
    device = device or model_device(model)
    vocab = model_vocab_size(model)
    for ctx, cont in requests:
        if not ctx or not cont:
            raise DataError("a scoring request has an empty context or continuation",
                            "every request needs at least one context and one continuation token")
        if len(cont) > max_length:
            raise DataError(f"continuation of {len(cont)} tokens is longer than max length {max_length}",
                            "raise --seq-len or shorten the data")
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
    out: list[Scored | None] = [None] * len(requests)
    lengths = [min(len(c) + len(t) - 1, max_length) for c, t in requests]
    with progress.tracker(sum(lengths)) as bar:
        for b0 in range(0, len(order), batch_size):
            idx = order[b0:b0 + batch_size]
            out_batch = _score_batch(model, requests, idx, max_length=max_length, pad_id=pad_id, device=device,
                                     vocab=vocab)
            for i, sc in zip(idx, out_batch):
                out[i] = sc
            bar.advance(sum(lengths[i] for i in idx))
    return out  # type: ignore[return-value]


def _score_batch(model, requests, idx: list[int], *, max_length: int, pad_id: int, device, vocab: int
                 ) -> list[Scored]:
    """Score the requests ``idx`` in one right-padded forward (see ``loglikelihoods``)."""
    out = []
    inps = [(requests[i][0] + requests[i][1])[-(max_length + 1):][:-1] for i in idx]
    T = max(len(x) for x in inps)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(idx), T), dtype=torch.long)
    for r, x in enumerate(inps):
        ids[r, :len(x)] = torch.tensor(x, dtype=torch.long)
        mask[r, :len(x)] = 1
    check_ids(ids, vocab)
    logits = forward_logits(model, ids.to(device), mask.to(device))  # [B, T, V]
    for r, i in enumerate(idx):
        cont = requests[i][1]
        inplen, contlen = len(inps[r]), len(cont)
        lp = F.log_softmax(logits[r, inplen - contlen:inplen].float(), dim=-1)  # [contlen, V]
        tgt = torch.tensor(cont, dtype=torch.long, device=lp.device)
        ll = lp.gather(-1, tgt[:, None]).squeeze(-1)
        greedy = bool((lp.argmax(-1) == tgt).all())
        out.append(Scored(float(ll.double().sum()), contlen, greedy))
    del logits
    return out
