"""Atomic writes: a file or a directory appears complete or not at all (temp path + rename)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes it 0600; others may read it
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj) -> None:
    """Atomically write ``obj`` as pretty JSON (sorted keys are not forced; order is kept)."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, default=str) + "\n").encode())


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Atomically write ``tensors`` (``{name: torch.Tensor}``, contiguous, no shared storage) as a
    safetensors file, serialised in memory first (for small files: routers, adapters)."""
    from safetensors.torch import save

    atomic_write_bytes(Path(path), save(tensors, metadata=metadata))


@contextlib.contextmanager
def atomic_directory(final: Path):
    """Build a directory at a temp path beside ``final``; on success swap it into place.

    The temp directory is named ``.<name>.partial-<host>-<pid>-<random>``; temp directories that a
    killed process (same host, pid no longer alive) left beside ``final`` are removed first.

    Yields the temp ``Path`` to write into. On an exception the temp directory is removed and
    any previous ``final`` is left untouched. An existing ``final`` is replaced only after the new
    one is complete (it is moved aside, the new one renamed in, then the old one deleted).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-{_owner()}-", dir=final.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; an export is read by other users
        yield tmp
        mask = _umask()
        for q in tmp.rglob("*"):  # writers (safetensors, mkstemp) create private 0600 files
            os.chmod(q, (0o777 if q.is_dir() else 0o666) & ~mask)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{_owner()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _owner() -> str:
    import socket

    return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(final: Path) -> list[Path]:
    """Delete ``.<name>.partial-*`` / ``.<name>.old-*`` directories beside ``final`` left by
    processes of this host that no longer run (SIGKILL, power loss). Returns what was removed.
    A dead process's ``.old-*`` copy is restored as ``final`` when ``final`` is missing (the
    process died in the middle of the swap).
    Directories of live processes, of other hosts (shared file systems) and older unnamed
    formats are left alone."""
    import socket

    host = socket.gethostname().replace("-", "_")
    removed = []
    final = Path(final)
    for kind in ("old", "partial"):
        prefix = f".{final.name}.{kind}-{host}-"
        for d in sorted(final.parent.iterdir()):
            if not (d.name.startswith(prefix) and d.is_dir()):
                continue
            pid = d.name[len(prefix):].split("-")[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            if kind == "old" and not final.exists():
                # killed between moving the previous copy aside and renaming the new one in: the
                # previous copy is the only complete one; put it back
                os.replace(d, final)
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _umask() -> int:
    """The process umask: from /proc (Linux) without changing it, else by setting and restoring."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask
