"""Errors that the CLI turns into one clear line and a non-zero exit code."""

from __future__ import annotations


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
