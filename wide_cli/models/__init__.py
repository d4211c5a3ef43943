"""Models: architecture facts (``arch``), tiny test models (``tiny``), loading from any source (``loader``).

Import the submodules directly (``from wide_cli.models.loader import load_model``); this package
imports nothing so that ``wide --help`` stays instant.
"""
