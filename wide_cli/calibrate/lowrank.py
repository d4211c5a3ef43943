"""Initial low-rank stand-ins (``--standin lowrank:R``): per routed group, the best rank-R linear
prediction of what the group adds to its module's output, from the module's normed input, fitted on
calibration tokens of the dense model.

A skipped group ``g`` of a module with normed input ``x [D]`` then contributes (``apply_standin``)::

    standin_g + (x @ V_g^T) @ U_g          V_g, U_g  [R, D]

the constant being the group's mean output (``standin_vectors``, FLAP's bias compensation) and the
map a reduced-rank regression of the centred output on the centred input: the low-rank remainder of
R-Sparse (arXiv 2504.19449) and SoLA, fitted per group. The group's output is
``y_g = a_g @ W_g^T`` where ``a_g [w]`` is its slice of the ``o_proj`` / ``down_proj`` input and
``W_g [D, w]`` the matching columns, so with input covariance ``C = cov(x)`` (ridge-damped), the
least-squares predictor of ``a_g`` is ``B_g = C^-1 cov(x, a_g)`` ``[D, w]`` and the map
``M_g = B_g W_g^T``. The rank-R map closest to it in the error that matters, the expected squared
output error ``E |(x - mean) (M_g - M)|^2 = |C^1/2 (M_g - M)|_F^2``, is ``C^-1/2 [C^1/2 M_g]_R``
(Eckart-Young on ``C^1/2 M_g``), computed through the thin factors of ``M_g`` (rank <= w).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wide_cli.errors import ConfigError

#: Ridge damping of the input covariance, relative to its mean eigenvalue: the normed residual
#: stream has a few channels far larger than the rest, and a few thousand tokens leave the small
#: directions noisy.
RIDGE = 1e-2


class _Moments:
    """Running sums over tokens of ``x``, ``x x^T``, ``a`` and ``x a^T`` (float64, CPU)."""

    def __init__(self, d_in: int, d_a: int):
        self.n = 0
        self.sx = torch.zeros(d_in, dtype=torch.float64)
        self.sxx = torch.zeros(d_in, d_in, dtype=torch.float64)
        self.sa = torch.zeros(d_a, dtype=torch.float64)
        self.sxa = torch.zeros(d_in, d_a, dtype=torch.float64)

    def add(self, x: torch.Tensor, a: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float64)
        a = a.detach().reshape(-1, a.shape[-1]).to("cpu", torch.float64)
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sxx += x.T @ x
        self.sa += a.sum(0)
        self.sxa += x.T @ a


def fit_group_maps(mom: _Moments, w_out: torch.Tensor, width: int, rank: int, *,
                   ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-``rank`` stand-in maps of every group of one module from its moments.

    Args:
        mom: moments of the module input ``x [D]`` and the projection input ``a [G * width]``.
        w_out: ``[D, G * width]`` the output projection (``o_proj`` / ``down_proj`` weight).
        width: columns per group (heads x head_dim, or FFN channels). rank: R < width.
        ridge: damping added to the input covariance, times its mean eigenvalue.

    Returns:
        ``(shift [G, D], v [G, R, D], u [G, R, D])`` fp32: a skipped group adds
        ``(x @ v_g^T) @ u_g - shift_g`` on top of its mean output; ``shift_g = mean(x) @ v_g^T @ u_g``
        centres the map on the calibration tokens.

    Raises:
        ConfigError: ``rank`` not below ``width``, or no tokens seen.
    """
    if not 0 < rank < width:
        raise ConfigError(f"stand-in rank {rank} does not fit groups of width {width}", f"use a rank below {width}")
    if mom.n < 2:
        raise ConfigError("no calibration tokens reached the low-rank stand-in fit", "give the run training data")
    n = float(mom.n)
    mx, ma = mom.sx / n, mom.sa / n
    cxx = mom.sxx / n - torch.outer(mx, mx)
    cxa = mom.sxa / n - torch.outer(mx, ma)
    D = cxx.shape[0]
    evals, evecs = torch.linalg.eigh(cxx)
    evals = evals.clamp_min(0) + ridge * float(evals.clamp_min(0).mean()) + 1e-12
    c_half = (evecs * evals.sqrt()) @ evecs.T  # C^1/2 (damped)
    c_inv_half = (evecs * evals.rsqrt()) @ evecs.T
    c_inv = (evecs / evals) @ evecs.T
    W = w_out.detach().to("cpu", torch.float64)
    G = W.shape[1] // width
    shift, vs, us = [], [], []
    for g in range(G):
        cols = slice(g * width, (g + 1) * width)
        b = c_inv @ cxa[:, cols]  # [D, w]: least-squares predictor of a_g from x
        q, r = torch.linalg.qr(W[:, cols])  # W_g = q r, q [D, w] orthonormal
        left, s, zt = torch.linalg.svd(c_half @ b @ r.T, full_matrices=False)  # C^1/2 M_g = left s (q zt^T)^T
        root = s[:rank].sqrt()
        v = (c_inv_half @ left[:, :rank] * root).T  # [R, D], acts on x
        u = root[:, None] * (q @ zt[:rank].T).T  # [R, D], writes the output
        vs.append(v)
        us.append(u)
        shift.append((mx @ v.T) @ u)
    assert vs[0].shape == (rank, D)
    return (torch.stack(shift).float(), torch.stack(vs).float(), torch.stack(us).float())


#: Host memory the float64 moments of one calibration pass may take: a model whose routed modules
#: need more (Llama-3.1-8B: ~0.9 GB a layer) is fitted over several passes of the same tokens.
MAX_MOMENT_BYTES = 2 << 30


@torch.no_grad()
def fit_lowrank_standins(model, batches: torch.Tensor, *, batch_size: int = 4, max_tokens: int = 8192,
                         max_moment_bytes: int = MAX_MOMENT_BYTES,
                         progress: Callable[[int, int], None] | None = None) -> int:
    """Set every learned router's low-rank stand-in (``standin_in`` / ``standin_out``) to the
    rank-R fit of its group's output (module docstring), and its constant ``standin`` to the
    group's mean output minus the map's mean, so that stand-in and mean agree on average.

    Args:
        model: a routed model (``attach_routers`` with ``standin lowrank:R``), any dtype; it runs
            with every group executed (the routers' decisions are not used).
        batches: ``[N, T]`` int64 packed token ids (the training data; never evaluation data).
        batch_size: sequences per forward pass. max_tokens: use the first sequences up to this many
            tokens.
        max_moment_bytes: the float64 moments of one pass stay under this many bytes (layers are
            fitted in as many passes over the same tokens as that takes; at least one layer a pass).
        progress: called as ``progress(done, total)`` after each forward pass.

    Returns:
        The number of calibration tokens the fit used.
    """
    from wide_cli.routing.model import decoder_layers

    layers = decoder_layers(model)
    routed = []  # (layer, module, router, first projection, output projection, group width)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        for module, first, last, unit in (("attention", attn.q_proj, attn.o_proj, attn.head_dim),
                                          ("ffn", mlp.gate_proj, mlp.down_proj, 1)):
            r = getattr(layer, f"router_{module}", None)
            if getattr(r, "standin_in", None) is None:
                continue
            gs = model.wide_routing.layout.attn_group_size if module == "attention" else \
                model.wide_routing.layout.ffn_group_size
            routed.append((i, module, r, first, last, gs * unit))
    if not routed:
        return 0
    passes, cur, size = [], [], 0
    for item in routed:  # float64: x x^T [D, D] and x a^T [D, K] dominate
        last = item[4]
        need = 8 * last.weight.shape[0] * (last.weight.shape[0] + last.weight.shape[1])
        if cur and size + need > max_moment_bytes:
            passes.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += need
    passes.append(cur)
    per = max(1, int(batches.shape[1]))
    n_seq = min(batches.shape[0], max(1, -(-int(max_tokens) // per)))
    tokens = 0
    for group in passes:
        moments = _collect(model, batches[:n_seq], group, batch_size, progress)
        for i, module, r, _, last, width in group:
            mom = moments.pop((i, module))
            shift, v, u = fit_group_maps(mom, last.weight, width, r.standin_in.shape[1])
            mean_a = (mom.sa / mom.n).float()
            W = last.weight.detach().float().cpu()
            mean_out = torch.stack([W[:, g * width:(g + 1) * width] @ mean_a[g * width:(g + 1) * width]
                                    for g in range(W.shape[1] // width)])
            r.standin.copy_((mean_out - shift).to(r.standin))
            r.standin_in.copy_(v.to(r.standin_in))
            r.standin_out.copy_(u.to(r.standin_out))
            tokens = mom.n
    return int(tokens)


def _collect(model, batches: torch.Tensor, group: list, batch_size: int,
             progress: Callable[[int, int], None] | None) -> dict[tuple[int, str], _Moments]:
    """One dense pass over ``batches``: the moments of the modules in ``group``."""
    from wide_cli.calibrate.statistics import calibration_pass

    state = model.wide_routing
    moments: dict[tuple[int, str], _Moments] = {}
    inputs: dict[tuple[int, str], torch.Tensor] = {}

    def keep_input(key):
        def hook(module, args):
            inputs[key] = args[0]
        return hook

    def accumulate(key):
        def hook(module, args):
            x, a = inputs.pop(key), args[0]
            if key not in moments:
                moments[key] = _Moments(x.shape[-1], a.shape[-1])
            moments[key].add(x, a)
        return hook

    hooks = []
    for i, module, _, first, last, _ in group:
        hooks += [(first, keep_input((i, module))), (last, accumulate((i, module)))]
    mode = state.mode
    state.set_mode("dense")
    try:
        calibration_pass(model, batches, hooks, batch_size=batch_size, progress=progress)
    finally:
        state.set_mode(mode)
    return moments
