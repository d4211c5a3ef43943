"""The ``cupy`` backend without a GPU: it imports cleanly and refuses to start with a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from wide_cli.errors import ConfigError, WideError


def test_modules_import_without_cupy_or_gpu():
    """Importing the backend and the kernel wrappers pulls in neither CuPy nor CUDA."""
    code = (
        "import sys, wide_cli.runtime.cupy_backend, wide_cli.runtime.cupy_ops;"
        "import wide_cli.runtime.cuda.sources, wide_cli.runtime.cuda.nvrtc, wide_cli.runtime.cuda.launch;"
        "import wide_cli.runtime.cuda.verify, wide_cli.runtime.cuda.autotune;"
        "print('cupy' in sys.modules, 'cupy_backends' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_selecting_cupy_without_gpu_is_a_clear_error():
    from wide_cli.runtime.backend import get_backend
    from wide_cli.runtime.cupy_backend import CupyBackend

    with pytest.raises(WideError, match="no CUDA device"):
        get_backend("cupy")
    with pytest.raises(ConfigError, match="no CUDA device") as info:
        CupyBackend()
    assert info.value.hint  # says what to do instead


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_status_names_the_missing_piece():
    from wide_cli.runtime.cuda.launch import cuda_status

    why = cuda_status()
    assert why is not None and "no CUDA device" in why
