"""`wide inspect EXPORT`: sizes, settings, per-layer sparsity (stored, or measured on --text),
a PNG plot, and a per-token heat-map of the groups a --prompt used."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wide_cli.cli.options import JsonOpt, TrustRemoteCodeOpt


def inspect_cmd(
    export: Annotated[Path, typer.Argument(help="Export directory (wide or hf format).")],
    text: Annotated[Path | None, typer.Option(
        "--text", help="Measure sparsity on this text file (default: the measurement stored at export).")] = None,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", help="Show which head groups / channel groups each token of PROMPT used.")] = None,
    layer: Annotated[int | None, typer.Option(
        "--layer", help="Layer of the --prompt heat-map (default: all layers summarised).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of per-layer attention/FFN sparsity.")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Window length for --text, tokens.")] = 256,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens of --text to measure at most.")] = 8192,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check manifest.json hashes first.")] = True,
    trust_remote_code: TrustRemoteCodeOpt = False,
    json_out: JsonOpt = False,
):
    """Inspect an export: sizes, settings, sparsity per layer and module, per-token routing."""
    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.errors import ConfigError, DataError
    from wide_cli.inspection import inspect_export
    from wide_cli.inspection.render import render as render_report

    if seq_len < 1 or max_tokens < 2:
        raise ConfigError(f"--seq-len {seq_len} / --max-tokens {max_tokens} too small", "use --seq-len >= 1, --max-tokens >= 2")
    body = None
    if text is not None:
        try:
            body = text.read_text(errors="replace")
        except OSError as e:
            raise DataError(f"cannot read --text {str(text)!r}: {e.strerror or e}", "pass a readable text file") from None
    if prompt is not None or text is not None:
        quiet_libraries()
    rep = inspect_export(export, text=body, text_name=str(text) if text else None, prompt=prompt, layer=layer,
                         plot=plot, seq_len=seq_len, max_tokens=max_tokens, verify=verify,
                         trust_remote_code=trust_remote_code)
    render.err.print(render_report(rep))
    if json_out:
        render.emit_json(rep.to_dict())
