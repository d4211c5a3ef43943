"""Two writers on one run directory: the second refuses (``<run>/.lock``), and the first one's
work is unharmed."""

from __future__ import annotations

import multiprocessing as mp
import os
import textwrap
import time

# `wide export` that pauses just before writing its manifest until a release file appears:
# the run lock is held for as long as the test needs, deterministically.
_PAUSED_EXPORT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import wide_cli.export.writer as w
    marker, release = Path(sys.argv[1]), Path(sys.argv[2])
    real = w.write_manifest
    def pause(root, **kw):
        marker.write_text(str(root))
        while not release.exists():
            time.sleep(0.05)
        return real(root, **kw)
    w.write_manifest = pause
    sys.argv = ["wide"] + sys.argv[3:]
    from wide_cli.cli.app import run
    run()
""")


def test_second_run_on_the_same_run_dir_refuses(tmp_path, wide, trained_run, fault):
    run = wide.copy_run(trained_run, tmp_path / "run")
    marker, release = tmp_path / "paused", tmp_path / "release"
    first = wide.Process([str(marker), str(release), "export", "--run-dir", str(run)], code=_PAUSED_EXPORT)
    first.wait_for(marker.exists)
    before = sorted(p.name for p in (run / "stage1").iterdir())
    others = [wide.Process(["train", "--run-dir", str(run), "--steps", "3"]),
              wide.Process(["export", "--run-dir", str(run), "--format", "hf"])]
    codes = [p.finish() for p in others]
    release.write_text("go")
    rc1 = first.finish()
    assert rc1 == 0, first.tail()
    msg = f"in use by process {first.proc.pid}"
    refused = codes == [2, 2] and all(p.errors() and msg in p.errors()[-1] for p in others)
    from wide_cli.export import load_pruned

    pm = load_pruned(run / "export")  # the first writer's export is complete and valid
    intact = sorted(p.name for p in (run / "stage1").iterdir()) == before and pm.wide_config["export_format"] == "wide"
    fault("second and third writer on the same --run-dir", f"train and export refused ({msg}); the first "
          "writer's export completed and loads", intact and refused)
    assert refused, [p.tail() for p in others]
    assert intact


def _hold_lock(run_root, slow: bool, out, hold_s: float):
    """Child: take the run lock (optionally slow between creating the lock file and filling it
    with our pid) and hold it for ``hold_s``; write 'held' or the error to ``out``."""
    from pathlib import Path

    from wide_cli.errors import CheckpointError
    from wide_cli.pipeline import rundir

    if slow:  # widen the window between "lock file exists" and "lock file names its owner"
        real_write, real_link = os.write, getattr(os, "link", None)

        def slow_write(fd, data):
            time.sleep(1.0)
            return real_write(fd, data)

        def slow_link(src, dst, *a, **k):
            time.sleep(1.0)
            return real_link(src, dst, *a, **k)

        os.write = slow_write
        if real_link is not None:
            os.link = slow_link
    try:
        with rundir.run_lock(rundir.RunDir(Path(run_root))):
            Path(out).write_text("held")
            time.sleep(hold_s)
    except CheckpointError as e:
        Path(out).write_text(f"refused: {e}")


def test_lock_is_never_taken_over_while_its_owner_is_writing_it(tmp_path, fault):
    """Process A creates the lock and is slow to write its pid into it; process B arrives in
    that window. B must not treat the (still empty) lock as stale: exactly one may hold it."""
    ctx = mp.get_context("fork")
    a = ctx.Process(target=_hold_lock, args=(tmp_path / "run", True, tmp_path / "a", 2.0))
    a.start()
    t0 = time.monotonic()
    while not (tmp_path / "run" / ".lock").exists() and time.monotonic() - t0 < 30:
        time.sleep(0.005)
    b = ctx.Process(target=_hold_lock, args=(tmp_path / "run", False, tmp_path / "b", 0.1))
    b.start()
    b.join(30)
    a.join(30)
    ra, rb = (tmp_path / "a").read_text(), (tmp_path / "b").read_text()
    held = [r for r in (ra, rb) if r == "held"]
    fault("two processes racing for the run lock", f"A: {ra}; B: {rb}".replace(str(tmp_path / "run"), "<run>"),
          len(held) == 1)
    assert ra == "held" and rb.startswith("refused:") and "in use by process" in rb
