"""Cross-check against lm-evaluation-harness itself (marker ``harness``).

The harness builds the requests from its own task yamls (fed our local records through
``custom_dataset``) and scores them with ``HFLM`` on the same tiny fp32 model. Our prompts must be
identical strings, our log-likelihoods equal to 1e-6 (relative), and our per-item acc / acc_norm
and wikitext words/bytes identical to the harness's ``process_results``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness (lm_eval) cannot be imported")
try:
    import datasets
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks._yaml_loader import load_yaml
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # a harness version with another layout
    pytest.skip(f"lm_eval internals needed for the cross-check are missing: {e}", allow_module_level=True)

from wide_cli.eval import tasks as T
from wide_cli.eval import wikitext
from wide_cli.eval.perplexity import rolling_perplexity, rolling_windows
from wide_cli.eval.zeroshot import mc_metrics, score_docs

pytestmark = pytest.mark.harness

TASK_DIR = Path(lm_eval.__file__).parent / "tasks"
MAX_LEN = 256  # zero-shot: long boolq passages exercise the harness's left truncation
ROLL_LEN = 64  # rolling: many windows per page, and a short last window
N_ITEMS = 3


def _hf_layout(task: str, rec: dict) -> dict:
    """Our staged record -> the Hugging Face dataset layout the harness yaml expects."""
    if task in ("arc_easy", "arc_challenge", "openbookqa"):
        ch = rec["question"]["choices"]
        out = {"id": rec["id"], "answerKey": rec["answerKey"],
               "choices": {"text": [c["text"] for c in ch], "label": [c["label"] for c in ch]}}
        out["question" if task != "openbookqa" else "question_stem"] = rec["question"]["stem"]
        return out
    if task == "boolq":  # SuperGLUE layout (PROVENANCE.md)
        return {"question": rec["question"], "passage": f"{rec['title']} -- {rec['passage']}",
                "idx": 0, "label": int(rec["answer"])}
    if task == "hellaswag":  # the harness's process_docs output; the staged file is already processed
        return {"query": rec["query"], "choices": rec["endings"], "label": str(rec["label"])}
    return rec


def _harness_task(yaml_rel: str, docs: list[dict], **overrides) -> ConfigurableTask:
    cfg = load_yaml(TASK_DIR / yaml_rel)
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list(docs) for s in ("train", "validation", "test")})
    cfg.update(custom_dataset=lambda **kw: dd, **overrides)
    return ConfigurableTask(config=cfg)


@pytest.fixture(scope="module")
def model_and_tok():
    from wide_cli.models.tiny import char_tokenizer, tiny_model

    return tiny_model(seed=0), char_tokenizer()


@pytest.fixture(scope="module")
def hflm(model_and_tok):
    model, tok = model_and_tok
    return HFLM(pretrained=model, tokenizer=tok, batch_size=4, max_length=MAX_LEN)


@pytest.fixture(scope="module")
def hflm_rolling(model_and_tok):
    model, tok = model_and_tok
    return HFLM(pretrained=model, tokenizer=tok, batch_size=4, max_length=ROLL_LEN)


@pytest.mark.parametrize("task", list(T.TASKS))
def test_zero_shot_matches_harness(task, data_dir, model_and_tok, hflm, tmp_path):
    model, tok = model_and_tok
    spec = T.TASKS[task]
    with open(data_dir / "zeroshot" / spec.file) as fh:
        recs = [json.loads(next(fh)) for _ in range(N_ITEMS)]
    overrides = {"process_docs": None} if task == "hellaswag" else {}
    ht = _harness_task(spec.harness, [_hf_layout(task, r) for r in recs], **overrides)
    ours, _ = T.load_docs(task, data_dir, limit=N_ITEMS)
    our_lls = score_docs(model, tok, ours, batch_size=4, max_length=MAX_LEN)
    metrics = mc_metrics(ours, our_lls, spec.metrics)["items"]
    for i, doc in enumerate(ht.eval_docs):
        reqs = ht.construct_requests(doc, ht.fewshot_context(doc, 0), metadata=(task, i, 1))
        assert [r.args for r in reqs] == list(zip(ours[i].contexts, ours[i].continuations))
        res = hflm.loglikelihood(reqs, disable_tqdm=True)
        assert [ll for ll, _ in res] == pytest.approx(our_lls[i], rel=1e-6, abs=1e-6)
        hr = ht.process_results(doc, res)
        assert hr["acc"] == (1.0 if metrics[i]["pred"] == ours[i].gold else 0.0)
        if "acc_norm" in spec.metrics:
            assert hr["acc_norm"] == (1.0 if metrics[i]["pred_norm"] == ours[i].gold else 0.0)


def test_rolling_windows_match_harness():
    toks = list(range(3, 3 + 157))
    for L in (1, 2, 16, 64, 157, 200):
        ref = [make_disjoint_window(w) for w in get_rolling_token_windows(toks, 1, L, 1)]
        assert rolling_windows(toks, 1, L) == [(list(a), list(b)) for a, b in ref]


def _pages() -> list[str]:
    data_dir = Path(__file__).resolve().parents[2].parent / "shared" / "data"  # <repo root>/../shared/data
    if (data_dir / "wikitext-2-raw").is_dir():
        return wikitext.documents(wikitext.read_raw(data_dir, "test"), limit=2)
    return [" = T = \n \n A b , c @-@ d . \n \n = = S = = \n \n e ' f ' g ( h ) \n" * 8, " = U = \n x y \n"]


def test_wikitext_rolling_matches_harness(model_and_tok, hflm_rolling):
    """lm-eval's own wikitext task (fed our pages) vs ``rolling_perplexity``: same strings scored,
    same per-document log-likelihood, same words and bytes."""
    model, tok = model_and_tok
    pages = _pages()
    ht = _harness_task("wikitext/wikitext.yaml", [{"page": p} for p in pages])
    ours = rolling_perplexity(model, tok, pages, max_length=ROLL_LEN, batch_size=4,
                              detokenize=wikitext.wikitext_detokenizer)
    words = nbytes = 0
    for i, doc in enumerate(ht.eval_docs):
        req = ht.construct_requests(doc, ht.fewshot_context(doc, 0), metadata=("wikitext", i, 1))
        req = req[0] if isinstance(req, list) else req
        assert req.args == (wikitext.wikitext_detokenizer(pages[i]),)
        (ll,) = hflm_rolling.loglikelihood_rolling([req], disable_tqdm=True)
        assert ours["per_document_loglikelihood"][i] == pytest.approx(ll, rel=1e-6)
        pr = ht.process_results(doc, [ll])
        words += pr["word_perplexity"][1]
        nbytes += pr["byte_perplexity"][1]
    assert (ours["n_words"], ours["n_bytes"]) == (words, nbytes)


def test_detokenizer_identical(data_dir):
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer as ref

    for page in wikitext.documents(wikitext.read_raw(data_dir, "test")):
        assert wikitext.wikitext_detokenizer(page) == ref({"page": page})


def test_harness_default_max_length(model_and_tok):
    from wide_cli.eval.scoring import resolve_max_length

    model, tok = model_and_tok
    assert resolve_max_length(model, tok) == HFLM(pretrained=model, tokenizer=tok).max_length

