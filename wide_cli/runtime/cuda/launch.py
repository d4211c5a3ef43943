"""Build and launch: availability, device arch, the compiled-kernel cache, zero-copy arguments,
launches on torch's current stream. State lives in ``registry.REGISTRY``.

Each kernel is compiled once per (source, function, dtype, tile config, arch) with
``cupy.RawModule(backend="nvrtc")`` and kept in the registry (CuPy also caches the cubin on
disk, keyed by source text + options). ``-arch=sm_XX`` comes from the device at run time.
Tensors are passed zero-copy: raw device pointers by default, CuPy views made with
``cupy.from_dlpack`` with ``WIDE_CUPY_ARGS=dlpack`` (same memory, more launch overhead).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from wide_cli.runtime.cuda import sources
from wide_cli.runtime.cuda.registry import REGISTRY

log = logging.getLogger("wide.cupy")


def cuda_status() -> str | None:
    """None when the kernels can run here, else the reason (one line, says what is missing)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy
    except ImportError as e:
        return f"cupy is not installed ({e}); install the cuda extra: pip install -e '.[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except RuntimeError as e:  # CUDARuntimeError: no driver / insufficient driver
        return f"no CUDA device visible to CuPy ({type(e).__name__}: {e})"
    return None if n > 0 else "no CUDA device visible to CuPy (device count 0)"


def device_arch(device: torch.device) -> str:
    """``sm_XY`` for ``device``, capped at the newest arch this NVRTC can target (cached)."""
    idx = torch.device(device).index
    arch = REGISTRY.arch.get(idx)
    if arch is None:
        arch = REGISTRY.arch[idx] = _query_arch(device)
    return arch


def _query_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    try:
        from cupy_backends.cuda.libs import nvrtc

        supported = [int(a) for a in nvrtc.getSupportedArchs()]
        cc = max(a for a in supported if a <= cc) if any(a <= cc for a in supported) else cc
    except (ImportError, AttributeError, RuntimeError):  # old binding: trust the device
        log.debug("NVRTC supported-arch query failed; using the device arch sm_%d", cc)
    return f"sm_{cc}"


def get_kernel(source: str, func: str, dtype: str, defines: dict[str, int], device: torch.device):
    """The compiled ``cupy.RawKernel`` ``func`` of ``source`` for this build (compiled once)."""
    import cupy

    arch = device_arch(device)
    key = (source, func, dtype, tuple(sorted(defines.items())), arch)
    kern = REGISTRY.kernels.get(key)
    if kern is None:
        with REGISTRY.lock:
            kern = REGISTRY.kernels.get(key)
            if kern is None:
                mod = cupy.RawModule(
                    code=sources.load_source(source),
                    options=sources.compile_options(dtype, arch, defines),
                    backend="nvrtc",
                )
                with cupy.cuda.Device(device.index):
                    kern = mod.get_function(func)  # compiles (or loads CuPy's disk cache) now
                REGISTRY.kernels[key] = kern
    return kern


def _stream(device: torch.device):
    import cupy

    s = torch.cuda.current_stream(device)
    key = (device.index, s.cuda_stream)
    st = REGISTRY.streams.get(key)
    if st is None:
        st = REGISTRY.streams[key] = cupy.cuda.ExternalStream(s.cuda_stream, device.index)
    return st


def arg(t: torch.Tensor):
    """A kernel pointer argument for tensor ``t`` (zero-copy)."""
    if REGISTRY.args_mode == "dlpack":
        import cupy

        view = t.view(torch.uint8) if t.dtype == torch.bool else t
        if view.dtype in (torch.bfloat16, torch.float16):
            view = view.view(torch.int16)
        return cupy.from_dlpack(view)
    return np.uint64(t.data_ptr())


def i32(x) -> np.int32:
    return np.int32(x)


def i64(x) -> np.int64:
    return np.int64(x)


def launch(kern, grid: tuple, block: tuple, args: tuple, smem: int, device: torch.device) -> None:
    """Launch on torch's current stream of ``device``; raises the kernel's dynamic-smem limit once."""
    import cupy

    with cupy.cuda.Device(device.index):
        if smem > 48 * 1024 and REGISTRY.smem_set.get(id(kern), 0) < smem:
            kern.max_dynamic_shared_size_bytes = smem
            REGISTRY.smem_set[id(kern)] = smem
        with _stream(device):
            kern(grid, block, args, shared_mem=smem)
