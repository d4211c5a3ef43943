"""Does a config describe its weights? One check for every loader (model directories, both
export formats, the runtime), run on tensor shapes before any weight is read, so that a hand-edited
``config.json`` is one clear error naming the field, both numbers and the files, not transformers'
generic size-mismatch traceback or (in the runtime) a model silently run with other head counts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from wide_cli.errors import CheckpointError
from wide_cli.filenames import CONFIG_JSON, WEIGHTS_FILE, WEIGHTS_INDEX

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def safetensors_files(path) -> list[Path] | None:
    """The weight files of directory ``path``: ``[model.safetensors]``, or the shards that
    ``model.safetensors.index.json`` lists (sorted, possibly missing on disk); ``None`` when the
    directory has neither file.

    Raises:
        ValueError: the index is not JSON or has no ``weight_map``.
        OSError: the index cannot be read.
    """
    path = Path(path)
    single, index = path / WEIGHTS_FILE, path / WEIGHTS_INDEX
    if single.is_file():
        return [single]
    if not index.is_file():
        return None
    try:
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    except KeyError as e:
        raise ValueError(f"no {e} key") from None


def weight_shapes(path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Shapes of the tensors in ``model.safetensors`` (or the shards its index lists) of
    directory ``path``, from the file headers only.

    Returns:
        ``(shapes, files)``: ``{tensor name: shape}`` and ``{tensor name: file name}``; both
        empty when the directory holds no safetensors weights (other errors name those).
    """
    from safetensors import safe_open

    try:
        files = safetensors_files(path)
    except (OSError, ValueError):
        return {}, {}
    if files is None:
        return {}, {}
    shapes, where = {}, {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():  # noqa: SIM118 -- safe_open is not a dict
                    shapes[k] = tuple(sf.get_slice(k).get_shape())
                    where[k] = f.name
        except Exception:  # noqa: BLE001 -- unreadable files are named by the loaders' own checks
            return {}, {}
    return shapes, where


def config_mismatch(config, shapes: dict[str, tuple[int, ...]]) -> tuple[str, str] | None:
    """The first disagreement between ``config`` and tensor ``shapes``, or None.

    Per-layer query heads and FFN widths of a physically narrowed (static-width hf) export come
    from ``wide_layer_heads`` / ``wide_layer_intermediate_sizes``. Tensors that are absent are
    not checked here (the loaders list missing tensors themselves).

    Returns:
        ``(what the config says, what the tensor has)``, e.g. ``("num_key_value_heads 4",
        "model.layers.0.self_attn.k_proj.weight has 32 rows = 2 KV heads of head_dim 16")``.
    """
    cfg = getattr(config, "text_config", None) or config
    D = int(cfg.hidden_size)
    H = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or H)
    hd = int(getattr(cfg, "head_dim", None) or D // H)
    F = int(cfg.intermediate_size)
    heads = getattr(cfg, "wide_layer_heads", None)
    inters = getattr(cfg, "wide_layer_intermediate_sizes", None)

    def rows(name):
        s = shapes.get(name)
        return None if s is None else s[0]

    def cols(name):
        s = shapes.get(name)
        return None if s is None or len(s) < 2 else s[1]

    emb = shapes.get("model.embed_tokens.weight")
    if emb is not None and emb[0] != int(cfg.vocab_size):
        return f"vocab_size {cfg.vocab_size}", f"model.embed_tokens.weight has {emb[0]} rows"
    if emb is not None and len(emb) > 1 and emb[1] != D:
        return f"hidden_size {D}", f"model.embed_tokens.weight has {emb[1]} columns"
    layers = {int(m.group(1)) for k in shapes if (m := _LAYER.match(k))}
    if layers and max(layers) + 1 != int(cfg.num_hidden_layers):
        return f"num_hidden_layers {cfg.num_hidden_layers}", f"the weights hold {max(layers) + 1} layers"
    for i in sorted(layers):
        p = f"model.layers.{i}."
        h = len(heads[i]) if heads is not None and i < len(heads) else H
        f_i = int(inters[i]) if inters is not None and i < len(inters) else F
        field_h = "wide_layer_heads" if heads is not None else "num_attention_heads"
        for name, got, want, unit, field, n in (
            ("self_attn.q_proj.weight", rows(p + "self_attn.q_proj.weight"), h * hd, "query heads", field_h, h),
            ("self_attn.k_proj.weight", rows(p + "self_attn.k_proj.weight"), kv * hd, "KV heads", "num_key_value_heads", kv),
            ("self_attn.v_proj.weight", rows(p + "self_attn.v_proj.weight"), kv * hd, "KV heads", "num_key_value_heads", kv),
        ):
            if got is not None and got != want:
                per = f" = {got / hd:g} {unit} of head_dim {hd}" if got % hd == 0 else f", not a multiple of head_dim {hd}"
                return f"{field} {n}", f"{p}{name} has {got} rows{per}"
        for name, got in (("self_attn.q_proj.weight", cols(p + "self_attn.q_proj.weight")),
                          ("mlp.gate_proj.weight", cols(p + "mlp.gate_proj.weight"))):
            if got is not None and got != D:
                return f"hidden_size {D}", f"{p}{name} has {got} columns"
        for name, got in (("mlp.gate_proj.weight", rows(p + "mlp.gate_proj.weight")),
                          ("mlp.up_proj.weight", rows(p + "mlp.up_proj.weight")),
                          ("mlp.down_proj.weight", cols(p + "mlp.down_proj.weight"))):
            if got is not None and got != f_i:
                field = "wide_layer_intermediate_sizes" if inters is not None else "intermediate_size"
                return f"{field} {f_i}", f"{p}{name} has {got} {'columns' if 'down' in name else 'rows'}"
    return None


def check_config_matches(config, shapes, *, config_file, weights_file: str = "the weights",
                         error=CheckpointError, hint: str = "restore the original config.json or re-run `wide export`") -> None:
    """Raise ``error`` (exit 2) naming the config field, both numbers and both files when
    ``config`` does not describe tensors of ``shapes`` (see ``config_mismatch``)."""
    bad = config_mismatch(config, shapes)
    if bad is not None:
        says, has = bad
        raise error(f"{config_file} says {says} but {has.replace(' has ', f' in {weights_file} has ', 1)}"
                    if " has " in has else f"{config_file} says {says} but {has} ({weights_file})", hint)


def check_export_shapes(path, config, *, error=CheckpointError,
                        hint: str = "restore the original config.json or re-run `wide export`") -> None:
    """``check_config_matches`` for the weights of directory ``path``, read from headers."""
    shapes, where = weight_shapes(path)
    if not shapes:
        return
    files = sorted(set(where.values()))
    check_config_matches(config, shapes, config_file=Path(path) / CONFIG_JSON,
                         weights_file=files[0] if len(files) == 1 else f"{len(files)} shards", error=error, hint=hint)
