"""CI without a GPU: every CUDA kernel compiles cleanly with NVRTC for sm_80 and sm_90.

NVRTC needs no device or driver: the compiler is the ``libnvrtc`` of the ``nvidia-cuda-nvrtc``
wheel, reached through CuPy's binding (or ctypes). "Cleanly" is -Werror style: the program log
must hold no warning or error line. Skips (with the reason) only when no NVRTC can be loaded.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from wide_cli.runtime.cuda import builds, nvrtc, sources


@pytest.fixture(scope="module")
def nvrtc_name() -> str:
    try:
        return nvrtc.nvrtc_backend()
    except nvrtc.NvrtcUnavailable as e:
        pytest.skip(str(e))


def _compile(source: str, dtype: str, arch: str, defines: tuple = ()) -> nvrtc.CompileResult:
    opts = sources.compile_options(dtype, arch, dict(defines))
    return nvrtc.nvrtc_compile(sources.load_source(source), opts, source)


_BUILDS = builds.kernel_builds()
# Compiled up front, in parallel (NVRTC is single-threaded): every source x dtype x arch with its
# default defines, and every dispatch build for sm_90 / bf16.
_DEFAULT_JOBS = [
    (src, dt, arch, ()) for src in sorted(sources.SOURCES) for dt in sorted(sources.DTYPE_DEFINES) for arch in sources.ARCHS
]
_DEFAULT_JOBS += [(b.source, "bf16", "sm_90", b.defines) for b in _BUILDS]


def _job(args) -> nvrtc.CompileResult:
    return _compile(*args)


@pytest.fixture(scope="module")
def compiled(nvrtc_name) -> dict:
    workers = max(1, min(8, os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(zip(_DEFAULT_JOBS, pool.map(_job, _DEFAULT_JOBS)))


def _result(compiled: dict, *key) -> nvrtc.CompileResult:
    return compiled[key] if key in compiled else _compile(*key)


def _assert_clean(res: nvrtc.CompileResult, what: str) -> None:
    assert res.ok, f"{what} failed to compile:\n{res.log}"
    problems = nvrtc.log_problems(res.log)
    assert not problems, f"{what} compiled with warnings (treated as errors):\n" + "\n".join(problems)
    assert res.binary_size > 0


def test_source_table_matches_files():
    on_disk = {p.name for p in sources.kernel_dir().glob("*.cu")}
    assert on_disk == set(sources.SOURCES), "every .cu file must be listed in sources.SOURCES (and only those)"
    for name, funcs in sources.SOURCES.items():
        text = sources.load_source(name)
        assert not re.search(r"^\s*#include", text, re.MULTILINE), f"{name}: include left unexpanded"
        for f in funcs:
            pattern = rf'extern "C" __global__ void\b[^;{{]*?\b{f}\('
            assert re.search(pattern, text), f"{name} does not define {f}"


@pytest.mark.parametrize("arch", sources.ARCHS)
@pytest.mark.parametrize("dtype", sorted(sources.DTYPE_DEFINES))
@pytest.mark.parametrize("source", sorted(sources.SOURCES))
def test_every_source_compiles_clean(compiled, nvrtc_name, source, dtype, arch):
    res = _result(compiled, source, dtype, arch, ())
    _assert_clean(res, f"{source} ({dtype}, {arch}, {nvrtc_name})")
    for func in sources.SOURCES[source]:  # the extern "C" kernels are in the cubin's symbol table
        assert func.encode() in res.binary, f"{func} missing from the {arch} cubin of {source}"


# Every tile configuration the dispatcher can pick. Both dtypes and both archs already go through
# every source above; here the tile defines vary. sm_90/bf16 always, the sm_80/fp16 repeat with
# WIDE_SLOW=1 (about a minute more on a 2-core machine).


@pytest.mark.parametrize(
    "arch,dtype", [("sm_90", "bf16"), pytest.param("sm_80", "fp16", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("build", _BUILDS, ids=[b.label for b in _BUILDS])
def test_every_dispatch_build_compiles_clean(compiled, build, arch, dtype):
    res = _result(compiled, build.source, dtype, arch, build.defines)
    _assert_clean(res, f"{build.label} ({dtype}, {arch})")


def test_warnings_are_caught(nvrtc_name):
    """The -Werror check is real: a source with a warning is flagged, a broken one fails."""
    warn = 'extern "C" __global__ void k(int* o) { unsigned x = 1u << 40; o[0] = x; }'
    res = nvrtc.nvrtc_compile(warn, sources.compile_options("bf16", "sm_90"), "warn.cu")
    assert res.ok and nvrtc.log_problems(res.log), res.log
    bad = 'extern "C" __global__ void k(int* o) { o[0] = undefined_name; }'
    res = nvrtc.nvrtc_compile(bad, sources.compile_options("bf16", "sm_80"), "bad.cu")
    assert not res.ok and "undefined_name" in res.log


def test_compile_options():
    opts = sources.compile_options("fp16", "sm_80", {"BM": 64})
    assert "-arch=sm_80" in opts and "-DWIDE_FP16" in opts and "-DBM=64" in opts
    with pytest.raises(ValueError, match="fp8"):
        sources.compile_options("fp8", "sm_90")
