"""`python -m wide_cli ...` (used by torchrun) runs the CLI."""

from wide_cli.cli.app import run

if __name__ == "__main__":
    run()
