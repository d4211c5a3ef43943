"""The CUDA C++ sources of the CuPy runtime (DESIGN.md §3): which files, which kernels, how to
build them.

Pure Python, no CuPy or GPU needed to import.

- ``SOURCES``: every kernel source file and the ``extern "C"`` kernels it defines;
- ``kernel_dir()``: the folder they are read from (top-level ``kernels/`` in the repository, a copy
  inside an installed wheel; see ``wide_cli.resources``);
- ``load_source(name)``: the text ready for NVRTC, with ``#include "common.cuh"`` pasted in (so
  CuPy's disk cache, keyed on source text + options, sees header changes too);
- ``compile_options(dtype, arch, defines)``: the NVRTC option tuple every build uses.

The tile-config tables (which defines each kernel is built with) live in
``wide_cli.runtime.cuda.builds``; ``kernel_builds()`` there enumerates every build.
"""

from __future__ import annotations

import re
from pathlib import Path

from wide_cli.resources import shipped_dir

# file -> kernels it defines (extern "C", so no name mangling)
SOURCES: dict[str, tuple[str, ...]] = {
    "reorder.cu": ("wide_reorder", "wide_pack_mask"),
    "gemm_mn.cu": ("wide_gemm_mn",),
    "gemm_k.cu": ("wide_gemm_k",),
    "gemv.cu": ("wide_gemv_mn", "wide_gemv_k"),
    "attn_prefill.cu": ("wide_attn_prefill",),
    "attn_decode.cu": ("wide_attn_decode_split", "wide_attn_decode_combine"),
}
HEADERS: tuple[str, ...] = ("common.cuh",)

DTYPE_DEFINES = {"bf16": "WIDE_BF16", "fp16": "WIDE_FP16"}
ARCHS: tuple[str, ...] = ("sm_80", "sm_90")

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """The folder holding the ``.cu``/``.cuh`` files (the installed copy, else the repository's)."""
    return shipped_dir("kernels")


def load_source(name: str) -> str:
    """Kernel source ``name`` (e.g. ``"gemm_mn.cu"``) with local ``#include "x.cuh"`` expanded.

    Raises:
        FileNotFoundError: unknown file (the message lists the known ones).
    """
    path = kernel_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {name!r} in {kernel_dir()}; known: {sorted(SOURCES)}")
    text = path.read_text()

    def paste(match: re.Match) -> str:
        header = match.group(1)
        return f"// ---- begin {header}\n{load_source(header)}\n// ---- end {header}\n"

    return _INCLUDE.sub(paste, text)


def compile_options(dtype: str, arch: str, defines: dict[str, int] | None = None) -> tuple[str, ...]:
    """NVRTC options for one build: element type, target, tile-config defines.

    Args:
        dtype: ``"bf16"`` or ``"fp16"``.
        arch: ``"sm_80"``, ``"sm_90"``, ... (or ``"compute_XX"`` for PTX).
        defines: tile configuration, e.g. ``{"BM": 128, "BN": 128}``.
    """
    if dtype not in DTYPE_DEFINES:
        raise ValueError(f"kernel dtype {dtype!r} is not one of {sorted(DTYPE_DEFINES)}")
    opts = ["-std=c++17", f"-arch={arch}", f"-D{DTYPE_DEFINES[dtype]}", "--use_fast_math"]
    for key, val in sorted((defines or {}).items()):
        opts.append(f"-D{key}={int(val)}")
    return tuple(opts)
