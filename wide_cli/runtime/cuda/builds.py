"""What the dispatcher may build: tensor-core GEMM tiles, GEMV/attention variants, and the pure
shape arithmetic that picks among them (no CuPy, no GPU; unit-tested on a CPU).

``kernel_builds()`` lists every (source, defines) build, for the CI compile and ``gpu-check``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GEMV_MAX_M = 8  # calls with at most this many tokens take the GEMV kernels
PREFILL_BM = 64  # query rows per attention-prefill block (4 warps x 16)


@dataclass(frozen=True)
class GemmTile:
    """One tensor-core GEMM tile: BM tokens x BN weight rows, WARPS_M x WARPS_N warps."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int
    stages: int = 4

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}"

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def bn_out(self, swiglu: bool) -> int:
        """Output channels per tile (a SwiGLU tile holds gate and up rows of BN/2 channels)."""
        return self.bn // 2 if swiglu else self.bn

    def valid(self, swiglu: bool) -> bool:
        wtm, wtn = self.bm // self.warps_m, self.bn // self.warps_n
        ok = wtm % 16 == 0 and wtn % 16 == 0
        return ok and (not swiglu or (wtn // 2) % 16 == 0)

    def smem(self) -> int:
        """Dynamic shared memory in bytes: ``stages`` buffers of (BM + BN) rows x 40 bf16."""
        return self.stages * (self.bm + self.bn) * (32 + 8) * 2

    def defines(self, swiglu: bool | None = None) -> dict[str, int]:
        d = {
            "BM": self.bm,
            "BN": self.bn,
            "WARPS_M": self.warps_m,
            "WARPS_N": self.warps_n,
            "STAGES": self.stages,
        }
        if swiglu is not None:
            d["SWIGLU"] = int(swiglu)
        return d


GEMM_MN_TILES: tuple[GemmTile, ...] = (
    GemmTile(128, 128, 2, 2), GemmTile(64, 128, 2, 2), GemmTile(32, 128, 2, 2), GemmTile(16, 128, 1, 4),
    GemmTile(128, 64, 2, 2), GemmTile(64, 64, 2, 2), GemmTile(32, 64, 2, 2), GemmTile(16, 64, 1, 4),
    GemmTile(64, 32, 2, 2), GemmTile(32, 32, 2, 2),
)  # fmt: skip
GEMM_K_TILES: tuple[GemmTile, ...] = (
    GemmTile(128, 128, 2, 2), GemmTile(64, 128, 2, 2), GemmTile(32, 128, 2, 2), GemmTile(16, 128, 1, 4),
    GemmTile(64, 64, 2, 2),
)  # fmt: skip
GEMV_MMAX = (1, 2, 4, 8)
PREFILL_HEAD_DIMS = (16, 32, 64, 128, 256)  # any multiple of 16 up to 256 works; these are CI-built
DECODE_HEAD_DIMS = (16, 32, 64, 128, 256)  # 8 * lanes-per-key must divide a warp
DECODE_HQ_CI = (1, 2, 3, 4, 8)  # query heads per KV head built in CI (any 1..16 at run time)


@dataclass(frozen=True)
class Build:
    """One compilation unit: a source file with its defines (dtype and arch come on top)."""

    source: str
    defines: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        return self.source + "".join(f" {k}={v}" for k, v in self.defines)


def _b(source: str, defines: dict[str, int] | None = None) -> Build:
    return Build(source, tuple(sorted((defines or {}).items())))


def kernel_builds() -> list[Build]:
    """Every build the dispatcher can ask for (decode attention: the CI subset of head counts)."""
    builds = [_b("reorder.cu")]
    for sw in (False, True):
        builds += [_b("gemm_mn.cu", t.defines(sw)) for t in GEMM_MN_TILES if t.valid(sw)]
    builds += [_b("gemm_k.cu", t.defines()) for t in GEMM_K_TILES]
    builds += [_b("gemv.cu", {"MMAX": m, "SWIGLU": sw}) for m in GEMV_MMAX for sw in (0, 1)]
    builds += [_b("attn_prefill.cu", {"HEAD_DIM": d}) for d in PREFILL_HEAD_DIMS]
    builds += [_b("attn_decode.cu", {"HEAD_DIM": d, "HQ": hq}) for d in (64, 128) for hq in DECODE_HQ_CI]
    builds += [_b("attn_decode.cu", {"HEAD_DIM": 16, "HQ": 2}), _b("attn_decode.cu", {"HEAD_DIM": 32, "HQ": 2}),
               _b("attn_decode.cu", {"HEAD_DIM": 256, "HQ": 16})]  # fmt: skip
    return builds


def next_pow2(x: int) -> int:
    """Smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, int(x - 1).bit_length())


def heuristic_tile(cands: list[GemmTile], M: int, n_tiles: int, sms: int, density: float) -> GemmTile:
    """Largest BM that still gives about two waves of live blocks at the expected density.

    Args:
        cands: candidate tiles (at least one).
        M: tokens; n_tiles: output tiles along N; sms: streaming multiprocessors of the device;
        density: expected fraction of live (token, group) pairs, 0..1.
    """
    cands = sorted(cands, key=lambda t: -t.bm)
    for t in cands:
        if t.bm > max(16, next_pow2(M)):
            continue
        if n_tiles * math.ceil(max(1, M * density) / t.bm) >= 2 * sms:
            return t
    fitting = [t for t in cands if t.bm <= max(16, next_pow2(M))]
    return fitting[-1] if fitting else cands[-1]


def decode_split(batch: int, kv_heads: int, slots: int, sms: int) -> tuple[int, int]:
    """``(keys per block, blocks per (row, KV head))`` for decode: about eight blocks per SM
    before skipping (so about four live ones at 50 % sparsity, enough 16-byte loads in flight to
    stream the cache), 64..1024 keys each (a power of two)."""
    want = max(1, (slots * batch * kv_heads) // (8 * sms))
    chunk = min(1024, max(64, next_pow2(want)))
    return chunk, -(-slots // chunk)
