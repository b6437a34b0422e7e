"""What a ``GraphEngine`` tells whoever watches its steps (tracing, for one), without knowing who.

An observer is registered with ``GraphEngine.observe`` and removed with ``GraphEngine.unobserve``.
Packages above ``cluster/`` implement it (``telemetry.session.TraceSession``); the engine imports
none of them.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext


class StepObserver:
    """The defaults observe nothing; an observer overrides what it needs."""

    def step(self, plan) -> AbstractContextManager:
        """Entered around running one planned step (``cluster.plan.Plan``, already stamped with the
        engine, step and expected States) on the cards; an exception from the step passes through it."""
        return nullcontext()

    def attach(self, cards: list[int]):
        """The workers now serving these cards are new (a recovery rebuilt their States): whatever the
        observer keeps on workers must be put there again."""
