"""The inference runtime: loads an exported checkpoint and runs routed prefill/decode with a KV
cache, skipping routed work for real (DESIGN.md §3).

Operators (the kernel contract) live in ``runtime/ops.py``; backends in ``runtime/backend.py``.
"""
