"""wide: token-level dynamic width pruning."""
