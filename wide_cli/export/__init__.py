"""Export: the deployable checkpoint directory and its strict loader (DESIGN.md §2)."""

from wide_cli.export.loader import PrunedModel, is_export, load_pruned
from wide_cli.export.writer import ExportResult, export_model

__all__ = ["ExportResult", "PrunedModel", "export_model", "is_export", "load_pruned"]
