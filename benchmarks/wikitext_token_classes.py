"""Where a pruned model loses perplexity on WikiText-2: mean NLL per predicted-token class (WikiText's
" @-@ " escapes, "= =" headings, punctuation, word starts, digits, other) on the first N test tokens,
non-overlapping 256-token windows, fp32, the runtime's cpu backend. Usage (from the repo root):
python benchmarks/wikitext_token_classes.py N dense EXPORT_DIR [EXPORT_DIR ...]
(``dense`` = smollm2-135m; WIKITEXT = path of wiki.test.raw, default ../shared/data/...)."""
import json
import os
import re
import sys

import torch

from wide_cli.models.loader import load_model
from wide_cli.runtime.engine import Runtime

torch.set_num_threads(1)
N = int(sys.argv[1]); targets = sys.argv[2:]
with open(os.environ.get("WIKITEXT", "../shared/data/wikitext-2-raw/wiki.test.raw")) as fh:
    text = fh.read()
ld = load_model("smollm2-135m")
tok = ld.tokenizer
ids = tok(text[:400000], return_tensors="pt").input_ids[0][: N + 1]
W = 256
nw = len(ids) // W
X = ids[: nw * W].view(nw, W)
pieces = tok.convert_ids_to_tokens(X.flatten().tolist())
out = {}
for t in targets:
    rt = Runtime.from_model(ld.model, tok, routing=False) if t == "dense" else Runtime.from_export(t, backend="cpu")
    nll = []
    with torch.no_grad():
        for i in range(0, nw, 4):
            x = X[i:i + 4]
            lg = rt.forward(x).float().log_softmax(-1)
            nll.append(-lg[:, :-1].gather(-1, x[:, 1:, None])[..., 0])
    out[t] = torch.cat(nll)  # [nw, W-1]
    print(t, "ppl", out[t].mean().exp().item(), flush=True)
# classes of the predicted token
tgt = [[pieces[w * W + j + 1] for j in range(W - 1)] for w in range(nw)]
def cls(p):
    s = p.replace("Ġ", " ").replace("Ċ", "\n")
    if "@" in s: return "@-escape"
    if "=" in s: return "heading ="
    if s.strip() in {",", ".", "(", ")", ";", ":", "'", "\"", "'s"} : return "punct"
    if s.startswith(" ") and re.search(r"[A-Za-z]", s): return "word start"
    if re.search(r"[0-9]", s): return "digits"
    return "other"
cl = [cls(p) for row in tgt for p in row]
names = sorted(set(cl))
for t in targets:
    v = out[t].flatten()
    row = {c: (sum(1 for x in cl if x == c), v[[i for i, x in enumerate(cl) if x == c]].mean().item()) for c in names}
    print(t, json.dumps({c: f"n={n} nll={m:.3f}" for c, (n, m) in row.items()}))
