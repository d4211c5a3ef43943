"""Quality beside speed in ``wide bench``: WikiText-2 perplexity of the runtime per weight format."""

from __future__ import annotations

from pathlib import Path

import torch


def runtime_perplexity(rt, ids: torch.Tensor, seq_len: int, mode: str = "prefill") -> dict:
    """Token-level perplexity of the runtime (routed as configured) over non-overlapping windows
    of ``seq_len`` tokens of ``ids [N]`` (the pruning papers' protocol, ``eval.perplexity``).

    mode: ``prefill`` scores each window in one forward (the runtime's prefill path); ``decode``
    feeds the window one token at a time through ``Runtime.step``, so every logit comes from the
    decode path users generate with (on the cpu backend, the native step where it runs).
    """
    import math

    import torch.nn.functional as F

    from wide_cli.eval.perplexity import token_windows

    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode {mode!r}: prefill or decode")
    nll, scored = 0.0, 0
    rt.stats.reset()
    for b, e, t0 in token_windows(int(ids.numel()), seq_len, None):
        x = ids[b:e][None]
        if mode == "prefill":
            logits = rt.forward(x)[0]
        else:
            cache = rt.new_cache(1, e - b)
            logits = torch.cat([rt.step(x[:, i : i + 1], None, cache) for i in range(e - b)])
        nll += float(F.cross_entropy(logits[t0 - 1 - b : e - 1 - b], x[0, t0 - b : e - b], reduction="sum").double())
        scored += e - t0
    return {"perplexity": math.exp(nll / scored), "tokens_scored": scored, "seq_len": seq_len,
            "sparsity": {k: rt.stats.summary()[k] for k in ("attention", "ffn", "total")}}  # fmt: skip


def wikitext_ids(tokenizer, data_dir: Path, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` ids of the WikiText-2 test rows joined with ``"\\n\\n"``."""
    from wide_cli.eval import wikitext

    text = "\n\n".join(wikitext.rows(wikitext.read_raw(Path(data_dir), "test")))
    ids = tokenizer(text[: n_tokens * 8], add_special_tokens=False).input_ids[:n_tokens]
    return torch.tensor(ids, dtype=torch.long)
