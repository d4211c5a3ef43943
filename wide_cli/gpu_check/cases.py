"""What ``gpu-check`` runs: model shapes, sparsities, mask kinds, the check and bench case lists,
and the speed-up targets (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass

MODELS = {
    "smollm2-135m": {"D": 576, "H": 9, "Hkv": 3, "d": 64, "F": 1536, "attn_group": 3, "ffn_group": 128},
    "llama-3.1-8b": {"D": 4096, "H": 32, "Hkv": 8, "d": 128, "F": 14336, "attn_group": 4, "ffn_group": 128},
}
MS = (1, 8, 128, 1024, 4096)
SPARSITIES = (0.0, 0.25, 0.5, 0.75, 1.0)
MASKS = ("random", "structured")  # structured: the same groups skip for every token / row
GEMM_OPS = ("q", "gate", "gate_up", "o", "down")  # gemm_mn, gemm_mn, gemm_mn_swiglu, gemm_k, gemm_k
TOL = {"bf16": 1e-2, "fp16": 2e-3}  # relative Frobenius error vs the fp32 reference
TARGETS = {  # (op, model, M or B, sparsity) -> wanted speedup over dense (benchmarks, not tests)
    "gemm_mn M=4096 (gate, g=128)": (("gate", "llama-3.1-8b", 4096, 0.5), 1.7),
    "gemm_k M=4096 (down, g=128)": (("down", "llama-3.1-8b", 4096, 0.5), 1.7),
    "GEMV decode gemm_mn M=1 (gate)": (("gate", "llama-3.1-8b", 1, 0.5), 1.8),
    "GEMV decode gemm_k M=1 (down)": (("down", "llama-3.1-8b", 1, 0.5), 1.8),
    "decode attention B=1 S=32k": (("attn_decode", "llama-3.1-8b", 1, 0.5), 1.6),
}


@dataclass(frozen=True)
class Case:
    """One operator run: ``m`` is tokens (GEMMs), prefill tokens (B=1), or batch rows (decode)."""

    op: str
    model: str
    m: int
    sparsity: float
    mask: str
    dtype: str = "bf16"
    slots: int = 0  # decode context length

    @property
    def name(self) -> str:
        s = f"{self.op}/{self.model}/M{self.m}/s{self.sparsity}/{self.mask}/{self.dtype}"
        return s + (f"/S{self.slots}" if self.slots else "")


def build_cases() -> dict[str, list[Case]]:
    """The check and bench case lists (pure Python)."""
    check: list[Case] = []
    for model in MODELS:
        for s in SPARSITIES:
            for mk in MASKS:
                for m in MS:
                    check += [Case(op, model, m, s, mk) for op in GEMM_OPS]
                    check.append(Case("attn_prefill", model, m, s, mk))
                for b, S in ((1, 4096), (8, 4096), (128, 1024)):
                    check.append(Case("attn_decode", model, b, s, mk, slots=S))
        for m in (1, 8, 128):  # fp16 subset
            check += [Case(op, model, m, 0.5, "random", "fp16") for op in (*GEMM_OPS, "attn_prefill")]
        check.append(Case("attn_decode", model, 8, 0.5, "random", "fp16", slots=1024))
    bench: list[Case] = []
    # the targets first, so a tight budget still measures them
    bench += [
        Case(op, model, m, s, "random", slots=32768 if op == "attn_decode" else 0)
        for (op, model, m, s), _ in TARGETS.values()
    ]
    for model in MODELS:
        for m in (1, 2, 4, 8):  # where GEMV stops paying against cuBLAS (WIDE_CUPY_GEMV_MAX_M)
            bench += [Case(op, model, m, s, "random") for s in (0.0, 0.5, 0.75) for op in GEMM_OPS]
        for m in MS:
            for s in SPARSITIES:
                bench += [Case(op, model, m, s, "random") for op in GEMM_OPS]
            bench += [Case(op, model, m, 0.5, "structured") for op in GEMM_OPS]
            bench += [Case("attn_prefill", model, m, s, "random") for s in (0.0, 0.5) if m >= 8]
        for S in (4096, 32768):
            bench += [Case("attn_decode", model, b, s, "random", slots=S) for b in (1, 8) for s in SPARSITIES]
    seen, unique = set(), []
    for c in bench:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return {"check": check, "bench": unique}
