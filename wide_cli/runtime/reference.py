"""The ``reference`` backend: dense compute, then mask (the correctness oracle).

Every call goes straight to the operators of ``runtime/ops.py``; nothing is skipped, so its speed
is that of a dense model plus the masking. It runs on any torch device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wide_cli.runtime import ops
from wide_cli.runtime.backend import Counter, LayerWeights


@dataclass
class _RefLayer:
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    bo: torch.Tensor | None
    head_dim: int
    attn_cols: int  # Q columns / O reduction channels per head group: heads_per_group * d
    ffn_group_size: int
    act: str  # the FFN's gating activation (ops.gate_act)


class ReferenceBackend:
    """PyTorch masking backend; weights stay in Hugging Face layout.

    Attributes:
        counter: ``Counter`` of the multiply-adds it executes (always the dense amount).
    """

    name = "reference"
    skips_work = False

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.counter = Counter()

    def prepare_layer(self, layer: LayerWeights, dtype: torch.dtype) -> _RefLayer:
        def t(x):
            return None if x is None else x.to(device=self.device, dtype=dtype).contiguous()

        return _RefLayer(
            t(layer.wq), t(layer.wk), t(layer.wv), t(layer.wo),
            t(layer.w_gate), t(layer.w_up), t(layer.w_down),
            t(layer.bq), t(layer.bk), t(layer.bv), t(layer.bo),
            layer.head_dim, layer.attn_group_size * layer.head_dim, layer.ffn_group_size, layer.act,
        )  # fmt: skip

    def attn_in(self, p: _RefLayer, x, mask):
        self.counter.macs += x.shape[0] * x.shape[1] * (p.wq.shape[0] + 2 * p.wk.shape[0])
        q = ops.gemm_mn(x, p.wq, mask, p.attn_cols, p.bq)
        k = torch.nn.functional.linear(x, p.wk, p.bk)
        v = torch.nn.functional.linear(x, p.wv, p.bv)
        return q, k, v

    def attn_out(self, p: _RefLayer, o, mask):
        self.counter.macs += o.shape[0] * p.wo.numel()
        return ops.gemm_k(o, p.wo, mask, p.attn_cols, p.bo)

    def mlp(self, p: _RefLayer, x, mask):
        self.counter.macs += x.shape[0] * 3 * p.w_gate.numel()
        h = ops.gemm_mn_swiglu(x, p.w_gate, p.w_up, mask, p.ffn_group_size, p.act)
        return ops.gemm_k(h, p.w_down, mask, p.ffn_group_size)

    def attention_prefill(self, q, k, v, head_mask, *, key_valid, q_offset, scale, window):
        B, T, H, d = q.shape
        self.counter.attn_macs += B * H * d * 2 * T * k.shape[1]  # masked scores: every (query, key) pair
        return ops.attention_prefill(
            q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale, window=window
        )

    def attention_decode(self, q, k_cache, v_cache, head_mask, key_valid, *, scale, window):
        B, H, d = q.shape
        self.counter.attn_macs += B * H * d * 2 * key_valid.shape[1]
        return ops.attention_decode(q, k_cache, v_cache, head_mask, key_valid, scale=scale, window=window)
