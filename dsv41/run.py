"""``python -m dsv41.run``: the command lives in ``dsv41.cli.run``."""
from dsv41.cli.interrupt import run_main

if __name__ == "__main__":
    raise SystemExit(run_main("dsv41.cli.run"))
