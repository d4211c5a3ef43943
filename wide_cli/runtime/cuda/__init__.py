"""The CUDA side of the ``cupy`` backend, below the operators of ``runtime/cupy_ops.py``.

- ``sources.py``: the kernel source files (top-level ``kernels/``), their kernels, NVRTC options;
- ``nvrtc.py``: compile a source with NVRTC without a device (CI, ``gpu-check --dry-run``).

Importing this package needs neither CuPy nor a GPU.
"""
