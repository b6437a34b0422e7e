"""DSpark in the graph: the seed, draft and head nodes of a step make the drafts the golden DSpark
(``model.dspark`` over the reference engine's taps, ``engine.dspark.DSparkDrafter``) makes, bit for
bit: tokens, confidence scores, the draft logits (Markov bias included) and a sampling request's
draft distributions; after a verify step that kept only some rows; and a request recomputed after
preemption drafts again, from the windows its recompute prefill seeded."""
from types import SimpleNamespace

import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.config import TINY, Topology
from dsv41.engine.dspark import DSparkDrafter
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.scheduler import Scheduler, jobs_for
from dsv41.model.dspark import seeded_sampler
from dsv41.ops.sampling import SamplingParams

V = TINY.vocab_size
PROMPTS = [[(5 * i + 11 * j) % V for j in range(n)] for i, n in enumerate((12, 19, 7))]
SAMPLING = [None, SamplingParams(temperature=0.8, top_k=40, seed=5), None]
CTX = 64


class Golden:
    """The reference engine with the golden drafter; ``drafts`` runs its stages on the windows the
    drafter holds and keeps everything they made."""

    def __init__(self):
        self.engine = ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX)
        self.drafter = DSparkDrafter(self.engine, self.engine.host_weights())
        self.jobs = []

    def step(self, phase: str, out, params):
        if phase == "prefill":
            self.jobs = [SimpleNamespace(id=i, rid=r, params=p or SamplingParams()) for i, (r, p) in
                         enumerate(zip(out.request_ids, params))]
        for job, last in zip(self.jobs, out.last):
            job.last = last
        self.drafter.observe(phase, self.jobs, out)

    def drafts(self):
        windows = [self.drafter.windows[j.id] for j in self.jobs]
        dists = {}
        sample = seeded_sampler([(j.params, self.engine.sequence(j.rid).seed, w.length)
                                 for j, w in zip(self.jobs, windows)], dists)
        made = self.drafter.model.draft(torch.tensor([j.last for j in self.jobs]), windows, self.drafter.tables, sample)
        return made, dists


def graph_drafts(engine: GraphEngine, rids: list[int]):
    """(tokens, confidences, distributions per request, draft logits [B, block, V]) the last step
    made, the logits from the head card of DP group 0 (the only group)."""
    made = [engine.drafts[r] for r in rids]
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


def test_the_graphs_drafts_are_the_golden_drafts_after_prefill_and_a_partly_rejected_verify():
    plain = jobs_for(PROMPTS, SAMPLING, 6, None)
    Scheduler(ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX)).run(plain)
    golden = Golden()
    engine = GraphEngine(TINY, Topology(2, 1, 2), seed=0, executor="sync", max_batch=4, max_context=CTX)
    try:
        engine.dspark = True
        out = engine.prefill(PROMPTS, SAMPLING)
        golden.step("prefill", golden.engine.prefill(PROMPTS, SAMPLING), SAMPLING)
        rids = out.request_ids
        assert_same_drafts(graph_drafts(engine, rids), golden.drafts())
        assert any(q is not None for q in engine.drafts[rids[1]][2:])      # the sampling request's distributions
        # request i accepts 3 - i of the true continuation, then a wrong draft: kept rows differ per request
        truth = [j.made for j in plain]
        drafts = [t[1:4 - i] + [(t[4 - i] + 1) % V] for i, t in enumerate(truth)]
        last = [t[0] for t in truth]
        out = engine.decode(last, rids, drafts)
        ref = golden.engine.decode(last, golden.engine.active, drafts)
        assert out.accepted == ref.accepted == [3, 2, 1]
        golden.step("decode", ref, SAMPLING)
        assert_same_drafts(graph_drafts(engine, rids), golden.drafts())
    finally:
        engine.close()


def test_a_request_recomputed_after_preemption_drafts_again():
    history = PROMPTS[1] + [7, 300, 41]
    golden = Golden()
    golden.step("prefill", golden.engine.prefill([history]), [None])
    engine = GraphEngine(TINY, Topology(1, 1, 1), seed=0, executor="sync", max_batch=2, max_context=CTX)
    try:
        engine.dspark = True
        rid = engine.prefill([PROMPTS[1]]).request_ids[0]
        state = engine.sequence(rid)
        engine.release(rid)
        assert rid not in engine.drafts
        again = engine.restart(history, state)
        made, _ = golden.drafts()
        tokens, conf, _, _ = graph_drafts(engine, [again])
        assert torch.equal(tokens, made.tokens) and torch.equal(conf, made.confidence)
    finally:
        engine.close()
