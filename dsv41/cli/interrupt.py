"""Ctrl-C before a command's main is running: while ``python -m dsv41.X`` imports torch and its own
modules (seconds on a loaded machine), one line and exit status 130, as the commands give once
running, instead of Python's KeyboardInterrupt traceback and status -2.

Imports nothing of dsv41: ``dsv41/__init__`` uses it around ``import torch``, the first slow import.
"""
from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager


def command() -> str | None:
    """``python -m dsv41.X`` when this process is that command, else None (a library user, a test: an
    interrupt is theirs to handle)."""
    argv = getattr(sys, "orig_argv", [])
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        if module.startswith("dsv41."):
            return f"python -m {module}"
    return None


@contextmanager
def loading():
    """Ctrl-C inside: ``PROG: interrupted`` on stderr and exit status 130 when running as a command."""
    try:
        yield
    except KeyboardInterrupt:
        prog = command()
        if prog is None:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def run_main(module: str) -> int:
    """A ``python -m`` shim's whole work: import the command's module (interruptible, as above), run its main."""
    with loading():
        main = importlib.import_module(module).main
    return main()
