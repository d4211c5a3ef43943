"""Calibration: per-unit activation statistics of the dense model (``statistics``).

Import the submodules directly; this package imports nothing (``wide --help`` stays instant).
"""
