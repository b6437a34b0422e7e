"""Ctrl-C before a command's main has caught it: while ``python -m dsv41.X`` imports torch and its own
modules (seconds on a loaded machine) or checks its arguments, one line and exit status 130, as the
commands give once running, instead of Python's KeyboardInterrupt traceback and status -2.

Imports nothing of dsv41: ``dsv41/__init__`` installs it before ``import torch``, the first slow import.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys


def command() -> str | None:
    """``python -m dsv41.X`` when this process is that command, else None (a library user, a test: an
    interrupt is theirs to handle)."""
    argv = getattr(sys, "orig_argv", [])
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        if module.startswith("dsv41."):
            return f"python -m {module}"
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is so that it closes what it started, as Ctrl-C does."""


def raise_terminated(signum, frame):
    raise Terminated()


def stopped(prog: str, e: KeyboardInterrupt, leave: bool) -> int:
    """The one line of a command a Ctrl-C or SIGTERM ended, and its status (130, 143, as a shell reports
    a process the signal ended); leave: exit now (``exit_now``: the process is the command's)."""
    terminated = isinstance(e, Terminated)
    print(f"{prog}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
    status = 143 if terminated else 130
    if leave:
        exit_now(status)
    return status


def exit_now(status: int) -> None:
    """Exit after the atexit handlers (multiprocessing's among them: children joined, semaphores
    released), without the interpreter's module teardown, which took 2.5 s of the 5 s a signal may
    take on a loaded machine and frees nothing the exit does not. A second Ctrl-C or SIGTERM while the
    handlers run (a distributed start-up being torn down) leaves at once with the same status, instead
    of a KeyboardInterrupt traceback from the handler it cut."""
    def leave(signum, frame):
        os._exit(status)

    signal.signal(signal.SIGINT, leave)
    signal.signal(signal.SIGTERM, leave)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(status)


def install() -> None:
    """When this process is a dsv41 command: a KeyboardInterrupt nothing caught is one line and 130."""
    prog, previous = command(), sys.excepthook
    if prog is None:
        return

    def hook(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        print(f"{prog}: interrupted", file=sys.stderr)
        exit_now(130)

    sys.excepthook = hook
