"""`wide inspect`: sizes, settings, per-layer sparsity and per-token routing of an export."""

from wide_cli.inspect.report import InspectReport, PromptTrace, inspect_export

__all__ = ["InspectReport", "PromptTrace", "inspect_export"]
