"""What every pipeline stage shares: the settings as they will run, the checked backbone, the
packed training data of a run, and the identity a stage's checkpoint is tied to."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from wide_cli.pipeline.rundir import RunDir, model_identity
from wide_cli.pipeline.settings import Settings

log = logging.getLogger("wide")


def effective_settings(settings: Settings) -> Settings:
    """Settings as they will run: fp16 on CPU becomes fp32 with one warning (CPU
    fp16 matmuls are missing or very slow in PyTorch); training dtype ``auto`` becomes bf16 on CUDA
    and on CPUs with bf16 hardware (``cpu_native.fast_bf16``), else fp32."""
    if settings.model.dtype in ("fp16", "float16") and not str(settings.model.device).startswith("cuda"):
        warnings.warn(
            "fp16 is not supported on CPU; computing in fp32 instead (pass --dtype fp32 or bf16 on CPU, "
            "or run on a GPU for fp16)",
            UserWarning,
            stacklevel=2,
        )
        settings = settings.replace("model", dtype="fp32")
    if settings.train.dtype == "auto":
        from wide_cli.train.config import resolve_dtype

        device_type = "cuda" if str(settings.model.device).startswith("cuda") else "cpu"
        settings = settings.replace("train", dtype=resolve_dtype("auto", device_type))
    if settings.train.dtype == "fp16" and not str(settings.model.device).startswith("cuda"):
        warnings.warn("fp16 training autocast needs CUDA; training in fp32 on CPU (use --train-dtype bf16)",
                      UserWarning, stacklevel=2)
        settings = settings.replace("train", dtype="fp32")
    return settings


def load_backbone(settings: Settings):
    """Load the dense model of ``settings.model`` (LoadedModel) and check the settings against
    it before any work is done: group sizes must divide H and F, and the training and
    perplexity sequence lengths must fit in the model's context (the rule of ``wide eval``).

    Raises:
        ModelSourceError: unknown/missing model, unsupported architecture.
        ConfigError: a group size that does not fit the model; a sequence length longer than
            the model's context length, naming both numbers.
    """
    from wide_cli.models.arch import check_context, context_length, model_shape
    from wide_cli.models.loader import load_model, resolve_dtype
    from wide_cli.routing.config import resolve_groups

    dtype = resolve_dtype(settings.model.dtype, settings.model.device)
    loaded = load_model(settings.model.name, dtype=dtype, device=settings.model.device)
    if settings.routing.method != "static-depth":  # removes whole layers: no groups
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolve_groups(settings.routing, model_shape(loaded.model.config))
    if settings.routing.method not in ("static-depth",):
        settings.routing.check_reachable(model_shape(loaded.model.config), settings.train.seq_len)
    max_len = context_length(loaded.model.config)
    check_context(settings.train.seq_len, max_len, f"seq-len {settings.train.seq_len}",
                  f"pass --seq-len {max_len} or less")
    if settings.eval.seq_len:
        check_context(settings.eval.seq_len, max_len, f"eval-seq-len {settings.eval.seq_len}",
                      f"pass --eval-seq-len {max_len} or less")
    return loaded


def stage_identity(settings: Settings, loaded, *, stage: str) -> dict:
    """What a stage's checkpoint (``train_stage``'s ``identity``) is tied to: the model, the
    routing and training maths, the data and the router init (plus the LoRA settings for
    ``stage2``); resuming with a different identity is refused."""
    routing = settings.routing.to_dict()
    if routing.get("router_input") == "residual":  # checkpoints from before the setting read the residual too
        del routing["router_input"]
    ident = {
        "model": model_identity(loaded),
        "routing": routing,
        "train": settings.train.math_dict(),
        "data": settings.data.train,
        "router_init": settings.run.router_init,
    }
    if settings.data.self_generated:
        ident["self_generated"] = [settings.data.self_generated, settings.data.self_generated_tokens]
    if settings.data.self_generated_text:
        ident["self_generated_text"] = [settings.data.self_generated_text, settings.data.self_generated_tokens]
    if stage == "stage2":
        ident["stage2"] = {**settings.stage2.__dict__, "target_modules": list(settings.stage2.target_modules)}
    return ident


def packed_data(settings: Settings, tokenizer, run: RunDir, *, model=None):
    """The run's packed training data (``PackedData``: ``train``/``heldout`` ``[N, seq_len]``
    int64), built once and cached in ``<run>/calibration/data``. With ``[data] self_generated``
    the dense model's own chat transcripts come first (``self_generated_file``; ``model`` is the
    dense model that writes them, needed only the first time)."""
    from wide_cli.data.packing import load_or_build

    d = settings.data
    extra = self_generated_file(settings, tokenizer, run, model) if d.self_generated or d.self_generated_text else None
    return load_or_build(
        settings.data.train,
        tokenizer,
        settings.train.seq_len,
        cache_dir=run.calibration / "data",
        heldout_fraction=settings.data.heldout_fraction,
        max_tokens=settings.data.max_train_tokens,
        seed=settings.train.seed if settings.data.shuffle_documents else None,
        extra_source=None if extra is None else str(extra),
    )


def self_generated_file(settings: Settings, tokenizer, run: RunDir, model=None) -> Path:
    """``<run>/calibration/data/self-generated-<key>.jsonl``: ``[data] self_generated`` chat
    transcripts and ``self_generated_text`` plain-text documents written by the dense ``model``
    (``data/self_generated.py``), generated once and kept (the key covers the tokenizer, the
    counts, the length and the seed).

    Raises:
        DataError: the file is missing and no model was given (the calibrate stage writes it).
        ConfigError: chat transcripts asked of a model without a chat template.
    """
    import hashlib
    import json

    from wide_cli.atomic import atomic_write_bytes
    from wide_cli.data.packing import tokenizer_fingerprint
    from wide_cli.errors import DataError

    d = settings.data
    ident = {"tokenizer": tokenizer_fingerprint(tokenizer), "n": d.self_generated, "tokens": d.self_generated_tokens,
             "seed": settings.train.seed}
    if d.self_generated_text:  # absent when 0: the files of chat-only runs keep their names
        ident["text"] = d.self_generated_text
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    path = run.calibration / "data" / f"self-generated-{key}.jsonl"
    if path.is_file():
        return path
    if model is None:
        raise DataError(f"{path} is missing (the dense model's own training text)",
                        "run the calibrate stage again: wide prune ... --resume")  # fmt: skip
    from wide_cli.data.self_generated import generate_chat_documents, generate_text_documents

    docs = []
    # chat transcripts first, then plain text: the order the file (and so the packing) has always had
    for n_docs, generate, what in ((d.self_generated, generate_chat_documents, "chat transcripts"),
                                   (d.self_generated_text, generate_text_documents, "plain-text documents")):
        if not n_docs:
            continue
        log.info("writing %d self-generated %s with the dense model (<= %d new tokens each)", n_docs, what,
                 d.self_generated_tokens)
        docs += generate(model, tokenizer, n=n_docs, max_new_tokens=d.self_generated_tokens, seed=settings.train.seed,
                         progress=lambda done, n, what=what: log.info("self-generated %s: %d/%d", what, done, n))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, "".join(json.dumps({"text": t}) + "\n" for t in docs).encode())
    return path


def shareable(value: str | None) -> str | None:
    """``value`` as an export may record it: a local file or directory (or any absolute path)
    becomes its name, so a shared export names no path of the machine that built it; aliases,
    hub ids and ``builtin:`` sources stay as they are."""
    if not value:
        return value
    p = Path(value).expanduser()
    return p.name if p.is_absolute() or p.exists() else value


def shareable_settings(d: dict) -> dict:
    """``Settings.to_dict()`` with the model and data paths passed through ``shareable``."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for section, key in (("model", "name"), ("data", "train"), ("data", "eval")):
        if key in out.get(section, {}):
            out[section][key] = shareable(out[section][key])
    return out
