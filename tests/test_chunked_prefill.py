"""Chunked prefill: a prompt longer than the step's token budget is fed in chunks (interleaved with
the decode rows of running requests) and makes exactly the tokens and final logits of the same
prompt prefilled in one step.

Prompts of 1.5x, 3x and 7.9x the budget run together, so chunks share steps with other requests'
chunks and decode rows. Budget 17 puts chunk boundaries at odd positions (the ratio-2 compressor's
pending pair), inside the indexer's candidate blocks of 4 and inside paged blocks, and the 7.9x
prompt's last chunk straddles position 128; budget 16 puts them on window page edges. Every
boundary past position 3 splits an Engram 4-gram. (V4.1's compressors are ratio 1 and 2: there is
no ratio-4 or ratio-128 block; the candidate blocks and the pages are what straddles.) The
recorded boundaries are checked to cover each case.

Oracle: the same prompts with the default budget (the engine's prefill capacity, 512 rows on TINY),
where each prompt is one prefill step; on the reference engine, whose logits every layout gives
bit for bit (tests/test_cluster.py)."""
import pytest
import torch

from dsv41.config import TINY, Topology
from dsv41.engine.drafters import NgramDrafter
from dsv41.engine.dspark import dspark_drafter
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.ops.sampling import SamplingParams
from test_chunked_window import W64
from test_speculative import graph_engine

V = TINY.vocab_size
CTX, NEW = 160, 4


def prompts(budget: int) -> list[list[int]]:
    """1.5x, 3x and 7.9x the budget, with repeats so the n-gram drafter proposes."""
    lengths = (int(7.9 * budget), 3 * budget, int(1.5 * budget))
    return [[(7 * j + 3 * i) % 41 + 11 * i for j in range(n)] for i, n in enumerate(lengths)]


SAMPLED = [SamplingParams(temperature=0.9, top_k=50, seed=21 + i) for i in range(3)]


class Recorder:
    """Wraps an engine's run: every step's (request id, rows fed, first position) per request."""

    def __init__(self, engine):
        self.engine, self.steps, self._run = engine, [], engine.run
        engine.run = self.run

    def run(self, parts, phase):
        kv = [0 if p.start else self.engine.sequence(p.id).kv_len for p in parts]
        out = self._run(parts, phase)
        self.steps.append([(p.id, len(p.tokens), at) for p, at in zip(parts, kv)])
        return out

    def boundaries(self) -> set[int]:
        """Positions where a prompt chunk started after an earlier chunk of the same request."""
        return {at for s in self.steps for _, n, at in s if n > 1 and at > 0}

    def mixed(self) -> bool:
        """Whether a step fed a prompt chunk beside another request's decode row."""
        return any(any(n > 1 for _, n, _ in s) and any(n == 1 for _, n, _ in s) for s in self.steps)

    def undo(self):
        self.engine.run = self._run


def generate(engine, prompts, budget=None, sampling=None, drafter=None):
    jobs = requests_for(prompts, sampling, NEW, None)
    Scheduler(engine, drafter, budget=budget, keep_logits=True).run(jobs)
    assert engine.blocks_in_use()[0] == 0
    return [j.made for j in jobs], torch.stack([j.final_logits for j in jobs])


_references: dict = {}


def reference_of(cfg):
    if cfg not in _references:
        _references[cfg] = ReferenceEngine(cfg, seed=0, max_batch=4, max_context=CTX)
    return _references[cfg]


@pytest.fixture(scope="module")
def oracle():
    """(budget, sampled, dspark, config) -> one-step prefill runs on a reference engine, made once."""
    made, refs = {}, {}

    def get(budget, sampled=False, dspark=False, cfg=TINY):
        """dspark: with the reference's DSpark drafter (a sampling request's tokens follow its drafts'
        distribution, so its oracle drafts too; the graph's drafts are the reference's)."""
        key = (budget, sampled, dspark, cfg)
        if key not in made:
            if cfg not in refs:
                refs[cfg] = ReferenceEngine(cfg, seed=0, max_batch=4, max_context=CTX)
            ref = refs[cfg]
            rec = Recorder(ref)
            made[key] = generate(ref, prompts(budget), sampling=SAMPLED if sampled else None,
                                 drafter=dspark_drafter(ref) if dspark else None)
            ref.taps = ()
            rec.undo()
            assert not rec.boundaries()            # every prompt was one step
        return made[key]
    return get


def check_chunked(engine, oracle, budget, sampled=False, drafter=None):
    rec = Recorder(engine)
    try:
        got = generate(engine, prompts(budget), budget, SAMPLED if sampled else None, drafter)
    finally:
        rec.undo()
    dspark = sampled and drafter is not None and not isinstance(drafter, NgramDrafter)
    want = oracle(budget, sampled, dspark, engine.cfg)
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])
    cuts = rec.boundaries()
    assert rec.mixed()                                 # chunks interleaved with decode rows
    assert len(cuts) >= 7
    if budget % 2:
        assert any(c % 2 for c in cuts)                                  # the ratio-2 pair split
        assert any(c % TINY.candidate_block_size for c in cuts)          # inside a candidate block
        assert any(c % TINY.block_size for c in cuts)                    # inside a page
        assert any(c < 128 < c + budget for c in cuts)                   # a chunk across position 128
    else:
        assert any(c % TINY.block_size == 0 for c in cuts)               # at a window page edge
    assert any(c >= TINY.engram_max_ngram_size for c in cuts)          # a whole 4-gram across a cut
    return rec


@pytest.fixture(scope="module")
def reference():
    return reference_of(TINY)


# TINY's window 16 (window and Top-K in one 64-slot tile, where the list's width changes no bit) and
# 64 + Top-K 16 (two tiles: a width taken from the chunk, not the prompt, moves compressed slots
# between tiles, tests/test_chunked_window.py); window 64 with budget 17 in the default run
WINDOWS = [pytest.param(TINY, id="w16"), pytest.param(W64, id="w64", marks=pytest.mark.slow)]
GREEDY = [pytest.param(17, TINY, id="17-w16"), pytest.param(16, TINY, id="16-w16"), pytest.param(17, W64, id="17-w64"),
          pytest.param(16, W64, id="16-w64", marks=pytest.mark.slow)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("budget,cfg", GREEDY)
def test_reference_chunked_prefill_equals_one_step_greedy(oracle, budget, cfg):
    check_chunked(reference_of(cfg), oracle, budget)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cfg", WINDOWS)
def test_reference_chunked_prefill_equals_one_step_sampled(oracle, cfg):
    check_chunked(reference_of(cfg), oracle, 17, sampled=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cfg", WINDOWS)
def test_reference_chunked_prefill_with_ngram_drafts(oracle, cfg):
    check_chunked(reference_of(cfg), oracle, 16, drafter=NgramDrafter(3))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cfg", WINDOWS)
def test_reference_chunked_prefill_with_dspark_drafts(oracle, cfg):
    reference = reference_of(cfg)
    check_chunked(reference, oracle, 17, drafter=dspark_drafter(reference))
    reference.taps = ()


def test_only_a_decode_row_verifies_drafts(reference):
    """A prompt chunk never carries drafts; a running request's one-token row may, in any phase."""
    for batch in ([(None, [1, 2])], [(None, [1])]):
        with pytest.raises(ValueError, match="^drafts: only a running request's decode row"):
            reference.step(batch, "prefill", drafts=[[3]])
    assert reference.blocks_in_use()[0] == 0


@pytest.mark.timeout(600)
def test_a_step_of_the_same_rows_and_more_requests_gets_its_own_dspark_graph():
    """DSpark drafts a block per request: a chunk step (one request, 6 rows) and a step of the same
    rows over two requests (a decode row beside a 5-row chunk) are different graphs."""
    with graph_engine("sync", Topology(1, 1, 1), max_context=CTX) as engine:
        engine.dspark = True
        a = engine.step([(None, list(range(1, 7)))], "prefill").request_ids[0]
        out = engine.step([(a, [7]), (None, list(range(9, 14)))], "prefill")
        assert engine.last_stats["graph_reused"] is False
        assert [len(engine.sequence(r).drafted[0]) for r in out.request_ids] == [TINY.dspark_block_size] * 2
        for r in out.request_ids:
            engine.release(r)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("cfg", WINDOWS)
def test_threads_tp2_dp2_chunked_prefill_equals_one_step(oracle, cfg):
    with graph_engine(max_context=CTX, cfg=cfg) as engine:
        check_chunked(engine, oracle, 17)
        check_chunked(engine, oracle, 16, sampled=True)


LAYOUTS = [("sync", Topology(1, 1, 1), "sharded"), ("distributed", Topology(2, 2, 4), "sharded"),
           ("threads", Topology(4, 1, 4), "sharded"), ("threads", Topology(4, 1, 4), "replicated")]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("executor,topo,wiring", LAYOUTS, ids=lambda v: str(v))
def test_every_layout_chunked_prefill_equals_one_step(executor, topo, wiring, oracle):
    with graph_engine(executor, topo, wiring, CTX) as engine:
        check_chunked(engine, oracle, 17)
        check_chunked(engine, oracle, 16, sampled=True)
        check_chunked(engine, oracle, 17, sampled=True, drafter=NgramDrafter(3))
        check_chunked(engine, oracle, 16, drafter=dspark_drafter(engine))
        engine.dspark = False


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_threads_tp2_dp2_chunked_prefill_with_drafters(oracle):
    with graph_engine(max_context=CTX) as engine:
        check_chunked(engine, oracle, 17, drafter=NgramDrafter(3))
        check_chunked(engine, oracle, 16, sampled=True, drafter=dspark_drafter(engine))
        engine.dspark = False


@pytest.mark.timeout(900)
def test_server_answers_a_prompt_of_three_budgets_and_refuses_one_past_max_model_len(reference):
    """--max-num-batched-tokens 40: a 120-token prompt is fed in three chunks and answered with the
    one-step prefill's tokens; /v1/models' max_model_len is the context really enforced."""
    httpx = pytest.importorskip("httpx")
    from test_serve import Served
    server = Served("--max-context", str(CTX), "--max-num-batched-tokens", "40")
    try:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            models = c.get("/v1/models").json()["data"]
            assert models[0]["max_model_len"] == CTX
            prompt = prompts(40)[1]
            assert len(prompt) == 120
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": NEW,
                                                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == reference.generate([prompt], NEW)[0]
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": [1] * (CTX + 1), "max_tokens": 1})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "prompt"
            assert f"max_model_len {CTX}" in err["message"]
    finally:
        server.stop()
