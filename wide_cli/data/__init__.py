"""Data: read documents from a source (``sources``), tokenize and pack them with a cache (``packing``).

Import the submodules directly; this package imports nothing (``wide --help`` stays instant).
"""
