"""Importance matrix of a model's quantized weights: per input channel of every projection and of
the LM head, the mean over calibration tokens of the squared input (llama.cpp's ``llama-imatrix``;
the diagonal of GPTQ's Hessian ``X^T X / n``, Frantar et al. 2022). ``quant.quantize_int4`` weights
each channel's squared error by it when choosing a block's scale.

The statistics are those of the model as it runs (routed, with its stand-ins, when routers are
attached), on training data: the inputs of q/k/v (the normed residual stream), o_proj (the
attention output, zero in skipped head groups), gate/up, down (``act(gate) * up``) and the LM head
(the final-normed hidden state). A tied embedding is the LM head's matrix and gets its importance:
as a lookup table it has no input, and as the head it is what the logits multiply.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wide_cli.calibrate.statistics import calibration_pass
from wide_cli.quant import export_groups


def _causal_lm(model):
    """The CausalLM under a PEFT wrapper, else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@torch.no_grad()
def collect_importance(
    model,
    batches: torch.Tensor,
    *,
    batch_size: int = 4,
    max_batches: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``model`` over ``batches`` and average the squared inputs of its quantized matrices.

    Args:
        model: a supported ``*ForCausalLM`` (any dtype / device; sums kept in float64 on the CPU),
            routed or plain.
        batches: ``[N, T]`` int64 token ids of training (never evaluation) data, no padding.
        batch_size: sequences per forward pass.
        max_batches: at most this many forward passes (the first ones); None = all of ``N``.
        progress: called as ``progress(done, total)`` after each forward pass.

    Returns:
        HF weight name (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, and
        ``model.embed_tokens.weight`` when tied to the head) -> fp32 ``[K]``, K the matrix's input
        width: mean over tokens of ``x_k ** 2``.

    Raises:
        ValueError: empty ``batches``.
    """
    if batches.dim() != 2 or batches.shape[0] == 0:
        raise ValueError(f"batches must be a non-empty [N, T] tensor, got shape {tuple(batches.shape)}")
    lm = _causal_lm(model)
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [B * T, K]
            s = x.square().sum(0).double().cpu()
            sums[name] = sums[name] + s if name in sums else s

        return fn

    hooks = []
    for name, mod in lm.model.named_modules(prefix="model"):
        wname = name + ".weight"
        if isinstance(mod, torch.nn.Linear) and export_groups(wname, attn_cols=0, ffn_group_size=0) is not None:
            hooks.append((mod, hook(wname)))
    head = torch.zeros(lm.config.hidden_size, dtype=torch.float64)

    def forward(chunk):
        nonlocal head
        # the decoder stack only: the LM head's input is its final-normed output, and the
        # [B, T, vocab] logits would dominate memory
        h = lm.model(input_ids=chunk, use_cache=False).last_hidden_state  # [B, T, D]
        head += h.float().reshape(-1, h.shape[-1]).square().sum(0).double().cpu()

    tokens = calibration_pass(model, batches, hooks, batch_size=batch_size, max_batches=max_batches,
                              progress=progress, forward=forward)
    out = {n: (s / tokens).float() for n, s in sums.items()}
    out["lm_head.weight"] = (head / tokens).float()
    if getattr(lm.config, "tie_word_embeddings", False):
        out["model.embed_tokens.weight"] = out["lm_head.weight"]
    return out
