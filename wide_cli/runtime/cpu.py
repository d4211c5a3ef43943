"""The ``cpu`` backend: routed work is actually skipped (DESIGN.md §3), with PyTorch on CPU.

Weight layout, built once in ``prepare_layer`` as ``Proj`` objects (no weight slice is copied per
step), in the backend's weight format (``fp32``, ``bf16``, or ``int8`` / ``int4`` weight-only, see
``runtime/quant.py``):
- ``qkv [(H + 2 H_kv) d, D]``: Q rows then K, V rows. A head group's Q rows are a contiguous row
  block; the dense path is one GEMM.
- ``o``: O projection routed along its reduction axis: float ``[H d, D]`` transposed (a head
  group's channels are contiguous rows); int8 one ``[D, c]`` block and one scale row per group.
- ``gu [G_f 2 g, D]``: per FFN group its gate rows then its up rows (group-major), so a run of
  adjacent groups is one contiguous block and one GEMM yields both halves.
- ``down``: like ``o`` with the FFN groups.
- the LM head (``prepare_head``), dense, in the same format.
Every GEMM adds its multiply-adds to ``Counter`` (``wide bench``'s executed share) and, in tests,
the byte spans it read (a skipped group reads none).

Decode of 1-64 rows does not come here: ``Runtime.step`` hands a one-token step to the native
step (``runtime/cpu_native.py``, ``kernels/cpu_decode.c``), which reads these same ``Proj``
tensors from C, one call per step, each row running its own groups. This module runs prefill,
batches of more than 64 rows and byte tracing, and is the native step's oracle in tests. The
measurements below are of this PyTorch path.

int8 decode, profiled with the torch profiler on the SmolLM2-135M demo export (batch 1, 1 thread,
shared machine): 56 % of the step is the int8 GEMM itself (~14 calls per layer plus the LM head,
3.9 ms of ~18 ms per token), the rest ~700 small ops per token (casts, norms, RoPE, masks); with
torch's per-row-scale int8 kernel the O/down projections take one call per active group.

Two ways to skip, chosen by the number of tokens ``M`` in the call:
- ``M <= SMALL_M`` (decode): *union runs*. The groups that any token executes are merged into runs
  of adjacent groups; each run is one GEMM on a weight view; rows of tokens that skip a group are
  zeroed afterwards. Decode is memory-bound, so reading only the union of active weights is what
  matters (at batch 1 the union is the token's own groups).
- ``M > SMALL_M`` (prefill): *mask reordering*. Per group, the executing tokens are gathered
  (``ops.group_token_lists``), multiplied by the group's weights and scattered back
  (``index_add_``), so compute follows the sparsity. The FFN keeps each group's intermediate
  activations compact between the gate/up and down GEMMs. A call whose tokens execute at least
  ``cpu_plan.DENSE_MASKED_FRACTION`` (80 %) of the (token, group) pairs, every group by some
  token, runs the dense GEMMs and zeroes the skipped pairs instead: the gathered GEMMs cost more
  than the few skipped pairs save.

On a CPU with AMX or AVX512-BF16 (``cpu_gather.isa``), a routed bf16 prefill call (Q, O, the
gated FFN, causal attention) runs as one native call per module instead
(``kernels/cpu_prefill_gather.c``): weights packed once per process, each group's tokens gathered
inside the kernel, the FFN's intermediate activations kept per group. On AMX it gathers below
``cpu_plan.AMX_DENSE_MASKED_FRACTION`` (90 %) of the pairs and otherwise runs PyTorch's dense
GEMMs (oneDNN on the tiles) and the mask; with AVX512-BF16 only it gathers whenever a pair is
skipped, and runs the dense FFN too, where it measured faster than oneDNN
(``cpu_plan.VDP_DENSE_MASKED_FRACTION``), and fp32 prefill's projections and FFN likewise on
fp32 FMAs (``cpu_gather.f32_ready``). There bf16 prefill's RMSNorm, RoPE and residual +
stand-ins run natively too (``runtime/cpu_prefill.py``). ``WIDE_CPU_GATHER=off`` keeps every call
on the paths of this module.

Attention prefill runs, per row and head group, only the executing query tokens, in chunks whose
key range ends at the chunk's last query (so causal work is not wasted), or, as the projections
above, one causal SDPA over every head then the mask; decode reads the KV heads of the active head
groups only (the union over rows when ``B > 1``).

Measured on a shared 2-core Xeon (AVX-512, no bf16 units), SmolLM2-135M shapes, fp32, one thread
(other jobs running, so +-15 %):
- 30 FFN layers at batch 1 with 5 of 12 groups active: 12 ms vs 25 ms dense (ideal 10.4 ms); a
  gather-then-GEMM variant (``index_select`` of the weights every step) was slower than dense
  (28 ms). What is left above the ideal is per-GEMV cost: ~3.4 runs per layer, two GEMVs each.
- Whole model, random routers at 50 %: decode batch 1 is 1.22x the runtime's dense mode (ideal
  1.59x), prefill of 1024 tokens 1.48x; decode batch 8 is at parity with dense (the union of 8
  tokens' groups is nearly everything; then dense GEMMs + masking are used).
- With 2 threads the dense GEMVs gain more from the second core than the short routed ones, and
  on a loaded machine OpenMP barriers dominate; ``wide bench`` defaults to one thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wide_cli.runtime.backend import Counter, LayerWeights
from wide_cli.runtime.cpu_attention import attention_decode, attention_prefill
from wide_cli.runtime.cpu_plan import skip_plan
from wide_cli.runtime.cpu_proj import (
    Proj,
    ffn_proj,
    gather_rows,
    gemm_k_proj,
    gemm_mn_proj,
    grouped_gate_up,
    zero_skipped,
)


@dataclass
class _CpuLayer:
    qkv: Proj  # axis n, [(H + 2 H_kv) d, D]: Q rows (head groups) then K, V rows
    bqkv: torch.Tensor | None
    q_rows: int  # H d
    o: Proj  # axis k, groups of attn_cols
    bo: torch.Tensor | None
    gu: Proj  # axis n, [G_f 2 g, D] group-major gate | up
    down: Proj  # axis k, groups of ffn_group_size
    attn_cols: int  # heads per group * d
    ffn_group_size: int
    act: str = "silu"  # the FFN's gating activation (ops.gate_act)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in (self.qkv, self.o, self.gu, self.down))


class CpuBackend:
    """Skips routed work on CPU (see the module docstring for layout and strategy).

    Args:
        device: ``cpu``.
        weights: weight format, ``fp32``, ``bf16``, ``int8`` or ``int4`` (``runtime/quant.py``); the
            activations are fp32 for fp32 weights and bf16 otherwise.

    Attributes:
        counter: ``Counter`` of executed multiply-adds (and, when tracing, weight reads).
    """

    name = "cpu"
    skips_work = True

    def __init__(self, device: str | torch.device = "cpu", weights: str = "fp32"):
        from wide_cli.runtime.quant import check_format

        self.device = torch.device(device)
        if self.device.type != "cpu":
            from wide_cli.errors import ConfigError

            raise ConfigError(f"backend 'cpu' runs on the CPU, not {self.device}", "use --backend cupy on a GPU")
        self.weights = check_format(weights)
        self.counter = Counter()

    def prepare_layer(self, layer: LayerWeights, dtype: torch.dtype) -> _CpuLayer:
        def t(x):
            return x.to(device=self.device, dtype=dtype)

        fmt, dev, c = self.weights, self.device, self.counter
        g = layer.ffn_group_size
        i = layer.index
        bqkv = layer.qkv_bias()
        if bqkv is not None:
            bqkv = t(bqkv).contiguous()
        cols = layer.attn_group_size * layer.head_dim
        return _CpuLayer(
            qkv=Proj(torch.cat([layer.wq, layer.wk, layer.wv]), "n", fmt, dtype, dev, c,
                     what=f"layer {i} q/k/v (hidden size)"),
            bqkv=bqkv,
            q_rows=layer.wq.shape[0],
            o=Proj(layer.wo, "k", fmt, dtype, dev, c, g=cols, what=f"layer {i} o_proj (attention group of {cols} channels)"),
            bo=None if layer.bo is None else t(layer.bo).contiguous(),
            gu=Proj(grouped_gate_up(layer.w_gate, layer.w_up, g), "n", fmt, dtype, dev, c,
                    what=f"layer {i} gate/up (hidden size)"),
            down=Proj(layer.w_down, "k", fmt, dtype, dev, c, g=g, what=f"layer {i} down_proj (FFN group size)"),
            attn_cols=cols,
            ffn_group_size=g,
            act=layer.act,
        )  # fmt: skip

    def prepare_head(self, w: torch.Tensor, dtype: torch.dtype) -> Proj:
        """The LM head ``[V, D]`` in this backend's weight format."""
        return Proj(w, "n", self.weights, dtype, self.device, self.counter, what="lm_head (hidden size)")

    def head(self, p: Proj, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x [M, D] -> [M, V]`` in the compute dtype."""
        return p.rows(x, 0, p.N)

    def attn_in(self, p: _CpuLayer, x, mask):
        nq = p.q_rows
        plan = skip_plan(mask)
        # Dense, or a call whose routed Q runs dense then masks (cpu_plan): one GEMM for Q, K and V
        # (with Q apart from K / V, a SmolLM2-135M prefill of 128 tokens spent 113.6 ms in its GEMMs
        # against 107.2 ms dense: bf16, 1 thread, 7 % of the pairs skipped)
        masked = plan[0] == "sparse" and plan[1] == [(0, mask.shape[1])] and not gather_rows(p.qkv, x, mask, p.attn_cols)
        if plan[0] == "dense" or masked:
            qkv = p.qkv.rows(x, 0, p.qkv.N)
            if p.bqkv is not None:
                qkv.add_(p.bqkv)
            q, kv = qkv[:, :nq], qkv[:, nq:]
            if masked:
                zero_skipped(q, mask, p.attn_cols)
            nkv = kv.shape[1] // 2
            return q, kv[:, :nkv], kv[:, nkv:]
        bq = bkv = None
        if p.bqkv is not None:
            bq, bkv = p.bqkv[:nq], p.bqkv[nq:]
        kv = p.qkv.rows(x, nq, p.qkv.N)  # dense: every token's K/V (later tokens read them)
        if bkv is not None:
            kv.add_(bkv)
        q = gemm_mn_proj(x, p.qkv, mask, p.attn_cols, bq, plan)
        nkv = kv.shape[1] // 2
        return q, kv[:, :nkv], kv[:, nkv:]

    def attn_out(self, p: _CpuLayer, o, mask):
        return gemm_k_proj(o, p.o, mask, p.bo, skip_plan(mask))

    def mlp(self, p: _CpuLayer, x, mask):
        return ffn_proj(x, p.gu, p.down, mask, skip_plan(mask), p.act)

    def attention_prefill(self, q, k, v, head_mask, *, key_valid, q_offset, scale, window):
        return attention_prefill(q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale,
                                 window=window, counter=self.counter)  # fmt: skip

    def attention_decode(self, q, k_cache, v_cache, head_mask, key_valid, *, scale, window):
        return attention_decode(q, k_cache, v_cache, head_mask, key_valid, scale=scale, window=window,
                                counter=self.counter)  # fmt: skip
