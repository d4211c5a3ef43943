"""The inference runtime: loads an exported checkpoint and runs routed prefill/decode with its own
KV cache, skipping routed work for real (DESIGN.md §3).

- ``ops.py``: the routed operators (PyTorch references; the contract every backend implements).
- ``backend.py``: the ``Backend`` protocol, the ``BACKENDS`` table, backend-neutral weights and
  the strict checkpoint reader.
- ``reference.py`` (masking oracle), ``cpu.py`` (work-skipping PyTorch: ``cpu_plan.py`` which
  groups a call runs, ``cpu_proj.py`` grouped weights and GEMMs, ``cpu_attention.py``);
  ``cupy_backend.py`` is imported lazily through ``BACKENDS``; its operators are ``cupy_ops.py``,
  over ``cuda/`` (kernel sources, builds, registry, launches, verification; ``make gpu-check`` is
  ``wide_cli/gpu_check``).
- ``engine.py``: ``Runtime`` (prefill, decode); ``layer_meta.py`` (what it keeps per layer:
  norms, folded routers), ``sparsity.py`` (its measured sparsity), ``generation.py`` (batched
  generation); ``kv_cache.py``; ``sampling.py``; ``quant.py`` (weight formats).
  ``wide bench`` is ``wide_cli/bench``.

Importing this package does not import torch-heavy modules: use ``from wide_cli.runtime.engine
import Runtime``.
"""
