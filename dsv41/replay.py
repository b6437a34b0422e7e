"""``python -m dsv41.replay``: the command lives in ``dsv41.cli.replay``."""
from dsv41.cli.replay import main

if __name__ == "__main__":
    raise SystemExit(main())
