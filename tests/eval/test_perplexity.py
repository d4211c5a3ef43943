"""Token-level and rolling perplexity against direct references (the two definitions
must each match their own reference, never each other's)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from wide_cli.errors import ConfigError, DataError
from wide_cli.eval import wikitext
from wide_cli.eval.perplexity import rolling_perplexity, rolling_windows, token_perplexity, token_windows


def _ids(n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 100, (n,), generator=g)


def _token_nlls(model, x):
    """Per-target NLL of one window ``x`` ([T]): entry j is -log p(x[j+1] | x[:j+1])."""
    with torch.no_grad():
        logits = model(x[None]).logits[0].float()
    return F.cross_entropy(logits[:-1], x[1:], reduction="none").double()


def reference_nonoverlapping(model, ids, L):
    nlls = [_token_nlls(model, ids[k * L:(k + 1) * L]) for k in range(len(ids) // L)]
    return math.exp(torch.cat(nlls).mean().item())


def reference_strided(model, ids, L, S):
    """Score each target once: first window [0, L); later windows end S tokens further."""
    per_token = {}
    end, prev = L, 1
    while True:
        nll = _token_nlls(model, ids[end - L:end])  # targets end-L+1 .. end-1
        for t in range(prev, end):
            assert t not in per_token
            per_token[t] = nll[t - (end - L) - 1].item()
        if end == len(ids):
            break
        prev, end = end, min(end + S, len(ids))
    assert sorted(per_token) == list(range(1, len(ids)))
    return math.exp(sum(per_token.values()) / len(per_token)), len(per_token)


def test_nonoverlapping_matches_reference(tiny):
    ids = _ids()
    res = token_perplexity(tiny, ids, seq_len=128, batch_size=3)
    ref = reference_nonoverlapping(tiny, ids, 128)
    assert res["perplexity"] == pytest.approx(ref, rel=1e-6)
    assert res["n_windows"] == 1000 // 128
    assert res["n_tokens_scored"] == 7 * 127
    assert res["unit"] == "token-level perplexity"
    assert "trailing 104 tokens dropped" in res["protocol"]
    # stride == seq_len is the same protocol as stride=None
    same = token_perplexity(tiny, ids, seq_len=128, stride=128, batch_size=4)
    assert same["perplexity"] == pytest.approx(res["perplexity"], rel=1e-9)


def test_strided_scores_every_token_once(tiny):
    ids = _ids()
    res = token_perplexity(tiny, ids, seq_len=128, stride=64, batch_size=4)
    ref, n = reference_strided(tiny, ids, 128, 64)
    assert res["n_tokens_scored"] == n == 999
    assert res["perplexity"] == pytest.approx(ref, rel=1e-6)
    plan = token_windows(1000, 128, 64)
    assert plan[0] == (0, 128, 1)  # first window is full length
    assert all(e - b == 128 for b, e, _ in plan)
    scored = [t for _, e, t0 in plan for t in range(t0, e)]
    assert scored == list(range(1, 1000))


def test_protocol_string_tracks_settings(tiny):
    ids = _ids(600)
    a = token_perplexity(tiny, ids, seq_len=128)
    b = token_perplexity(tiny, ids, seq_len=64)
    c = token_perplexity(tiny, ids, seq_len=128, stride=32)
    assert len({a["protocol"], b["protocol"], c["protocol"]}) == 3
    assert (a["seq_len"], a["stride"], c["stride"]) == (128, 128, 32)


def test_window_errors():
    with pytest.raises(ConfigError, match="stride 200"):
        token_windows(1000, 128, 200)
    with pytest.raises(ConfigError, match="seq-len 1"):
        token_windows(1000, 1, None)
    with pytest.raises(DataError, match="only 50 tokens"):
        token_windows(50, 128, None)


def test_token_perplexity_rejects_out_of_vocab_ids(tiny):
    ids = _ids(300)
    ids[7] = 500
    with pytest.raises(DataError, match="token id 500 is outside the model's vocabulary of 128"):
        token_perplexity(tiny, ids, seq_len=128)


def test_rolling_windows_cover_each_token_once():
    toks = list(range(10, 10 + 23))
    for L in (1, 4, 5, 23, 30):
        wins = rolling_windows(toks, 1, L)
        preds = [t for _, cont in wins for t in cont]
        assert preds == toks
        for ctx, cont in wins:
            assert len(ctx) + len(cont) - 1 <= L  # fits the model input after the shift
        assert wins[0][0] == [1]


def test_rolling_equals_full_sequence_when_one_window(tiny, tok):
    doc = " = Title = \n Some text , with words @-@ and more . \n"
    res = rolling_perplexity(tiny, tok, [doc], max_length=256, batch_size=1,
                             detokenize=wikitext.wikitext_detokenizer)
    text = wikitext.wikitext_detokenizer(doc)
    ids = tok.encode(text)
    x = torch.tensor([tok.bos_token_id] + ids)
    ll = -_token_nlls(tiny, x).sum().item()
    assert res["n_windows"] == 1
    assert res["loglikelihood"] == pytest.approx(ll, rel=1e-6)
    words = len(re.split(r"\s+", doc))  # the harness's rule, on the original document
    assert res["n_words"] == words
    assert res["word_perplexity"] == pytest.approx(math.exp(-ll / words), rel=1e-6)
    nbytes = len(doc.encode())
    assert res["bits_per_byte"] == pytest.approx(-ll / nbytes / math.log(2), rel=1e-6)


def test_rolling_batch_independent(tiny, tok):
    docs = ["a b c " * 40, "short doc", "x" * 300]
    r1 = rolling_perplexity(tiny, tok, docs, max_length=64, batch_size=1)
    r4 = rolling_perplexity(tiny, tok, docs, max_length=64, batch_size=4)
    for a, b in zip(r1["per_document_loglikelihood"], r4["per_document_loglikelihood"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert r1["n_windows"] == 1 + 4 + 5


# ----------------------------------------------------------------------------------------------
# WikiText-2 from the raw file


def test_dataset_names(caplog):
    assert wikitext.resolve_dataset("wikitext2") == "wikitext-2-raw-v1"
    with caplog.at_level("WARNING", logger="wide.eval"):
        assert wikitext.resolve_dataset("wikitext") == "wikitext-2-raw-v1"
    assert "resolved to wikitext-2-raw-v1" in caplog.text
    with pytest.raises(DataError, match="wikitext-103"):
        wikitext.resolve_dataset("wikitext-103-raw-v1")
    with pytest.raises(DataError, match="unknown perplexity dataset 'ptb'"):
        wikitext.resolve_dataset("ptb")


def test_document_split_small():
    raw = " \n = A = \n \n text a \n \n = = Sec = = \n more \n = B = \n text b \n"
    docs = wikitext.documents(raw)
    # the whitespace-only piece before the first title is not a page (the HF script skips it)
    assert docs == [" = A = \n \n text a \n \n = = Sec = = \n more ", " = B = \n text b \n"]
    assert wikitext.rows(raw) == ["", " = A = \n", "", " text a \n", "", " = = Sec = = \n", " more \n",
                                  " = B = \n", " text b \n"]
    assert wikitext.rows(raw, limit_documents=1) == wikitext.rows(raw)[:7]


@pytest.mark.real_data
def test_wikitext2_test_split_layout(data_dir):
    raw = wikitext.read_raw(data_dir, "test")
    docs = wikitext.documents(raw)
    assert len(docs) == 62  # the harness's document count for wikitext-2-raw-v1 test
    assert docs[0].startswith(" = Robert Boulter = \n")
    assert raw.startswith(" \n") and "\n".join(docs) == raw[2:]  # only the leading blank line is lost
    rows = wikitext.rows(raw)
    assert len(rows) == 4358  # HF wikitext-2-raw-v1 test rows
    assert sum(1 for r in rows if r) == 2891
