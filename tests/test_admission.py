"""Admission by what fits: 32 concurrent requests whose contexts sum past the cache budget all
finish with the tokens of a run with room for all of them; every block returns; on DP2 a request is
preempted only in a DP group whose free blocks could not hold its requests' next decode step.

Oracle: the same requests on the reference engine with pools sized for every request at its full
context (a request's tokens do not depend on what it is batched with, tests/test_speculative.py)."""
import pytest

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler

V = TINY.vocab_size
CTX, NEW, COUNT = 64, 14, 32
PROMPTS = [[(13 * i + 5 * j) % V for j in range(6 + i % 15)] for i in range(COUNT)]


class Watched(Scheduler):
    """Checks every preemption against the group's free blocks, counted from its pools."""

    def _preempt(self, job, group):
        table = self.engine.host.tables[group]
        decoding = [j for j in self.running.values() if not j.feed and self._group(j) == group]
        need: dict = {}
        for j in decoding:
            for k, n in table.blocks.needs(self.engine.sequence(j.id), 1).items():
                need[k] = need.get(k, 0) + n
        pools = table.pools
        free = {"window": len(pools.window), "state": len(pools.state), **{r: len(b) for r, b in pools.compressed.items()}}
        assert self._group(job) == group
        assert any(free[k] < n for k, n in need.items()), f"group {group} had room, yet lost a request"
        super()._preempt(job, group)


@pytest.mark.timeout(1800)
def test_requests_past_the_cache_budget_all_finish_with_their_tokens():
    roomy = ReferenceEngine(TINY, seed=0, max_batch=8, max_context=CTX)
    want = requests_for(PROMPTS, None, NEW, None)
    Scheduler(roomy).run(want)
    budget = 2 * 100                                  # tokens in all: 100 per DP group, 16 requests reach ~30 each
    engine = GraphEngine(TINY, Topology(1, 2, 2), EngineConfig(seed=0, executor="threads", max_batch=16,
                                                               max_context=CTX, cache_tokens=budget // 2))
    try:
        jobs = requests_for(PROMPTS, None, NEW, None)
        sched = Watched(engine, budget=24)
        sched.run(jobs)
        assert [j.made for j in jobs] == [j.made for j in want]
        assert sched.victims and {g for _, g in sched.victims} <= {0, 1}
        assert engine.blocks_in_use()[0] == 0
    finally:
        engine.close()
