"""`wide generate MODEL... --prompt ...`: stream tokens from an export (or a dense model) through
the runtime.

MODEL is an export directory or a model spec (``smollm2-135m``, a local Hugging Face directory,
a ``.gguf``), which runs dense. Text goes to stdout, statistics (tokens/s, measured sparsity) to
stderr; ``--json`` prints one JSON object instead. With several MODELs every prompt is generated
by each of them and the continuations are printed side by side (``--json``: ``{"models": [...]}``).
"""

from __future__ import annotations

from typing import Annotated

import typer

from wide_cli.cli.options import JsonOpt, ThreadsOpt

ModelsArg = Annotated[list[str], typer.Argument(
    help="Export directory (written by `wide export`) or dense model spec (smollm2-135m, local HF dir, .gguf); "
         "several: side by side.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="Runtime backend: cpu | reference | cupy.")]


def generate_cmd(
    models: ModelsArg,
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
    weights: Annotated[str | None, typer.Option(
        "--weights", help="Weight format: fp32 | bf16 | int8 | int4 (int8 / int4: weight-only, bf16 activations; default: the "
        "export's stored format, else fp32).")] = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
):
    """Generate text from MODEL (an export, or a dense model spec) with the runtime, streaming
    tokens; prints tokens/s and the measured sparsity of the run. Several MODELs: the same prompts
    through each, continuations side by side."""
    import sys

    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.runtime.engine import Runtime
    from wide_cli.runtime.sampling import SamplingConfig

    check_prompts(prompt)
    quiet_libraries()
    from wide_cli.cli.threads import apply_threads

    apply_threads(threads)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
    if weights is not None:
        from wide_cli.runtime.quant import check_format

        check_format(weights)
    if len(models) > 1:
        return _side_by_side(models, list(prompt), max_new_tokens=max_new_tokens, backend=backend, sampling=sampling,
                             stop=tuple(stop or ()), chat=chat, ignore_eos=ignore_eos, no_routing=no_routing,
                             dtype=dtype, json_out=json_out, weights=weights)
    export = models[0]
    rt = Runtime.from_target(export, backend=backend, dtype=dtype, routing=not no_routing, weight_format=weights)
    prompts = _prompts_for(rt, list(prompt), chat)
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
                          "dtype": str(rt.dtype).removeprefix("torch."), "weights": rt.weight_format,
                          **res.to_dict()})  # fmt: skip
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
        f"backend {rt.backend.name} ({'routed' if rt.routing else 'dense'}, {rt.weight_format} weights, "
        f"{str(rt.dtype).removeprefix('torch.')} activations): "
        f"prefill {res.prompt_tokens} tok in {res.prefill_s:.2f} s ({res.prefill_tokens_per_s:.1f} tok/s), "
        f"decode {res.new_tokens} tok in {res.decode_s:.2f} s ({res.decode_tokens_per_s:.1f} tok/s); "
        f"measured sparsity attention {fmt(sp.get('attention'))} ffn {fmt(sp.get('ffn'))} total {fmt(sp.get('total'))}; "
        f"finish {','.join(res.finish_reasons)}",
        highlight=False,
        soft_wrap=True,
    )


def check_prompts(prompts: list[str]) -> None:
    """Refuse an empty ``--prompt`` before any model is loaded.

    Raises:
        ConfigError: naming the empty prompt (its position when several are given).
    """
    from wide_cli.errors import ConfigError

    for i, p in enumerate(prompts):
        if not p:
            which = "--prompt" if len(prompts) == 1 else f"--prompt {i + 1} of {len(prompts)}"
            raise ConfigError(f"{which} is empty", "give a non-empty prompt")


def _prompts_for(rt, prompts: list[str], chat: bool) -> list:
    """The prompts as the model sees them: text, or with ``chat`` the token ids of the
    tokenizer's chat template (ids straight from the template: rendering it to text and
    tokenizing again adds a second BOS)."""
    if not chat:
        return prompts
    return [chat_ids(rt.tokenizer, p) for p in prompts]


def _side_by_side(models: list[str], prompts: list[str], *, max_new_tokens: int, backend: str, sampling, stop,
                  chat: bool, ignore_eos: bool, no_routing: bool, dtype, json_out: bool, weights: str | None = None) -> None:
    """Every prompt through every model (one at a time, same sampling), one table: a row per
    prompt, a column per model."""
    from rich.table import Table

    from wide_cli.cli import render
    from wide_cli.runtime.engine import Runtime

    docs = []
    for m in models:
        rt = Runtime.from_target(m, backend=backend, dtype=dtype, routing=not no_routing, weight_format=weights)
        res = rt.generate(_prompts_for(rt, prompts, chat), max_new_tokens=max_new_tokens, sampling=sampling,
                          stop=stop, ignore_eos=ignore_eos)
        docs.append({"model": str(m), "backend": rt.backend.name, "routing": rt.routing,
                     "dtype": str(rt.dtype).removeprefix("torch."), "weights": rt.weight_format, **res.to_dict()})
        del rt
    if json_out:
        render.emit_json({"prompts": prompts, "chat": chat, "models": docs})
        return
    t = Table(expand=True, title=f"wide generate: {'greedy' if sampling.temperature == 0 else 'sampled'}, "
                    f"{max_new_tokens} new tokens{', chat template' if chat else ''}", show_lines=True)
    t.add_column("prompt", ratio=1)
    for d in docs:
        t.add_column(d["model"], ratio=2)
    for i, p in enumerate(prompts):
        t.add_row(p, *[" ".join(d["texts"][i].split()) for d in docs])
    from rich.console import Console

    Console(width=max(render.err.width if render.err.is_terminal else 160, 100)).print(t)



def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn of the tokenizer's chat template, with the
    generation prompt: exactly ``apply_chat_template(..., tokenize=True)``.

    Raises:
        ConfigError: the tokenizer has no chat template.
    """
    from wide_cli.errors import ConfigError

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--chat: the export's tokenizer has no chat template", "drop --chat and write the prompt as text")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # a BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return [int(i) for i in ids]
