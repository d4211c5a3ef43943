"""Zero-shot scoring: forced answers, metrics, batching, padding and data errors (padding never
changes a score; metrics are named)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from wide_cli.errors import ConfigError, DataError
from wide_cli.eval import tasks as T
from wide_cli.eval.scoring import encode_pair, loglikelihoods
from wide_cli.eval.zeroshot import evaluate_task, mc_metrics, mean_stderr, score_docs
from wide_cli.routing.measure import SparsityMeter, count_sparsity


def _doc(ctx, choices, gold):
    return T.MCDoc(tuple(ctx for _ in choices), tuple(" " + c for c in choices), tuple(choices), gold)


def test_uniform_model_forces_acc_and_acc_norm(fixed_lm, tok):
    """Uniform logits: every token costs ln 128, so acc picks the shortest choice and acc_norm
    (ll / characters) the longest; the gold labels below make acc 2/3 and acc_norm 1/3."""
    docs = [
        _doc("Q1", ["a", "bbbb", "cc"], 0),  # acc right, acc_norm wrong (picks bbbb)
        _doc("Q2", ["dddd", "e", "ff"], 0),  # acc wrong (picks e), acc_norm right
        _doc("Q3", ["gg", "h", "iiiii"], 1),  # acc right, acc_norm wrong
    ]
    lls = score_docs(fixed_lm(), tok, docs, batch_size=2)
    ln = math.log(128)
    assert lls[0] == pytest.approx([-2 * ln, -5 * ln, -3 * ln], rel=1e-6)  # " " + choice
    m = mc_metrics(docs, lls)
    assert m["acc"] == pytest.approx(2 / 3) and m["acc_norm"] == pytest.approx(1 / 3)
    assert [i["pred"] for i in m["items"]] == [0, 1, 1]
    assert [i["pred_norm"] for i in m["items"]] == [1, 0, 2]
    # harness stderr: sqrt(p (1 - p) / (n - 1))
    assert m["acc_stderr"] == pytest.approx(math.sqrt((2 / 3) * (1 / 3) / 2))
    assert m["acc_norm_stderr"] == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 2))


def test_bigram_model_prefers_its_token(fixed_lm, tok):
    """A bigram table that makes 'y' likely after anything: equal-length choices are decided by 'y'."""
    y = tok.convert_tokens_to_ids("y")
    table = torch.zeros(128, 128)
    table[:, y] = 8.0
    docs = [_doc("Is it?", ["no!", "yyy"], 1), _doc("Is it?", ["yyy", "no!"], 0), _doc("x", ["ab", "yy"], 0)]
    m = mc_metrics(docs, score_docs(fixed_lm(table=table), tok, docs))
    assert (m["acc"], m["acc_norm"]) == (pytest.approx(2 / 3), pytest.approx(2 / 3))


def test_mean_stderr_matches_formula():
    assert mean_stderr([1.0]) is None
    vals = [1.0, 0.0, 1.0, 1.0]
    p, n = 0.75, 4
    assert mean_stderr(vals) == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))


def test_encode_pair_moves_trailing_space(tok):
    ctx, cont = encode_pair(tok, "Answer: ", "yes")
    assert tok.decode(ctx) == "Answer:" and tok.decode(cont) == " yes"
    ctx, cont = encode_pair(tok, "", "ab")
    assert ctx == [tok.bos_token_id] and tok.decode(cont) == "ab"


def test_batch_1_vs_4_identical(tiny, tok):
    docs = [_doc("Question: what?\nAnswer:", ["a longer answer here", "b", "cc cc"], 0),
            _doc("Q: short", ["x", "yy yy yy yy yy"], 1),
            T.MCDoc(("The cat sat on the", "The dog ran to the"), (" mat.", " mat."), ("a", "b"), 0)]
    l1 = score_docs(tiny, tok, docs, batch_size=1)
    l4 = score_docs(tiny, tok, docs, batch_size=4)
    for a, b in zip(l1, l4):
        assert a == pytest.approx(b, abs=1e-4)


def test_padding_excluded_from_sparsity(routed, tok):
    """Batch 4 (right-padded) and batch 1 (no padding) count the same decisions (padding must not change
    a score)."""
    reqs = [encode_pair(tok, "ctx " * k, " cont" * (k % 3 + 1)) for k in range(1, 8)]
    meters = {}
    for bs in (1, 4):
        meters[bs] = SparsityMeter()
        with count_sparsity(routed, meters[bs]):
            out = loglikelihoods(routed, reqs, max_length=256, batch_size=bs)
        meters[bs].tokens_measured = 0
        if bs == 1:
            ref = out
    assert [o.logprob for o in out] == pytest.approx([o.logprob for o in ref], abs=1e-4)
    assert meters[1].decisions == meters[4].decisions
    assert meters[1].skipped == meters[4].skipped
    n_real = sum(len(c) + len(t) - 1 for c, t in reqs)
    g = routed.wide_routing.layout
    assert meters[4].decisions["attention"] == [float(n_real * g.attn_groups)] * 2
    assert meters[4].decisions["ffn"] == [float(n_real * g.ffn_groups)] * 2
    s = meters[4].summary()
    assert 0.0 < s["total"] < 1.0


def test_task_table_and_errors(tmp_path):
    assert T.SUMMARY_METRIC == {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "piqa": "acc_norm",
                                "hellaswag": "acc_norm", "boolq": "acc", "winogrande": "acc",
                                "openbookqa": "acc_norm"}
    with pytest.raises(ConfigError, match="unknown task 'arc'.*known tasks: wikitext, arc_easy"):
        T.get_task("arc")
    with pytest.raises(ConfigError, match="limit 0 must be >= 1"):
        T.load_docs("piqa", tmp_path, limit=0)
    with pytest.raises(DataError, match="piqa.jsonl not found"):
        T.load_docs("piqa", tmp_path)


def _write(tmp_path, task, lines):
    d = tmp_path / "zeroshot"
    d.mkdir(exist_ok=True)
    (d / f"{task}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_malformed_jsonl_names_file_line_and_field(tmp_path):
    good = json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0})
    dd = _write(tmp_path, "piqa", [good, json.dumps({"goal": "g", "sol1": "a", "label": 1})])
    with pytest.raises(DataError, match=r"piqa.jsonl:2: missing field 'sol2'"):
        T.load_docs("piqa", dd)
    dd = _write(tmp_path, "piqa", [good, "{not json"])
    with pytest.raises(DataError, match=r"piqa.jsonl:2: not valid JSON"):
        T.load_docs("piqa", dd)
    # --limit reads only the first items: a bad line after them is not parsed
    docs, n_total = T.load_docs("piqa", dd, limit=1)
    assert len(docs) == 1 and n_total == 2
    arc = {"question": {"stem": "s", "choices": [{"text": "a", "label": "A"}]}, "answerKey": "B"}
    dd = _write(tmp_path, "arc_easy", [json.dumps(arc)])
    with pytest.raises(DataError, match=r"arc_easy.jsonl:1: answerKey 'B' is not one of"):
        T.load_docs("arc_easy", dd)


def test_prompt_formats(tmp_path):
    recs = {
        "arc_easy": {"question": {"stem": "Why?", "choices": [{"text": "A1", "label": "1"},
                                                             {"text": "B1", "label": "2"}]}, "answerKey": "2"},
        "openbookqa": {"question": {"stem": "Fog is", "choices": [{"text": "x", "label": "A"},
                                                                 {"text": "y", "label": "B"}]}, "answerKey": " A"},
        "piqa": {"goal": "Open jar", "sol1": "twist", "sol2": "smash", "label": 0},
        "hellaswag": {"query": "Act: he", "endings": ["runs.", "sits."], "label": 1},
        "boolq": {"question": "is it", "title": "T", "answer": True, "passage": "P."},
        "winogrande": {"sentence": "A beat B so _ won.", "option1": "A", "option2": "B", "answer": "1"},
    }
    for task, rec in recs.items():
        _write(tmp_path, task, [json.dumps(rec)])
    doc = lambda t: T.load_docs(t, tmp_path)[0][0]
    assert doc("arc_easy") == T.MCDoc(("Question: Why?\nAnswer:",) * 2, (" A1", " B1"), ("A1", "B1"), 1, 1)
    assert doc("openbookqa").contexts[0] == "Fog is" and doc("openbookqa").gold == 0
    assert doc("piqa").contexts[0] == "Question: Open jar\nAnswer:"
    assert doc("hellaswag").continuations == (" runs.", " sits.") and doc("hellaswag").gold == 1
    assert doc("boolq") == T.MCDoc(("T -- P.\nQuestion: is it?\nAnswer:",) * 2, (" no", " yes"), ("no", "yes"), 1, 1)
    w = doc("winogrande")
    assert w.contexts == ("A beat B so A", "A beat B so B") and w.continuations == (" won.", " won.")
    assert w.gold == 0


@pytest.mark.real_data
def test_real_tasks_limit_deterministic(tiny, tok, data_dir):
    for task in T.TASKS:
        r = evaluate_task(tiny, tok, task, data_dir=data_dir, limit=2, batch_size=4)
        assert r["dataset"]["n_items"] == 2 and r["dataset"]["n_total"] > 100
        assert set(r["metrics"]) == {f"{m}{s}" for m in T.TASKS[task].metrics for s in ("", "_stderr")}
        assert r["summary_metric"] == T.SUMMARY_METRIC[task]
        assert "accuracy" not in r["metrics"]
    a = evaluate_task(tiny, tok, "arc_challenge", data_dir=data_dir, limit=3, keep_items=True)
    b = evaluate_task(tiny, tok, "arc_challenge", data_dir=data_dir, limit=3, batch_size=1, keep_items=True)
    assert [i["line"] for i in a["items"]] == [1, 2, 3]
    for x, y in zip(a["items"], b["items"]):
        assert x["lls"] == pytest.approx(y["lls"], abs=1e-4)


def test_gumbel_mode_is_evaluated_deterministically(routed, tok):
    docs = [_doc("Question: why?\nAnswer:", ["because", "no reason at all"], 0)]
    ref = score_docs(routed, tok, docs)
    routed.wide_routing.set_mode("gumbel")
    assert score_docs(routed, tok, docs) == ref
    assert routed.wide_routing.mode == "gumbel"  # restored
