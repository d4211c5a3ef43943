"""The inputs of ``wide bench``: prompts of natural English text, and random per-token masks that
stand in for routers a model does not have."""

from __future__ import annotations

import torch


def text_token_stream(tokenizer, min_tokens: int) -> torch.Tensor:
    """At least ``min_tokens`` token ids of English prose (``pydoc_data.topics``, repeated if the
    tokenizer is very efficient). Returns ``[N]`` int64."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids: list[int] = []
    chunk = 200_000
    for start in range(0, len(text), chunk):
        ids.extend(tokenizer(text[start : start + chunk], add_special_tokens=False).input_ids)
        if len(ids) >= min_tokens:
            break
    while len(ids) < min_tokens:
        ids = ids + ids
    return torch.tensor(ids, dtype=torch.long)


def prompt_batch(stream: torch.Tensor, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hi = max(len(stream) - length, 1)
    offs = torch.randint(0, hi, (batch,), generator=g).tolist()
    return torch.stack([stream[o : o + length] for o in offs])


def random_forced_masks(runtime, batch: int, slots: int, p_skip: float, seed: int) -> dict:
    """``{(layer, module): [B, slots, G] bool}``: each (token, group) skips with probability
    ``p_skip``, independently (a stand-in for trained routers; label results that use it)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in runtime.meta:
        for module, G in (("attention", m.attn_groups), ("ffn", m.ffn_groups)):
            out[(m.index, module)] = (torch.rand(batch, slots, G, generator=g) >= p_skip).to(runtime.device)
    return out
