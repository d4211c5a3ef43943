"""atomic_directory: stale temp directories of dead processes are removed, live ones kept."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from wide_cli.atomic import atomic_directory, remove_stale_temps


def test_stale_partial_dirs_of_dead_processes_are_removed(tmp_path):
    host = socket.gethostname().replace("-", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that has exited
    final = tmp_path / "export"
    stale = tmp_path / f".export.partial-{host}-{dead}-abc"
    live = tmp_path / f".export.partial-{host}-{os.getpid()}-def"
    other_host = tmp_path / f".export.partial-elsewhere-{dead}-ghi"
    other_name = tmp_path / f".exportB.partial-{host}-{dead}-jkl"
    for d in (stale, live, other_host, other_name):
        d.mkdir()
    with atomic_directory(final) as tmp:
        (tmp / "f").write_text("x")
        assert tmp.name.startswith(f".export.partial-{host}-{os.getpid()}-")
    assert (final / "f").read_text() == "x"
    assert not stale.exists() and live.exists() and other_host.exists() and other_name.exists()
    assert remove_stale_temps(final) == []


def test_killed_mid_swap_restores_the_previous_copy(tmp_path):
    host = socket.gethostname().replace("-", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    final = tmp_path / "checkpoint"
    old = tmp_path / f".checkpoint.old-{host}-{dead}"
    old.mkdir()
    (old / "state.json").write_text("previous")
    (tmp_path / f".checkpoint.partial-{host}-{dead}-x").mkdir()  # the new copy, maybe incomplete
    assert remove_stale_temps(final) == [tmp_path / f".checkpoint.partial-{host}-{dead}-x"]
    assert (final / "state.json").read_text() == "previous" and not old.exists()
