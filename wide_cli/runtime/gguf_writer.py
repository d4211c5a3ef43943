"""Write an export's dense weights as a llama.cpp GGUF (``F16``, ``Q8_0`` or ``Q4_0``) with the ``gguf`` package,
so that ``wide bench`` can run llama.cpp on the very same weights.

Only the backbone is written (no routers: llama.cpp runs the dense model). Tensor names and the
Q/K row order follow llama.cpp's ``llama`` architecture: Hugging Face stores Q/K rows in the
"rotate half" RoPE order, llama.cpp's ``llama`` graph expects interleaved pairs, so the rows of each
head are permuted ``[h, 2, d/2] -> [h, d/2, 2]`` (what llama.cpp's own converter does). Norms stay
F32; every matrix is F16, Q8_0 or Q4_0 (blocks of 32 with one f16 scale; Q4_0 for every matrix,
the embedding / tied head included, unlike llama-quantize's Q4_0 mix, which keeps the output
matrix at 6 bits).

The vocabulary is written as a ``gpt2`` (byte-level BPE) tokenizer from the export's
``tokenizer.json`` (tokens, merges, special-token types), or as ``none`` (no vocabulary) for other
tokenizers; ``wide bench`` feeds token ids, so the GGUF's own tokenizer is only used by people who
run the file elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from wide_cli.errors import ConfigError
from wide_cli.filenames import TOKENIZER_JSON, WEIGHTS_FILE

GGUF_TYPES = ("F16", "Q8_0", "Q4_0")
# llama.cpp block formats: 32 weights per block, one f16 scale (Q4_0: 4-bit, offset 8)
_BLOCKED = ("Q8_0", "Q4_0")
# Bytes per matrix weight of each type (a block's scale included).
BYTES_PER_WEIGHT = {"F16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF Q/K rows (per head: first halves, then second halves of the rotary pairs) -> llama.cpp's
    interleaved pairs. ``w [n_heads * d, D]``."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(export_dir: Path, tokenizer, vocab_size: int):
    """``(tokens, token_types, merges)`` for a ``gpt2`` GGUF vocabulary of ``vocab_size`` entries."""
    from gguf import TokenType

    merges: list[str] = []
    tj = export_dir / TOKENIZER_JSON
    if tj.is_file():
        model = json.loads(tj.read_text()).get("model") or {}
        if model.get("type") == "BPE":
            merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    inv = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in inv:
            tokens.append(inv[i])
            types.append(TokenType.CONTROL if i in special or i in added else TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
    return tokens, types, merges


def write_gguf(export_dir, out_path, gguf_type: str = "F16") -> Path:
    """Write the export at ``export_dir`` as a llama.cpp ``llama`` GGUF at ``out_path``.

    Args:
        export_dir: a wide export (fp32 or int8; int8 weights are dequantized first).
        out_path: the ``.gguf`` file to write.
        gguf_type: ``F16``, ``Q8_0`` or ``Q4_0`` for every matrix (norms stay F32).
    Returns:
        ``out_path``.
    Raises:
        ConfigError: an unknown type, a model llama.cpp's ``llama`` graph does not run as is
            (biases, q/k norms, RoPE scaling, sliding windows), a width Q8_0 / Q4_0 cannot block by 32.
        CheckpointError: an unreadable export.
    """
    import gguf
    from transformers import AutoConfig

    from wide_cli.artifacts import read_backbone
    from wide_cli.models.loader import load_tokenizer
    from wide_cli.quant import dequantize_state_dict

    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"unknown GGUF type {gguf_type!r}", f"choose one of {', '.join(GGUF_TYPES)}")
    export_dir, out_path = Path(export_dir), Path(out_path)
    config = AutoConfig.from_pretrained(export_dir, local_files_only=True)
    tensors, _ = dequantize_state_dict(read_backbone(export_dir), str(export_dir / WEIGHTS_FILE))
    tokenizer = load_tokenizer(export_dir)
    odd = [n for n in tensors if n.endswith(".bias") or "q_norm" in n or "k_norm" in n]
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type") or (getattr(config, "rope_scaling", None) or {}).get("rope_type") or "default"
    if odd or rope_type != "default" or getattr(config, "sliding_window", None):
        raise ConfigError(
            f"llama.cpp rows need a plain Llama model; this one has {odd[:2] or rope_type or 'a sliding window'}",
            "drop llama.cpp from --systems for this model",
        )
    D, L = int(config.hidden_size), int(config.num_hidden_layers)
    H, Hkv = int(config.num_attention_heads), int(config.num_key_value_heads)
    d = int(getattr(config, "head_dim", None) or D // H)
    V = tensors["model.embed_tokens.weight"].shape[0]
    qtype = getattr(gguf.GGMLQuantizationType, gguf_type)
    ftype = getattr(gguf.LlamaFileType, f"MOSTLY_{gguf_type}")

    w = gguf.GGUFWriter(str(out_path), "llama")
    w.add_name(export_dir.name)
    w.add_context_length(int(getattr(config, "max_position_embeddings", 2048)))
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(int(config.intermediate_size))
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_dimension_count(d)
    if d != D // H:
        w.add_key_length(d)
        w.add_value_length(d)
    w.add_rope_freq_base(float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(getattr(config, "rms_norm_eps", 1e-6)))
    w.add_file_type(ftype)
    w.add_vocab_size(V)
    tokens, types, merges = _vocab(export_dir, tokenizer, V)
    if merges:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    else:  # not a BPE tokenizer (e.g. the tiny models' characters): llama.cpp runs on token ids only
        w.add_tokenizer_model("none")
    for setter, tid in ((w.add_bos_token_id, tokenizer.bos_token_id), (w.add_eos_token_id, tokenizer.eos_token_id),
                        (w.add_pad_token_id, tokenizer.pad_token_id)):  # fmt: skip
        if tid is not None:
            setter(int(tid))
    w.add_add_bos_token(False)

    def put(name: str, t: torch.Tensor, matrix: bool = True) -> None:
        a = t.detach().float().numpy()
        if not matrix:
            w.add_tensor(name, a.astype(np.float32))
        elif gguf_type in _BLOCKED:
            if a.shape[-1] % 32:
                raise ConfigError(f"{name}: width {a.shape[-1]} is not a multiple of 32 ({gguf_type} blocks)", "use F16")
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a.astype(np.float16))

    put("token_embd.weight", tensors["model.embed_tokens.weight"])
    put("output_norm.weight", tensors["model.norm.weight"], matrix=False)
    if "lm_head.weight" in tensors and not getattr(config, "tie_word_embeddings", False):
        put("output.weight", tensors["lm_head.weight"])
    for i in range(L):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], matrix=False)
        put(f"blk.{i}.attn_q.weight", _permute_rope(tensors[p + "self_attn.q_proj.weight"], H))
        put(f"blk.{i}.attn_k.weight", _permute_rope(tensors[p + "self_attn.k_proj.weight"], Hkv))
        put(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"], matrix=False)
        put(f"blk.{i}.ffn_gate.weight", tensors[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", tensors[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", tensors[p + "mlp.down_proj.weight"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
