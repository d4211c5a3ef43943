"""The CPU side of the vLLM plugin's routed ops: what ``torch.ops.vllm.wide_ffn_cpu`` /
``wide_out_cpu`` run inside vLLM's compiled graph (``WideRoutedFFN`` / ``WideRoutedOut.forward_cpu``
in ``vllm_models.py``), and the multiply-adds they executed (``stats()``).

Each op takes its module's input and the residual stream its router reads, and returns the
module's output with the skipped groups' stand-ins added, so that the router, the projections and
the stand-ins of one module are one opaque call rather than several small ops of the graph.
A step of at most ``NATIVE_M`` tokens is one native call (``cpu_rows.routed_ffn`` /
``routed_out`` with the module's router: each token over its own groups, a group's weights read
once for all the tokens that execute it, in one forward stream, so with every group on they read
the weights at least as fast as vLLM's dense kernels). A step of up to ``SMALL_M`` tokens decides
natively (``cpu_rows.route_rows``: decisions and stand-in sums in one call), then runs on the
same kernels when the union of its tokens' groups is at most half the groups
(``NATIVE_UNION_SHARE``), else on vLLM's own prepacked dense kernels, then masked. A larger step
routes in PyTorch and gathers each group's executing tokens on the ``cpu`` backend's projections
(``runtime/cpu_proj.py``), or, when its tokens execute most (token, group) pairs and every group
(``cpu_plan.skip_plan``), runs vLLM's dense kernels and masks.
Needs the serving environment (vLLM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.utils.torch_utils import direct_register_custom_op

from wide_cli.runtime import cpu_native, cpu_proj, cpu_rows
from wide_cli.runtime.cpu_plan import SMALL_M, skip_plan

#: multiply-adds of the routed projections: ``executed`` by the PyTorch paths, ``dense`` for the
#: same tokens without routing (every path), per op kind ("attention" = O projection, "ffn" =
#: gate/up/down). ``stats()`` adds what the native kernels executed.
STATS: dict[str, dict[str, int]] = {"attention": {"executed": 0, "dense": 0}, "ffn": {"executed": 0, "dense": 0}}


#: what the native decode kernels executed, per op kind: int64 ``[len(cpu_native.COUNTERS)]``
#: the C calls add to themselves (``COUNTERS[0]``: multiply-adds), so a decode call counts nothing
#: in Python.
NATIVE_COUNTS: dict[str, torch.Tensor] = {k: torch.zeros(len(cpu_native.COUNTERS), dtype=torch.int64) for k in STATS}


def reset_stats() -> None:
    for v in STATS.values():
        v["executed"] = v["dense"] = 0
    for c in NATIVE_COUNTS.values():
        c.zero_()


def stats() -> dict[str, dict[str, int]]:
    """``STATS`` with the native kernels' multiply-adds added: per op kind ``executed`` and
    ``dense``."""
    return {k: {"executed": v["executed"] + int(NATIVE_COUNTS[k][0]), "dense": v["dense"]} for k, v in STATS.items()}


def _count(kind: str, plan, mask: torch.Tensor, group_macs: int, M: int, *, every_group: bool = False) -> None:
    """Add what a PyTorch path executes for this call: every group for every token (``state``
    dense, or ``every_group``: vLLM's dense kernels, then the mask), the union of active groups for
    every token (``cpu_proj``'s small-M path), each token's own groups (large M, gathered), or
    nothing."""
    state, runs, _ = plan
    G = mask.shape[1]
    if state == "dense" or every_group:
        n = M * G
    elif state == "none":
        n = 0
    elif M <= SMALL_M or runs:
        n = M * sum(e - s for s, e in runs)
    else:
        n = int(mask.sum())
    STATS[kind]["executed"] += n * group_macs
    STATS[kind]["dense"] += M * G * group_macs


# ---------------------------------------------------------------------------------------------
# opaque ops (the data-dependent work; vLLM's compiled graph sees one fixed-shape call)


#: the routed op modules of this process, by ``op_id`` (the opaque ops get the id, so that their
#: dense branch can call the layer's vLLM linear layers: on CPU those hold weights prepacked for
#: oneDNN, faster than a plain GEMM on the unpacked copy).
OP_MODULES: list[nn.Module] = []


def _dense_masked(plan, M: int, G: int) -> bool:
    """Whether a call that does not run natively runs vLLM's prepacked dense kernels on every group
    for every token and then zeroes the skipped (token, group) pairs: a decode call (at most
    ``SMALL_M`` tokens, see ``NATIVE_UNION_SHARE``), or a prefill call whose tokens execute most
    pairs and every group (``cpu_plan.dense_then_mask``). Otherwise the ``cpu`` backend's
    projections gather each group's tokens."""
    state, runs, _ = plan
    return state == "dense" or (state == "sparse" and (M <= SMALL_M or runs == [(0, G)]))


#: Calls of at most this many tokens run on the native step kernels whatever their masks. 26
#: SmolLM2-135M FFN + O projections, every group on, fp32, 1 thread, 2-core AVX-512 EPYC, two
#: rounds each: at 1 token 20-22 ms native against 24-29 ms for vLLM's oneDNN kernels, at 4 tokens
#: 23-24 against 23, at 6 tokens 29-32 against 20-21, at 8 tokens 35-38 against 27, at 16 tokens
#: 59-77 against 33-44 (the native kernels run 4 tokens per pass over a weight block, oneDNN
#: blocks every token into one GEMM).
NATIVE_M = 4

#: A call of ``NATIVE_M + 1`` to ``SMALL_M`` tokens runs natively only when the union of its
#: tokens' groups is at most this share of the groups: there the native kernels take 1.3-1.8x
#: oneDNN's time on the same weights (``NATIVE_M``), so skipping a few groups does not pay (on
#: the make demo export at 16 concurrent requests, running such steps natively whenever their
#: union skipped any group served 155 tok/s, median of 3 rounds of 150-178, against 172, rounds of
#: 169-193, with every group on through oneDNN; 2-core AVX-512 EPYC, 1 thread).
NATIVE_UNION_SHARE = 0.5


def _native_step(plan, M: int, G: int) -> bool:
    """Whether a call of ``M`` tokens (``plan``: its ``skip_plan``, None up to ``NATIVE_M``) runs on the
    native step kernels: up to ``NATIVE_M`` tokens always; up to ``SMALL_M`` tokens when their
    union is at most ``NATIVE_UNION_SHARE`` of the groups (the rest are then not read at all).
    Other calls run vLLM's prepacked dense kernels and mask, or (more than ``SMALL_M`` tokens with
    few pairs executed) gather each group's tokens."""
    if M <= NATIVE_M:
        return True
    if M > SMALL_M or plan[0] == "dense":
        return False
    return sum(e - s for s, e in plan[1]) <= NATIVE_UNION_SHARE * G  # "none": nothing to run


def _vllm_gemm(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` with vLLM's CPU kernel of ``linear`` (no bias, no tensor-parallel reduction)."""
    return linear.cpu_linear(x, linear.weight, None)


def _ffn_vllm(mlp: nn.Module, x: torch.Tensor, mask: torch.Tensor, zero_skipped: bool) -> torch.Tensor:
    """The FFN on vLLM's prepacked dense kernels for every group, the skipped (token, group) pairs
    of ``mask [M, G]`` zeroed by one broadcast multiply when ``zero_skipped``."""
    gu = _vllm_gemm(mlp.gate_up_proj, x)
    Fl = gu.shape[1] // 2
    h = F.silu(gu[:, :Fl]) * gu[:, Fl:]
    if zero_skipped:
        h.view(mask.shape[0], mask.shape[1], -1).mul_(mask.unsqueeze(-1))
    return _vllm_gemm(mlp.down_proj, h)


def _out_vllm(o_proj: nn.Module, o: torch.Tensor, mask: torch.Tensor, zero_skipped: bool) -> torch.Tensor:
    """The O projection on vLLM's prepacked dense kernel, skipped head groups' channels of
    ``mask [M, G]`` zeroed first when ``zero_skipped``."""
    if zero_skipped:
        M, G = mask.shape
        o = (o.reshape(M, G, -1) * mask.unsqueeze(-1)).reshape(M, -1)
    return _vllm_gemm(o_proj, o)


def _ffn_cpu(x: torch.Tensor, r: torch.Tensor, op_id: int) -> torch.Tensor:
    """``x [M, D]``, ``r [M, D]`` (what its router reads) -> ``[M, D]``: the routed FFN of op module
    ``op_id``, stand-ins included. A step of at most ``NATIVE_M`` tokens is one native call
    (router, projections and stand-ins); otherwise the router runs here and picks the path."""
    op = OP_MODULES[op_id]
    M = x.shape[0]
    mr = op.router.module_router() if M <= SMALL_M else None
    if mr is not None and M <= NATIVE_M:
        y = cpu_rows.routed_ffn(op.gu, op.down, x, None, NATIVE_COUNTS["ffn"], router=mr, r=r)
        if y is not None:
            STATS["ffn"]["dense"] += M * mr.weight.shape[0] * op.group_macs
            return y
    if mr is not None and (routed := cpu_rows.route_rows(mr, r, x.shape[1], NATIVE_COUNTS["ffn"])) is not None:
        mask, sums, union, pairs = routed  # one native call: decisions and stand-in sums
        y = _ffn_small(op, x, mask, union, pairs)
        return y if sums is None or pairs == mask.numel() else y.add_(sums.to(y.dtype))
    ex = op.router(r)
    return op.router.add_standin(_ffn_masked(op, x, ex), ex)


def _ffn_small(op, x: torch.Tensor, mask: torch.Tensor, union: int, pairs: int) -> torch.Tensor:
    """The FFN of ``NATIVE_M < M <= SMALL_M`` tokens over ``mask [M, G]`` uint8 (``union`` groups
    executed by some token, ``pairs`` executed pairs): natively when the union is at most
    ``NATIVE_UNION_SHARE`` of the groups, else vLLM's dense kernels and one broadcast multiply."""
    M, G = mask.shape
    mlp = op._mlp[0]
    if union <= NATIVE_UNION_SHARE * G or not hasattr(mlp.down_proj, "cpu_linear"):
        y = cpu_rows.routed_ffn(op.gu, op.down, x, mask, NATIVE_COUNTS["ffn"])
        if y is not None:
            STATS["ffn"]["dense"] += M * G * op.group_macs
            return y
        return _ffn_masked(op, x, mask.bool())
    STATS["ffn"]["executed"] += M * G * op.group_macs
    STATS["ffn"]["dense"] += M * G * op.group_macs
    return _ffn_vllm(mlp, x, mask, pairs < M * G)


def _ffn_masked(op, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The FFN of ``x [M, D]`` over ``mask [M, G]`` bool (no stand-ins)."""
    M, G = mask.shape
    plan = None if M <= NATIVE_M else skip_plan(mask)
    if _native_step(plan, M, G):
        # a decode step: each token over its own groups, a group's weights read once for all
        # the tokens that execute it (the runtime's native step kernels; they count what they
        # execute)
        y = cpu_rows.routed_ffn(op.gu, op.down, x, mask, NATIVE_COUNTS["ffn"])
        if y is not None:
            STATS["ffn"]["dense"] += M * G * op.group_macs
            return y
    plan = plan or skip_plan(mask)
    mlp = op._mlp[0]
    if _dense_masked(plan, M, G) and hasattr(mlp.down_proj, "cpu_linear"):
        _count("ffn", plan, mask, op.group_macs, M, every_group=True)
        return _ffn_vllm(mlp, x, mask, plan[0] != "dense")
    _count("ffn", plan, mask, op.group_macs, M)
    return cpu_proj.ffn_proj(x, op.gu, op.down, mask, plan)


def _ffn_fake(x: torch.Tensor, r: torch.Tensor, op_id: int) -> torch.Tensor:
    return torch.empty_like(x)


def _out_cpu(o: torch.Tensor, r: torch.Tensor, out_features: int, op_id: int) -> torch.Tensor:
    """``o [M, K]``, ``r [M, out_features]`` (what its router reads) -> ``[M, out_features]``: the
    routed O projection (``ops.gemm_k``) of op module ``op_id``, stand-ins included; paths as
    ``_ffn_cpu``."""
    op = OP_MODULES[op_id]
    M = o.shape[0]
    mr = op.router.module_router() if M <= SMALL_M else None
    if mr is not None and M <= NATIVE_M:
        y = cpu_rows.routed_out(op.o, o, None, NATIVE_COUNTS["attention"], router=mr, r=r)
        if y is not None:
            STATS["attention"]["dense"] += M * mr.weight.shape[0] * op.group_cols * out_features
            return y
    if mr is not None and (routed := cpu_rows.route_rows(mr, r, out_features, NATIVE_COUNTS["attention"])):
        mask, sums, union, pairs = routed
        y = _out_small(op, o, mask, union, pairs, out_features)
        return y if sums is None or pairs == mask.numel() else y.add_(sums.to(y.dtype))
    ex = op.router(r)
    return op.router.add_standin(_out_masked(op, o, ex, out_features), ex)


def _out_small(op, o: torch.Tensor, mask: torch.Tensor, union: int, pairs: int, out_features: int) -> torch.Tensor:
    """The O projection of ``NATIVE_M < M <= SMALL_M`` tokens over ``mask [M, G]`` uint8 (paths as
    ``_ffn_small``)."""
    M, G = mask.shape
    o_proj = op._o[0]
    macs = M * G * op.group_cols * out_features
    if union <= NATIVE_UNION_SHARE * G or not hasattr(o_proj, "cpu_linear"):
        y = cpu_rows.routed_out(op.o, o, mask, NATIVE_COUNTS["attention"])
        if y is not None:
            STATS["attention"]["dense"] += macs
            return y
        return _out_masked(op, o, mask.bool(), out_features)
    STATS["attention"]["executed"] += macs
    STATS["attention"]["dense"] += macs
    return _out_vllm(o_proj, o, mask, pairs < M * G)


def _out_masked(op, o: torch.Tensor, mask: torch.Tensor, out_features: int) -> torch.Tensor:
    """The O projection of ``o [M, K]`` over ``mask [M, K / group_cols]`` bool (no stand-ins)."""
    M, G = mask.shape
    plan = None if M <= NATIVE_M else skip_plan(mask)
    if _native_step(plan, M, G):
        y = cpu_rows.routed_out(op.o, o, mask, NATIVE_COUNTS["attention"])
        if y is not None:
            STATS["attention"]["dense"] += M * G * op.group_cols * out_features
            return y
    plan = plan or skip_plan(mask)
    o_proj = op._o[0]
    if _dense_masked(plan, M, G) and hasattr(o_proj, "cpu_linear"):
        _count("attention", plan, mask, op.group_cols * out_features, M, every_group=True)
        return _out_vllm(o_proj, o, mask, plan[0] != "dense")
    _count("attention", plan, mask, op.group_cols * out_features, M)
    return cpu_proj.gemm_k_proj(o, op.o, mask, None, plan)


def _out_fake(o: torch.Tensor, r: torch.Tensor, out_features: int, op_id: int) -> torch.Tensor:
    return o.new_empty(o.shape[0], out_features)


_REGISTERED = False


def register_ops() -> None:
    """Register ``torch.ops.vllm.wide_ffn_cpu`` / ``wide_out_cpu`` once per process."""
    global _REGISTERED
    if _REGISTERED:
        return
    direct_register_custom_op("wide_ffn_cpu", _ffn_cpu, fake_impl=_ffn_fake)
    direct_register_custom_op("wide_out_cpu", _out_cpu, fake_impl=_out_fake)
    _REGISTERED = True
