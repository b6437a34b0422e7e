"""``python -m dsv41.checkpoint.write``: the command lives in ``dsv41.cli.write_checkpoint``."""
from dsv41.cli.write_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
