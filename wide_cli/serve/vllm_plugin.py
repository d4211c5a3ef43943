"""The vLLM plugin: ``vllm.general_plugins`` entry point ``wide = wide_cli.serve.vllm_plugin:register``.

vLLM calls ``register`` in every process it starts (API server, engine core, workers) before it
builds a model. The model classes are registered by import path, so importing this module (and
vLLM's plugin scan) stays cheap; vLLM imports ``wide_cli.serve.vllm_models`` when an export names
one of them in ``architectures``.
"""

from __future__ import annotations

from wide_cli.serve.config import SERVED_ARCHITECTURES


def register() -> None:
    """Register ``Wide{Llama,Mistral,Qwen2,Qwen3}ForCausalLM`` with vLLM's ``ModelRegistry``."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch in SERVED_ARCHITECTURES.values():
        if arch not in supported:
            ModelRegistry.register_model(arch, f"wide_cli.serve.vllm_models:{arch}")
