"""Batched generation on a ``Runtime``: prompts of any lengths padded into one batch, a prefill,
then decode steps until every row has finished (EOS, a stop string or the token budget).

Finished rows stay in the batch as padding (they skip every group and are not counted in the
measured sparsity), so one cache serves the whole batch; results do not depend on the padding
side or on the prefill chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from wide_cli.errors import ConfigError
from wide_cli.runtime.sampling import Sampler, SamplingConfig, TextTracker


@dataclass
class GenerationResult:
    """Outcome of ``Runtime.generate``.

    Attributes:
        texts: generated text per prompt (stop string excluded).
        tokens: generated token ids per prompt (EOS / stop-string tokens included).
        finish_reasons: per prompt ``eos``, ``stop`` or ``length``.
        prompt_tokens: real (non-padding) prompt tokens, all prompts.
        new_tokens: generated tokens counted until each row finished.
        prefill_s, decode_s: wall time of the prompt forward and of the decode steps, seconds.
        sparsity: measured sparsity of this run (``SparsityStats.summary``).
    """

    texts: list[str]
    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    sparsity: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decode time (the first token comes from the prefill)."""
        steps = max(self.new_tokens - len(self.texts), 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "texts": self.texts,
            "tokens": self.tokens,
            "finish_reasons": self.finish_reasons,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "sparsity": self.sparsity,
        }


def encode_prompts(tokenizer, prompts) -> list[list[int]]:
    """Strings (tokenized with ``tokenizer``) or token-id sequences -> token-id lists."""
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer; pass token ids or a tokenizer")
        return [list(tokenizer(p).input_ids) for p in prompts]
    return [list(map(int, p)) for p in prompts]


def pad_token_id(tokenizer, eos_token_ids) -> int:
    """The id padding is filled with: the tokenizer's pad id, else an EOS id, else 0."""
    for cand in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None), *eos_token_ids):
        if cand is not None:
            return int(cand)
    return 0


def pad_batch(prompts: list[list[int]], pad_id: int, padding_side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists into ``input_ids [B, T]`` int64 and ``valid [B, T]`` bool (False on the
    ``pad_id`` padding)."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side {padding_side!r} is not 'left' or 'right'")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        sl = slice(T - len(p), T) if padding_side == "left" else slice(0, len(p))
        ids[b, sl] = torch.tensor(p, dtype=torch.long)
        valid[b, sl] = True
    return ids, valid


def generate(
    rt,
    prompts,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingConfig | None = None,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    padding_side: str = "left",
    on_text: Callable[[int, str], None] | None = None,
    prefill_chunk: int | None = 2048,
) -> GenerationResult:
    """Generate continuations of a batch of prompts of any lengths on ``rt``.

    Args:
        rt: the ``engine.Runtime`` that runs the steps (not imported here: the engine imports
            this module).
        prompts: strings (needs the tokenizer) or lists of token ids.
        max_new_tokens: upper bound of generated tokens per prompt.
        sampling: greedy by default.
        stop: stop strings; the text is cut before the first one (needs the tokenizer).
        ignore_eos: keep generating through EOS (benchmarks).
        padding_side: ``left`` or ``right``; results do not depend on it (positions are
            per row and padding is never counted).
        on_text: called as ``on_text(row, text_delta)`` while tokens stream in.
        prefill_chunk: prompt tokens per forward (bounds activation memory of long prompts;
            None = the whole prompt at once). Results do not depend on it.

    Raises:
        ConfigError: ``max_new_tokens`` < 1, a prompt of no tokens (naming it), a prompt (+ new
            tokens) longer than the model's context.
    """
    from wide_cli.models.arch import check_context

    sampling = sampling or SamplingConfig()
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be >= 1", "ask for at least one new token")
    if not prompts:
        raise ValueError("no prompts")
    ids = encode_prompts(rt.tokenizer, prompts)
    for i, p in enumerate(ids):
        if len(p) == 0:
            raise ConfigError(f"prompt {i + 1} of {len(ids)} has no tokens", "give a non-empty prompt")
    longest = max(len(p) for p in ids)
    check_context(longest, rt.max_positions, f"a prompt of {longest} tokens",
                  "shorten the prompt (or use a model with a longer context)")
    check_context(longest + max_new_tokens, rt.max_positions,
                  f"a prompt of {longest} tokens + --max-new-tokens {max_new_tokens} = {longest + max_new_tokens} tokens",
                  f"lower --max-new-tokens to {(rt.max_positions or 0) - longest} or shorten the prompt")
    pad = pad_token_id(rt.tokenizer, rt.eos_token_ids)
    input_ids, valid = pad_batch(ids, pad, padding_side)
    B, T = input_ids.shape
    cache = rt.new_cache(B, T + max_new_tokens)
    sampler = Sampler(sampling, rt.device)
    trackers = [TextTracker(rt.tokenizer, tuple(stop)) if rt.tokenizer is not None else None for _ in range(B)]
    eos = set() if ignore_eos else set(rt.eos_token_ids)
    out_tokens: list[list[int]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    finished = torch.zeros(B, dtype=torch.bool)
    rt.stats.reset()

    t0 = time.perf_counter()
    logits = rt.prefill(input_ids, valid, cache, chunk=prefill_chunk)
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    for n in range(max_new_tokens):
        nxt = sampler(logits).cpu()
        for b in range(B):
            if finished[b]:
                continue
            tok = int(nxt[b])
            out_tokens[b].append(tok)
            if trackers[b] is not None:
                delta = trackers[b].push(tok) if tok not in eos else ""
                if delta and on_text is not None:
                    on_text(b, delta)
            if tok in eos:
                finished[b], reasons[b] = True, "eos"
            elif trackers[b] is not None and trackers[b].stopped:
                finished[b], reasons[b] = True, "stop"
        if bool(finished.all()) or n == max_new_tokens - 1:
            break
        step_ids = torch.where(finished, pad, nxt)[:, None]
        logits = rt.step(step_ids, ~finished[:, None], cache)  # finished rows ride along as padding
    t_decode = time.perf_counter() - t1
    texts = []
    for b in range(B):
        tr = trackers[b]
        if tr is not None:
            tail = tr.flush()
            if tail and on_text is not None:
                on_text(b, tail)
            texts.append(tr.text)
        else:
            texts.append("")
    return GenerationResult(
        texts=texts, tokens=out_tokens, finish_reasons=reasons, prompt_tokens=int(valid.sum()),
        new_tokens=sum(len(t) for t in out_tokens), prefill_s=t_prefill, decode_s=t_decode,
        sparsity=rt.stats.summary(),
    )  # fmt: skip
