"""The native kernels for one routed module's rows outside a decode step: what the vLLM plugin's
CPU ops call (``serve/vllm_cpu_ops.py``). ``routed_ffn`` / ``routed_out`` run each token over its
own groups (a group's weights read once for all the tokens that execute it), optionally deciding
the groups with the module's router and adding its stand-ins in the same call; ``route_rows``
decides only. The library, its build and the decode step are ``cpu_native``'s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from wide_cli.runtime.cpu_native import COUNTERS, MAX_BATCH, _proj_fmt, _proj_ptrs, _ptr, context, library


def _row_mask(mask: torch.Tensor, M: int, G: int) -> torch.Tensor:
    """``mask [M, G]`` as the C kernels read it: one byte per (token, group), nonzero = execute,
    rows contiguous (a contiguous bool tensor already is; no copy then).

    Raises:
        ValueError: another shape (the kernels would read past the mask).
    """
    if tuple(mask.shape) != (M, G):
        raise ValueError(f"routed call: mask of shape {tuple(mask.shape)}, expected ({M}, {G})")
    if mask.dtype in (torch.bool, torch.uint8) and mask.is_contiguous():
        return mask
    return mask.to(torch.uint8).contiguous()


def _counters(cnt: torch.Tensor | None) -> torch.Tensor:
    """The int64 ``[len(COUNTERS)]`` the C call adds to: ``cnt``, or a fresh one.

    Raises:
        ValueError: ``cnt`` of another dtype, size or layout (the kernels write through its pointer).
    """
    if cnt is None:
        return torch.zeros(len(COUNTERS), dtype=torch.int64)
    if cnt.dtype != torch.int64 or not cnt.is_contiguous() or cnt.numel() < len(COUNTERS) or cnt.device.type != "cpu":
        raise ValueError(f"counters must be a contiguous CPU int64 tensor of {len(COUNTERS)}, got {cnt.dtype} {tuple(cnt.shape)}")
    return cnt


class ModuleRouter(NamedTuple):
    """A routed module's folded router and stand-ins, for ``routed_ffn`` / ``routed_out`` to decide
    the tokens' groups themselves: ``weight [G, D]`` and ``bias [G]`` fp32 contiguous (execute group
    j when ``weight[j] . r + bias[j] >= 0``, as ``WideRouter``), ``force`` (every group executes),
    ``standin [G, N]`` fp32 contiguous or None (what each skipped group adds to the output)."""

    weight: torch.Tensor
    bias: torch.Tensor
    force: bool
    standin: torch.Tensor | None


def _route_args(router: ModuleRouter | None, r: torch.Tensor | None, M: int, G: int, D: int) -> tuple:
    """``(r_f32, r, rw, rb, force, st)`` C arguments (the first keeps the fp32 copy alive)."""
    if router is None:
        return None, None, None, None, 0, None
    if r is None or tuple(r.shape) != (M, D) or tuple(router.weight.shape) != (G, D):
        raise ValueError(f"router input {None if r is None else tuple(r.shape)} / weight "
                         f"{tuple(router.weight.shape)} do not fit {M} tokens, {G} groups of width {D}")  # fmt: skip
    rf = r.to(torch.float32).contiguous()
    st = router.standin
    return rf, rf.data_ptr(), router.weight.data_ptr(), router.bias.data_ptr(), int(router.force), _ptr(st)


def route_rows(router: ModuleRouter, r: torch.Tensor, n_out: int, cnt: torch.Tensor | None = None):
    """One routed module's decisions for ``M <= MAX_BATCH`` tokens whose projections run elsewhere,
    in one native call: ``(mask [M, G] uint8, sums [M, n_out] fp32 or None, union, pairs)`` where
    ``sums`` holds each token's skipped groups' stand-ins summed (None without stand-ins),
    ``union`` counts the groups some token executes and ``pairs`` the executed (token, group)
    pairs. ``r [M, D]``: what the router reads. Returns None when the library cannot run it.

    Raises:
        ValueError: ``r`` or the router's shapes do not fit.
    """
    lib = library()
    M = r.shape[0]
    G, D = router.weight.shape
    if lib is None or not 1 <= M <= MAX_BATCH or G > 4096:
        return None
    keep, rp, rw, rb, force, st = _route_args(router, r, M, G, D)
    if router.standin is not None and tuple(router.standin.shape) != (G, n_out):
        raise ValueError(f"stand-ins {tuple(router.standin.shape)} do not fit {G} groups x {n_out} outputs")
    mask = torch.empty(M, G, dtype=torch.uint8)
    sums = torch.empty(M, n_out, dtype=torch.float32) if st is not None else None
    info = torch.zeros(2, dtype=torch.int64)
    cnt = _counters(cnt)
    rc = lib.wide_route_rows(rw, rb, force, st, G, D, n_out, M, rp, mask.data_ptr(), _ptr(sums), info.data_ptr(),
                             cnt.data_ptr())  # fmt: skip
    del keep
    return None if rc != 0 else (mask, sums, int(info[0]), int(info[1]))


def routed_ffn(gu, down, x: torch.Tensor, mask: torch.Tensor | None, cnt: torch.Tensor | None = None, *,
               router: ModuleRouter | None = None, r: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
    """The routed SwiGLU FFN of ``x [M, D]`` for ``M <= MAX_BATCH`` tokens, each over its own groups
    (``mask [M, G]`` bool or uint8; any mask, all on or all off included), every group's weights read
    once for the tokens that execute it: the native step's FFN (``wide_ffn_rows``) on ``cpu_proj``
    projections ``gu`` (axis n, group-major gate | up) and ``down`` (axis k). With ``router`` the
    call decides the groups itself from ``r [M, D]`` (the residual stream the router reads; ``mask``
    is then ignored) and adds the skipped groups' stand-ins, in one native call. ``cnt``: int64
    ``[len(COUNTERS)]`` the call adds its executed multiply-adds, router multiply-adds and weight
    bytes to (None: not kept). Returns ``[M, D]`` in ``x``'s dtype, or None when the library cannot
    run it (no library, no tokens or more than ``MAX_BATCH``, another format, more than 4,096
    groups): the caller runs its PyTorch path.

    Raises:
        ValueError: ``mask`` not ``[M, G]``, ``r`` / ``router`` not fitting, or ``cnt`` not an
            int64 ``[len(COUNTERS)]``.
    """
    lib = library()
    M, D = x.shape
    fmt = _proj_fmt(down)
    if lib is None or M > MAX_BATCH or fmt is None or _proj_fmt(gu) != fmt:
        return None
    g = down.g
    G = down.K // g
    keep, *rargs = _route_args(router, r, M, G, D)
    m = torch.empty(M, G, dtype=torch.uint8) if router is not None else _row_mask(mask, M, G)
    cnt = _counters(cnt)
    xf = x.to(torch.float32).contiguous()
    y = torch.empty(M, D, dtype=torch.float32)
    scratch = torch.empty(M * G * g * 3, dtype=torch.float32)
    (wg, sg), (wd, sd) = _proj_ptrs(gu), _proj_ptrs(down)
    rc = lib.wide_ffn_rows(context(lib), torch.get_num_threads(), fmt, 0, int(x.dtype == torch.bfloat16), wg, sg, wd, sd,
                           D, G, g, M, xf.data_ptr(), *rargs, m.data_ptr(), y.data_ptr(), scratch.data_ptr(),
                           cnt.data_ptr())  # fmt: skip
    del keep
    return None if rc != 0 else y.to(x.dtype)


def routed_out(o, a: torch.Tensor, mask: torch.Tensor | None, cnt: torch.Tensor | None = None, *,
               router: ModuleRouter | None = None, r: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
    """The routed O projection of ``a [M, G cols]`` for ``M <= MAX_BATCH`` tokens, each over its own
    head groups (``mask [M, G]``): ``wide_out_rows`` on the axis-k ``cpu_proj`` projection ``o``.
    Returns ``[M, N]`` in ``a``'s dtype, or None (``router``, ``r``, ``cnt`` and the rest as
    ``routed_ffn``; ``r`` is ``[M, N]``)."""
    lib = library()
    M = a.shape[0]
    fmt = _proj_fmt(o)
    if lib is None or M > MAX_BATCH or fmt is None:
        return None
    G = o.K // o.g
    keep, *rargs = _route_args(router, r, M, G, o.N)
    m = torch.empty(M, G, dtype=torch.uint8) if router is not None else _row_mask(mask, M, G)
    cnt = _counters(cnt)
    af = a.to(torch.float32).contiguous()
    y = torch.empty(M, o.N, dtype=torch.float32)
    w, s = _proj_ptrs(o)
    rc = lib.wide_out_rows(context(lib), torch.get_num_threads(), fmt, 0, int(a.dtype == torch.bfloat16), w, s, o.N,
                           o.g, G, M, af.data_ptr(), *rargs, m.data_ptr(), y.data_ptr(), cnt.data_ptr())  # fmt: skip
    del keep
    return None if rc != 0 else y.to(a.dtype)
