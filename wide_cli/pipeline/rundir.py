"""The run directory (DESIGN.md §2): ``run.json``, ``calibration/``, ``stage1/``, ``stage2/``,
``eval/``; one writer at a time (a lock file)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from wide_cli.artifacts import RUN_FORMAT_VERSION, check_format_version
from wide_cli.atomic import atomic_write_json
from wide_cli.errors import CheckpointError
from wide_cli.filenames import RUN_JSON
from wide_cli.version import __version__

LOCK = ".lock"


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory."""

    root: Path

    @property
    def calibration(self) -> Path:
        return self.root / "calibration"

    @property
    def stage1(self) -> Path:
        return self.root / "stage1"

    @property
    def stage2(self) -> Path:
        return self.root / "stage2"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def default_export(self) -> Path:
        return self.root / "export"

    def read_run(self) -> dict | None:
        """``run.json`` (None when the directory holds no run yet).

        Raises:
            CheckpointError: not JSON, or written by a newer wide (``check_format_version``).
        """
        p = self.root / RUN_JSON
        if not p.is_file():
            return None
        try:
            doc = json.loads(p.read_text())
        except ValueError as e:
            raise CheckpointError(f"{p} is corrupt ({e})", "delete the run directory to start over") from None
        if not isinstance(doc, dict):
            raise CheckpointError(f"{p} is corrupt (not a JSON object)", "delete the run directory to start over")
        check_format_version(doc, RUN_FORMAT_VERSION, p)
        return doc


def model_identity(loaded) -> dict:
    """What identifies the model of a run: the spec, its resolved source and revision."""
    return {"spec": loaded.source, "resolved_dir": str(loaded.local_dir), "revision": loaded.revision}


def record_run(run: RunDir, settings_dict: dict, model_id: dict, *, resume: bool) -> None:
    """Create ``run.json`` or check it: a run dir belongs to one model.

    Raises:
        CheckpointError: the directory holds a run of a different model (on ``--resume``, or
            whenever stages of a run are mixed).
    """
    run.root.mkdir(parents=True, exist_ok=True)
    old = run.read_run()
    if old is not None and old.get("model", {}).get("revision") != model_id.get("revision") or (
        old is not None and old.get("model", {}).get("spec") != model_id.get("spec")
    ):
        raise CheckpointError(
            f"run dir {run.root} belongs to model {old['model'].get('spec')!r} "
            f"(revision {old['model'].get('revision')}), not {model_id.get('spec')!r}",
            "use another --run-dir for this model",
        )
    atomic_write_json(
        run.root / RUN_JSON,
        {"format_version": RUN_FORMAT_VERSION, "wide_version": __version__, "model": model_id, "settings": settings_dict},
    )


@contextlib.contextmanager
def run_lock(run: RunDir):
    """Hold ``<run>/.lock`` for the duration; a second writer gets CheckpointError.

    A lock left by a process that no longer exists is taken over.
    """
    run.root.mkdir(parents=True, exist_ok=True)
    path = run.root / LOCK
    for _ in range(2):
        if _create_lock(path):
            break
        try:
            pid = int(path.read_text().strip() or 0)
        except (ValueError, OSError):
            pid = 0
        if pid and pid != os.getpid() and _alive(pid):
            raise CheckpointError(
                f"run dir {run.root} is in use by process {pid}",
                "wait for it to finish or use another --run-dir",
            ) from None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        raise CheckpointError(f"cannot lock run dir {run.root}")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def rank0_lock(run):
    """Hold the run directory's lock on rank 0 for the block (every process runs it).

    Only rank 0 writes, so only it locks; when it cannot (another job holds the run), every
    rank raises the same CheckpointError instead of the others waiting in a collective.
    """
    import torch

    from wide_cli.train.distributed import dist_info

    info = dist_info()
    if not info.enabled:
        with run_lock(run):
            yield
        return
    with contextlib.ExitStack() as stack:
        msg = [None]
        if info.is_main:
            try:
                stack.enter_context(run_lock(run))
            except CheckpointError as e:
                msg = [str(e)]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(msg, src=0)
        if msg[0] is not None:
            raise CheckpointError(msg[0])
        yield


def _create_lock(path: Path) -> bool:
    """Create ``path`` holding our pid, atomically: the lock never exists empty, so another
    process can never mistake a lock being written for a stale one. False if it exists.

    The pid goes to a private temp file that is hard-linked to ``path`` (``link`` fails if the
    target exists). Filesystems without hard links fall back to O_EXCL create + write.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(str(os.getpid()))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
