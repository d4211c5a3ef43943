"""Evaluation: perplexity, zero-shot multiple choice, FLOPs, and the comparison report.

Modules (import the one you need; this package imports nothing so that ``wide --help`` stays fast):

- ``scoring``: harness-compatible tokenization and batched log-likelihood scoring; measured sparsity.
- ``perplexity``: ``token_perplexity`` (pruning papers' unit) and ``rolling_perplexity`` (lm-eval).
- ``wikitext``: WikiText-2 raw v1 from the local raw files; ``evaluate_wikitext``.
- ``tasks`` / ``zeroshot``: the zero-shot task table and ``evaluate_task``.
- FLOPs relative to dense and the ideal decode bound come from ``wide_cli.cost`` (the one cost model).
- ``report`` / ``plots`` / ``run``: ``evaluate_targets`` and report.json / report.md / PNGs.
"""
