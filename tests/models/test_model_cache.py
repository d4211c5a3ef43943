"""Model-cache entries are published atomically (``wide_cli.atomic``): complete or absent."""

from __future__ import annotations

import json

import pytest

from wide_cli.models import loader


def _entries(parent):
    # the lock file beside an entry (`.<name>.lock`) stays by design: deleting it would let a
    # waiting process and a newcomer hold locks on two different files
    return sorted(p.name for p in parent.iterdir() if not p.name.endswith(".lock"))


def _writer(payload: str):
    def build(tmp):
        (tmp / "config.json").write_text(payload)
        (tmp / loader._SOURCE_FILE).write_text(json.dumps({"payload": payload}))

    return build


def test_a_failed_build_publishes_nothing(tmp_path):
    final = tmp_path / "models" / "m"

    def build(tmp):
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        loader._build_cache_entry(final, build)
    assert _entries(final.parent) == []  # neither the entry nor a temp directory


def test_a_stale_entry_is_replaced_whole(tmp_path):
    final = tmp_path / "m"
    loader._build_cache_entry(final, _writer("old"))
    (final / "extra.bin").write_text("from the old build")
    loader._build_cache_entry(final, _writer("new"))
    assert _entries(final) == sorted(["config.json", loader._SOURCE_FILE])
    assert (final / "config.json").read_text() == "new" and _entries(tmp_path) == ["m"]


def test_an_entry_published_meanwhile_by_another_process(tmp_path):
    final = tmp_path / "m"

    def build(tmp):
        theirs = final.parent / "theirs"  # another process finishes first
        theirs.mkdir()
        _writer("theirs")(theirs)
        theirs.rename(final)
        _writer("ours")(tmp)

    loader._build_cache_entry(final, build)
    assert json.loads((final / loader._SOURCE_FILE).read_text())["payload"] in ("ours", "theirs")
    assert _entries(tmp_path) == ["m"]  # no temp or moved-aside copy left behind


def _resolve_tiny_in_child(cache: str, log: str, barrier) -> None:
    """One process of the race below: resolve ``tiny-llama`` in ``cache`` with a slow build that
    logs itself, then read the entry's config the way every command does."""
    import os
    import time

    from transformers import AutoConfig

    from wide_cli.models import tiny

    os.environ["WIDE_CACHE"] = cache
    real = tiny.tiny_model

    def slow_logged_build(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # longer than the spread of the processes' start after the barrier
        return real(*args, **kwargs)

    tiny.tiny_model = slow_logged_build
    barrier.wait()
    path, _, _ = loader._resolve_tiny("tiny-llama")
    assert AutoConfig.from_pretrained(path).model_type == "llama"


def test_processes_resolving_one_new_entry_build_it_once(tmp_path):
    # torchrun ranks on a fresh machine all resolve the model at once. Each used to build the
    # entry and swap its copy in over the others', so a rank reading the config meanwhile found
    # a directory being moved away ("Unrecognized model ... should have a model_type key").
    # One process builds under a lock; the others wait for it and use its entry.
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    log = tmp_path / "builds.log"
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_resolve_tiny_in_child, args=(str(tmp_path / "cache"), str(log), barrier))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1
    assert _entries(tmp_path / "cache" / "models") == ["tiny-llama"]
