"""Shared fixtures: an isolated model cache, a small training text, the real-data path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def _have_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    slow_ok = os.environ.get("WIDE_SLOW", "") not in ("", "0")
    cuda = _have_cuda()
    for item in items:
        if "slow" in item.keywords and not slow_ok:
            item.add_marker(pytest.mark.skip(reason="slow test: set WIDE_SLOW=1 to run"))
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"))


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tiny-model aliases materialise under a per-session cache, never the user's."""
    if "WIDE_CACHE" not in os.environ:
        os.environ["WIDE_CACHE"] = str(tmp_path_factory.mktemp("wide-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    yield


@pytest.fixture
def text_file(tmp_path) -> Path:
    """About 6k characters of English prose in three documents (blank-line separated)."""
    import pydoc_data.topics as t

    docs = [v for _, v in sorted(t.topics.items())][:3]
    p = tmp_path / "train.txt"
    p.write_text("\n\n".join(d[:2000] for d in docs))
    return p


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not available: {SHARED_DATA} is absent (a user's clone has no ../shared)")
    return SHARED_DATA
