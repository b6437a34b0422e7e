"""Sampling on the card: the head's draws equal the golden ``ops.sampling.sample`` applied on the
host to the same logits with the request's (seed, draw index) generator, on the reference engine
and on every executor and layout; a recovery replay leaves the draws where they were; requests end
at their stop ids and limits."""
import pytest
import torch

from dsv41.cluster import registry
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.engine.reference import ReferenceEngine
from dsv41.ops.stopping import Stops
from dsv41.ops.sampling import RequestGenerator, SamplingParams, sample

PROMPTS = [[5, 9, 100, 7, 300, 2], [11, 2, 3]]
STEPS = 5
CTX = 16
PARAMS = [SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=STEPS),
          SamplingParams(temperature=1.3, top_p=0.9, min_p=0.01, seed=12, presence_penalty=0.5,
                         frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2, max_tokens=STEPS)]


def drive(engine, between=None):
    """STEPS tokens per request, the logits of each step kept; between(step) runs before each decode."""
    out = engine.prefill(PROMPTS, PARAMS)
    rids = list(out.request_ids)
    tokens, logits, logprobs = [out.last], [out.logits], [_one_each(out.logprobs)]
    for i in range(STEPS - 1):
        if between is not None:
            between(i)
        out = engine.decode(tokens[-1], rids)
        tokens.append(out.last)
        logits.append(out.logits)
        logprobs.append(_one_each(out.logprobs))
    for r in rids:
        engine.release(r)
    return tokens, logits, logprobs


def _one_each(logprobs):
    """A plain step's logprob entries: one per request (each request's list holds its one token's)."""
    return None if logprobs is None else [None if e is None else e[0] for e in logprobs]


def host_draws(logits):
    """The golden: each step's rows sampled on the host, draw n of a request seeded by (seed, n)."""
    gens = [RequestGenerator(p.seed) for p in PARAMS]
    rows, history = [], [[] for _ in PARAMS]
    for step in logits:
        row = [sample(step[j], p, gens[j], history[j], PROMPTS[j]) for j, p in enumerate(PARAMS)]
        for j, r in enumerate(row):
            history[j].append(r[0])
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def reference():
    return drive(ReferenceEngine(TINY, seed=0, max_batch=2, max_context=CTX))


def test_reference_draws_are_the_golden_sample_of_its_logits(reference):
    tokens, logits, logprobs = reference
    golden = host_draws(logits)
    assert tokens == [[r[0] for r in row] for row in golden]
    for step, row in zip(logprobs, golden):
        assert step[0] is None                                   # request 0 asked for none
        assert step[1] == (row[1][1], row[1][2])
    # the draws are not greedy: at these temperatures some token differs from the argmax
    assert any(t != int(torch.argmax(l[j])) for ts, l in zip(tokens, logits) for j, t in enumerate(ts))


@pytest.mark.parametrize("tp,dp,executor", [(1, 1, "threads"), (2, 2, "sync"), (2, 1, "threads"),
                                             pytest.param(2, 1, "distributed", marks=pytest.mark.timeout(300))])
def test_graph_draws_equal_the_reference(reference, tp, dp, executor):
    engine = GraphEngine(TINY, Topology(tp, dp, tp * dp), EngineConfig(seed=0, executor=executor, max_batch=2,
                                                                       max_context=CTX))
    try:
        tokens, _, logprobs = drive(engine)
    finally:
        engine.close()
    assert tokens == reference[0] and logprobs == reference[2]


@pytest.mark.timeout(300)
def test_recovery_replay_keeps_the_draw_index(reference):
    """A lost card's group is replayed as prefills of its histories; those replays draw nothing,
    so the next draw is the one an undisturbed run makes."""
    engine = GraphEngine(TINY, Topology(1, 2, 2), EngineConfig(seed=0, executor="threads", max_batch=2,
                                                               max_context=CTX))

    def lose(i):
        if i in (1, 2):
            registry.find(engine.id).states.pop(i - 1)        # card 0, then card 1
    try:
        tokens, _, _ = drive(engine, lose)
        assert len(engine.recoveries) == 2
    finally:
        engine.close()
    assert tokens == reference[0]


def test_greedy_with_logprobs_keeps_the_argmax():
    engine = ReferenceEngine(TINY, seed=0, max_batch=2, max_context=CTX)
    plain = engine.prefill(PROMPTS)
    logits = plain.logits
    for r in plain.request_ids:
        engine.release(r)
    asked = engine.prefill(PROMPTS, SamplingParams(logprobs=3))
    assert asked.last == plain.last == torch.argmax(logits, -1).tolist() and plain.logprobs is None
    for row, [(lp, top)] in zip(logits, asked.logprobs):
        raw = torch.log_softmax(row, -1)
        assert lp == float(raw.max()) and [i for i, _ in top] == torch.topk(raw, 3).indices.tolist()


def test_generate_ends_at_stop_ids_and_limits():
    engine = ReferenceEngine(TINY, seed=0, max_batch=2, max_context=CTX)
    free = engine.generate(PROMPTS, sampling=PARAMS)
    assert [len(t) for t in free] == [STEPS, STEPS]
    stop_at = free[0][2]
    first = free[0].index(stop_at)
    params = [SamplingParams(**{**PARAMS[0].__dict__, "stop_token_ids": (stop_at,)}), PARAMS[1]]
    got = engine.generate(PROMPTS, sampling=params)
    assert got[0] == free[0][:first] and got[1] == free[1]      # the stop id ends it and is left out
    assert engine.generate(PROMPTS, 2, sampling=PARAMS) == [t[:2] for t in free]
    assert engine.active == [] and engine.blocks_in_use()[0] == 0


def test_stops_hold_back_what_could_become_a_stop_string():
    text = {1: "ab", 2: "c", 3: "X", 4: "Yz"}
    s = Stops(SamplingParams(stop=("XY",), max_tokens=10), decode_text=lambda ids: "".join(text[i] for i in ids))
    assert [s.push(t) for t in (1, 2, 3)] == ["ab", "c", ""]     # "X" might start "XY"
    assert s.push(4) == "" and s.finish == "stop" and s.text == "abc" and s.tokens == [1, 2, 3, 4]
    s = Stops(SamplingParams(stop=("XY",), max_tokens=3), decode_text=lambda ids: "".join(text[i] for i in ids))
    assert [s.push(t) for t in (1, 3, 2)] == ["ab", "", "Xc"] and s.finish == "length"
    with pytest.raises(ValueError, match="^stop: "):
        Stops(SamplingParams(stop=("x",)))


def test_logit_bias_and_min_tokens_draw_alike_on_every_layout():
    """The row edits happen where the head draws, on the gathered row: the same seeded tokens on the
    reference and a TP2/DP2 graph, each the golden sample of its logits with the edits."""
    params = [SamplingParams(temperature=1.0, seed=5, logit_bias={17: 6.0, 300: -100.0}, max_tokens=STEPS),
              SamplingParams(temperature=0.7, seed=6, min_tokens=3, eos_token_id=9, stop_token_ids=(2,),
                             logit_bias={9: 50.0}, max_tokens=STEPS)]

    def run(engine):
        try:
            out = engine.prefill(PROMPTS, params)
            rids, steps = list(out.request_ids), [(out.last, out.logits)]
            for _ in range(STEPS - 1):
                out = engine.decode(steps[-1][0], rids)
                steps.append((out.last, out.logits))
            return steps
        finally:
            engine.close()

    ref = run(ReferenceEngine(TINY, seed=0, max_batch=2, max_context=CTX))
    graph = run(GraphEngine(TINY, Topology(2, 2, 4), EngineConfig(seed=0, executor="sync", max_batch=2,
                                                                  max_context=CTX)))
    assert [t for t, _ in graph] == [t for t, _ in ref]
    gens = [RequestGenerator(p.seed) for p in params]
    for n, (tokens, logits) in enumerate(ref):
        assert tokens == [sample(logits[j], p, gens[j], generated=n)[0] for j, p in enumerate(params)]
    second = [t[1] for t, _ in ref]
    assert second[:3].count(9) == 0 and second[3:] == [9, 9]     # +50 on EOS wins once min_tokens allows it
    assert all(t[0] != 300 for t, _ in ref)
