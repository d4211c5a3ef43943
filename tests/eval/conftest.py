"""Shared fixtures for the eval tests: tiny seeded models, a fixed-logits model, the data dir."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def data_dir() -> Path:
    """``<repo root>/../shared/data``; tests that need it skip when it is absent."""
    if not (DATA_DIR / "zeroshot").is_dir():
        pytest.skip(f"shared data not found at {DATA_DIR} (<repo root>/../shared/data)")
    return DATA_DIR


@pytest.fixture
def tiny():
    from wide_cli.models.tiny import tiny_model

    return tiny_model(seed=0)


@pytest.fixture
def tok():
    from wide_cli.models.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture
def routed():
    """A routed tiny Llama (2 layers, 2 attention groups, 4 FFN groups), argmax routing."""
    from wide_cli.models.tiny import tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers

    m = tiny_model(seed=1)
    attach_routers(m, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    torch.manual_seed(3)
    with torch.no_grad():  # random routers so that roughly half the decisions skip
        for n, p in m.named_parameters():
            if ".router_" in n:
                p.normal_(0.0, 0.5)
    return m.eval()


class FixedLogitsLM(torch.nn.Module):
    """A stand-in causal LM whose next-token logits are ``table[current token]`` (a bigram table).

    ``table = None`` gives uniform logits (every token has log-prob -ln V).
    """

    def __init__(self, vocab: int = 128, table: torch.Tensor | None = None):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 1)
        self.table = torch.zeros(vocab, vocab) if table is None else table
        self.config = SimpleNamespace(max_position_embeddings=512, vocab_size=vocab)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, **kw):
        return SimpleNamespace(logits=self.table[input_ids])


@pytest.fixture
def fixed_lm():
    return FixedLogitsLM
