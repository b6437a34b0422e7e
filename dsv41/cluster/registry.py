"""What each engine owns in one process: its cards' States and its run hooks, keyed by engine id.

The engine's own process (``sync``/``threads``) and every dask worker hold one ``Owned`` per engine
that installed State there, so any number of engines and runs share a process or a worker without
seeing each other's State. The functions below are what the engine calls here or, with
``client.run``, on a worker; ``free`` drops one engine's entry and nothing else.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


ABORT_WAIT_S = 60.0          # how long an abort waits for this engine's running submissions to end


class StateLost(RuntimeError):
    """A card's State is missing or is not the one the step expects (worker restarted, replaced or gone)."""

    def __init__(self, cards, reason: str):
        self.cards, self.reason = sorted(cards), reason
        super().__init__(f"card(s) {self.cards}: State lost ({reason})")

    def __reduce__(self):     # crosses process boundaries inside dask errors
        return StateLost, (self.cards, self.reason)


class StepAborted(RuntimeError):
    """A submission of a step that was already aborted here (a task that started late)."""


@dataclass
class Hooks:
    """Per-engine run hooks: fault injection (fires once), span recording, simulated device time per
    node (``--backend pypto-sim``) and its log by node key for the step summary."""
    fail_at: str | None = None
    tracer: object = None
    device_time: object = None                   # (state, node, args) -> µs or None
    sim_log: dict = field(default_factory=dict)  # node key -> (card, kernel, µs)
    check: object = None                         # (state, node, args, value) -> None after each node (--check)


@dataclass
class Owned:
    states: dict = field(default_factory=dict)   # card -> CardState
    hooks: Hooks = field(default_factory=Hooks)
    fence: int = 0                               # steps up to this one were aborted: their late tasks refuse
    busy: int = 0                                # submissions of this engine running now
    cond: threading.Condition = field(default_factory=threading.Condition)

    def enter(self, step: int):
        with self.cond:
            if step <= self.fence:
                raise StepAborted(f"step {step} was aborted")
            self.busy += 1

    def leave(self):
        with self.cond:
            self.busy -= 1
            self.cond.notify_all()


_OWNED: dict[str, Owned] = {}
_LOCK = threading.Lock()


def owned(engine: str) -> Owned:
    """The engine's entry here, created empty on first use."""
    with _LOCK:
        return _OWNED.setdefault(engine, Owned())


def find(engine: str) -> Owned | None:
    return _OWNED.get(engine)


def engines() -> list[str]:
    """Ids of the engines with an entry in this process."""
    return list(_OWNED)


def install(engine: str, states: dict, device_time=None):
    """Put (or replace) these cards' States; other cards and engines are untouched."""
    entry = owned(engine)
    entry.states.update(states)
    entry.hooks.device_time = device_time


def abort(engine: str, step: int, generation: int) -> int:
    """Fence the step, wait for its running submissions, drop every staged write and undo its commit.

    Returns how many submissions were still running when the abort began (0 in the common case)."""
    entry = find(engine)
    if entry is None:
        return 0
    with entry.cond:
        entry.fence = max(entry.fence, step)
        running = entry.busy
        deadline = time.monotonic() + ABORT_WAIT_S
        while entry.busy and entry.cond.wait(max(0.0, deadline - time.monotonic())):
            pass
        if entry.busy:
            raise RuntimeError(f"abort of step {step}: {entry.busy} submission(s) still running after "
                               f"{ABORT_WAIT_S} s")
    for st in entry.states.values():
        st.caches.abort(step)
        if st.generation == generation + 1:   # its commit was just undone
            st.generation = generation
    return running


def probe(engine: str) -> dict[int, tuple[str, int]]:
    """card -> (build id, generation) of this engine's States here."""
    entry = find(engine)
    return {} if entry is None else {c: (st.build, st.generation) for c, st in entry.states.items()}


def free(engine: str):
    with _LOCK:
        _OWNED.pop(engine, None)
