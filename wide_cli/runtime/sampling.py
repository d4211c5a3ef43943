"""Next-token choice (greedy, temperature, top-p with a seed) and stop handling for generation.

Pure helpers: the engine's generation loop only wires them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wide_cli.errors import ConfigError

#: temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        temperature: 0 = greedy (argmax); > 0 divides the logits before sampling. Values below
            ``GREEDY_BELOW`` (1e-5, vLLM's threshold) decode greedily too: dividing logits by
            e.g. 1e-40 overflows to inf and the softmax is NaN, and the limit of sampling as the
            temperature goes to 0 is the argmax anyway.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass reaches
            ``top_p`` (1.0 = no filtering). Only used when ``temperature > 0``.
        seed: RNG seed for sampling (None = nondeterministic).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (0.0 <= self.temperature < math.inf):
            raise ConfigError(f"temperature {self.temperature} must be a finite number >= 0",
                              "use 0 for greedy decoding, or e.g. 0.7 to sample")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top-p {self.top_p} must be in (0, 1]", "use e.g. 0.9, or 1.0 for no filtering")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the top-p nucleus to -inf (Hugging Face ``TopPLogitsWarper`` rule: drop
    tokens whose ascending cumulative probability is <= 1 - top_p; the top token always stays).

    Args:
        logits: ``[B, V]`` float. Returns the filtered ``[B, V]``.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


class Sampler:
    """Chooses next tokens: ``sampler(logits [B, V] float) -> [B] int64``."""

    def __init__(self, cfg: SamplingConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.generator = None
        if not cfg.greedy:
            self.generator = torch.Generator(device=device)
            if cfg.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(cfg.seed))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.cfg.greedy:
            return logits.argmax(dim=-1)
        logits = top_p_filter(logits / self.cfg.temperature, self.cfg.top_p)
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def special_token_ids(tokenizer, strings: tuple[str, ...]) -> frozenset[int]:
    """Ids of the tokenizer's special tokens whose text is one of ``strings``."""
    if tokenizer is None or not strings:
        return frozenset()
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {i for i, t in decoder.items() if getattr(t, "special", False)} | set(tokenizer.all_special_ids)
    return frozenset(i for i in special if tokenizer.convert_ids_to_tokens(i) in strings)


class TextTracker:
    """Incremental detokenization of one row, with stop strings.

    ``push(token_id)`` returns the new text that is safe to show: text that could still turn into
    a stop string, or an incomplete UTF-8 character, is held back. Once a stop string appears, the
    text is cut just before it and ``stopped`` becomes True. The shown text skips special tokens,
    so a stop string that is a special token (``<|eot|>``) is matched on the token itself, as
    transformers' ``stop_strings`` does.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.stop_ids = special_token_ids(tokenizer, self.stop)
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        if int(token_id) in self.stop_ids:  # a special token is never in the shown text
            self.stopped = True
            return self._emit(self.text)
        self.ids.append(int(token_id))
        text = self._decode()
        if self.stop:
            lo = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [p for p in (text.find(s, lo) for s in self.stop) if p >= 0]
            if hits:
                self.text = text[: min(hits)]
                self.stopped = True
                return self._emit(self.text)
        self.text = text
        safe = text.rstrip("\ufffd")
        for s in self.stop:  # hold back a suffix that may grow into a stop string
            for k in range(min(len(s) - 1, len(safe)), 0, -1):
                if safe.endswith(s[:k]):
                    safe = safe[:-k]
                    break
        return self._emit(safe)

    def _emit(self, upto: str) -> str:
        if len(upto) <= self.emitted:
            return ""
        delta = upto[self.emitted :]
        self.emitted = len(upto)
        return delta

    def flush(self) -> str:
        """The held-back tail at the end of generation (nothing after a stop string)."""
        return self._emit(self.text)
