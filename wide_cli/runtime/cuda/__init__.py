"""The CUDA side of the ``cupy`` backend, below the operators of ``runtime/cupy_ops.py``.

- ``sources.py``: the kernel source files (top-level ``kernels/``), their kernels, NVRTC options;
- ``nvrtc.py``: compile a source with NVRTC without a device (CI, ``gpu-check --dry-run``);
- ``builds.py``: tile tables, every build the dispatcher may ask for, tile and split arithmetic;
- ``schedule.py``: what the kernels compute, in pure PyTorch (their specification, for tests);
- ``registry.py``: ``REGISTRY``, the process-wide kernel state and settings;
- ``launch.py``: availability, device arch, the build cache, zero-copy launches;
- ``verify.py``: reference fallbacks and first-use verification; ``autotune.py``: tile timing.

Importing this package needs neither CuPy nor a GPU.
"""
