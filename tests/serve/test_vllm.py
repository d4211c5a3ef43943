"""The plugin inside vLLM (CPU build, serving venv): greedy tokens equal the runtime's reference
backend, routed and with every group on (= the dense model); the OpenAI server answers
concurrent requests like sequential ones, and survives bad requests.

Each test module starts vLLM as few times as it can: one offline engine per architecture (routed,
then all groups on, in the same engine) and one server for every HTTP test. Skipped by `make test`;
`make test-serving` runs them.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.serving

PROMPTS = [[10, 20, 30], [5, 6, 7, 8, 9, 11, 12, 13, 14], list(range(40, 57)), [(7 * i) % 100 + 5 for i in range(40)]]
MAX_TOKENS = 16
#: Llama 3 RoPE scaling (its low frequencies rescaled, at every position).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
STARTUP_S = 900


def _serve_python() -> str:
    py = os.environ.get("WIDE_SERVE_PYTHON")
    assert py and os.path.isfile(py), "WIDE_SERVE_PYTHON must point at the serving venv's python (make test-serving)"
    return py


def _reference(export, routing: bool) -> list[list[int]]:
    """`wide generate --backend reference` on token-id prompts (greedy, EOS ignored)."""
    from wide_cli.runtime.engine import Runtime

    rt = Runtime.from_export(export, backend="reference", dtype="fp32", routing=routing)
    return rt.generate(PROMPTS, max_new_tokens=MAX_TOKENS, ignore_eos=True).tokens


# ------------------------------------------------------------------------------------- offline


@pytest.fixture(scope="module")
def offline(export_factory, tmp_path_factory):
    """``(kind, method, **features) -> (export, result)``: one vLLM engine per model, both modes."""
    done = {}

    def run(kind: str, method: str = "wide", export_format: str = "wide", **features):
        key = (kind, method, export_format, json.dumps(features, sort_keys=True))
        if key not in done:
            export = export_factory(kind, export_format, method=method, **features)
            d = tmp_path_factory.mktemp(f"offline-{kind}")
            req = {"export": str(export), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "dtype": "float32",
                   "max_model_len": 128, "modes": ["routed", "all-on"], "kv_cache_gib": 1}  # fmt: skip
            (d / "req.json").write_text(json.dumps(req))
            r = subprocess.run([_serve_python(), "-m", "wide_cli.serve.offline", str(d / "req.json"), str(d / "out.json")],
                               capture_output=True, text=True, timeout=STARTUP_S, check=False)  # fmt: skip
            assert r.returncode == 0, r.stderr[-4000:]
            done[key] = (export, json.loads((d / "out.json").read_text()))
        return done[key]

    return run


@pytest.mark.parametrize(
    ("kind", "method", "features"),
    [("llama", "wide", {}), ("mistral", "wide", {"sliding_window": 16}), ("qwen2", "wide", {}),
     ("qwen3", "wide", {}), ("llama", "static-width", {}), ("llama", "wide", {"standin": "trained", "drop_layers": 1}),
     ("llama", "wide", {"standin": "trained", "drop_layers": 1, "export_format": "hf"}), ("llama", "dynamic-depth", {}),
     ("llama", "wide", {"attention_bias": True}), ("llama", "wide", {"rope_parameters": LLAMA3_ROPE})],
    ids=["llama", "mistral-window", "qwen2", "qwen3", "static-width", "standin-hybrid", "standin-hybrid-hf",
         "dynamic-depth", "attention-bias", "llama3-rope"],
)
def test_offline_greedy_tokens_equal_the_reference(offline, kind, method, features):
    """Routed tokens equal the runtime's reference backend; with every group forced on they
    equal the runtime's dense mode (the backbone as a dense model). Mistral with a sliding window
    shorter than the prompts; a hybrid export (a layer removed, then routed) with stand-ins."""
    export, res = offline(kind, method, **features)
    assert res["path"] == "forward_cpu"
    routed, all_on = res["runs"]["routed"], res["runs"]["all-on"]
    assert routed["tokens"] == _reference(export, routing=True)
    assert all_on["tokens"] == _reference(export, routing=False)
    assert routed["tokens"] != all_on["tokens"]  # the routers changed what was computed
    # forward_cpu executed part of the routed projections when routing, all of them when not
    for module in ("attention", "ffn"):
        st = routed["stats"][module]
        assert 0 < st["executed"] < st["dense"], (module, st)
        assert all_on["stats"][module]["executed"] == all_on["stats"][module]["dense"] > 0


def test_offline_static_depth_export_is_vllms_own_model_with_the_reference_tokens(offline):
    """A static-depth export (no routers: a plain model with fewer layers) is served by vLLM's
    own class, and gives the reference backend's tokens."""
    export, res = offline("llama", "static-depth")
    assert res["runs"]["routed"]["tokens"] == _reference(export, routing=True)
    assert res["runs"]["routed"]["stats"]["ffn"]["dense"] == 0  # no routed op ran


def test_plugin_refuses_a_feature_its_row_lacks_when_the_model_is_built(export_factory):
    """The plugin checks its row of the feature table itself (vLLM started without `wide serve`'s
    preflight): int8 weights are refused naming the file and the feature."""
    export = export_factory("llama", weight_format="int8")
    code = (
        "import sys\n"
        "from transformers import AutoConfig\n"
        "from wide_cli.features import UnsupportedFeature\n"
        "from wide_cli.serve.vllm_models import check_served_features\n"
        "try:\n"
        "    check_served_features(AutoConfig.from_pretrained(sys.argv[1]), sys.argv[1])\n"
        "except UnsupportedFeature as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([_serve_python(), "-c", code, str(export)], capture_output=True, text=True, timeout=300,
                       check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith(
        f"{export / 'wide_config.json'}: int8 weights (wide export --weights int8) [weights_int8] is not supported "
        "by the wide vLLM plugin (")


# -------------------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVED = {"standin": "trained", "drop_layers": 1}


@pytest.fixture(scope="module")
def server(export_factory):
    """`wide serve` on an --format hf Qwen2 export (q/k/v bias, trust_remote_code), a hybrid with
    stand-ins (a layer removed, then routed), on 127.0.0.1."""
    export = export_factory("qwen2", "hf", **SERVED)
    port = _free_port()
    env = {**os.environ, "WIDE_SERVE_PYTHON": _serve_python()}
    cmd = [sys.executable, "-m", "wide_cli", "serve", str(export), "--port", str(port), "--dtype", "float32",
           "--max-model-len", "128", "--served-model-name", "tiny", "--kv-cache-gib", "1"]  # fmt: skip
    log = open(export.parent / "server.log", "w")  # noqa: SIM115 -- open for the fixture's lifetime
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(p.stdout.readline()), daemon=True).start()
    try:
        url = lines.get(timeout=STARTUP_S).strip()
    except queue.Empty:
        url = ""
    try:
        assert url == f"http://127.0.0.1:{port}/v1", (export.parent / "server.log").read_text()[-4000:]
        yield url, export
    finally:
        p.terminate()  # SIGTERM: wide serve stops the whole server group
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


TEXTS = ["def f(x):", "Hello", "The cat", "0123456789", "import os", "a b c d e", "[1, 2, 3]", "Zebra!"]


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def _completion(url: str, prompt: str) -> list[int]:
    """Greedy completion: the generated token ids."""
    code, r = _post(url + "/completions", {"model": "tiny", "prompt": prompt, **GREEDY})
    assert code == 200, r
    assert len(r["choices"][0]["token_ids"]) == MAX_TOKENS
    return r["choices"][0]["token_ids"]


def _chat(url: str, prompt: str) -> list[int]:
    code, r = _post(url + "/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": prompt}], **GREEDY})
    assert code == 200, r
    assert len(r["choices"][0]["token_ids"]) == MAX_TOKENS and isinstance(r["choices"][0]["message"]["content"], str)
    return r["choices"][0]["token_ids"]


@pytest.mark.parametrize("endpoint", [_completion, _chat], ids=["completions", "chat"])
def test_eight_concurrent_requests_equal_sequential_ones(server, endpoint):
    url, _ = server
    sequential = [endpoint(url, t) for t in TEXTS]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda t: endpoint(url, t), TEXTS))
    assert concurrent == sequential
    assert len({tuple(t) for t in sequential}) > 1


def test_server_completion_equals_the_reference(server):
    from wide_cli.runtime.engine import Runtime

    url, export = server
    rt = Runtime.from_export(export, backend="reference", dtype="fp32")
    ref = rt.generate(TEXTS[:2], max_new_tokens=MAX_TOKENS, ignore_eos=True)
    assert [_completion(url, t) for t in TEXTS[:2]] == ref.tokens


def test_bad_requests_get_vllms_error_and_the_server_keeps_serving(server):
    url, _ = server
    code, r = _post(url + "/completions", {"model": "tiny", "prompt": "x" * 300, "max_tokens": 4})
    assert code == 400 and "128" in r["error"]["message"], r  # longer than --max-model-len
    code, r = _post(url + "/completions", {"model": "nope", "prompt": "Hello", "max_tokens": 4})
    assert code == 404 and "nope" in r["error"]["message"], r
    assert _completion(url, "Hello") == _completion(url, "Hello")


# ------------------------------------------------------------------------------- real clients

#: What a user's own client script runs against the server (the serving venv has ``openai``).
OPENAI_CLIENT = """
import json, sys
from openai import OpenAI
url, texts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
client = OpenAI(base_url=url, api_key="unused")
greedy = dict(max_tokens=n, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
out = {"completions": [], "chat": []}
for t in texts:
    r = client.completions.create(model="tiny", prompt=t, **greedy)
    out["completions"].append({"ids": r.choices[0].model_extra["token_ids"], "text": r.choices[0].text,
                               "completion_tokens": r.usage.completion_tokens})
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": t}], **greedy)
    out["chat"].append({"ids": r.choices[0].model_extra["token_ids"], "text": r.choices[0].message.content})
print(json.dumps(out))
"""


def test_openai_client_completions_and_chat_equal_the_reference(server):
    """The ``openai`` package's client (completions and chat) gets the reference backend's greedy
    tokens and their text."""
    from wide_cli.runtime.engine import Runtime

    url, export = server
    texts = TEXTS[:3]
    r = subprocess.run([_serve_python(), "-c", OPENAI_CLIENT, url, json.dumps(texts), str(MAX_TOKENS)], capture_output=True,
                       text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    rt = Runtime.from_export(export, backend="reference", dtype="fp32")
    ref = rt.generate(texts, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    assert [c["ids"] for c in out["completions"]] == ref.tokens
    assert [c["text"] for c in out["completions"]] == [rt.tokenizer.decode(t) for t in ref.tokens]
    assert all(c["completion_tokens"] == MAX_TOKENS for c in out["completions"])
    # vLLM renders the chat template and tokenizes it without special tokens, as transformers does
    chat_ids = [rt.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True, return_dict=True,
                                                 add_generation_prompt=True)["input_ids"] for t in texts]  # fmt: skip
    chat_ref = rt.generate(chat_ids, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    assert [c["ids"] for c in out["chat"]] == chat_ref.tokens


#: Multiple-choice items in PIQA's layout, short enough for the server's 128-token context (the
#: character tokenizer spends one token per character).
PIQA_ITEMS = [
    {"goal": "dry wet hands", "sol1": "use a towel", "sol2": "use a bucket", "label": 0},
    {"goal": "cut bread", "sol1": "use a spoon", "sol2": "use a knife", "label": 1},
    {"goal": "cool tea", "sol1": "wait a bit", "sol2": "add hot water", "label": 0},
    {"goal": "see at night", "sol1": "close eyes", "sol2": "turn on a lamp", "label": 1},
    {"goal": "open a jar", "sol1": "twist the lid", "sol2": "shake the jar", "label": 0},
]


def test_lm_eval_local_completions_scores_like_wide_eval(server):
    """lm-evaluation-harness's ``local-completions`` model (prompt log-probabilities through
    ``/v1/completions`` with ``echo``) on the harness's own PIQA task, fed local items, against
    `wide eval`'s scoring of the same export and items: the same log-likelihood per choice (fp32,
    1e-3 nats) and the same acc / acc_norm per item."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness (lm_eval) cannot be imported")
    import datasets
    import torch
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks._yaml_loader import load_yaml

    from wide_cli.eval import tasks as T
    from wide_cli.eval.run import load_target
    from wide_cli.eval.zeroshot import mc_metrics, score_docs

    url, export = server
    cfg = load_yaml(os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "piqa", "piqa.yaml"))
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list(PIQA_ITEMS) for s in ("train", "validation", "test")})
    cfg.update(custom_dataset=lambda **kw: dd)
    task = ConfigurableTask(config=cfg)
    lm = LocalCompletionsAPI(base_url=url + "/completions", model="tiny", tokenizer=str(export),
                             tokenizer_backend="huggingface", max_length=128, num_concurrent=2)  # fmt: skip
    harness = []
    for i, doc in enumerate(task.eval_docs):
        reqs = task.construct_requests(doc, task.fewshot_context(doc, 0), metadata=("piqa", i, 1))
        res = lm.loglikelihood(reqs, disable_tqdm=True)
        harness.append(([ll for ll, _ in res], task.process_results(doc, res)))

    target = load_target(str(export), dtype=torch.float32, device="cpu", trust_remote_code=True)
    docs = [T.build_piqa(T._Fields(rec, f"item {i}")) for i, rec in enumerate(PIQA_ITEMS)]
    lls = score_docs(target.model, target.tokenizer, docs, max_length=128)
    items = mc_metrics(docs, lls)["items"]
    for (h_lls, h_res), ours, item, doc in zip(harness, lls, items, docs):
        assert h_lls == pytest.approx(ours, abs=1e-3)
        assert h_res["acc"] == (1.0 if item["pred"] == doc.gold else 0.0)
        assert h_res["acc_norm"] == (1.0 if item["pred_norm"] == doc.gold else 0.0)
