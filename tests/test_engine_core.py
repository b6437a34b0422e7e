"""The engine core: a request is one record with one id from arrival to end (across preemption),
a step ships only device inputs to the cards (host bookkeeping stays in ``Planned``), and the
requests' host state has one owner (``engine.host``), the engines only execute planned steps."""
import dataclasses
import pickle

import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.engine.blocks import BlockManager, Pools
from dsv41.engine.host import HostState
from dsv41.engine.layout import StepLayout
from dsv41.engine.protocol import parts_of
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.routing import Router
from dsv41.engine.requests import RequestTable, StepInputs
from dsv41.engine.scheduler import Scheduler
from dsv41.engine.sequence import Sequence
from dsv41.ops.sampling import SamplingParams

V = TINY.vocab_size
PROMPTS = [[(11 * i + 3 * j) % V for j in range(5 + 2 * i)] for i in range(6)]


def test_a_request_keeps_its_one_id_through_preemption():
    """Pools for ~2.5 requests at their full length: the scheduler preempts and recomputes, and
    every step the engine runs names each request by the id it arrived with, also when it starts
    again after a preemption; the tokens are those of a run with room for all."""
    roomy = ReferenceEngine(TINY, seed=0, max_batch=6, max_context=64)
    want = requests_for(PROMPTS, None, 12, None)
    Scheduler(roomy).run(want)
    engine = ReferenceEngine(TINY, seed=0, max_batch=6, max_context=64, cache_tokens=64)
    seen, starts = [], []
    run = engine.run

    def recording(parts, phase):
        seen.extend(p.id for p in parts)
        starts.extend(p.id for p in parts if p.start)
        return run(parts, phase)

    engine.run = recording
    requests = requests_for(PROMPTS, None, 12, None)
    sched = Scheduler(engine)
    sched.run(requests)
    ids = {r.id for r in requests}
    assert len(ids) == len(requests) and set(seen) == ids
    assert sched.victims                                   # the pools were short: someone was preempted
    for victim, _ in sched.victims:                         # started again under the same id
        assert starts.count(victim.id) == 1 + victim.preemptions
    assert [r.made for r in requests] == [r.made for r in want]
    assert engine.active == [] and engine.blocks_in_use()[0] == 0


def test_the_layout_is_the_rows_the_parts_feed_and_the_verdict_keeps():
    layout = StepLayout.of(parts_of([(7, [1]), (None, [2, 3, 4]), (9, [5])], drafts=[[6, 7], [], [8]]))
    assert layout.rows == [3, 3, 2] and layout.starts == [0, 3, 6, 8] and layout.proposed == [2, 0, 1]
    assert layout.logit_rows == [0, 1, 2, 5, 6, 7] and layout.first_rows == [0, 3, 4]
    assert [list(layout.logit_span(i)) for i in range(3)] == [[0, 1, 2], [3], [4, 5]]
    assert layout.kept([[6, 1], [4], [3]]) == [2, 3, 1]      # 1 of 2 drafts, the prompt, no draft


def test_a_step_ships_only_device_inputs():
    """What a card receives (``StepInputs``) holds no part, sequence, reservation or token history:
    a request's sampling settings, grammar and history stay with the host's ``Planned`` step."""
    table = RequestTable(TINY, 2, 64)
    first = table.plan(parts_of([(None, list(range(1, 30)))], [SamplingParams(temperature=0.5, seed=1)]), "prefill")
    table.commit(first, [[3]])
    planned = table.plan(parts_of([(first.rids[0], [3])]), "decode")
    names = {f.name for f in dataclasses.fields(StepInputs)}
    assert names == {"layout", "input_ids", "md", "hash_ids", "phase", "logit_rows", "draws"}
    shipped = pickle.dumps(planned.inputs)
    for host in (b"Sequence", b"Reservation", b"Part", b"Planned", b"RequestTable"):
        assert host not in shipped
    assert set(vars(planned.inputs.layout)) == {"ids", "rows", "drafts", "probs", "proposed", "starts", "first_rows",
                                                "logit_rows"}
    assert planned.parts[0].tokens == [3] and isinstance(table.requests[first.rids[0]], Sequence)


def _holds_request_state(value) -> bool:
    """Whether a value is, or directly contains, a piece of the requests' host state."""
    kinds = (RequestTable, BlockManager, Sequence, Router, Pools, HostState)
    if isinstance(value, kinds):
        return True
    if isinstance(value, dict):
        return any(_holds_request_state(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_request_state(v) for v in value)
    return False


@pytest.mark.timeout(600)
def test_the_engines_hold_no_request_state_but_their_host():
    """Sequences, block pools, tables and routing have one owner, the host state (``engine.host``),
    which the scheduler drives; the engine itself holds none of them. Each live request's sequence
    sits in exactly one group's table, under its one id."""
    engines = [ReferenceEngine(TINY, seed=0, max_batch=4, max_context=64),
               GraphEngine(TINY, Topology(1, 2, 2), EngineConfig(seed=0, executor="sync", max_batch=4, max_context=64))]
    try:
        for engine in engines:
            out = engine.prefill([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
            own = {k: v for k, v in vars(engine).items() if k != "host"}
            assert not [k for k, v in own.items() if _holds_request_state(v)]
            assert isinstance(engine.host, HostState) and Scheduler(engine).host is engine.host
            held = [rid for t in engine.host.tables for rid in t.requests]
            assert sorted(held) == sorted(out.request_ids) == engine.active      # one table each
            for rid in out.request_ids:
                assert engine.host.sequence(rid).rid == rid
            if len(engine.host.tables) == 2:                  # DP2: three requests over both groups
                assert {engine.host.group_of(r) for r in out.request_ids} == {0, 1}
    finally:
        engines[1].close()


def test_a_step_is_planned_on_the_host_executed_by_the_engine_and_committed_on_the_host():
    """The anatomy of ``Engine.run``, step by step: the host plans device inputs per DP group, the
    engine executes only those, the host commits the verdict; the tokens and logits are ``run``'s."""
    whole = ReferenceEngine(TINY, seed=0, max_batch=2, max_context=64)
    split = ReferenceEngine(TINY, seed=0, max_batch=2, max_context=64)
    parts = parts_of([(None, [5, 6, 7]), (None, [8, 9])])
    want = whole.run(parts, "prefill")
    step = split.host.plan(parts, "prefill")
    assert set(step.inputs) == {0} and all(isinstance(i, StepInputs) for i in step.inputs.values())
    ran = split.execute(step.inputs, "prefill")
    assert split.active == []                              # nothing on the host changes until the commit
    split.host.commit(step, ran.tokens)
    assert step.split.gather(ran.tokens) == want.tokens and split.active == whole.active
    assert torch.equal(ran.fetch()[0], want.fetch())
    for rid in want.request_ids:
        assert split.host.sequence(rid).tokens == whole.host.sequence(rid).tokens


def test_a_refused_step_leaves_the_host_as_it_was():
    """A group that refuses its share (a request past its context) reserves nothing in any group."""
    engine = ReferenceEngine(TINY, seed=0, max_batch=2, max_context=16)
    free = engine.blocks_in_use()
    with pytest.raises(ValueError, match="max_context is 16"):
        engine.host.plan(parts_of([(None, [1, 2]), (None, list(range(1, 20)))]), "prefill")
    assert engine.blocks_in_use() == free and engine.active == []
