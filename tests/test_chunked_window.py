"""Chunked prefill at a window wider than the attention's 64-slot tile makes the one-step prefill's
bits: TINY with window 64 and Top-K 16 (80-slot lists, two tiles).

The attention lists min(prompt, window) window slots on a prompt's rows, then the Top-K slots, and
rounds P to BF16 per 64-slot tile, so the width of the window part decides which tile each
compressed slot lands in. It comes from the request's whole prompt: a prompt fed in chunks (the
first one 1, 13, 50, 63, 64 or 65 rows), started after a cached prefix, or recomputed after a
preemption lists what its one-step prefill lists. A prompt shorter than the window (45 tokens)
lists 45 slots on its rows in every chunk, and the window on the rows it generates; its history's
spans are found only under its own prompt length (its recompute), never by a longer prompt, whose
one-step prefill lists the whole window on those rows (``engine/prefix_cache.py``).

Oracle: each prompt prefilled in one step on the reference engine with room for every request
(a request's tokens do not depend on its batch, tests/test_admission.py)."""
from dataclasses import replace

import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.engine.prefix_cache import span
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.ops.sampling import SamplingParams

W64 = replace(TINY, sliding_window=64, index_topk=16)
CTX, NEW = 384, 4
TILE = 64


def prompt(n: int, salt: int) -> list[int]:
    return [(7 * j + 3 * salt) % 41 + 11 * salt for j in range(n)]


LONG, LONGER, SHORT = prompt(130, 0), prompt(300, 1), prompt(45, 2)
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=5)


class Planned(Scheduler):
    """The step's token budget per DP group from a list, one entry a step (then the engine's
    capacity), and every step's (request id, rows fed, first position) per request."""

    def __init__(self, engine, budgets=(), **kw):
        """budgets: the first steps' budgets; after them, the scheduler's own (kw's budget)."""
        super().__init__(engine, keep_logits=True, **kw)
        self.budgets, self.full, self.fed = list(budgets), self.budget, []
        run = engine.run

        def recorded(parts, phase):
            at = [len(p.cached or []) if p.start else engine.sequence(p.id).kv_len for p in parts]
            out = run(parts, phase)
            self.fed.append([(p.id, len(p.tokens), a) for p, a in zip(parts, at)])
            return out
        engine.run = recorded

    def step(self):
        self.budget = self.budgets.pop(0) if self.budgets else self.full
        return super().step()

    def chunks(self, rid: int, end: int) -> list[tuple[int, int]]:
        """(first position, rows) of each step that fed a request rows before position end."""
        return [(a, n) for s in self.fed for r, n, a in s if r == rid and a < end]


def generate(engine, prompts, sampling, budgets=(), new=NEW, **kw):
    jobs = requests_for(prompts, sampling, new, None)
    sched = Planned(engine, budgets, **kw)
    try:
        sched.run(jobs)
    finally:
        engine.__dict__.pop("run", None)          # the engine's own method again
    assert engine.blocks_in_use()[0] == 0
    return jobs, sched


_oracle: dict = {}


def one_step(prompts, sampling, new=NEW, oracle=None):
    """Each prompt alone, prefilled in one step, on a reference engine caching nothing (default: one
    at window 64; memoised)."""
    if oracle is None:
        if W64 not in _oracle:
            _oracle[W64] = ReferenceEngine(W64, seed=0, max_batch=4, max_context=CTX)
        oracle = _oracle[W64]
    out = []
    for p, s in zip(prompts, sampling):
        key = (id(oracle), tuple(p), s is None, new)
        if key not in _oracle:
            (job,), sched = generate(oracle, [p], [s], new=new)
            assert [n for _, n, _ in sched.fed[0]] == [len(p)]
            _oracle[key] = (job.made, job.final_logits)
        out.append(_oracle[key])
    return out


def assert_one_step(jobs, prompts, sampling, new=NEW, oracle=None):
    for job, (made, logits) in zip(jobs, one_step(prompts, sampling, new, oracle)):
        assert job.made == made
        assert torch.equal(job.final_logits, logits)


def check_first_chunks(engine, k: int):
    """130 and 300 tokens: the first steps feed k rows of the first, then its rest beside k rows of the
    second, then the second's rest (its odd cut at k, and at 130 - k in the first, for odd k)."""
    sampling = [None, SEEDED] if k % 2 else [SEEDED, None]
    jobs, sched = generate(engine, [LONG, LONGER], sampling, budgets=[k, 130])
    first, second = (sched.chunks(j.id, len(p)) for j, p in zip(jobs, [LONG, LONGER]))
    assert first[0] == (0, k) and second[0] == (0, k) and len(second) > 1
    assert_one_step(jobs, [LONG, LONGER], sampling)


@pytest.fixture(scope="module")
def reference():
    return ReferenceEngine(W64, seed=0, max_batch=4, max_context=CTX)


def test_the_lists_span_two_tiles():
    assert W64.sliding_window + W64.index_topk > TILE and W64.sliding_window >= TILE


@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", [1, 63] + [pytest.param(k, marks=pytest.mark.slow) for k in (13, 50, 64, 65)])
def test_reference_first_chunks_of_every_width_equal_one_step(reference, k):
    check_first_chunks(reference, k)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("budget", [13, pytest.param(30, marks=pytest.mark.slow)])
def test_reference_a_prompt_shorter_than_the_window_in_chunks_equals_one_step(reference, budget):
    """45 tokens (shorter than the window) in chunks of the budget, then 130 beside its last chunk
    (a first chunk of 7 or 15 rows): the 45-token prompt lists 45 window slots in every chunk."""
    prompts, sampling = [SHORT, LONG], [SEEDED, None]
    jobs, sched = generate(reference, prompts, sampling, budgets=[budget] * 4)
    assert [n for _, n in sched.chunks(jobs[0].id, len(SHORT))] == [budget] * (45 // budget) + [45 % budget]
    assert sched.chunks(jobs[1].id, len(LONG))[0] == (0, budget - 45 % budget)
    assert_one_step(jobs, prompts, sampling)


@pytest.mark.timeout(900)
def test_reference_starts_after_a_cached_prefix_as_the_one_step_prefill():
    """300 tokens sharing 130 with a prompt computed before start after 128 (two 64-token spans) and
    are fed 13 rows, then the rest; a prompt continuing a 60-token prompt's history (its span computed
    under a 60-slot list) finds nothing cached, and equals its one-step prefill."""
    assert span(W64) == 64
    engine = ReferenceEngine(W64, seed=0, max_batch=4, max_context=CTX, prefix_caching=True)
    generate(engine, [LONG], [None])
    shared = LONG + prompt(170, 3)
    first = prompt(60, 6)
    (short,), _ = generate(engine, [first], [None], new=5)        # its history reaches the first span's end
    turn = first + short.made[:-1] + prompt(20, 4)
    jobs, sched = generate(engine, [shared, turn], [SEEDED, None], budgets=[13])
    assert [j.cached for j in jobs] == [128, 0]
    assert sched.chunks(jobs[0].id, len(shared))[:2] == [(128, 13), (141, 159)]
    assert_one_step(jobs, [shared, turn], [SEEDED, None])


@pytest.mark.timeout(900)
def test_reference_preemption_recomputes_as_the_one_step_prefill():
    """130 and 47 tokens in one step, then pools of 12 ratio-1 pages: the shorter, newer request needs
    a fourth page at position 48 and is preempted; it is recomputed from its history in chunks of 13
    (its prompt's 47 rows listing 47 window slots, its generated row the window) and makes the tokens
    of a run never preempted."""
    short = prompt(47, 5)
    prompts, sampling = [LONG, short], [None, SEEDED]
    engine = ReferenceEngine(W64, seed=0, max_batch=2, max_context=CTX, cache_tokens=160)
    assert engine.host.tables[0].blocks.compressed_blocks[1] == 12
    jobs, sched = generate(engine, prompts, sampling, budgets=[512], budget=13)
    assert [v.id for v, _ in sched.victims] == [jobs[1].id]
    first, *again = sched.chunks(jobs[1].id, len(short))
    assert first == (0, 47) and again[0][0] == 0 and all(n <= 13 for _, n in again)
    assert sum(n for _, n in again) == len(short) + 1          # its prompt and its first token, recomputed
    assert_one_step(jobs, prompts, sampling)


@pytest.mark.timeout(900)
def test_a_lost_card_replays_a_short_prompt_as_the_one_step_prefill():
    """A card loses its State after a 45-token prompt's first decode step: recovery replays its
    history (its prompt and a generated row) in one step, the prompt's rows listing 45 window slots
    and the generated row the window, and its tokens and final logits are the one-step prefill's."""
    from dsv41.cluster import registry
    engine = GraphEngine(W64, Topology(1, 1, 1), EngineConfig(seed=0, executor="threads", max_batch=4,
                                                              max_context=CTX))

    class Losing(Planned):
        def step(self):
            turn = super().step()
            if not engine.recoveries and any(len(j.made) == 2 for j in self.running.values()):
                registry.find(engine.id).states.pop(0)
            return turn
    try:
        (job,) = requests_for([SHORT], [SEEDED], NEW, None)
        Losing(engine).run([job])
        engine.__dict__.pop("run", None)
        assert engine.recoveries
        assert_one_step([job], [SHORT], [SEEDED])
    finally:
        engine.close()


@pytest.mark.timeout(1800)
def test_threads_tp2_dp2_first_chunks_equal_one_step():
    """A first chunk of 63 rows of 130 and 300 tokens, and 45 tokens in chunks of 13."""
    engine = GraphEngine(W64, Topology(2, 2, 4), EngineConfig(seed=0, executor="threads", max_batch=4,
                                                              max_context=CTX))
    try:
        check_first_chunks(engine, 63)
        jobs, _ = generate(engine, [SHORT, LONG], [SEEDED, None], budgets=[13] * 12)
        assert_one_step(jobs, [SHORT, LONG], [SEEDED, None])
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_threads_tp2_dp2_every_first_chunk_equals_one_step():
    engine = GraphEngine(W64, Topology(2, 2, 4), EngineConfig(seed=0, executor="threads", max_batch=4,
                                                              max_context=CTX))
    try:
        for k in (1, 13, 50, 64, 65):
            check_first_chunks(engine, k)
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_flash_width_first_chunks_equal_one_step():
    """FLASH width (``--layers 4 --experts 8``: window 128, Top-K 512, 640-slot lists over ten tiles),
    300 and 110 tokens: the first steps feed k rows of the first, then its rest beside k rows of the
    second (at most its 110), then the second's rest; k = 1, 63, 64, 65, 101 (the issue's failing
    case: a first chunk of 101 rows of a 1,200-token prompt)."""
    from dsv41.checkpoint.headers import without_dspark
    from dsv41.config import FLASH
    from test_flash_shapes import _HeldDraw
    cfg = without_dspark(FLASH.reduced(layers=4, experts=8, engram_rows=4099))
    assert cfg.sliding_window == 128 and [spec.kind for spec in cfg.layers] == ["swa", "swa", "c2a_full", "c2a_reuse"]
    source, long, short = _HeldDraw(cfg), prompt(300, 7), prompt(110, 8)
    oracle = ReferenceEngine(cfg, max_batch=2, max_context=CTX, checkpoint=source)
    try:                                     # every answer first (memoised): one engine at a time
        one_step([long, short] * 2, [None, None, SEEDED, SEEDED], oracle=oracle)
    finally:
        oracle.close()
    engine = ReferenceEngine(cfg, max_batch=2, max_context=CTX, checkpoint=source)
    try:
        for i, k in enumerate((1, 63, 64, 65, 101)):
            sampling = [None, SEEDED] if i % 2 else [SEEDED, None]
            jobs, sched = generate(engine, [long, short], sampling, budgets=[k, 300])
            assert [sched.chunks(j.id, len(p))[0] for j, p in zip(jobs, [long, short])] == [(0, k), (0, min(k, 110))]
            assert_one_step(jobs, [long, short], sampling, oracle=oracle)
    finally:
        engine.close()
