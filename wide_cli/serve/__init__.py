"""Serving exports on vLLM: the plugin (``vllm_plugin``), its model classes (``vllm_models``,
imported by vLLM only), what an export needs to be served (``config``) and ``wide serve``'s
server process handling (``server``). Only ``config`` and ``server`` are imported without vLLM.
"""
