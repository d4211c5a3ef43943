"""`wide inspect`: sizes, settings, per-layer sparsity and per-token routing of an export.

Named ``inspection`` (not ``inspect``) so it never shadows the standard library's ``inspect``.
"""

from wide_cli.inspection.report import InspectReport, PromptTrace, inspect_export

__all__ = ["InspectReport", "PromptTrace", "inspect_export"]
