"""HBM accounting per card: resident weights + allocated caches + transient values by graph liveness.

A node's value is allocated on its card when the node finishes and freed once its last consumer on
the same card has finished; a value another card (or the host) reads is also held until the
submission that produced it has ended, i.e. until it has been sent. Received copies are not charged
to the receiving card: collectives and the expert nodes produce their own outputs there. Every rule
needs only the card's own events, so one worker per card can keep its ledger alone.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class SubmissionTrace:
    """What a card needs to account a submission's values, shipped with the submission."""
    uses: dict            # node key -> consumers on its own card
    remote: frozenset     # node keys read by another card or by the host
    parent: tuple | None  # (trace id, span id) of the step span


def annotate(plan, parent: tuple | None = None) -> None:
    """Attach a SubmissionTrace to every submission of the plan."""
    nodes = plan.graph.nodes
    uses, remote = Counter(), set(plan.outputs)
    for n in nodes.values():
        for i in n.inputs:
            p = nodes.get(i)
            if p is None:
                continue
            if p.card == n.card:
                uses[i] += 1
            else:
                remote.add(i)
    for sub in plan.submissions.values():
        keys = [n.key for n in sub.nodes]
        sub.trace = SubmissionTrace({k: uses[k] for k in keys}, frozenset(k for k in keys if k in remote), parent)


class CardLedger:
    """One card's bytes: ``resident`` (weights + caches) plus the transient values now live."""

    def __init__(self, weights: int, caches: int):
        self.weights, self.caches = weights, caches
        self.transient = self.peak_transient = self.allocated = 0
        self.step = None
        self._live: dict[str, list] = {}    # key -> [bytes, local uses left, held until sent]
        self.lock = threading.Lock()

    @property
    def resident(self) -> int:
        return self.weights + self.caches

    @property
    def live_bytes(self) -> int:
        return self.resident + self.transient

    @property
    def peak_bytes(self) -> int:
        return self.resident + self.peak_transient

    def begin(self, step) -> None:
        """A new step: values left by an aborted one are dropped; the peak spans the whole run."""
        if step != self.step:
            self.step, self._live, self.transient = step, {}, 0

    def produce(self, key: str, nbytes: int, uses: int, remote: bool) -> None:
        self._live[key] = [nbytes, uses, remote]
        self.transient += nbytes
        self.allocated += nbytes
        self.peak_transient = max(self.peak_transient, self.transient)
        self._maybe_free(key)

    def consume(self, key: str) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[1] -= 1
            self._maybe_free(key)

    def sent(self, key: str) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[2] = False
            self._maybe_free(key)

    def _maybe_free(self, key: str) -> None:
        nbytes, uses, held = self._live[key]
        if uses <= 0 and not held:
            del self._live[key]
            self.transient -= nbytes
