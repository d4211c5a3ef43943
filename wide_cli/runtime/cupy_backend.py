"""The ``cupy`` backend: routed work on NVIDIA GPUs through the CUDA kernels of ``cupy_ops``.

Importing this module needs neither CuPy nor a GPU (so ``wide --help`` and CPU-only CI stay
clean); constructing ``CupyBackend`` without a usable CUDA device raises ``ConfigError``
("no CUDA device ...") naming what is missing.

Weight layout, built once in ``prepare_layer``:
- ``wqkv [(H + 2 H_kv) d, D]``: Q rows, then K, V rows. ``wq`` and ``wkv`` are contiguous row
  views of it: the routed Q projection reads ``wq``; K/V stay dense (one cuBLAS GEMM: later tokens
  attend to every token's K/V); the dense path (no mask) is a single GEMM over all of it.
- ``w_gu [2F, D]``: gate rows then up rows, with contiguous views ``w_gate``, ``w_up``; the
  dense path is one GEMM.
- ``wo [D, H d]``, ``w_down [D, F]``: Hugging Face layout; ``gemm_k`` reads only the column
  groups (reduction channels) that execute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wide_cli.errors import ConfigError
from wide_cli.runtime import cupy_ops
from wide_cli.runtime.backend import LayerWeights
from wide_cli.runtime.cuda.launch import cuda_status


@dataclass
class _GpuLayer:
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    q_rows: int
    wo: torch.Tensor
    bo: torch.Tensor | None
    w_gu: torch.Tensor
    w_down: torch.Tensor
    attn_cols: int  # Q columns / O reduction channels per head group: heads_per_group * d
    ffn_group_size: int

    @property
    def wq(self) -> torch.Tensor:
        return self.wqkv[: self.q_rows]

    @property
    def ffn_size(self) -> int:
        return self.w_gu.shape[0] // 2


class CupyBackend:
    """Routed prefill/decode on one NVIDIA GPU (see the module docstring for the layout)."""

    name = "cupy"

    def __init__(self, device: str | torch.device = "cuda"):
        why = cuda_status()
        if why is not None:
            raise ConfigError(
                f"backend 'cupy' cannot run: {why}",
                "use --backend cpu, or run on a machine with an NVIDIA GPU, a CUDA build of torch and cupy",
            )
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(
                f"backend 'cupy' runs on a CUDA device, not {dev}", "pass device='cuda' (or 'cuda:N')"
            )
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)

    def prepare_layer(self, layer: LayerWeights, dtype: torch.dtype) -> _GpuLayer:
        if layer.act != "silu" or layer.ln_attn_out is not None or layer.ln_ffn_out is not None:
            # the CUDA FFN kernels fuse SwiGLU; the engine's sandwich norms would run, its FFN would not
            from wide_cli.features import UnsupportedFeature

            raise UnsupportedFeature("gemma3_layer", "cupy", label=f"layer {layer.index}")

        def t(x):
            return x.to(device=self.device, dtype=dtype)

        bqkv = layer.qkv_bias()
        if bqkv is not None:
            bqkv = t(bqkv).contiguous()
        return _GpuLayer(
            wqkv=t(torch.cat([layer.wq, layer.wk, layer.wv])).contiguous(),
            bqkv=bqkv,
            q_rows=layer.wq.shape[0],
            wo=t(layer.wo).contiguous(),
            bo=None if layer.bo is None else t(layer.bo).contiguous(),
            w_gu=t(torch.cat([layer.w_gate, layer.w_up])).contiguous(),
            w_down=t(layer.w_down).contiguous(),
            attn_cols=layer.attn_group_size * layer.head_dim,
            ffn_group_size=layer.ffn_group_size,
        )

    def attn_in(self, p: _GpuLayer, x, mask):
        nq = p.q_rows
        if mask is None:
            qkv = F.linear(x, p.wqkv, p.bqkv)
            q, kv = qkv[:, :nq], qkv[:, nq:]
        else:
            bq = None if p.bqkv is None else p.bqkv[:nq]
            bkv = None if p.bqkv is None else p.bqkv[nq:]
            q = cupy_ops.gemm_mn(x, p.wq, mask, p.attn_cols, bq)
            kv = F.linear(x, p.wqkv[nq:], bkv)  # every token's K/V, routed or not (later tokens read them)
        nkv = kv.shape[1] // 2
        return q, kv[:, :nkv], kv[:, nkv:]

    def attn_out(self, p: _GpuLayer, o, mask):
        return cupy_ops.gemm_k(o, p.wo, mask, p.attn_cols, p.bo)

    def mlp(self, p: _GpuLayer, x, mask):
        F_ = p.ffn_size
        if mask is None:
            gu = F.linear(x, p.w_gu)
            return F.linear(F.silu(gu[:, :F_]) * gu[:, F_:], p.w_down)
        return cupy_ops.mlp(x, p.w_gu[:F_], p.w_gu[F_:], p.w_down, mask, p.ffn_group_size)

    def attention_prefill(self, q, k, v, head_mask, *, key_valid, q_offset, scale, window):
        return cupy_ops.attention_prefill(
            q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale, window=window
        )

    def attention_decode(self, q, k_cache, v_cache, head_mask, key_valid, *, scale, window):
        return cupy_ops.attention_decode(
            q, k_cache, v_cache, head_mask, key_valid, scale=scale, window=window
        )
