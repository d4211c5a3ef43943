"""wide: token-level dynamic width pruning (WIDE) for Llama-family LLMs."""

from wide_cli.version import __version__

__all__ = ["__version__", "load_pruned"]


def load_pruned(*args, **kwargs):
    """Load a wide export; see ``wide_cli.export.loader.load_pruned``."""
    from wide_cli.export.loader import load_pruned as _load

    return _load(*args, **kwargs)

