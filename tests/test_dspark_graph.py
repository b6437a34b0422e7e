"""DSpark in the graph: the seed, draft and head nodes of a step make the drafts the golden DSpark
(``model.dspark`` over the reference engine's taps, ``engine.dspark.DSparkDrafter``) makes, bit for
bit: tokens, confidence scores, the draft logits (Markov bias included) and a sampling request's
draft distributions; after a verify step that kept only some rows; and a request recomputed after
preemption drafts again, from the windows its recompute prefill seeded."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import FLASH, TINY, Topology
from dsv41.engine.dspark import DSparkDrafter
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.layout import Part
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.model.dspark import seeded_sampler
from dsv41.ops.sampling import SamplingParams

V = TINY.vocab_size
PROMPTS = [[(5 * i + 11 * j) % V for j in range(n)] for i, n in enumerate((12, 19, 7))]
SAMPLING = [None, SamplingParams(temperature=0.8, top_k=40, seed=5), None]
CTX = 64


class Golden:
    """The reference engine with the golden drafter; ``drafts`` runs its stages on the windows the
    drafter holds and keeps everything they made."""

    def __init__(self, cfg=TINY, ctx=CTX):
        self.engine = ReferenceEngine(cfg, seed=0, max_batch=4, max_context=ctx)
        self.drafter = DSparkDrafter(self.engine, self.engine.host_weights())
        self.jobs = []

    def step(self, phase: str, out, params):
        if phase == "prefill":
            self.jobs = [SimpleNamespace(id=r, params=p or SamplingParams()) for r, p in zip(out.request_ids, params)]
        for job, last in zip(self.jobs, out.last):
            job.last = last
        self.drafter.observe(phase, self.jobs, out)

    def drafts(self):
        windows = [self.drafter.windows[j.id] for j in self.jobs]
        dists = {}
        sample = seeded_sampler([(j.params, self.engine.sequence(j.id).seed, w.length)
                                 for j, w in zip(self.jobs, windows)], dists)
        made = self.drafter.model.draft(torch.tensor([j.last for j in self.jobs]), windows, self.drafter.tables, sample)
        return made, dists


def graph_drafts(engine: GraphEngine, rids: list[int]):
    """(tokens, confidences, distributions per request, draft logits [B, block, V]) the last step
    made, the logits from the head card of DP group 0 (the only group)."""
    made = [engine.sequence(r).drafted for r in rids]
    _, logits = engine.states()[engine.topo.group_cards(0)[0]].draft_logits[0]
    return torch.stack([m[0] for m in made]), torch.stack([m[1] for m in made]), [m[2] for m in made], logits


def assert_same_drafts(graph, golden):
    tokens, conf, probs, logits = graph
    made, dists = golden
    assert torch.equal(tokens, made.tokens)
    assert torch.equal(conf, made.confidence)
    assert torch.equal(logits, made.logits)
    for b, q in enumerate(probs):
        assert (q is None) == (b not in dists)
        if q is not None:
            assert torch.equal(q, torch.stack(dists[b]))


def check_graph_drafts(cfg, topo: Topology, prompts, sampling, ctx: int):
    """Prefill, then a verify step in which request i accepts 3 - i drafts of the true continuation and
    rejects the next: after each, the graph's drafts equal the golden's."""
    v = cfg.vocab_size
    plain = requests_for(prompts, sampling, 6, None)
    Scheduler(ReferenceEngine(cfg, seed=0, max_batch=4, max_context=ctx)).run(plain)
    golden = Golden(cfg, ctx)
    engine = GraphEngine(cfg, topo, EngineConfig(seed=0, executor="sync", max_batch=4, max_context=ctx))
    try:
        engine.dspark = True
        out = engine.prefill(prompts, sampling)
        golden.step("prefill", golden.engine.prefill(prompts, sampling), sampling)
        rids = out.request_ids
        assert_same_drafts(graph_drafts(engine, rids), golden.drafts())
        truth = [j.made for j in plain]
        drafts = [t[1:4 - i] + [(t[4 - i] + 1) % v] for i, t in enumerate(truth)]
        last = [t[0] for t in truth]
        out = engine.decode(last, rids, drafts)
        ref = golden.engine.decode(last, golden.engine.active, drafts)
        assert out.accepted == ref.accepted == [3 - i for i in range(len(prompts))]
        golden.step("decode", ref, sampling)
        assert_same_drafts(graph_drafts(engine, rids), golden.drafts())
        return [engine.sequence(r).drafted for r in rids]
    finally:
        engine.close()


def test_the_graphs_drafts_are_the_golden_drafts_after_prefill_and_a_partly_rejected_verify():
    drafts = check_graph_drafts(TINY, Topology(2, 1, 2), PROMPTS, SAMPLING, CTX)
    assert drafts[1][2] is not None and drafts[0][2] is None   # the sampling request's distributions


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_flash_width_graph_drafts_are_the_golden_drafts():
    """FLASH width (3 layers, 3 stages, 8 experts each, small Engram tables and a 4096-token vocabulary),
    TP2 and EP2: a 131-token prompt (the 128-slot window wraps) beside a short one."""
    cfg = replace(FLASH.reduced(layers=3, experts=8, engram_rows=4099), name="flash-dspark-graph-test",
                  vocab_size=4096, dspark_noise_token_id=4000).validate()
    prompts = [[(3 * j + 1) % cfg.vocab_size for j in range(131)], [9, 4000, 17]]
    check_graph_drafts(cfg, Topology(2, 1, 2), prompts, [None, SamplingParams(temperature=0.7, seed=3)], 160)


def test_a_request_recomputed_after_preemption_drafts_again():
    history = PROMPTS[1] + [7, 300, 41]
    golden = Golden()
    golden.step("prefill", golden.engine.prefill([history]), [None])
    engine = GraphEngine(TINY, Topology(1, 1, 1), EngineConfig(seed=0, executor="sync", max_batch=2, max_context=CTX))
    try:
        engine.dspark = True
        rid = engine.prefill([PROMPTS[1]]).request_ids[0]
        state = engine.sequence(rid)
        engine.release(rid)
        assert rid not in engine.active
        # recomputed as the scheduler does a preempted request (one chunk here, under its one id),
        # its state settled
        assert state.drafted is not None
        again = engine.run([Part(rid, history, sampling=state.sampling, start=True)], "prefill").request_ids[0]
        assert again == rid
        engine.host.settle(again, state)
        made, _ = golden.drafts()
        tokens, conf, _, _ = graph_drafts(engine, [again])
        assert torch.equal(tokens, made.tokens) and torch.equal(conf, made.confidence)
    finally:
        engine.close()
