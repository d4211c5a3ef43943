"""``python -m wide_cli.gpu_check``."""

from wide_cli.gpu_check.main import main

if __name__ == "__main__":  # not when a spawned compile worker imports it
    raise SystemExit(main())
