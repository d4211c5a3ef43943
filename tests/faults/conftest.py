"""Fault-injection suite (``make faults`` = ``pytest tests/faults``).

Every test injects one fault into a real run on a tiny model (signals to a real ``wide``
process, corrupted files, failing writes, a second writer) and records with the ``fault``
fixture what happened and whether the user's data stayed intact. A table of all faults is
printed at the end of the session (``pytest_terminal_summary``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# nodeid -> {"fault", "outcome", "intact"} as recorded by the test; nodeid -> pytest outcome.
_RECORDS: dict[str, dict] = {}
_RESULTS: dict[str, str] = {}

TINY = ["--seq-len", "32", "--batch-size", "2", "--attn-group-size", "2", "--ffn-group-size", "32"]
STEPS = 200  # ~10 ms each on the tiny model: long enough to interrupt mid-run, short enough to finish
CKPT_EVERY = 25


class FaultRecorder:
    """``fault(name, outcome, intact)``: what a test injected, what happened, data intact?"""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def __call__(self, fault: str, outcome: str, intact: bool) -> None:
        _RECORDS[self.nodeid] = {"fault": fault, "outcome": outcome, "intact": intact}


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _sigint_raises(monkeypatch):
    """In-process tests: SIGINT raises KeyboardInterrupt even when the runner inherited it ignored."""
    import signal

    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def fault(request) -> FaultRecorder:
    return FaultRecorder(request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and not rep.passed):
        _RESULTS[item.nodeid] = rep.outcome


def pytest_terminal_summary(terminalreporter):
    ids = [i for i in _RESULTS if i in _RECORDS or "tests/faults" in i]
    if not ids:
        return
    rows = []
    for nodeid in ids:
        rec = _RECORDS.get(nodeid)
        res = _RESULTS.get(nodeid, "?")
        name = rec["fault"] if rec else nodeid.split("::")[-1]
        if res == "skipped":
            rows.append((name, "skipped", "-"))
        elif res != "passed":
            rows.append((name, f"TEST {res.upper()}" + (f" ({rec['outcome']})" if rec else ""), "no?"))
        else:
            rows.append((name, rec["outcome"] if rec else "passed (not recorded)", "yes" if rec and rec["intact"] else "no"))
    w0 = max(len("fault"), *(len(r[0]) for r in rows))
    w1 = min(90, max(len("outcome"), *(len(r[1]) for r in rows)))
    tr = terminalreporter
    tr.section("fault injection summary")
    tr.write_line(f"{'fault':<{w0}}  {'outcome':<{w1}}  data intact")
    tr.write_line(f"{'-' * w0}  {'-' * w1}  -----------")
    for name, out, intact in rows:
        out = out if len(out) <= w1 else out[: w1 - 1] + "…"
        tr.write_line(f"{name:<{w0}}  {out:<{w1}}  {intact}")


# ----------------------------------------------------------------------------- wide processes
def wide_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.pop("WIDE_DEBUG", None)
    return env


class WideProcess:
    """A ``python -m wide_cli ...`` child whose stderr lines are collected by a thread."""

    def __init__(self, args: list[str], *, code: str | None = None, cwd=None):
        import tempfile

        cwd = cwd or tempfile.gettempdir()  # never the repository: a stray relative path lands there
        cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "wide_cli", *args]
        # A job started in the background of a non-interactive shell inherits SIGINT ignored, and
        # Python then keeps it ignored: give the child the default disposition, as a terminal would.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=wide_env(),
                                     cwd=cwd, preexec_fn=_default_sigint)  # noqa: PLW1509 - the test process starts no threads before this
        self.lines: list[str] = []
        self.stdout = ""
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate, timeout: float = 180.0) -> None:
        """Wait until ``predicate()`` is true (fails if the process exits first)."""
        t0 = time.monotonic()
        while not predicate():
            if self.proc.poll() is not None:
                self._t.join(5)
                pytest.fail(f"process exited with {self.proc.returncode} before the fault point:\n" + self.tail())
            if time.monotonic() - t0 > timeout:
                self.proc.kill()
                pytest.fail("timed out waiting for the fault point:\n" + self.tail())
            time.sleep(0.01)

    def wait_line(self, text: str, timeout: float = 180.0) -> None:
        self.wait_for(lambda: any(text in line for line in self.lines), timeout)

    def finish(self, timeout: float = 300.0) -> int:
        self.stdout = self.proc.stdout.read() if self.proc.stdout else ""
        rc = self.proc.wait(timeout)
        self._t.join(5)
        return rc

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.lines[-n:])

    def errors(self) -> list[str]:
        return [line for line in self.lines if line.startswith("error: ")]


def run_wide(args: list[str], **kw) -> tuple[int, WideProcess]:
    p = WideProcess(args, **kw)
    return p.finish(), p


# ----------------------------------------------------------------------------- shared runs
@pytest.fixture(scope="session")
def train_text(tmp_path_factory) -> Path:
    import pydoc_data.topics as t

    docs = [v for _, v in sorted(t.topics.items())][:6]
    p = tmp_path_factory.mktemp("faults-data") / "train.txt"
    p.write_text("\n\n".join(d[:3000] for d in docs))
    return p


@pytest.fixture(scope="session")
def calibrated_run(tmp_path_factory, train_text) -> Path:
    """A calibrated tiny-llama run directory (in-process; copy it before writing to it)."""
    from wide_cli.cli.app import main

    run = tmp_path_factory.mktemp("faults-runs") / "calibrated"
    assert main(["calibrate", "tiny-llama", "--run-dir", str(run), "--data", str(train_text), *TINY]) == 0
    return run


@pytest.fixture(scope="session")
def reference_routers(tmp_path_factory, calibrated_run) -> dict:
    """Final stage-1 routers of an uninterrupted ``wide train`` (a real child process)."""
    from safetensors.torch import load_file

    run = tmp_path_factory.mktemp("faults-ref") / "run"
    shutil.copytree(calibrated_run, run)
    rc, p = run_wide(["train", "--run-dir", str(run), "--steps", str(STEPS), "--checkpoint-every", str(CKPT_EVERY)])
    assert rc == 0, p.tail()
    return load_file(str(run / "stage1" / "routers.safetensors"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, calibrated_run) -> Path:
    """A run with briefly trained routers (in-process; copy it before writing to it)."""
    from wide_cli.cli.app import main

    run = tmp_path_factory.mktemp("faults-trained") / "run"
    shutil.copytree(calibrated_run, run)
    assert main(["train", "--run-dir", str(run), "--steps", "4"]) == 0
    return run


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="session")
def wide():
    """The helpers above, for the test modules (conftest is not importable by name)."""
    from types import SimpleNamespace

    return SimpleNamespace(Process=WideProcess, run=run_wide, copy_run=copy_run, same_tensors=same_tensors,
                           TINY=TINY, STEPS=STEPS, CKPT_EVERY=CKPT_EVERY)
