"""The version of wide (one place; ``wide_cli.__version__`` re-exports it). A leaf: modules
that record the version (exports, run dirs, reports) import it from here, not from the package."""

__version__ = "0.1.0"
