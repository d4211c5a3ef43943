"""``wide bench``: prefill and decode throughput of dense Hugging Face transformers, llama.cpp, the
runtime in dense mode and the routed backends, per weight format and thread count, on one export.

Protocol (one process, same weights, same prompts, same threads for every system):
- Prompts are real English text (CPython's ``pydoc_data.topics``, the embedded default data set)
  tokenized with the export's tokenizer, so the routers see natural inputs.
- Prefill: one prompt of each length, batch 1; tokens/s = prompt tokens / wall time of the forward
  (HF with ``logits_to_keep=1``, the runtime and llama.cpp compute last-token logits only).
- Decode: ``batch`` prompts of ``decode_prompt_len`` tokens are prefilled (not timed), then
  ``new_tokens`` greedy steps are timed; tokens/s = batch * new_tokens / time.
- Systems are measured round-robin (warm-up rounds first, then ``repeats`` rounds); the median
  is reported, so load from other processes hits every system alike.
- Honest rows: every row says whether its path skips work (``skips_work``) and the share of the
  dense multiply-adds it executed (``executed_mac_fraction``), counted by the runtime's backends
  while they run (weights, attention scores, LM head and routers) and divided by the dense
  multiply-adds of ``wide_cli.cost`` for the same tokens and context. A row skips work when it
  executed fewer multiply-adds than dense (routers excluded); rows that only mask (the reference
  backend, a decode batch whose union of groups is everything) carry no ideal bound. HF and
  llama.cpp are dense code that the runtime cannot count: their fraction is null.
- Ideal speedup (skipping rows only), from ``wide_cli.cost`` at the measured sparsity: decode =
  dense weight bytes per token / routed ones (``decode_bytes``); prefill = dense FLOPs / routed
  FLOPs at the prompt's mean context.

Modules: ``config.py`` (what to measure), ``workload.py`` (prompts, forced masks),
``systems.py`` (HF, the runtime, llama.cpp behind one prefill/decode interface),
``dense_work.py`` (the dense multiply-adds and weight bytes a row is compared with),
``quality.py`` (perplexity per weight format), ``report.py`` (rows and speedups), ``run.py``
(``run_bench``). A tool beside the runtime, not part of it.
"""
