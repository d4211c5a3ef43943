#!/usr/bin/env bash
# The hf export outside wide (docs/results/hf-export-parity.md): an `--format hf` export of the
# demo run loads in a fresh venv holding only torch and transformers (no wide), and its greedy
# generation equals `wide generate --backend reference` for 32 tokens. Needs `make demo` first
# (runs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${PROMPT:-"The Python interpreter"}
HFVENV=${HFVENV:-/tmp/wide-hf-venv}
OUT=${OUT:-docs/results/hf-export-parity.json}
[ -x "$HFVENV/bin/python" ] || { python3 -m venv "$HFVENV"; "$HFVENV/bin/pip" install -q torch==2.13.0 transformers; }
.venv/bin/wide export --run-dir runs/demo --out runs/demo/export-hf --format hf
.venv/bin/wide generate runs/demo/export --prompt "$PROMPT" --max-new-tokens 32 --ignore-eos \
    --backend reference --json > /tmp/wide-gen.json
"$HFVENV/bin/python" -I - runs/demo/export-hf "$PROMPT" > /tmp/hf-gen.json <<'PY'
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
try:
    import wide_cli  # noqa: F401
    raise SystemExit("wide_cli must not be importable here")
except ImportError:
    pass
path, prompt = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
ids = tok(prompt, return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
new = out[0, ids.shape[1]:].tolist()
print(json.dumps({"prompt_ids": ids[0].tolist(), "new_ids": new, "text": tok.decode(new),
                  "transformers": __import__("transformers").__version__, "torch": torch.__version__}))
PY
.venv/bin/python - "$OUT" <<'PY'
import json, sys
hf = json.load(open("/tmp/hf-gen.json"))
w = json.load(open("/tmp/wide-gen.json"))
wide_ids = w["tokens"][0][:32]
res = {"prompt": w.get("prompts", [None])[0] if isinstance(w.get("prompts"), list) else None,
       "hf_export_new_ids": hf["new_ids"], "wide_reference_new_ids": wide_ids,
       "identical": hf["new_ids"] == wide_ids, "hf_text": hf["text"],
       "hf_venv": {"transformers": hf["transformers"], "torch": hf["torch"], "wide_importable": False}}
json.dump(res, open(sys.argv[1], "w"), indent=2)
print(json.dumps(res, indent=2))
sys.exit(0 if res["identical"] else 1)
PY
