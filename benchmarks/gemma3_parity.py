"""Dense Gemma 3 270M: `wide eval`'s token-level WikiText-2 perplexity (wide's loader and cache,
`wide_cli.eval.wikitext.evaluate_wikitext`) against transformers' own forward of the same GGUF
weights (`from_pretrained(gguf_file=...)`, no wide code in the model path), on the same windows.

Usage: python benchmarks/gemma3_parity.py DATA_DIR PAGES SEQ_LEN OUT.json
"""

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from wide_cli.eval.perplexity import token_windows
from wide_cli.eval.wikitext import evaluate_wikitext, read_raw, rows
from wide_cli.models.loader import gemma3_gguf, load_model

data_dir, pages, seq_len, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
t0 = time.perf_counter()
lm = load_model("gemma3-270m")
ours = evaluate_wikitext(lm.model, lm.tokenizer, data_dir=data_dir, limit=pages, seq_len=seq_len,
                         protocols=("token",))["token_level"]
wide_s = time.perf_counter() - t0

gguf, version = gemma3_gguf()
ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
ids = torch.tensor(lm.tokenizer("\n\n".join(rows(read_raw(data_dir), pages)))["input_ids"])
nll, scored = 0.0, 0
with torch.no_grad():
    for b, e, t in token_windows(len(ids), seq_len, None):
        x = ids[b:e][None]
        logits = ref(x).logits[0].float()
        nll += float(F.cross_entropy(logits[t - 1 - b:e - 1 - b], x[0, t - b:e - b], reduction="sum").double())
        scored += e - t
theirs = math.exp(nll / scored)
result = {"model": f"gemma3-270m ({gguf.name}, package version {version})", "pages": pages, "seq_len": seq_len,
          "tokens_scored": scored, "wide_eval_perplexity": ours["perplexity"], "transformers_perplexity": theirs,
          "relative_difference": ours["perplexity"] / theirs - 1, "wide_eval_seconds": wide_s}
out.write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result))
