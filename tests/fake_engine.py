"""A host-side stand-in for an engine: one DP group, no cards, a token per request and step. What
the scheduler and the server ask of an engine besides its tokens; a test subclasses it with the
tokens it needs (``token``) and, where it tests capacity, its own ``fits``."""
from __future__ import annotations

from dsv41.engine.prefix_cache import Hit
from dsv41.engine.protocol import StepOutput
from dsv41.engine.sequence import Sequence


class OneGroupEngine:
    max_batch, max_context = 4, 4096

    def __init__(self):
        self.next, self.last_stats = 0, {}

    def token(self, rid: int) -> int:
        raise NotImplementedError

    def started(self, rid: int):
        """A new request got its id."""

    def step(self, batch, phase, sampling=None, drafts=None, draft_probs=None):
        rids = []
        for rid, _ in batch:
            if rid is None:
                rid, self.next = self.next, self.next + 1
                self.started(rid)
            rids.append(rid)
        return self._out(rids)

    def decode(self, tokens, rids, drafts=None, draft_probs=None):
        return self._out(rids)

    def _out(self, rids):
        return StepOutput(rids, [[self.token(r)] for r in rids], fetch=lambda: None)

    def group_of(self, rid):
        return 0

    def place(self, count):
        return [0] * count

    def needs(self, rid, n_new, drawn=0, hit=None, group=0):
        return {"rows": n_new}

    prefix_caching = False

    def cached_prefix(self, group, tokens, min_feed=1):
        return Hit()

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
