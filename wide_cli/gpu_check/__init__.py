"""``make gpu-check``: check and time every CuPy kernel on one GPU, write one JSON.

A tool beside the runtime, not part of it: ``python -m wide_cli.gpu_check --help``.
"""
