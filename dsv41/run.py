"""``python -m dsv41.run``: the command lives in ``dsv41.cli.run``."""
from dsv41.cli.run import main

if __name__ == "__main__":
    raise SystemExit(main())
