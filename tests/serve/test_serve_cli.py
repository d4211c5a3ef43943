"""`wide serve` without vLLM: what an export tells the plugin, the tensor-parallel refusal, bad
input (one line, non-zero exit), and that no server process outlives `wide serve` (a stand-in
server that answers /health like vLLM's)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wide_cli.errors import CheckpointError, ConfigError, ModelSourceError
from wide_cli.serve.config import check_tensor_parallel, serve_plan

WIDE = [sys.executable, "-m", "wide_cli"]


def _wide(args, env=None, timeout=120):
    return subprocess.run(WIDE + list(map(str, args)), capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})  # fmt: skip


def _error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), r.stderr
    return lines[-1]


# --------------------------------------------------------------------------------------- plans


def test_plan_wide_format_overrides_architecture_and_routing(export_factory):
    path = export_factory("qwen3")
    plan = serve_plan(path)
    wc = json.loads((path / "wide_config.json").read_text())
    assert plan.architecture == "WideQwen3ForCausalLM" and plan.export_format == "wide"
    assert plan.overrides == {
        "architectures": ["WideQwen3ForCausalLM"],
        "wide_routing": {"routing": wc["routing"], "layout": wc["layout"], "serve_mode": "routed"},
    }
    assert not plan.trust_remote_code
    # the export's own config.json stays the base model's (transformers loads it as Qwen3)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert serve_plan(path, mode="all-on").overrides["wide_routing"]["serve_mode"] == "all-on"


def test_plan_hf_format_is_served_as_written(export_factory):
    path = export_factory("llama", "hf")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["WideLlamaForCausalLM"] and "wide_routing" in cfg
    plan = serve_plan(path)
    assert plan.overrides == {} and plan.trust_remote_code and plan.architecture == "WideLlamaForCausalLM"
    assert serve_plan(path, mode="all-on").overrides == {"wide_routing": {**cfg["wide_routing"], "serve_mode": "all-on"}}


def test_plan_refuses_non_exports_and_unsupported_architectures(tmp_path, export_factory):
    with pytest.raises(CheckpointError, match="not a directory"):
        serve_plan(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a wide export"):
        serve_plan(tmp_path / "plain")
    import shutil

    bad = tmp_path / "gpt2"
    shutil.copytree(export_factory("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match="'GPT2LMHeadModel' is not served by the wide vLLM plugin"):
        serve_plan(bad)
    with pytest.raises(ConfigError, match="unknown serve mode"):
        serve_plan(export_factory("llama"), mode="sparse")


def test_plan_takes_stand_in_hybrid_exports(export_factory):
    plan = serve_plan(export_factory("llama", standin="trained", drop_layers=1))
    assert plan.overrides["wide_routing"]["routing"]["standin"] == "trained"
    assert plan.overrides["wide_routing"]["routing"]["drop_layers"] == 1


def test_plan_serves_exports_without_routed_layers_as_vllms_own_model(export_factory):
    plan = serve_plan(export_factory("llama", method="static-depth"))
    assert (plan.architecture, plan.overrides, plan.trust_remote_code) == ("LlamaForCausalLM", {}, False)
    assert json.loads((plan.path / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize(
    ("features", "file", "message"),
    [({"weight_format": "int8"}, "wide_config.json", "int8 weights (wide export --weights int8) [weights_int8]"),
     ({"export_format": "hf", "method": "static-width"}, "config.json",
      "static width physically narrowed per layer (wide_layer_heads) [static_width_compact]"),
     ({"standin": "lowrank:4"}, "wide_config.json",
      "low-rank stand-ins for skipped groups (routing.standin lowrank:R) [lowrank_standins]")],
    ids=["int8", "static-width-hf", "lowrank-standins"],
)
def test_preflight_refuses_what_the_plugin_cannot_run_naming_feature_and_file(export_factory, features, file, message):
    """`wide serve` reads the feature table before vLLM starts: one line, exit 2."""
    export = export_factory("llama", **features)
    r = _wide(["serve", export, "--port", _free_port()], env={"WIDE_SERVE_PYTHON": sys.executable})
    assert r.returncode == 2
    assert _error_line(r).startswith(f"error: {export / file}: {message} is not supported by the wide vLLM plugin (")
    assert "starting vLLM" not in r.stderr


@pytest.mark.parametrize("export_format", ["wide", "hf"])
def test_preflight_refuses_a_gemma3_export_naming_the_layer_and_what_to_use(export_factory, export_format):
    """The plugin has no Gemma 3 layer (sandwich norms, GELU-tanh gating): `wide serve` says so by
    the feature, with the runtime as the way to run it, before vLLM starts (one line, exit 2)."""
    from wide_cli.features import FEATURES, IMPLEMENTATIONS

    export = export_factory("gemma3", export_format)
    r = _wide(["serve", export, "--port", _free_port()], env={"WIDE_SERVE_PYTHON": sys.executable})
    assert r.returncode == 2
    what, file = FEATURES["gemma3_layer"]
    name, fix = IMPLEMENTATIONS["vllm"]
    assert _error_line(r) == f"error: {export / file}: {what} [gemma3_layer] is not supported by {name} ({fix})"
    assert "starting vLLM" not in r.stderr


def test_preflight_follows_the_feature_table(export_factory, monkeypatch):
    from wide_cli import features
    from wide_cli.features import UnsupportedFeature

    export = export_factory("llama", standin="trained")
    monkeypatch.setitem(features.SUPPORT, "vllm", features.SUPPORT["vllm"] - {"standins"})
    with pytest.raises(UnsupportedFeature, match=r"wide_config.json: stand-ins for skipped groups .* \[standins\]"):
        serve_plan(export)


# ------------------------------------------------------------------------------ tensor parallel


SMOLLM2 = {"num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536, "attn_group_size": 3, "ffn_group_size": 128}


def test_tensor_parallel_keeps_groups_on_one_shard():
    check_tensor_parallel(**SMOLLM2, tp=1)
    check_tensor_parallel(**SMOLLM2, tp=3)  # 3 heads (one group) and 512 = 4 x 128 channels per rank
    with pytest.raises(ConfigError, match=r"9 query heads / tp 2 is not a multiple of the attention group size 3.*\[1, 3\]"):
        check_tensor_parallel(**SMOLLM2, tp=2)
    wide_ffn = {"num_heads": 64, "num_kv_heads": 8, "intermediate_size": 14336, "attn_group_size": 4, "ffn_group_size": 256}
    check_tensor_parallel(**wide_ffn, tp=8)  # 1792 = 7 x 256 channels per rank
    with pytest.raises(ConfigError, match="intermediate size 14336 / tp 16 is not a multiple of the FFN group size 256"):
        check_tensor_parallel(**wide_ffn, tp=16)  # 896 channels: 3.5 groups


# ------------------------------------------------------------------------------------ bad input


def test_serve_bad_input_is_one_line(tmp_path, export_factory):
    r = _wide(["serve", tmp_path / "missing"])
    assert r.returncode == 2 and "is not a directory" in _error_line(r)
    r = _wide(["serve", tmp_path])
    assert r.returncode == 2 and "is not a wide export" in _error_line(r)
    r = _wide(["serve", export_factory("llama")], env={"WIDE_SERVE_PYTHON": str(tmp_path / "no-python")})
    line = _error_line(r)
    assert r.returncode == 2 and "make serve-setup" in line and "no-python" in line
    r = _wide(["serve", export_factory("llama"), "--tp", "4"], env={"WIDE_SERVE_PYTHON": sys.executable})
    assert r.returncode == 2 and "tensor-parallel-size 4 would split a routed group" in _error_line(r)


def test_serve_takes_the_projects_dtype_names_and_refuses_others_before_vllm_starts(export_factory):
    from wide_cli.serve.server import vllm_dtype

    assert [vllm_dtype(d) for d in ("fp32", "bf16", "fp16", "float32", "bfloat16", "auto")] == [
        "float32", "bfloat16", "float16", "float32", "bfloat16", "auto"]
    r = _wide(["serve", export_factory("llama"), "--dtype", "fp8"], env={"WIDE_SERVE_PYTHON": sys.executable})
    line = _error_line(r)
    assert r.returncode == 2 and "--dtype 'fp8'" in line and "fp32" in line and "bf16" in line
    assert "starting vLLM" not in r.stderr


def test_serve_refuses_a_port_in_use(export_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _wide(["serve", export_factory("llama"), "--port", port], env={"WIDE_SERVE_PYTHON": sys.executable})
    line = _error_line(r)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


# ------------------------------------------------------------------- process handling (stand-in)

FAKE_SERVER = r'''
import http.server, os, sys, subprocess
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
pids = os.environ["FAKE_PIDS"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine core
with open(pids, "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
if os.environ.get("FAKE_HEALTHY") != "1":
    import time; time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _fake_python(tmp_path: Path) -> Path:
    """An executable standing in for the serving venv's python: runs FAKE_SERVER whatever the
    module arguments say."""
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    exe.chmod(0o755)
    return exe


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(pids, timeout=20.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_start_up_that_never_gets_ready_leaves_nothing_running(tmp_path, export_factory):
    pids = tmp_path / "pids"
    env = {"WIDE_SERVE_PYTHON": str(_fake_python(tmp_path)), "FAKE_PIDS": str(pids)}
    # long enough for the stand-in to start (and write its pids) on a loaded machine
    r = _wide(["serve", export_factory("llama"), "--port", _free_port(), "--startup-timeout", "12"], env=env)
    assert r.returncode == 1 and "was not ready after 12 s" in _error_line(r)
    assert _wait_gone(map(int, pids.read_text().split()))


DYING_SERVER = r'''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an engine core left behind
open(os.environ["FAKE_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(1)
print("INFO 01-01 00:00:00 [core.py:100] Waiting for init message from front-end.", flush=True)
print("(EngineCore pid=7) ERROR 01-01 00:00:01 [core.py:700] EngineCore failed to start.", flush=True)
print("(EngineCore pid=7) Traceback (most recent call last):", flush=True)
print('(EngineCore pid=7)   File "vllm_models.py", line 9, in _load_routers', flush=True)
print("(EngineCore pid=7) ValueError: router tensors do not match the routing settings: missing []", flush=True)
print("Traceback (most recent call last):", file=sys.stderr, flush=True)
print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
      file=sys.stderr, flush=True)
sys.exit(1)
'''


def test_engine_that_dies_is_reported_by_its_own_error_and_leaves_nothing_running(tmp_path, export_factory):
    pids = tmp_path / "pids"
    (tmp_path / "fake_server.py").write_text(DYING_SERVER)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    exe.chmod(0o755)
    r = _wide(["serve", export_factory("llama"), "--port", _free_port()],
              env={"WIDE_SERVE_PYTHON": str(exe), "FAKE_PIDS": str(pids)})
    assert r.returncode == 1
    assert _error_line(r) == ("error: the vLLM server exited during start-up (exit code 1): ValueError: router "
                              "tensors do not match the routing settings: missing [] (the server's full log is above)")
    assert "EngineCore failed to start." in r.stderr  # the log itself still reaches the user
    assert _wait_gone(map(int, pids.read_text().split()))


def test_last_error_line_skips_pointers_and_logging_prefixes():
    from wide_cli.serve.server import last_error_line

    assert last_error_line(["\x1b[1;31mERROR\x1b[0m 01-01 00:00:00 [x.py:1] boom", "all fine"]) == "boom"
    assert last_error_line(["(APIServer pid=1) ERROR 01-01 00:00:00 [api.py:3] something broke"]) == "something broke"
    assert last_error_line(["torch.OutOfMemoryError: no memory", "RuntimeError: see root cause above"]) == (
        "torch.OutOfMemoryError: no memory")
    assert last_error_line(["plain output"]) is None


def test_ctrl_c_prints_nothing_more_and_stops_the_server_group(tmp_path, export_factory):
    pids = tmp_path / "pids"
    port = _free_port()
    env = {**os.environ, "WIDE_SERVE_PYTHON": str(_fake_python(tmp_path)), "FAKE_PIDS": str(pids), "FAKE_HEALTHY": "1"}
    # A shell that starts jobs in the background makes them ignore SIGINT; a terminal would not.
    p = subprocess.Popen(WIDE + ["serve", str(export_factory("llama")), "--port", str(port), "--served-model-name", "tiny"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509  # fmt: skip
    try:
        url = p.stdout.readline().strip()  # printed once /health answers
        assert url == f"http://127.0.0.1:{port}/v1"
        server_pids = list(map(int, pids.read_text().split()))
        assert all(_alive(q) for q in server_pids)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 130
        assert _wait_gone(server_pids)
        err = p.stderr.read()
        assert "as model 'tiny'" in err and err.strip().splitlines()[-1] == "error: interrupted"
    finally:
        if p.poll() is None:
            p.kill()


def test_json_prints_one_object_and_sigterm_stops_the_server_group(tmp_path, export_factory):
    pids = tmp_path / "pids"
    port = _free_port()
    env = {**os.environ, "WIDE_SERVE_PYTHON": str(_fake_python(tmp_path)), "FAKE_PIDS": str(pids), "FAKE_HEALTHY": "1"}
    export = export_factory("llama")
    p = subprocess.Popen(WIDE + ["serve", str(export), "--port", str(port), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        info = json.loads(p.stdout.readline())
        assert info == {"url": f"http://127.0.0.1:{port}/v1", "model": export.name, "export": str(export),
                        "architecture": "WideLlamaForCausalLM", "routing": True}  # fmt: skip
        server_pids = list(map(int, pids.read_text().split()))
        p.terminate()
        assert p.wait(timeout=60) == 130
        assert _wait_gone(server_pids)
        assert p.stdout.read() == ""
    finally:
        if p.poll() is None:
            p.kill()
