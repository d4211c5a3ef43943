"""Sections 2 and 3 inputs: one ``Workload`` per case (inputs, kernel, fp32 reference, dense op,
naive gather-compute-scatter baseline) and those baselines (exact on a CPU too)."""

from __future__ import annotations

import math
import zlib

from wide_cli.gpu_check.cases import GEMM_OPS, MODELS, Case


def _shape(case: Case) -> dict:
    cfg = MODELS[case.model]
    D, H, d, F = cfg["D"], cfg["H"], cfg["d"], cfg["F"]
    ag, fg = cfg["attn_group"] * d, cfg["ffn_group"]
    return {
        "q": {"K": D, "N": H * d, "g": ag},
        "gate": {"K": D, "N": F, "g": fg},
        "gate_up": {"K": D, "N": F, "g": fg},
        "o": {"K": H * d, "N": D, "g": ag},
        "down": {"K": F, "N": D, "g": fg},
    }.get(case.op, {})


def _group_mask(rows: int, groups: int, s: float, kind: str, gen, device):
    import torch

    if kind == "structured":  # the same groups skip for every row: exactly round(s*G) of them
        n_skip = round(s * groups)
        keep = torch.ones(groups, dtype=torch.bool, device=device)
        keep[torch.randperm(groups, generator=gen, device=device)[:n_skip]] = False
        return keep.expand(rows, groups).contiguous()
    return torch.rand(rows, groups, generator=gen, device=device) >= s


class Workload:
    """Inputs of one case plus its kernel, reference, dense and naive callables."""

    def __init__(self, case: Case, weights: dict):
        import torch
        import torch.nn.functional as Fn

        from wide_cli.runtime import cupy_ops, ops

        self.case = case
        dev = torch.device("cuda")
        dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
        gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case.name.encode()))
        cfg = MODELS[case.model]
        self.flops = self.bytes = 0.0
        if case.op in GEMM_OPS:
            sh = _shape(case)
            K, N, g, M = sh["K"], sh["N"], sh["g"], case.m
            key = (case.model, case.op, case.dtype)
            if key not in weights:
                ws = [(0.02 * torch.randn(N, K, device=dev, generator=gen)).to(dt) for _ in range(2)]
                weights[key] = ws
            w, w2 = weights[key]
            a = torch.randn(M, K, device=dev, generator=gen).to(dt)
            G = (N if case.op in ("q", "gate", "gate_up") else K) // g
            mask = _group_mask(M, G, case.sparsity, case.mask, gen, dev)
            self.mask, self.g = mask, g
            live = float(mask.float().mean())
            if case.op in ("o", "down"):  # gemm_k: the live 16-row fragments decide its work
                Mp = -(-M // 16) * 16
                pad = torch.zeros(Mp, G, dtype=torch.bool, device=dev)
                pad[:M] = mask
                self.live = float(pad.view(-1, 16, G).any(1).float().mean())
            else:
                self.live = live
            mult = 2 if case.op == "gate_up" else 1
            self.flops = 2.0 * M * K * N * mult * live
            self.bytes = 2.0 * (
                N * K * mult * (mask.any(0).float().mean().item() if M <= 8 else 1.0) + M * K + M * N
            )
            if case.op == "gate_up":
                w_gu = torch.cat([w, w2])
                self.kernel = lambda: cupy_ops.gemm_mn_swiglu(a, w, w2, mask, g)
                self.reference = lambda: ops.gemm_mn_swiglu(a.float(), w.float(), w2.float(), mask, g)
                self.dense = lambda: _dense_swiglu(a, w_gu, N)
                self.naive = lambda: _naive_mn(a, w, w2, mask, g)
                self.zero_mask = ops.expand_mask(mask, g)
            elif case.op in ("q", "gate"):
                self.kernel = lambda: cupy_ops.gemm_mn(a, w, mask, g)
                self.reference = lambda: ops.gemm_mn(a.float(), w.float(), mask, g)
                self.dense = lambda: Fn.linear(a, w)
                self.naive = lambda: _naive_mn(a, w, None, mask, g)
                self.zero_mask = ops.expand_mask(mask, g)
            else:
                self.kernel = lambda: cupy_ops.gemm_k(a, w, mask, g)
                self.reference = lambda: ops.gemm_k(a.float(), w.float(), mask, g)
                self.dense = lambda: Fn.linear(a, w)
                self.naive = lambda: _naive_k(a, w, mask, g)
                self.zero_mask = None
        elif case.op == "attn_prefill":
            H, Hkv, d, hg = cfg["H"], cfg["Hkv"], cfg["d"], cfg["attn_group"]
            T = case.m
            q = torch.randn(1, T, H, d, device=dev, generator=gen).to(dt)
            k = torch.randn(1, T, Hkv, d, device=dev, generator=gen).to(dt)
            v = torch.randn(1, T, Hkv, d, device=dev, generator=gen).to(dt)
            hm = _group_mask(T, H // hg, case.sparsity, case.mask, gen, dev).repeat_interleave(hg, dim=-1)[
                None
            ]
            scale = d**-0.5
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            self.kernel = lambda: cupy_ops.attention_prefill(q, k, v, hm, scale=scale)
            self.reference = lambda: ops.attention_prefill(q.float(), k.float(), v.float(), hm, scale=scale)
            self.dense = lambda: _sdpa(qt, kt, vt, causal=True)
            self.naive = lambda: _naive_prefill(q, k, v, hm, hg, scale)
            self.zero_mask = hm[..., None].expand(1, T, H, d)  # executing entries
            live = float(hm.float().mean())
            self.flops = 4.0 * T * T / 2 * d * H * live
            self.bytes = 2.0 * (2 * T * H * d + 2 * T * Hkv * d)
        else:  # attn_decode
            H, Hkv, d = cfg["H"], cfg["Hkv"], cfg["d"]
            B, S = case.m, case.slots
            hq = H // Hkv
            q = torch.randn(B, H, d, device=dev, generator=gen).to(dt)
            kc = torch.randn(B, Hkv, S, d, device=dev, generator=gen).to(dt)
            vc = torch.randn(B, Hkv, S, d, device=dev, generator=gen).to(dt)
            hm = _group_mask(B, Hkv, case.sparsity, case.mask, gen, dev).repeat_interleave(hq, dim=-1)
            kv = torch.ones(B, S, dtype=torch.bool, device=dev)
            scale = d**-0.5
            self.kernel = lambda: cupy_ops.attention_decode(q, kc, vc, hm, kv, scale=scale)
            self.reference = lambda: ops.attention_decode(
                q.float(), kc.float(), vc.float(), hm, kv, scale=scale
            )
            self.dense = lambda: _sdpa(q[:, :, None], kc, vc, causal=False)
            self.naive = lambda: _naive_decode(q, kc, vc, hm, hq, scale)
            self.zero_mask = hm[..., None].expand(B, H, d)
            live = float(hm.float().mean())
            self.flops = 4.0 * B * H * S * d * live
            self.bytes = 2.0 * 2 * B * Hkv * S * d * live
        self.ideal = math.inf if case.sparsity >= 1.0 else 1.0 / (1.0 - case.sparsity)
        self.live = getattr(self, "live", None)


def _sdpa(q, k, v, causal: bool):
    import torch.nn.functional as Fn

    if q.shape[1] != k.shape[1]:
        try:
            return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        except (TypeError, RuntimeError):
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _dense_swiglu(a, w_gu, n: int):
    """The dense FFN up-projection: one GEMM over [gate; up], then silu(gate) * up."""
    import torch.nn.functional as Fn

    gu = Fn.linear(a, w_gu)
    return Fn.silu(gu[:, :n]) * gu[:, n:]


def _naive_mn(a, w, w2, mask, g):
    """Gather the executing tokens of each group, one GEMM per group, scatter back."""
    import torch
    import torch.nn.functional as Fn

    out = torch.zeros(a.shape[0], w.shape[0], dtype=a.dtype, device=a.device)
    for j in range(mask.shape[1]):
        idx = mask[:, j].nonzero().squeeze(1)
        if idx.numel():
            x = a.index_select(0, idx)
            y = Fn.linear(x, w[j * g : (j + 1) * g])
            if w2 is not None:
                y = Fn.silu(y) * Fn.linear(x, w2[j * g : (j + 1) * g])
            out[idx, j * g : (j + 1) * g] = y
    return out


def _naive_k(a, w, mask, g):
    import torch
    import torch.nn.functional as Fn

    out = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    for j in range(mask.shape[1]):
        idx = mask[:, j].nonzero().squeeze(1)
        if idx.numel():
            out.index_add_(0, idx, Fn.linear(a[idx, j * g : (j + 1) * g], w[:, j * g : (j + 1) * g]).float())
    return out.to(a.dtype)


def _naive_prefill(q, k, v, hm, hg, scale):
    """Per head group: gather its executing queries, SDPA with their causal rows, scatter."""
    import torch
    import torch.nn.functional as Fn

    _, T, H, d = q.shape
    Hkv = k.shape[2]
    out = torch.zeros_like(q)
    slots = torch.arange(T, device=q.device)
    for j in range(H // hg):
        idx = hm[0, :, j * hg].nonzero().squeeze(1)
        if not idx.numel():
            continue
        heads = slice(j * hg, (j + 1) * hg)
        kvh = (j * hg) // (H // Hkv)
        qs = q[0, idx, heads].transpose(0, 1)[None]  # [1, hg, n, d]
        ks = k[0, :, kvh][None, None].expand(1, hg, T, d)
        vs = v[0, :, kvh][None, None].expand(1, hg, T, d)
        vis = slots[None, :] <= idx[:, None]
        o = Fn.scaled_dot_product_attention(qs, ks, vs, attn_mask=vis, scale=scale)
        out[0, idx, heads] = o[0].transpose(0, 1)
    return out


def _naive_decode(q, kc, vc, hm, hq, scale):
    import torch
    import torch.nn.functional as Fn

    out = torch.zeros_like(q)
    for j in range(kc.shape[1]):
        rows = hm[:, j * hq].nonzero().squeeze(1)
        if rows.numel():
            qs = q[rows, j * hq : (j + 1) * hq, None]  # [n, hq, 1, d]
            ks = kc[rows, j][:, None].expand(-1, hq, -1, -1)
            vs = vc[rows, j][:, None].expand(-1, hq, -1, -1)
            out[rows, j * hq : (j + 1) * hq] = Fn.scaled_dot_product_attention(qs, ks, vs, scale=scale)[
                :, :, 0
            ]
    return out
