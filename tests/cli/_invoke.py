"""The CLI invocation the CLI tests share."""

from typer.testing import CliRunner

from wide_cli.cli.app import app


def ok(args):
    """Run ``wide ARGS`` in-process; assert exit 0 (showing the output otherwise); return the result."""
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r
