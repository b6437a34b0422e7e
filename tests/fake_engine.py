"""A host-side stand-in for an engine: one DP group, no cards, a token per request and step. What
the scheduler and the server ask of an engine besides its tokens; a test subclasses it with the
tokens it needs (``token``) and, where it tests capacity, its own ``fits``."""
from __future__ import annotations

from dsv41.capacity import CAPACITIES
from dsv41.engine.layout import StepLayout
from dsv41.engine.prefix_cache import Hit
from dsv41.engine.protocol import StepOutput
from dsv41.engine.sequence import Sequence


class OneGroupEngine:
    max_batch, max_context = 4, 4096
    capacity = CAPACITIES["tiny"]

    def __init__(self):
        self.last_stats = {}

    @property
    def host(self):
        """The stand-in is its own host state: what fits, where, the sequences (``engine.host``)."""
        return self

    def token(self, rid: int) -> int:
        raise NotImplementedError

    def started(self, rid: int):
        """A request started (under its own id)."""

    def run(self, parts, phase):
        for part in parts:
            if part.start:
                self.started(part.id)
        return StepOutput(StepLayout.of(parts), [[self.token(p.id)] for p in parts], fetch=lambda: None)

    def group_of(self, rid):
        return 0

    dp = 1

    def place(self, cached, placed):
        return 0, 0

    def needs(self, rid, n_new, drawn=0, hit=None, group=0):
        return {"rows": n_new}

    prefix_caching = False

    def cached_prefixes(self, tokens, prompt_len, min_feed=1, salt_root=b""):
        return [Hit()]

    def fits(self, group, needs):
        return True

    def sequence(self, rid):
        return Sequence(rid, [])

    def settle(self, rid, state):
        pass

    def release(self, rid):
        pass

    def blocks_in_use(self):
        return 0, 0

    def close(self):
        pass
