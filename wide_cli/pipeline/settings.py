"""Resolved settings of a pruning run: defaults <- recipe TOML <- command-line flags.

One frozen dataclass per recipe section; ``Settings`` groups them. Every number a run uses lives
here, and the run directory stores the resolved settings (``run.json``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomllib

from wide_cli.errors import ConfigError, refuse_non_finite
from wide_cli.routing.config import RoutingConfig
from wide_cli.train.config import TrainConfig

ROUTER_INITS = ("default", "calibration")


@dataclass(frozen=True)
class ModelSection:
    """``name``: model spec (alias, HF id, local dir, .gguf); ``dtype``: fp32/bf16/fp16;
    ``device``: cpu / cuda / cuda:N."""

    name: str = "smollm2-135m"
    dtype: str = "fp32"
    device: str = "cpu"


@dataclass(frozen=True)
class DataSection:
    """``train``: training data source (files, dir, HF id, ``builtin:pydoc``); ``eval``: text
    file/source for perplexity (None = the held-out split of ``train``); ``heldout_fraction``:
    share of packed sequences kept out of training; ``max_train_tokens``: cap on tokenised
    training data (None = all); ``shuffle_documents``: shuffle documents (seeded by
    ``train.seed``) before packing, so that the held-out split is not the tail of a sorted corpus;
    False keeps file order (held-out = the last sequences). ``self_generated``: that many chat
    transcripts written by the dense model itself (Magpie prompts, sampled answers of at most
    ``self_generated_tokens`` tokens; ``data/self_generated.py``) are added before ``train``'s
    documents (and shuffled with them when ``shuffle_documents``; 0 = none; needs a chat model).
    ``self_generated_text``: that many plain-text documents the dense model writes from its
    start-of-text token, ``self_generated_tokens`` tokens each (any model; 0 = none): text as broad
    as what the model was trained on, where the chat transcripts keep its chat register."""

    train: str = "builtin:pydoc"
    eval: str | None = None
    heldout_fraction: float = 0.1
    max_train_tokens: int | None = None
    shuffle_documents: bool = True
    self_generated: int = 0
    self_generated_tokens: int = 192
    self_generated_text: int = 0

    def __post_init__(self):
        refuse_non_finite(self)
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"heldout-fraction {self.heldout_fraction} must be in [0, 1)")
        if self.self_generated < 0 or self.self_generated_tokens < 1:
            raise ConfigError(f"self_generated {self.self_generated} must be >= 0 and self_generated_tokens "
                              f"{self.self_generated_tokens} >= 1")  # fmt: skip
        if self.self_generated_text < 0:
            raise ConfigError(f"self_generated_text {self.self_generated_text} must be >= 0",
                              "pass the number of plain-text documents the dense model writes (0 = none)")


@dataclass(frozen=True)
class Stage2Config:
    """LoRA recovery (DESIGN.md §1): rank 16, alpha 32, dropout 0.1 on q,k,v,o,gate,up,down;
    routers keep training unless ``freeze_routers``; lr 2e-4. ``joint``: train the LoRA adapters
    together with the routers from the first stage-1 step (at ``lr``; the routers at
    ``train.lr``) instead of in a separate stage 2 afterwards."""

    enabled: bool = False
    steps: int = 100
    lr: float = 2e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.1
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    freeze_routers: bool = False
    joint: bool = False

    def __post_init__(self):
        refuse_non_finite(self, {"lr": "lora-lr"})
        if self.steps < 1:
            raise ConfigError(f"stage2 steps {self.steps} must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"lora-lr {self.lr} must be > 0")
        if not self.lora_alpha > 0:
            raise ConfigError(f"lora-alpha {self.lora_alpha} must be > 0",
                              "the LoRA update is scaled by alpha / rank: 0 leaves the model unchanged")
        if self.lora_rank < 1:
            raise ConfigError(f"lora-rank {self.lora_rank} must be >= 1")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora-dropout {self.lora_dropout} must be in [0, 1)")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))


@dataclass(frozen=True)
class EvalSection:
    """Perplexity protocol of the run's own evaluation: contiguous windows of ``seq_len``
    tokens (None = the training seq_len), ``batch_size`` windows per forward, at most
    ``max_tokens`` tokens of the eval text (None = all)."""

    seq_len: int | None = None
    batch_size: int = 4
    max_tokens: int | None = None


@dataclass(frozen=True)
class RunSection:
    """``router_init``: ``default`` (kaiming, zero bias) or ``calibration`` (skip-logit bias
    from the calibration statistics: unimportant groups start closer to skipping)."""

    router_init: str = "default"

    def __post_init__(self):
        if self.router_init not in ROUTER_INITS:
            raise ConfigError(f"router-init {self.router_init!r} unknown", f"choose one of {', '.join(ROUTER_INITS)}")


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "routing": RoutingConfig,
    "train": TrainConfig,
    "stage2": Stage2Config,
    "eval": EvalSection,
    "run": RunSection,
}


@dataclass(frozen=True)
class Settings:
    """Everything a run uses (see each section's docstring)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stage2: Stage2Config = field(default_factory=Stage2Config)
    eval: EvalSection = field(default_factory=EvalSection)
    run: RunSection = field(default_factory=RunSection)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stage2"]["target_modules"] = list(self.stage2.target_modules)
        return d

    def replace(self, section: str, **changes) -> Settings:
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **changes)})


def _suggest(key: str, allowed) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(sorted(allowed))}"


_EXPECTED = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _kind(value) -> str:
    """What a TOML value is, in the words of ``_EXPECTED``."""
    for t in (bool, int, float, str):  # bool before int: True is an int to Python
        if isinstance(value, t):
            return _EXPECTED[t]
    return {list: "a list", dict: "a table"}.get(type(value), f"a {type(value).__name__}")


def _checked(origin: str, section: str, key: str, value, hint):
    """``value`` of recipe key ``[section] key`` checked against the field's type ``hint``
    (``X | None`` means ``X``: TOML has no null); an integer is accepted for a number and
    returned as a float.

    Raises:
        ConfigError: naming the section, key, expected type and value (a quoted number or boolean
            is a string, never read as what it spells).
    """
    if isinstance(hint, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):  # a resolved ``run.json`` keeps None
            return value
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        expected = "a list of strings"
    elif hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif hint not in _EXPECTED:
        return value  # a type this check does not know is left to the section's validation
    elif isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    else:
        expected = _EXPECTED[hint]
    raise ConfigError(
        f"{origin}: [{section}] {key} must be {expected}, got {json.dumps(value, default=str)} ({_kind(value)})",
        "write it without quotes" if isinstance(value, str) and hint in (int, float, bool) else None,
    )


def settings_from_dict(raw: dict, *, origin: str = "recipe") -> Settings:
    """Build validated Settings from a nested dict (a parsed recipe).

    Raises:
        ConfigError: unknown section or key (suggesting the nearest valid one), a value of the
            wrong type (naming section, key, expected type and value), or a value rejected by a
            section's validation (naming the field).
    """
    sections = {}
    for name, values in raw.items():
        if name == "recipe":  # free-form description block
            continue
        if name not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{name}]", _suggest(name, SECTIONS))
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{name}] must be a table")
        cls = SECTIONS[name]
        allowed = {f.name for f in dataclasses.fields(cls)}
        for k in values:
            if k not in allowed:
                raise ConfigError(f"{origin}: unknown key {name}.{k}", _suggest(k, allowed))
        hints = typing.get_type_hints(cls)
        values = {k: _checked(origin, name, k, v, hints[k]) for k, v in values.items()}
        try:
            sections[name] = cls(**values)
        except TypeError as e:
            raise ConfigError(f"{origin}: bad value in [{name}]: {e}") from None
    return Settings(**sections)


def load_recipe(path: str | Path) -> Settings:
    """Parse and validate a recipe TOML file (sections as in ``SECTIONS``).

    Raises:
        ConfigError: missing file, TOML syntax error, unknown key, invalid value.
    """
    p = Path(path)
    if not p.is_file():
        from wide_cli.pipeline.recipes import recipe_path

        alt = recipe_path(str(path))
        if alt is None:
            raise ConfigError(f"recipe {str(path)!r} not found", "see `wide recipes` for the shipped ones")
        p = alt
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {p}: {e}") from None
    return settings_from_dict(raw, origin=str(p))


def apply_overrides(s: Settings, overrides: dict[tuple[str, str], object]) -> Settings:
    """Apply ``{(section, field): value}`` overrides; ``None`` values mean "not given".

    Raises ConfigError from the sections' validation.
    """
    by_section: dict[str, dict] = {}
    for (sec, key), v in overrides.items():
        if v is not None:
            by_section.setdefault(sec, {})[key] = v
    for sec, changes in by_section.items():
        s = s.replace(sec, **changes)
    return s
