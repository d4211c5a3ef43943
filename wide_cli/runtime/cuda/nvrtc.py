"""Compile CUDA sources with NVRTC *without a device* (CI, ``gpu_check --dry-run``, an install check).

It drives CuPy's thin NVRTC binding (``cupy_backends.cuda.libs.nvrtc``), which loads ``libnvrtc``
from the ``nvidia-cuda-nvrtc`` wheel and never touches the driver; if CuPy is absent it falls back
to ``libnvrtc.so`` through ctypes. The run-time build on a GPU goes through ``cupy.RawModule``
instead (``wide_cli.runtime.cuda.registry``).
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompileResult:
    """Outcome of one offline NVRTC compile."""

    ok: bool
    log: str  # NVRTC's program log (errors and warnings); empty on a clean build
    binary_size: int  # bytes of cubin (or PTX) produced; 0 on failure
    backend: str  # "cupy-nvrtc" or "ctypes:<path>"
    binary: bytes = field(default=b"", repr=False)  # the cubin / PTX itself


class NvrtcUnavailable(RuntimeError):
    """No usable libnvrtc (the message says what was tried)."""


def _cupy_nvrtc():
    from cupy_backends.cuda.libs import nvrtc  # the binding only, never initialises CUDA

    nvrtc.getVersion()  # loads libnvrtc now, so a missing library fails here
    return nvrtc


def _ctypes_candidates() -> list[str]:
    found: list[str] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for root in list(getattr(nvidia, "__path__", [])):
            found += sorted(glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so*")))
            found += sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            found += sorted(glob.glob(os.path.join(os.environ[env], "lib64", "libnvrtc.so*")))
    found += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))
    return [p for p in found if "builtins" not in os.path.basename(p)]


def _ctypes_compile(lib_path: str, source: str, options: tuple[str, ...], name: str) -> CompileResult:
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    src = source.encode()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None)
    if rc != 0:
        raise NvrtcUnavailable(f"nvrtcCreateProgram failed with code {rc} ({lib_path})")
    try:
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        binary = b""
        if rc == 0:
            cubin = any(o.startswith("-arch=sm_") for o in options)
            out = ctypes.c_size_t()
            (lib.nvrtcGetCUBINSize if cubin else lib.nvrtcGetPTXSize)(prog, ctypes.byref(out))
            buf = ctypes.create_string_buffer(out.value)
            (lib.nvrtcGetCUBIN if cubin else lib.nvrtcGetPTX)(prog, buf)
            binary = buf.raw
        return CompileResult(rc == 0, log, len(binary), f"ctypes:{lib_path}", binary)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_backend() -> str:
    """Which NVRTC the offline compiler will use.

    Raises:
        NvrtcUnavailable: neither CuPy's binding nor a ``libnvrtc.so`` could be loaded; the message
            names what was tried and how to install it.
    """
    try:
        nvrtc = _cupy_nvrtc()
        major, minor = nvrtc.getVersion()
        return f"cupy-nvrtc {major}.{minor}"
    except (ImportError, OSError, RuntimeError, AttributeError) as err:  # missing CuPy or libnvrtc
        cupy_err = f"{type(err).__name__}: {err}"
    cands = _ctypes_candidates()
    for path in cands:
        try:
            ctypes.CDLL(path)
            return f"ctypes:{path}"
        except OSError:
            continue
    raise NvrtcUnavailable(
        f"NVRTC not found: CuPy's binding failed ({cupy_err}) and no loadable libnvrtc.so among "
        f"{cands or 'the nvidia-* wheels, $CUDA_HOME, /usr/local/cuda'} "
        "(install the 'cuda' extra: pip install 'cupy-cuda13x' 'nvidia-cuda-nvrtc')"
    )


def nvrtc_compile(source: str, options: tuple[str, ...], name: str = "kernel.cu") -> CompileResult:
    """Compile ``source`` with NVRTC for the ``-arch`` in ``options``; no GPU or driver needed.

    Returns a ``CompileResult`` whether or not compilation succeeded (``ok``, ``log``).

    Raises:
        NvrtcUnavailable: no NVRTC library could be loaded (see ``nvrtc_backend``).
    """
    try:
        nvrtc = _cupy_nvrtc()
    except (ImportError, OSError, RuntimeError, AttributeError):
        nvrtc = None
    if nvrtc is not None:
        prog = nvrtc.createProgram(source, name, (), ())
        try:
            try:
                nvrtc.compileProgram(prog, options)
                ok = True
            except nvrtc.NVRTCError:
                ok = False
            log = nvrtc.getProgramLog(prog)
            binary = b""
            if ok:
                cubin = any(o.startswith("-arch=sm_") for o in options)
                binary = nvrtc.getCUBIN(prog) if cubin else nvrtc.getPTX(prog)
                binary = binary.encode() if isinstance(binary, str) else bytes(binary)
            return CompileResult(ok, log, len(binary), "cupy-nvrtc", binary)
        finally:
            nvrtc.destroyProgram(prog)
    backend = nvrtc_backend()  # raises NvrtcUnavailable with the full story
    return _ctypes_compile(backend.split(":", 1)[1], source, options, name)


def log_problems(log: str) -> list[str]:
    """Lines of an NVRTC log that are warnings or errors (ptxas ``-v`` resource lines are not)."""
    bad = []
    for line in log.replace("\x00", "").splitlines():
        s = line.strip()
        if not s or "precompiled header" in s:
            continue
        if s.startswith("ptxas") and "warning" not in s.lower() and "error" not in s.lower():
            continue  # "ptxas info : Used N registers", "ptxas . 0 bytes stack frame", ...
        bad.append(s)
    return bad
