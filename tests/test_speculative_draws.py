"""A verify step draws each row as a plain step at that row's position would: its own count of
tokens made (``min_tokens``: stop ids and EOS masked before it, drawable from it on), its own
history (penalties) and its own draw of the request's random stream (draw p at position p).

Three ways to hold the engines to that, each failing on an engine that gets one of them wrong for
the rows after a step's first (every row counting ``min_tokens`` as the first row does, or every
row drawing from the first row's stream):

- oracle drafts (the plain run's tokens, EOS and a stop id put in at and around each request's
  ``min_tokens`` boundary) make the plain run's tokens and final logits, greedy and seeded, with
  penalties and logit_bias, on the reference and a graph layout;
- drafts given with their own distribution (the speculative-sampling rule) make, step by step, the
  tokens the rule gives on the host from the step's logit rows, row j with the request's draw at
  that position and its own history and count (``ops.sampling`` as the golden);
- over many seeds, a verify step's later rows follow their target distributions (chi-square),
  which a step that reuses the first row's uniform number for every row's acceptance test misses.
"""
from types import SimpleNamespace

import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.engine.drafters import Drafter, OracleDrafter
from dsv41.engine.layout import StepLayout
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.engine.sequence import Sequence
from dsv41.model.head import Head
from dsv41.ops.sampling import RequestGenerator, SamplingParams, filtered_probs, processed
from dsv41.ops.verify import speculative_tokens
from test_speculative_sampling import chi_square_p

V = TINY.vocab_size
CTX = 64
NEW = 12
EOS, STOP = 7, 11
PROMPTS = [[(5 * i + 3 * j + 1) % V for j in range(n)] for i, n in enumerate((9, 12, 7))]
PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2)
# greedy: EOS (+50) is the argmax from the min_tokens-th token on, so the plain run ends exactly there;
# seeded: EOS and the stop id likely, not certain, once min_tokens tokens are out
PARAMS = [SamplingParams(min_tokens=3, eos_token_id=EOS, stop_token_ids=(STOP,), logit_bias={EOS: 50.0},
                         max_tokens=NEW, **PENALTIES),
          SamplingParams(temperature=0.8, seed=5, min_tokens=4, eos_token_id=EOS, stop_token_ids=(STOP,),
                         logit_bias={EOS: 4.0, STOP: 5.0}, max_tokens=NEW, **PENALTIES),
          SamplingParams(temperature=1.1, top_k=60, seed=9, min_tokens=2, eos_token_id=EOS,
                         logit_bias={EOS: 4.5}, max_tokens=NEW, repetition_penalty=1.3)]
SEEDED = [PARAMS[1], PARAMS[2], SamplingParams(**{**PARAMS[0].__dict__, "temperature": 0.9, "seed": 3})]
# longer seeded runs for the rule's rows: later boundaries, stop tokens less likely after them
RULE = [SamplingParams(temperature=0.8, seed=5, min_tokens=5, eos_token_id=EOS, stop_token_ids=(STOP,),
                       logit_bias={EOS: 2.0}, max_tokens=NEW, **PENALTIES),
        SamplingParams(temperature=1.1, top_k=60, seed=9, min_tokens=4, eos_token_id=EOS, max_tokens=NEW,
                       repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=3, min_tokens=6, eos_token_id=EOS, stop_token_ids=(STOP,),
                       logit_bias={STOP: 3.0}, max_tokens=NEW, **PENALTIES)]


def generate(engine, drafter=None, sampling=PARAMS):
    """Each request's tokens (its stop token included), the logits of its last token, the scheduler."""
    jobs = requests_for(PROMPTS, sampling, NEW, None)
    sched = Scheduler(engine, drafter, keep_logits=True)
    sched.run(jobs)
    return [j.made for j in jobs], torch.stack([j.final_logits for j in jobs]), sched


class Around:
    """Oracle drafts from the plain run's tokens (``truth``); with ``stops``, EOS or the stop id put
    in at one of them: at positions min_tokens - 2, - 1, + 0, + 1 of the request in turn, at a
    cycling offset when that position is not among the drafts. Records every proposal as (request,
    position of its first draft, drafts)."""

    def __init__(self, truth, mins, stops: bool):
        self.truth, self.mins, self.stops, self.proposals = truth, mins, stops, []

    def __call__(self, job, room):
        i = PROMPTS.index(job.prompt)
        at, t = len(job.made), self.truth[i]
        drafts = t[at:at + room]
        if self.stops and drafts:
            turn = sum(p[0] == i for p in self.proposals)
            o = self.mins[i] + (-2, -1, 0, 1)[turn % 4] - at
            if not 0 <= o < len(drafts):
                o = (at + 2 * i) % len(drafts)
            drafts = drafts[:o] + [EOS if (at + o + i) % 2 else STOP] + drafts[o + 1:]
        self.proposals.append((i, at, drafts))
        return drafts


def accepted(proposal, made) -> int:
    i, at, drafts = proposal
    n = 0
    while n < len(drafts) and at + n < len(made[i]) and made[i][at + n] == drafts[n]:
        n += 1
    return n


def check_min_tokens_boundary(engine, sampling):
    plain = generate(engine, sampling=sampling)
    made, mins = plain[0], [p.min_tokens for p in sampling]
    stops = [{EOS, STOP} & p.stop_ids for p in sampling]
    ended = [i for i, m in enumerate(made) if m[-1] in stops[i]]
    assert len(ended) >= 2, made                     # the runs end at a stop token, not only at the limit
    for i, m in enumerate(made):                     # never a stop token before min_tokens
        assert not stops[i] & set(m[:mins[i]]), (i, m)
    if not sampling[0].temperature:
        assert len(made[0]) == mins[0] + 1 and made[0][-1] == EOS   # the greedy run ends at its boundary
    for put_stops in (False, True):
        drafter = Around(made, mins, put_stops)
        spec = generate(engine, OracleDrafter(drafter), sampling)
        assert spec[0] == made, put_stops
        assert torch.equal(spec[1], plain[1]), put_stops
        if not put_stops:      # rows before and at or after a boundary in one step, the drafts between accepted
            assert any(p[1] < mins[p[0]] <= p[1] + accepted(p, made) for p in drafter.proposals)
        else:                  # stop tokens proposed before, at and after a boundary
            offsets = {p[1] + d - mins[p[0]] for p in drafter.proposals for d, t in enumerate(p[2])
                       if t in stops[p[0]]}
            assert {-2, -1, 0, 1} <= offsets, offsets


@pytest.fixture(scope="module")
def graph():
    engine = GraphEngine(TINY, Topology(1, 1, 1), EngineConfig(seed=0, executor="sync", max_batch=4, max_context=CTX))
    yield engine
    engine.close()


@pytest.mark.parametrize("sampling", [PARAMS, SEEDED], ids=["greedy-and-seeded", "seeded"])
def test_drafts_around_min_tokens_make_the_plain_tokens_on_the_reference(sampling):
    check_min_tokens_boundary(ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX), sampling)


def test_drafts_around_min_tokens_make_the_plain_tokens_on_a_graph(graph):
    check_min_tokens_boundary(graph, PARAMS)


class Recorded(Drafter):
    """Drafts given with a distribution spread over the vocabulary (below the target on most of the
    chosen tokens, so most are accepted and steps reach their later rows), the chosen tokens the
    plain run's with EOS and the stop id put in around the boundary as ``Around`` does (masked
    there: rejected, the row's residual draw decides); records every decode step's proposals and
    logit rows."""

    def __init__(self, truth):
        self.around = Around(truth, [p.min_tokens for p in RULE], True)
        self.steps = []                          # (prompt, made before the step, drafts, q, rows, tokens)
        self.pending = {}

    def propose_batch(self, jobs, rooms):
        spread = torch.softmax(torch.arange(V, dtype=torch.float64) % 5, 0)
        drafts, probs = [], []
        for job, room in zip(jobs, rooms):
            d = self.around(job, room) if room else []
            q = spread.expand(len(d), V).clone()
            drafts.append(d)
            probs.append(q if d else None)
            self.pending[job.id] = (list(job.prompt), list(job.made), d, q)
        return drafts, probs

    def observe(self, phase, jobs, out):
        if phase != "decode":
            return
        for job in jobs:
            if job is None:                  # a prompt chunk of a step that also decodes
                continue
            i = out.request_ids.index(job.id)
            prompt, made, d, q = self.pending.pop(job.id)
            k = out.proposed[i] if out.proposed else 0
            assert k == len(d)
            rows = torch.stack([out.token_logits(i, j) for j in range(k + 1)])
            self.steps.append((prompt, made, d, q, rows, list(out.tokens[i])))


def rule_on_the_host(params: SamplingParams, prompt, made, drafts, q, rows) -> list[int]:
    """The speculative-sampling rule over a verify step's rows, each row's target distribution made
    by the golden (``processed``, ``filtered_probs``) from its own history and count, and its uniform
    numbers from the request's draw at its own position (the token at position p is draw p)."""
    target = torch.stack([filtered_probs(processed(rows[j], params, made + drafts[:j], prompt, len(made) + j), params)
                          for j in range(len(drafts) + 1)])
    return speculative_tokens(target, q, drafts, lambda j: RequestGenerator(params.seed, len(made) + j).next())


def check_rule_rows(engine):
    truth = generate(engine, sampling=RULE)[0]
    drafter = Recorded(truth)
    generate(engine, drafter, RULE)
    by_prompt = {tuple(p): s for p, s in zip(PROMPTS, RULE)}
    verified = 0
    for prompt, made, drafts, q, rows, tokens in drafter.steps:
        params = by_prompt[tuple(prompt)]
        assert tokens == rule_on_the_host(params, prompt, made, drafts, q, rows), (prompt, made, drafts)
        verified += len(tokens) - 1
    # rows past the first decided: accepted drafts, some of them before a request's boundary
    assert verified >= 6, verified
    assert any(len(t) > 1 and len(m) < by_prompt[tuple(p)].min_tokens for p, m, _, _, _, t in drafter.steps)


def test_drafts_with_their_distribution_follow_the_rule_row_by_row_on_the_reference():
    check_rule_rows(ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX))


def test_drafts_with_their_distribution_follow_the_rule_row_by_row_on_a_graph(graph):
    check_rule_rows(graph)


TRIALS = 3000


def test_a_verify_steps_later_rows_follow_their_targets_over_many_seeds():
    """One request, two drafts with their own distribution, a verify step decided by the head (the
    function every engine's head runs) with the draws its request's host state hands out, over
    TRIALS seeds: the first token follows row 0's target, the second (after an accepted draft) row
    1's and the third (after two) row 2's, chi-square p > 1e-3 each. Rows sharing one uniform number
    accept together far more often, which moves the later tokens towards the drafts' distribution."""
    vocab, k = 6, 2
    target_logits = torch.tensor([[2.0, 1.2, 0.4, 0.0, -0.5, -1.0],
                                  [-1.0, 0.0, 1.5, 0.3, 0.9, -0.4],
                                  [0.5, -0.5, 0.0, 1.8, 0.2, 1.0]])
    q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.2, 0.3], dtype=torch.float64).expand(k, vocab).clone()
    params = SamplingParams(temperature=1.0)
    target = torch.softmax(target_logits.to(torch.float64), -1)
    rng = torch.Generator().manual_seed(0)
    counts = torch.zeros(k + 1, vocab, dtype=torch.float64)
    prompt = [1, 2, 3]
    for seed in range(TRIALS):
        drafts = torch.multinomial(q[0], k, replacement=True, generator=rng).tolist()
        seq = Sequence(0, prompt[:-1], kv_len=len(prompt) - 1, sampling=params, seed=seed, drawn=4,
                       prompt_len=1)
        fed = [prompt[-1]] + drafts
        layout = StepLayout([0], [len(fed)], [drafts], [q])
        step = SimpleNamespace(draws=seq.row_draws(fed, k + 1), layout=layout, draft_probs=layout.draft_probs)
        made = Head.tokens(target_logits, step).tokens[0]
        for j, t in enumerate(made):
            counts[j, t] += 1
    for j in range(k + 1):
        assert counts[j].sum() > 300, counts            # enough steps reached row j
        p = chi_square_p(counts[j], target[j])
        assert p > 1e-3, (j, p, counts[j].tolist())
