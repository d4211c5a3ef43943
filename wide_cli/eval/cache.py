"""Per-model result cache for ``wide eval --cache-dir DIR``.

A comparison report is one row per model; evaluating a model is the expensive part, and adding a
model to a table (or re-rendering it) should not re-evaluate the others. A row is reused only when
everything that determines its numbers is unchanged: the model (an export's ``manifest.json``,
which holds every file's sha256; a plain model's resolved path, revision and weight files' sizes
and mtimes), the evaluation settings (tasks, limit, window, stride, batch size, dtype, device),
the data files (sizes and mtimes) and the code that computes it (a hash of the sources of
``wide_cli.eval``, ``wide_cli.routing``, ``wide_cli.export`` and ``wide_cli.models``, and the
torch / transformers / tokenizers versions). Entries
are JSON files named by the sha256 of that fingerprint, written atomically.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

CODE_PACKAGES = ("eval", "routing", "export", "models")


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 over the source files of the packages that compute an evaluation row and the
    versions of torch, transformers and tokenizers."""
    import tokenizers
    import torch
    import transformers

    import wide_cli

    root = Path(wide_cli.__file__).parent
    h = hashlib.sha256(wide_cli.__version__.encode())
    for lib in (torch, transformers, tokenizers):  # their kernels and model classes compute the row too
        h.update(f"{lib.__name__}=={lib.__version__}".encode())
    for pkg in CODE_PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _file_sig(path: Path) -> list:
    st = Path(path).stat()
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]


def target_fingerprint(target) -> dict:
    """What identifies a loaded target's weights (``wide_cli.eval.run.Target``)."""
    from wide_cli.export import is_export
    from wide_cli.filenames import MANIFEST, WIDE_CONFIG

    if is_export(target.name):
        d = Path(target.name)
        manifest = d / MANIFEST
        src = manifest if manifest.is_file() else d / WIDE_CONFIG
        return {"export": hashlib.sha256(src.read_bytes()).hexdigest()}
    fp = {"source": target.source}
    resolved = (target.source or {}).get("resolved")
    if resolved and Path(resolved).is_dir():
        fp["files"] = [_file_sig(f) for f in sorted(Path(resolved).iterdir())
                       if f.is_file() and f.suffix in (".safetensors", ".bin", ".json", ".gguf", ".model", ".txt", ".py")]
    elif resolved and Path(resolved).is_file():
        fp["files"] = [_file_sig(Path(resolved))]
    return fp


def plan_fingerprint(plan, *, dtype, device) -> dict:
    """The evaluation settings and the data files of ``plan`` (``wide_cli.eval.run.EvalPlan``)."""
    from wide_cli.eval.tasks import TASKS, get_task, task_path
    from wide_cli.eval.wikitext import raw_path

    files = []
    for t in plan.tasks:
        if t == "wikitext":
            files.append(_file_sig(raw_path(plan.data_dir, plan.split)))
        elif t in TASKS:
            files.append(_file_sig(task_path(get_task(t), plan.data_dir)))
    if plan.eval_data is not None:
        files.append(_file_sig(plan.eval_data))
    return {"tasks": list(plan.tasks), "limit": plan.limit, "seq_len": plan.seq_len, "stride": plan.stride,
            "batch_size": plan.batch_size, "dataset": plan.wikitext_dataset, "split": plan.split,
            "wikitext_protocols": list(plan.wikitext_protocols),
            "dtype": str(dtype), "device": str(device), "files": files}


def cache_key(target, plan, *, dtype, device) -> str:
    """sha256 hex of the model, settings, data and code fingerprints."""
    blob = json.dumps({"target": target_fingerprint(target), "plan": plan_fingerprint(plan, dtype=dtype, device=device),
                       "code": code_fingerprint()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_row(cache_dir: Path, key: str) -> dict | None:
    """The cached row for ``key``, or None (missing or unreadable entries are misses)."""
    p = Path(cache_dir) / f"{key}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def store_row(cache_dir: Path, key: str, row: dict) -> None:
    """Write ``row`` under ``key`` atomically."""
    from wide_cli.atomic import atomic_write_json

    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(cache_dir) / f"{key}.json", row)
