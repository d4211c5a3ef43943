"""The names of the files wide writes and reads (DESIGN.md §2), spelled once.

A leaf that imports nothing, so that any module (the model loaders included, which
``wide_cli.artifacts`` itself calls) may use them; ``wide_cli.artifacts`` re-exports them next to
the readers.

Run directory: ``run.json``, ``calibration/statistics.safetensors``,
``stage1/routers.safetensors``, ``stage2/{adapter,routers}.safetensors`` + ``result.json``.
Export (and any Hugging Face model directory): ``config.json``, ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``), ``generation_config.json``, tokenizer files; wide's
own: ``routers.safetensors``, ``wide_config.json``, ``manifest.json``, and in an ``hf`` export the
shipped ``modeling_wide.py`` / ``configuration_wide.py``.
"""

WIDE_CONFIG = "wide_config.json"
ROUTERS_FILE = "routers.safetensors"
ADAPTER_FILE = "adapter.safetensors"
STATS_FILE = "statistics.safetensors"
MANIFEST = "manifest.json"
CONFIG_JSON = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
RESULT_JSON = "result.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
RUN_JSON = "run.json"
HF_MODELING_FILE = "modeling_wide.py"
HF_CONFIGURATION_FILE = "configuration_wide.py"
