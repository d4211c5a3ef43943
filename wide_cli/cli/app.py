"""The `wide` command-line application: wires command modules and the error boundary.

Commands are registered explicitly in ``COMMANDS`` (no discovery). Each command module keeps
torch imports inside its function so that ``wide --help`` stays instant.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

app = typer.Typer(
    name="wide",
    help="Token-level dynamic width pruning (WIDE) for Llama-family LLMs: "
    "train routers, recover with LoRA, evaluate, export, and run fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# name -> (module, function). The order is the order of `wide --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "prune": ("wide_cli.cli.commands.prune", "prune_cmd"),
    "calibrate": ("wide_cli.cli.commands.stages", "calibrate_cmd"),
    "train": ("wide_cli.cli.commands.stages", "train_cmd"),
    "export": ("wide_cli.cli.commands.stages", "export_cmd"),
    "eval": ("wide_cli.cli.commands.eval", "eval_cmd"),
    "generate": ("wide_cli.cli.commands.generate", "generate_cmd"),
    "bench": ("wide_cli.cli.commands.bench", "bench_cmd"),
    "compare": ("wide_cli.cli.commands.compare", "compare_cmd"),
    "serve": ("wide_cli.cli.commands.serve", "serve_cmd"),
    "inspect": ("wide_cli.cli.commands.inspect", "inspect_cmd"),
    "recipes": ("wide_cli.cli.commands.recipes", "recipes_cmd"),
}


def _register() -> None:
    for name, (mod, fn) in COMMANDS.items():
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:  # a command whose module is not written yet
            if e.name == mod:
                continue
            raise
        app.command(name)(getattr(module, fn))


_register()


def main(argv: list[str] | None = None) -> int:
    """Console entry point with one error boundary.

    A ``WideError`` prints one line (``error: ...``) and exits with its code (2, or 3 for a
    diverged run); any other exception prints one line plus a hint to set ``WIDE_DEBUG=1`` for
    the traceback, and exits 1. Ctrl-C exits 130.
    """
    from wide_cli.errors import WideError

    debug = os.environ.get("WIDE_DEBUG", "") not in ("", "0")
    try:
        code = app(args=argv, standalone_mode=False)
        # Non-standalone typer returns the code of an explicit Exit instead of raising it, and
        # turns Ctrl-C into Exit(130) itself; our commands return None.
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            if code == 130:
                print("error: interrupted", file=sys.stderr)
            return code
        return 0
    except SystemExit as e:  # typer/click exits (e.g. --help)
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except WideError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # the boundary: one line, traceback only on request
        import click

        if isinstance(e, click.exceptions.Exit):
            return e.exit_code
        if isinstance(e, click.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):
            print("error: aborted", file=sys.stderr)
            return 130
        if debug:
            raise
        print(f"error: {type(e).__name__}: {e} (set WIDE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


def run() -> None:
    sys.exit(main())
