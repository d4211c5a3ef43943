"""Errors that the CLI turns into one clear line and a non-zero exit code."""

from __future__ import annotations

import dataclasses
import math


class WideError(Exception):
    """A user-facing error: what is wrong (naming the bad value) and how to fix it.

    The CLI's error boundary prints ``str(err)`` on one line and exits with ``exit_code``.
    """

    exit_code: int = 2

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message} ({hint})")


class ConfigError(WideError):
    """An invalid setting: group size, sparsity target, recipe key, flag combination."""


class ModelSourceError(WideError):
    """A model that cannot be found or is not a supported architecture."""


class DataError(WideError):
    """Missing, empty, malformed or too-short data."""


class CheckpointError(WideError):
    """A run directory or export that is corrupt, incomplete or belongs to another model."""


class TrainingDivergedError(WideError):
    """A non-finite loss during training; the last good checkpoint is kept."""

    exit_code = 3


def refuse_non_finite(section, names: dict[str, str] | None = None) -> None:
    """Refuse NaN or infinity in any float field of a settings dataclass (``section``): no setting
    means anything at either, and training on one only diverges minutes later.

    ``names``: ``{field: name}`` where the flag's name is not the field's (``lr`` -> ``lora-lr``).

    Raises:
        ConfigError: naming the first such field (``lora_alpha`` -> ``lora-alpha``) and its value.
    """
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            name = (names or {}).get(f.name, f.name.replace("_", "-"))
            raise ConfigError(f"{name} {v} must be a finite number")
