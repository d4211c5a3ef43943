"""Training text written by the dense model itself (self-data distillation).

Fine-tuning a pruned model on text that is not the dense model's own (a corpus of another style,
such as the builtin pydoc topics) pulls it towards that text: the demo's pruned SmolLM2 answered
chat prompts with its system prompt and drifted into documentation prose. Training on what the
dense model itself writes keeps the pruned model in the dense model's distribution (Thangarasa et
al., "Self-Data Distillation for Recovering Quality in Pruned Large Language Models", 2024).

For a chat model the prompts come from the model too (Magpie: Xu et al., "Magpie: Alignment Data
Synthesis from Scratch by Prompting Aligned LLMs with Nothing", 2024): the chat template up to
the start of a user turn is sampled into a user request, then the assistant turn is sampled as
the answer. Each document is the whole transcript in the model's chat template. Plain-text
documents (``generate_text_documents``, any model) are sampled from the start-of-text token alone:
text in the breadth of what the model was pretrained on, not only its chat register. Generation
runs on the runtime (dense, bf16 compute), in batches, with seeded sampling, so a seed gives the
same documents.
"""

from __future__ import annotations

import logging

from wide_cli.errors import ConfigError

log = logging.getLogger("wide")

# Sampling of the user turn (diverse requests) and of the answer (the model's usual register).
USER_SAMPLING = {"temperature": 1.0, "top_p": 0.95}
ANSWER_SAMPLING = {"temperature": 0.7, "top_p": 0.9}
# Plain text: the model's own distribution, with the tail of least likely tokens cut.
TEXT_SAMPLING = {"temperature": 1.0, "top_p": 0.95}
USER_MAX_TOKENS = 64
MARKER = "\x00WIDE_USER_TURN\x00"


def chat_turn_prefixes(tokenizer) -> tuple[str, str]:
    """``(before_user_text, after_user_text)``: the chat template's text before a user message
    (with the template's default system prompt, if any) and between the message and the start of
    the assistant answer.

    Raises:
        ConfigError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "self-generated training data needs a chat model (the tokenizer has no chat template)",
            "set [data] self_generated = 0, or prune an instruct model",
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    before, after = text.split(MARKER)
    return before, after


def generate_chat_documents(model, tokenizer, *, n: int, max_new_tokens: int, seed: int, batch_size: int = 32,
                            progress=None) -> list[str]:
    """``n`` chat transcripts written by ``model`` (a dense Hugging Face causal LM): a sampled user
    request, then a sampled answer of at most ``max_new_tokens`` tokens.

    Args:
        progress: called as ``progress(done, n)`` after each batch.

    Returns:
        ``n`` strings, each ``before + request + after + answer + end``, where ``end`` is the
        template's end-of-turn text (the EOS token's text when the template has none).

    Raises:
        ConfigError: no chat template, ``n < 1`` or ``max_new_tokens < 1``.
    """
    from wide_cli.runtime.engine import Runtime
    from wide_cli.runtime.sampling import SamplingConfig

    if n < 1 or max_new_tokens < 1:
        raise ConfigError(f"self-generated documents {n} and tokens {max_new_tokens} must be >= 1")
    before, after = chat_turn_prefixes(tokenizer)
    end = _end_of_turn(tokenizer)
    rt = Runtime.from_model(model, tokenizer, routing=False, weight_format="bf16")
    docs: list[str] = []
    for b0 in range(0, n, batch_size):
        m = min(batch_size, n - b0)
        users = rt.generate([before] * m, max_new_tokens=USER_MAX_TOKENS, stop=(end,),
                            sampling=SamplingConfig(**USER_SAMPLING, seed=seed * 1_000_003 + b0)).texts  # fmt: skip
        users = [u.strip() or "Hello!" for u in users]
        prompts = [before + u + after for u in users]
        answers = rt.generate(prompts, max_new_tokens=max_new_tokens, stop=(end,),
                              sampling=SamplingConfig(**ANSWER_SAMPLING, seed=seed * 1_000_003 + b0 + 1)).texts  # fmt: skip
        docs.extend(p + a.strip() + end for p, a in zip(prompts, answers))
        if progress is not None:
            progress(len(docs), n)
    return docs


def text_start(tokenizer) -> str:
    """The text a plain-text document starts from: the tokenizer's BOS token, else its EOS token
    (the separator between pretraining documents).

    Raises:
        ConfigError: the tokenizer has neither.
    """
    start = tokenizer.bos_token or tokenizer.eos_token
    if not start:
        raise ConfigError("self-generated plain text needs a start-of-text token (the tokenizer has no BOS or EOS)",
                          "set [data] self_generated_text = 0")
    return start


def generate_text_documents(model, tokenizer, *, n: int, max_new_tokens: int, seed: int, batch_size: int = 32,
                            progress=None) -> list[str]:
    """``n`` plain-text documents written by ``model`` (a dense Hugging Face causal LM), each
    sampled from the start-of-text token (``text_start``) for at most ``max_new_tokens`` tokens
    (``TEXT_SAMPLING``), ending early at EOS.

    Args:
        progress: called as ``progress(done, n)`` after each batch.

    Returns:
        ``n`` strings: the generated text, without the start token; empty samples are dropped, so
        there may be fewer.

    Raises:
        ConfigError: ``n < 1``, ``max_new_tokens < 1``, or no start-of-text token.
    """
    from wide_cli.runtime.engine import Runtime
    from wide_cli.runtime.sampling import SamplingConfig

    if n < 1 or max_new_tokens < 1:
        raise ConfigError(f"self-generated documents {n} and tokens {max_new_tokens} must be >= 1")
    start = text_start(tokenizer)
    rt = Runtime.from_model(model, tokenizer, routing=False, weight_format="bf16")
    docs: list[str] = []
    for b0 in range(0, n, batch_size):
        m = min(batch_size, n - b0)
        # another seed stream than the chat transcripts' (seed * 1_000_003 + b0 [+ 1])
        texts = rt.generate([start] * m, max_new_tokens=max_new_tokens,
                            sampling=SamplingConfig(**TEXT_SAMPLING, seed=seed * 1_000_003 + 500_000 + b0)).texts
        docs.extend(t.strip() for t in texts if t.strip())
        if progress is not None:
            progress(b0 + m, n)
    return docs


def _end_of_turn(tokenizer) -> str:
    """The text that closes a turn in the chat template (``<|im_end|>`` for ChatML), found by
    rendering a one-message conversation; the EOS token's text otherwise."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    tail = text.split(MARKER, 1)[1].split()
    return tail[0] if tail else (tokenizer.eos_token or "")
