"""``python -m dsv41.serve``: the command lives in ``dsv41.cli.serve``."""
from dsv41.cli.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
