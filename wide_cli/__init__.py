"""wide: token-level dynamic width pruning (WIDE) for Llama-family LLMs."""

__version__ = "0.1.0"


def load_pruned(*args, **kwargs):
    """Load a wide export; see ``wide_cli.export.loader.load_pruned``."""
    from wide_cli.export.loader import load_pruned as _load

    return _load(*args, **kwargs)

