"""Speculative steps: a verify step keeps the accepted prefix of each request's drafts and publishes
only the rows that fed it, so generation with any drafter gives exactly the tokens and logits of
generation without one (greedy and seeded sampling), on every layout; preemption recomputes to the
same tokens; a lost card mid-verify recovers to them.

Oracle: plain generation (the scheduler with no drafter) on the reference engine, run once for the
module (every layout gives its logits bytes), or on the same engine."""
from contextlib import contextmanager

import pytest
import torch

from dsv41.cluster import registry
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.cluster.runtime import NodeError
from dsv41.config import FLASH, TINY, Topology
from dsv41.engine.drafters import Drafter, NgramDrafter, OracleDrafter
from dsv41.engine.dspark import dspark_drafter
from dsv41.engine.reference import ReferenceEngine
from dsv41.model import caches as cache
from dsv41.ops.sampling import SamplingParams
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler

V = TINY.vocab_size
BS = TINY.block_size
NEW = 10
# lengths whose generation crosses the page boundary at 16 and both parities
PROMPTS = [[(7 * i + 3 * j) % V for j in range(n)] for i, n in enumerate((13, 14, 9))]
SAMPLED = [SamplingParams(temperature=0.9, top_k=50, seed=11 + i) for i in range(len(PROMPTS))]
CTX = 64


def generate(engine, drafter=None, sampling=None, prompts=PROMPTS, new=NEW, context=0):
    """Each request's tokens, the logits of its last token, the scheduler (its spec counts)."""
    jobs = requests_for(prompts, sampling, new, None)
    sched = Scheduler(engine, drafter, keep_logits=True, context=context)
    sched.run(jobs)
    return [j.made for j in jobs], torch.stack([j.final_logits for j in jobs]), sched


class Policy:
    """Oracle drafts from the plain run's tokens: accept ``pick(job index, step)`` of them, then a
    wrong one; records each rejected draft's position."""

    def __init__(self, truth, pick, prompts=PROMPTS):
        self.truth, self.pick, self.prompts, self.rejected, self.steps = truth, pick, prompts, [], {}

    def __call__(self, job, room):
        i = self.prompts.index(job.prompt)
        step = self.steps[i] = self.steps.get(i, -1) + 1
        m, t = len(job.made), self.truth[i]
        a = min(self.pick(i, step, room), room)
        drafts = t[m:m + a]
        if a < room:
            drafts = drafts + [(t[m + a] + 1) % V] + t[m + a + 1:m + room]
            self.rejected.append(len(job.prompt) + m + a)
        return drafts


ALL = lambda i, step, room: room            # noqa: E731
NONE = lambda i, step, room: 0              # noqa: E731
PREFIXES = lambda i, step, room: (step + 2 * i) % (room + 1)   # noqa: E731  every length, differing per request


def assert_same(plain, spec):
    assert spec[0] == plain[0]
    assert torch.equal(spec[1], plain[1])


@pytest.fixture(scope="module")
def plain_runs():
    """Plain generation of PROMPTS on the reference engine, greedy and with SAMPLED, run once for the
    module: the oracle of every engine's speculative runs (each layout gives the reference's logits
    bytes, tests/test_cluster.py, so a layout's runs are held to the reference's directly)."""
    ref = ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX)
    return generate(ref), generate(ref, sampling=SAMPLED)


def check_layout(engine, full: bool, oracle):
    """Greedy and seeded sampling: oracle drafts (every policy when full, else prefixes) and n-gram;
    ``oracle``: plain_runs."""
    plain, sampled = oracle
    policies = [ALL, NONE, PREFIXES] if full else [PREFIXES]
    for pick in policies:
        policy = Policy(plain[0], pick)
        spec = generate(engine, OracleDrafter(policy))
        assert_same(plain, spec)
        accepted = spec[2].spec.accepted
        if pick is ALL:
            assert accepted == spec[2].spec.drafted > 0 and not policy.rejected
        if pick is NONE:
            assert accepted == 0 < spec[2].spec.drafted
        if pick is PREFIXES:
            assert 0 < accepted < spec[2].spec.drafted
            # rejections at a page boundary and at odd and even positions (the ratio-2 pair state)
            assert any(p % BS == 0 for p in policy.rejected)
            assert {p % 2 for p in policy.rejected} == {0, 1}
    if full:                                           # prompts that repeat themselves: n-gram proposes
        periodic = [[5, 9, 2, 7] * 4, [3, 1] * 7]
        ngram = generate(engine, NgramDrafter(5), prompts=periodic)
        assert ngram[2].spec.drafted > 0
        assert_same(generate(engine, prompts=periodic), ngram)
    assert sampled[0] != plain[0]                      # the draws are not greedy
    assert_same(sampled, generate(engine, OracleDrafter(Policy(sampled[0], PREFIXES)), SAMPLED))
    assert engine.blocks_in_use()[0] == 0              # every request released


def check_dspark(engine, other, plain):
    """DSpark drafting: greedy tokens and logits equal plain generation (``plain``: plain_runs'
    greedy run); seeded sampling (the speculative-sampling rule over the stages' draft distribution)
    equal on both engines."""
    spec = generate(engine, dspark_drafter(engine))
    assert_same(plain, spec)
    assert spec[2].spec.drafted > 0
    a = generate(engine, dspark_drafter(engine), SAMPLED)
    b = generate(other, dspark_drafter(other), SAMPLED)
    assert_same(a, b)
    assert a[2].spec.drafted > 0


LAYOUTS = [("sync", Topology(1, 1, 1), "sharded"), ("threads", Topology(2, 2, 4), "sharded"),
           ("distributed", Topology(2, 2, 4), "sharded"), ("threads", Topology(4, 1, 4), "sharded"),
           ("threads", Topology(4, 1, 4), "replicated")]


@contextmanager
def graph_engine(executor="threads", topo=Topology(2, 2, 4), wiring="sharded", max_context=CTX, cfg=TINY):
    engine = GraphEngine(cfg, topo, EngineConfig(seed=0, executor=executor, wiring=wiring, max_batch=4,
                                                 max_context=max_context))
    try:
        yield engine
    finally:
        engine.close()


def test_dspark_drafts_on_the_reference_and_the_graph(plain_runs):
    with graph_engine() as graph:
        check_dspark(ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX), graph, plain_runs[0])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("executor,topo,wiring", LAYOUTS)
def test_dspark_drafts_on_every_layout(executor, topo, wiring, plain_runs):
    with graph_engine(executor, topo, wiring) as engine:
        check_dspark(engine, ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX), plain_runs[0])
        # fewer drafts a step, cut where the stages' confidence falls below one half
        assert_same(plain_runs[0], generate(engine, dspark_drafter(engine, k=3, confidence=0.5)))


def test_reference_speculative_equals_plain(plain_runs):
    check_layout(ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX), True, plain_runs)


def test_graph_speculative_equals_plain_on_tp2_dp2(plain_runs):
    with graph_engine() as engine:
        check_layout(engine, False, plain_runs)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("executor,topo,wiring", LAYOUTS)
def test_every_layout_speculative_equals_plain(executor, topo, wiring, plain_runs):
    with graph_engine(executor, topo, wiring) as engine:
        check_layout(engine, True, plain_runs)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_speculative_equals_plain_at_flash_width_and_16k_context():
    """Three FLASH-width layers (two SWA, one ratio-2 FULL with its indexer over 8,192 compressed
    keys), two requests at 16,384 tokens of drawn context: oracle drafts accepting prefixes of every
    length give plain generation's tokens and logits on the reference and on threads TP4/DP2/EP8."""
    cfg = FLASH.reduced(layers=3, experts=8, engram_rows=4099)
    context, prompts = 16384, [[7, 3], [11, 5, 9]]
    def run(make, drafter=None):
        engine = make()        # a fresh engine: the drawn history is drawn for the request ids
        try:
            return generate(engine, drafter, prompts=prompts, new=6, context=context)
        finally:
            engine.close()
    for make in (lambda: ReferenceEngine(cfg, seed=0, max_batch=2, max_context=context + 16),
                 lambda: GraphEngine(cfg, Topology(4, 2, 8), EngineConfig(seed=0, executor="threads", max_batch=2,
                                                                          max_context=context + 16))):
        plain = run(make)
        policy = Policy(plain[0], PREFIXES, prompts)
        assert_same(plain, run(make, OracleDrafter(policy)))
        assert policy.rejected and {p % 2 for p in policy.rejected} == {0, 1}


# ---- rollback: the published caches of a verify step equal a plain run's at the same position ---------

def published_rows(engine, rid) -> dict:
    """Request rid's published cache rows by logical position: window rows in its window, every
    compressed and index row, its ring slots; raw bytes."""
    seq, caches = engine.host.tables[0].requests[rid], engine.caches
    kv, cfg = seq.kv_len, engine.cfg
    out = {}

    def raw(name, slots):
        return [t[slots].contiguous().view(torch.uint8) for t in caches.read(name)]
    window = [p for p in range(max(0, kv - cfg.sliding_window), kv)]
    for spec in cfg.layers:
        slots = torch.tensor([seq.window_pages[p // BS] * BS + p % BS for p in window])
        out[cache.window(spec.layer)] = raw(cache.window(spec.layer), slots)
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        rows = range(kv // r)
        slots = torch.tensor([seq.compressed_pages[r][q // BS] * BS + q % BS for q in rows], dtype=torch.long)
        out[cache.compressed(s)] = raw(cache.compressed(s), slots)
        out[cache.index(s)] = raw(cache.index(s), slots)
        if r == 2:
            cap = cfg.state_capacity
            ring = torch.tensor([seq.state_block * cap + p % cap for p in range(max(0, kv - cap), kv)])
            out[cache.ring(s)] = raw(cache.ring(s), ring)
    return out


def accepted_slots(engine, rid, first: int, end: int) -> dict:
    """Physical slots written by positions [first, end) of request rid, per cache."""
    seq, cfg = engine.host.tables[0].requests[rid], engine.cfg
    out = {}
    # the backbone's windows and DSpark's stages' (layer ids past the backbone), at the same slots
    for layer in range(cfg.num_hidden_layers + cfg.n_mtp_layers):
        out[cache.window(layer)] = {seq.window_pages[p // BS] * BS + p % BS for p in range(first, end)}
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        rows = [p // r for p in range(first, end) if (p + 1) % r == 0]
        out[cache.compressed(s)] = out[cache.index(s)] = \
            {seq.compressed_pages[r][q // BS] * BS + q % BS for q in rows}
        if r == 2:
            out[cache.ring(s)] = {seq.state_block * cfg.state_capacity + p % cfg.state_capacity
                                  for p in range(first, end)}
    return out


def snapshot(engine):
    return {name: [t.clone() for t in ts] for name, ts in engine.caches.committed.items()}


def test_a_rejected_step_publishes_only_its_accepted_rows():
    plain = ReferenceEngine(TINY, seed=0, max_batch=2, max_context=CTX)
    spec = ReferenceEngine(TINY, seed=0, max_batch=2, max_context=CTX)
    prompts = [PROMPTS[0], PROMPTS[2]]
    truth = plain.generate(prompts, 24)
    full = [p + t for p, t in zip(prompts, truth)]
    a, b = plain.prefill(prompts), spec.prefill(prompts)
    plain_rids, spec_rids = a.request_ids, b.request_ids
    made = [1, 1]
    lasts = list(b.last)
    picks = [(2, 0), (0, 5), (4, 3), (5, 1), (1, 2)]      # accepted drafts per request, step by step
    for accept in picks:
        drafts = []
        for i, n in enumerate(accept):
            t = truth[i]
            d = t[made[i]:made[i] + n] + [(t[made[i] + n] + 1) % V]
            drafts.append((d + t[made[i] + n + 1:made[i] + 5])[:5])
        before = snapshot(spec)
        kv0 = [spec.host.tables[0].requests[r].kv_len for r in spec_rids]
        out = spec.decode(lasts, spec_rids, drafts)
        assert out.accepted == list(accept)
        assert out.tokens == [truth[i][made[i]:made[i] + n + 1] for i, n in enumerate(accept)]
        # every byte the step changed belongs to an accepted row's write
        allowed = [accepted_slots(spec, r, k, spec.host.tables[0].requests[r].kv_len) for r, k in zip(spec_rids, kv0)]
        for name, ts in spec.caches.committed.items():
            for t, old in zip(ts, before[name]):
                changed = (t.view(torch.uint8) != old.view(torch.uint8)).reshape(t.shape[0], -1).any(1)
                rows = set(torch.nonzero(changed).flatten().tolist())
                assert rows <= set().union(*(x[name] for x in allowed)), name
        # the plain engine, a token a step, to the same positions, publishes the same rows
        while True:
            live = [i for i in range(2) if plain.host.tables[0].requests[plain_rids[i]].kv_len
                    < spec.host.tables[0].requests[spec_rids[i]].kv_len]
            if not live:
                break
            plain.decode([full[i][plain.host.tables[0].requests[plain_rids[i]].kv_len] for i in live],
                         [plain_rids[i] for i in live])
        for i in range(2):
            assert plain.host.tables[0].requests[plain_rids[i]].kv_len == spec.host.tables[0].requests[spec_rids[i]].kv_len
            p_rows, s_rows = published_rows(plain, plain_rids[i]), published_rows(spec, spec_rids[i])
            for name in p_rows:
                for x, y in zip(p_rows[name], s_rows[name]):
                    assert torch.equal(x, y), (name, i)
        for i, n in enumerate(accept):
            made[i] += n + 1
        lasts = out.last
    assert spec.blocks_in_use() == plain.blocks_in_use()


# ---- preemption, recovery ---------------------------------------------------------------------------

# seeded sampling after a preemption is in the default run with DSpark's drafts (the next test)
@pytest.mark.parametrize("sampling", [None, pytest.param(SAMPLED, marks=pytest.mark.slow)], ids=["greedy", "sampled"])
def test_preemption_recomputes_to_the_tokens_of_an_unconstrained_run(sampling):
    prompts = [p + p[:7] for p in PROMPTS]                  # 20-ish tokens each
    roomy = ReferenceEngine(TINY, seed=0, max_batch=3, max_context=CTX)
    tight = ReferenceEngine(TINY, seed=0, max_batch=3, max_context=CTX, cache_tokens=100)
    plain = generate(roomy, sampling=sampling, prompts=prompts, new=30)
    jobs = requests_for(prompts, sampling, 30, None)
    turns = Scheduler(tight, keep_logits=True).run(jobs)
    assert [t.phase for t in turns].count("restart") >= 1 and any(j.preemptions for j in jobs)
    assert [j.made for j in jobs] == plain[0]
    assert torch.equal(torch.stack([j.final_logits for j in jobs]), plain[1])
    assert tight.blocks_in_use()[0] == 0


def test_preemption_with_dspark_sampling_recomputes_to_the_tokens_of_an_unconstrained_run():
    """A preempted request's recompute seeds DSpark's windows and draws its next drafts with its own
    seed, so seeded sampling with DSpark's drafts makes the tokens of a run never preempted."""
    prompts = [p + p[:7] for p in PROMPTS]
    roomy = ReferenceEngine(TINY, seed=0, max_batch=3, max_context=CTX)
    tight = ReferenceEngine(TINY, seed=0, max_batch=3, max_context=CTX, cache_tokens=100)
    plain = generate(roomy, dspark_drafter(roomy), SAMPLED, prompts, 30)
    jobs = requests_for(prompts, SAMPLED, 30, None)
    sched = Scheduler(tight, dspark_drafter(tight), keep_logits=True)
    turns = sched.run(jobs)
    restarted = [j for j in jobs if j.preemptions]
    assert [t.phase for t in turns].count("restart") >= 1 and restarted
    # the decode step after each restart verified drafts again
    after = [turns[i + 1] for i, t in enumerate(turns[:-1]) if t.phase == "restart"]
    assert any(t.out.proposed and any(t.out.proposed) for t in after if t.phase == "decode")
    assert [j.made for j in jobs] == plain[0]
    assert torch.equal(torch.stack([j.final_logits for j in jobs]), plain[1])


def test_a_request_the_pools_can_never_hold_fails_clearly():
    tight = ReferenceEngine(TINY, seed=0, max_batch=1, max_context=CTX, cache_tokens=16)
    with pytest.raises(ValueError, match="cache pools cannot hold"):
        generate(tight, prompts=[list(range(40))], new=5)
    assert tight.blocks_in_use()[0] == 0


@pytest.mark.timeout(600)
def test_verify_steps_recover_a_lost_card_and_abort_an_injected_failure():
    engine = GraphEngine(TINY, Topology(1, 2, 2), EngineConfig(seed=0, executor="threads", max_batch=4,
                                                               max_context=CTX))
    try:
        plain = generate(engine)
        policy = Policy(plain[0], PREFIXES)
        calls = []

        def lose_then_draft(job, room):
            calls.append(1)
            if len(calls) == 5:                           # right before the second verify step
                registry.find(engine.id).states.pop(1)
            return policy(job, room)
        spec = generate(engine, OracleDrafter(lose_then_draft))
        assert_same(plain, spec)
        leaf = next(k for k, n in engine.last_graph.nodes.items() if n.kernel.startswith("attn.leaf") and n.card == 0)
        fail_calls = []

        def fail_then_draft(job, room):
            fail_calls.append(1)
            if len(fail_calls) == 4:                      # the second verify step fails in a leaf
                engine.inject_failure(leaf)
            return policy(job, room)
        policy = Policy(plain[0], PREFIXES)
        try:
            with pytest.raises(NodeError, match=leaf):
                generate(engine, OracleDrafter(fail_then_draft))
        finally:
            engine.inject_failure(None)
        assert engine.blocks_in_use()[0] == 0
        assert_same(plain, generate(engine, OracleDrafter(Policy(plain[0], PREFIXES))))
    finally:
        engine.close()


def test_ngram_proposes_what_followed_the_latest_longest_match():
    class J:
        def __init__(self, prompt, made=()):
            self.prompt, self.made = list(prompt), list(made)
    d = NgramDrafter(3, 1, 3)
    assert d.propose(J([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]), 5) == [8, 1, 2]    # latest 3-gram match
    assert d.propose(J([4, 5, 6, 7], [5]), 5) == [6, 7, 5]                   # 1-gram, history includes made
    assert d.propose(J([1, 2, 3, 4]), 5) == []                              # nothing repeats
    assert d.propose(J([1, 2, 1, 2, 1, 2]), 2) == [1, 2]                    # room caps the proposal
    with pytest.raises(ValueError, match="ngram_min"):
        NgramDrafter(3, 4, 2)


class Distributed(Drafter):
    """Drafts drawn from a fixed distribution (one seeded stream per request and position), given
    with it: a sampling request accepts them by the speculative-sampling rule."""

    def propose_batch(self, jobs, rooms):
        q = torch.softmax(torch.arange(V, dtype=torch.float64) % 7, 0)
        drafts, probs = [], []
        for job, room in zip(jobs, rooms):
            g = torch.Generator().manual_seed(len(job.prompt) * 1000 + len(job.made))
            drafts.append([int(t) for t in torch.multinomial(q, room, replacement=True, generator=g)] if room else [])
            probs.append(q.expand(room, V).clone() if room else None)
        return drafts, probs


def test_drafts_with_their_distribution_draw_the_same_tokens_on_every_layout(plain_runs):
    ref = ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX)
    with graph_engine() as graph:
        a = generate(ref, Distributed(), SAMPLED)
        b = generate(graph, Distributed(), SAMPLED)
    assert_same(a, b)
    assert a[2].spec.drafted > 0
    # greedy requests ignore the distribution: drafts accepted while they equal the argmax
    assert_same(plain_runs[0], generate(ref, Distributed()))
