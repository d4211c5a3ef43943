"""`wide generate EXPORT --prompt ...`: stream tokens from an export through the runtime.

Text goes to stdout, statistics (tokens/s, measured sparsity) to stderr; ``--json`` prints one
JSON object instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wide_cli.cli import options as o

ExportArg = Annotated[Path, typer.Argument(help="Export directory (written by `wide export`).")]
BackendOpt = Annotated[str, typer.Option("--backend", help="Runtime backend: cpu | reference | cupy.")]


def generate_cmd(
    export: ExportArg,
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="Prompt text; repeat for a batch.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Upper bound of new tokens per prompt.")] = 64,
    backend: BackendOpt = "cpu",
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with --temperature > 0).")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string; repeatable.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the tokenizer's chat template.")] = False,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the EOS token.")] = False,
    no_routing: Annotated[bool, typer.Option("--no-routing", help="Run every group (the runtime's dense mode).")] = False,
    dtype: Annotated[str | None, typer.Option("--dtype", help="fp32 | bf16 (default fp32).")] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="Torch CPU threads.")] = None,
    json_out: o.JsonOpt = False,
):
    """Generate text from EXPORT with the runtime, streaming tokens; prints tokens/s and the
    measured sparsity of the run."""
    import sys

    import torch

    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.runtime.engine import Runtime
    from wide_cli.runtime.sampling import SamplingConfig

    quiet_libraries()
    if threads is not None:
        torch.set_num_threads(threads)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
    rt = Runtime.from_export(export, backend=backend, dtype=dtype, routing=not no_routing)
    prompts = list(prompt)
    if chat:
        prompts = [
            rt.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    stream = not json_out and len(prompts) == 1

    def on_text(row: int, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    res = rt.generate(
        prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop or ()), ignore_eos=ignore_eos,
        on_text=on_text if stream else None,
    )  # fmt: skip
    if json_out:
        render.emit_json({"export": str(export), "backend": rt.backend.name, "routing": rt.routing,
                          "dtype": str(rt.dtype).removeprefix("torch."), **res.to_dict()})  # fmt: skip
        return
    if stream:
        sys.stdout.write("\n")
    else:
        for i, text in enumerate(res.texts):
            sys.stdout.write(f"--- [{i}] {prompt[i]!r}\n{text}\n")
    sys.stdout.flush()
    sp = res.sparsity
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    render.err.print(
        f"backend {rt.backend.name} ({'routed' if rt.routing else 'dense'}, {str(rt.dtype).removeprefix('torch.')}): "
        f"prefill {res.prompt_tokens} tok in {res.prefill_s:.2f} s ({res.prefill_tokens_per_s:.1f} tok/s), "
        f"decode {res.new_tokens} tok in {res.decode_s:.2f} s ({res.decode_tokens_per_s:.1f} tok/s); "
        f"measured sparsity attention {fmt(sp.get('attention'))} ffn {fmt(sp.get('ffn'))} total {fmt(sp.get('total'))}; "
        f"finish {','.join(res.finish_reasons)}",
        highlight=False,
        soft_wrap=True,
    )
