"""What a run shows while it works: tqdm bars on a terminal, plain lines otherwise.

Bars (stderr a terminal and no ``--json``): cluster start-up (workers joined), the run's steps
(prefill, then each decode step) and pypto-sim compilations. Plain lines everywhere else; with
``--json`` every line goes to stderr so stdout stays one JSON object.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

from tqdm import tqdm

from dsv41.cli.args import isatty

PYPTO_LOGGER = "dsv41.pypto"


def tolerant_streams() -> None:
    """stdout and stderr write what their encoding cannot hold as escapes instead of raising
    (PYTHONIOENCODING=ascii, a C locale): generated text may be any Unicode, and a run must not
    fail on printing the answer it computed."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


class Progress:
    def __init__(self, json_mode: bool):
        self.bars = not json_mode and isatty(sys.stderr)
        self.out = sys.stderr if json_mode else sys.stdout
        self._bar = None

    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    # ---- cluster start-up ------------------------------------------------------------------------
    def on_workers(self, ready: int, expected: int) -> None:
        if self.bars:
            if self._bar is None:
                self._bar = tqdm(total=expected, desc="  workers", unit="worker", leave=False)
            self._bar.n = ready
            self._bar.refresh()
        elif ready in (0, expected):
            self.say(f"  cluster: {ready}/{expected} workers")

    def on_ready(self, link: str | None) -> None:
        self._close()
        if link:
            self.say(f"  dashboard: {link}  (watch the steps live)")

    # ---- steps -------------------------------------------------------------------------------------
    @contextmanager
    def steps(self, total: int):
        """Yields ``start(label)`` / ``done(line)``: a step begins, then ends with its summary line."""
        if self.bars:
            self._bar = tqdm(total=total, desc="  steps", unit="step", leave=False)
        try:
            yield self
        finally:
            self._close()

    def start(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_description(f"  {label}")

    def done(self, line: str) -> None:
        self.say(line)
        if self._bar is not None:
            self._bar.update(1)

    # ---- pypto-sim compilations --------------------------------------------------------------------
    @contextmanager
    def compilations(self):
        """Counts the pypto cost model's compilations (logged by ``kernels.pypto.sim``) in this process."""
        handler = _Compilations(self)
        log = logging.getLogger(PYPTO_LOGGER)
        log.addHandler(handler)
        level, log.level = log.level, logging.INFO
        try:
            yield
        finally:
            log.removeHandler(handler)
            log.setLevel(level)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _Compilations(logging.Handler):
    def __init__(self, progress: Progress):
        super().__init__(logging.INFO)
        self.progress, self.count = progress, 0

    def emit(self, record):
        if record.levelno > logging.INFO:
            self.progress.say(f"  pypto-sim: {record.getMessage()}")
            return
        self.count += 1
        bar = self.progress._bar
        if bar is not None:
            bar.set_postfix_str(f"pypto-sim compiled {self.count}")
        else:
            self.progress.say(f"  pypto-sim: {record.getMessage()} ({self.count} so far)")
