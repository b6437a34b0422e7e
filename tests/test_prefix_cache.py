"""Prefix caching: the block machinery (this part) and a request served from a cached prefix against
the same request on a fresh engine (below).

The block part drives one group's ``BlockManager`` as the request table does (reserve, publish,
register, release stale pages) and checks the cache's bookkeeping against a count kept here: every
block is exactly one of free, cached with nobody holding it, or held, and a held block's count is
the number of sequences whose pages name it; a shared block is never handed out, written or put on a
free list while a sequence holds it; everything returns at the end."""
import json
import random

import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import FLASH, TINY, Topology
from dsv41.engine.blocks import BlockManager, PoolExhausted, Reservation
from dsv41.capacity import CAPACITIES
from dsv41.engine.drafters import NgramDrafter, OracleDrafter
from dsv41.engine.dspark import dspark_drafter
from dsv41.engine.prefix_cache import chain_start, root, span, span_hashes
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.engine.sequence import Sequence
from dsv41.model.caches import cache_names
from dsv41.ops import kv_cache
from dsv41.ops.sampling import SamplingParams
from dsv41.serving import schema
from test_chunked_window import W64

V = TINY.vocab_size
G = span(TINY)


def feed(bm: BlockManager, seq: Sequence, tokens: list[int], drafts: int = 0, kept: int | None = None):
    """One step of seq as RequestTable.plan/commit make it: reserve rows for tokens (+ drafts),
    keep ``kept`` of them (default all tokens), register, release stale pages."""
    res = Reservation()
    try:
        bm.reserve(seq, len(tokens) + drafts, res)
    except PoolExhausted:
        res.undo(bm.pools)
        raise
    kept = len(tokens) if kept is None else kept
    seq.tokens.extend(tokens[:kept])
    seq.kv_len += kept
    if kept < len(tokens) + drafts:
        bm.trim(seq, res)
    bm.register(seq)
    bm.release_stale(seq)
    return res


def start(bm: BlockManager, rid: int, tokens: list[int], limit: int | None = None,
          salt: str | None = None) -> tuple[Sequence, int]:
    """A new sequence over tokens' longest cached prefix (at most limit tokens) under its cache salt,
    fed the rest: its prompt is all of them."""
    res = Reservation()
    seq = Sequence(rid, [], prompt_len=len(tokens), cache_root=root(salt))
    hit = bm.cache.lookup(tokens, len(tokens) - 1 if limit is None else limit,
                          root=chain_start(TINY, len(tokens), seq.cache_root))
    try:
        bm.take_state(seq, res)
        if hit.length:
            seq.tokens = list(tokens[:hit.length])
            bm.attach(seq, hit, res)
        feed(bm, seq, tokens[hit.length:])
    except PoolExhausted:
        res.undo(bm.pools)
        bm.pools.state.extend([seq.state_block] if seq.state_block >= 0 and seq.state_block not in bm.pools.state else [])
        raise
    return seq, hit.length


def census(bm: BlockManager, seqs: list[Sequence]):
    """Every block of every pool is free, idle-cached or held, exactly once; held counts match."""
    cache, pools = bm.cache, bm.pools
    sizes = {"window": bm.window_blocks, "state": bm.state_blocks, **bm.compressed_blocks}
    for key, size in sizes.items():
        free = list(pools.window if key == "window" else pools.state if key == "state" else pools.compressed[key])
        idle = list(cache.idle.get(key, ()))
        holders: dict[int, int] = {}
        for s in seqs:
            blocks = ([s.state_block] if key == "state" else list(s.window_pages.values()) if key == "window"
                      else s.compressed_pages.get(key, []))
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        assert len(free) == len(set(free)), f"{key}: a block twice on the free list"
        assert not set(free) & set(idle) and not set(free) & set(holders) and not set(idle) & set(holders), key
        assert sorted(free + idle + list(holders)) == list(range(size)), f"{key}: a block lost or made up"
        for b, n in holders.items():
            if n > 1 or cache.shared(key, b):
                assert cache.refs[(key, b)] == n, f"{key} block {b}: {cache.refs.get((key, b))} holders, {n} hold it"
        for b in idle:
            assert cache.refs[(key, b)] == 0 and (key, b) in cache.owner


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * j + 3 * salt + j * j) % V for j in range(n)]


def test_the_span_is_where_every_page_and_the_ratio_2_pair_end():
    assert span(TINY) == 2 * TINY.block_size == 32
    assert span(FLASH) == 2 * FLASH.block_size == 256
    from dataclasses import replace
    wide = replace(TINY, sliding_window=3 * TINY.block_size)     # a window reaching past one span
    assert span(wide) == 64 and span(wide) >= wide.sliding_window - 1


def test_a_hit_holds_the_prefix_pages_and_the_window_before_the_cut():
    bm = BlockManager(TINY, 4, 256, prefix_caching=True)
    toks = prompt(100)
    a, cached = start(bm, 0, toks)
    assert cached == 0 and len(a.hashes) == 100 // G
    # a prompt equal for its first 77 tokens (odd, inside a ratio-2 page, an Engram 4-gram and a span)
    other = toks[:77] + prompt(40, salt=1)
    hit = bm.cache.lookup(other, len(other) - 1)
    assert hit.length == 64 == (77 // G) * G
    assert hit.compressed[1] == a.compressed_pages[1][:64 // 16] and hit.compressed[2] == a.compressed_pages[2][:64 // 32]
    assert list(hit.window) == [3]                 # positions 49..63 of the window: page 3
    b, cached = start(bm, 1, other)
    assert cached == 64 and b.kv_len == len(other) and b.compressed_pages[1][:4] == a.compressed_pages[1][:4]
    assert b.window_pages.get(3) is None           # stale after its own rows: given back to the cache
    census(bm, [a, b])
    bm.free(a)
    census(bm, [b])
    assert all(bm.cache.refs[(1, blk)] == 1 for blk in b.compressed_pages[1][:4])
    bm.free(b)
    census(bm, [])
    assert bm.in_use()[0] == 0 and len(bm.cache.entries) == 100 // G + 1   # b's span 64..95 cached too


def test_the_cut_leaves_a_row_to_feed_and_a_miss_is_a_miss():
    bm = BlockManager(TINY, 4, 256, prefix_caching=True)
    toks = prompt(64)
    a, _ = start(bm, 0, toks)
    assert bm.cache.lookup(toks, 63).length == 32      # the whole prompt cached, but one row must be fed
    assert bm.cache.lookup(toks + [1], 64).length == 64
    assert bm.cache.lookup([toks[0] ^ 1] + toks[1:], 63).length == 0
    assert bm.cache.lookup(toks, 31).length == 0
    bm.free(a)


def test_a_prompt_shorter_than_the_window_keys_its_spans_by_its_length():
    """A 10-token prompt (window 16) decodes to 40 tokens: its span 0..32 holds rows computed with a
    10-slot window list (``ops.metadata``), so only a request with a 10-token prompt (its recompute)
    finds it; a prompt of 16 or more, whose one-step prefill lists the whole window, does not. Prompts
    of a window or more share one chain."""
    bm = BlockManager(TINY, 4, 256, prefix_caching=True)
    a, _ = start(bm, 0, prompt(10))
    for t in prompt(30, salt=1):
        feed(bm, a, [t])
    history = a.tokens + [1]
    assert len(a.hashes) == 1 and a.kv_len == 40
    assert bm.cache.lookup(history, 40).length == 0
    assert bm.cache.lookup(history, 40, root=chain_start(TINY, 15)).length == 0
    assert bm.cache.lookup(history, 40, root=chain_start(TINY, 10)).length == 32
    b, _ = start(bm, 1, prompt(40, salt=2))
    again = prompt(40, salt=2) + [1]
    assert [bm.cache.lookup(again, 40, root=chain_start(TINY, n)).length for n in (16, 41, 200, 10)] == [32, 32, 32, 0]
    bm.free(a)
    bm.free(b)
    census(bm, [])


def test_a_span_is_keyed_by_the_prefix_before_it_not_by_its_own_tokens():
    """A prompt of two equal spans, sent again, gets its own four ratio-1 pages, not span 0's pages
    twice; a prompt sharing a later span with a computed one but not the span before it starts from
    nothing, and sent again gets its own pages for that span, not the other prompt's (whose rows
    were computed after other tokens)."""
    bm = BlockManager(TINY, 8, 256, prefix_caching=True)
    x = prompt(G, salt=1)
    a, _ = start(bm, 0, x + x + [5])
    b, cached = start(bm, 1, x + x + [6])
    assert cached == 2 * G
    assert b.compressed_pages[1][:4] == a.compressed_pages[1][:4] and len(set(a.compressed_pages[1][:4])) == 4
    census(bm, [a, b])
    y, z = prompt(G, salt=2), prompt(G, salt=3)
    c, _ = start(bm, 2, y + x + [5])
    d, cached = start(bm, 3, z + x + [5])
    assert cached == 0, "a later span shared, the one before it not: no hit"
    e, cached = start(bm, 4, z + x + [6])
    assert cached == 2 * G and e.compressed_pages[1][:4] == d.compressed_pages[1][:4]
    assert not set(d.compressed_pages[1]) & set(c.compressed_pages[1])
    census(bm, [a, b, c, d, e])
    assert len(set(span_hashes(x + x, G))) == 2 and span_hashes(y + x, G)[1] != span_hashes(z + x, G)[1]
    for s in (a, b, c, d, e):
        bm.free(s)
    census(bm, [])


def test_two_cache_salts_never_share_a_span_and_one_salt_does():
    """vLLM's cache_salt is the root of a prompt's span chain: the same tokens under another salt
    (or none) are a miss, under the same salt a hit."""
    assert root(None) == b"" and root("a") != root("b") and len(root("")) == 16
    toks = prompt(70)
    assert not set(span_hashes(toks, G, root("a"))) & set(span_hashes(toks, G, root("b")) + span_hashes(toks, G))
    bm = BlockManager(TINY, 4, 256, prefix_caching=True)
    a, _ = start(bm, 0, toks, salt="tenant-a")
    b, cached_b = start(bm, 1, toks, salt="tenant-b")
    c, cached_c = start(bm, 2, toks)
    d, cached_d = start(bm, 3, toks, salt="tenant-a")
    assert (cached_b, cached_c, cached_d) == (0, 0, 64)
    assert d.compressed_pages[1][:4] == a.compressed_pages[1][:4]
    assert not set(b.compressed_pages[1]) & set(a.compressed_pages[1])
    census(bm, [a, b, c, d])
    for s in (a, b, c, d):
        bm.free(s)
    census(bm, [])


def test_eviction_takes_the_least_recently_used_block_nobody_holds():
    bm = BlockManager(TINY, 2, 256, cache_tokens=192, prefix_caching=True)
    a, _ = start(bm, 0, prompt(129))
    bm.free(a)
    entries = len(bm.cache.entries)
    assert entries == 4 and bm.in_use()[0] == 0
    # a request needing every ratio-1 block evicts the cached spans, newest span first
    b = Sequence(1, [])
    res = Reservation()
    bm.take_state(b, res)
    bm.reserve(b, 112, res)
    assert bm.cache.lookup(prompt(129), 128).length == 96, "the last span goes first"
    census(bm, [b])
    res.undo(bm.pools)
    census(bm, [])
    c, cached = start(bm, 2, prompt(129))
    assert cached == 96
    with pytest.raises(PoolExhausted):              # held blocks are never evicted
        feed(bm, Sequence(3, [], state_block=-1), prompt(200, salt=5))
    census(bm, [c])
    bm.free(c)
    census(bm, [])


def test_an_undone_start_leaves_holders_and_pools_as_they_were():
    bm = BlockManager(TINY, 4, 256, prefix_caching=True)
    a, _ = start(bm, 0, prompt(80))
    before = (list(bm.pools.window), {r: list(b) for r, b in bm.pools.compressed.items()}, list(bm.pools.state),
              dict(bm.cache.refs), {k: list(v) for k, v in bm.cache.idle.items()})
    res = Reservation()
    b = Sequence(1, prompt(80)[:64])
    bm.take_state(b, res)
    bm.attach(b, bm.cache.lookup(prompt(80), 79), res)
    bm.reserve(b, 16, res)
    res.undo(bm.pools)
    after = (list(bm.pools.window), {r: list(b) for r, b in bm.pools.compressed.items()}, list(bm.pools.state),
             dict(bm.cache.refs), {k: list(v) for k, v in bm.cache.idle.items()})
    assert after == before
    census(bm, [a])
    bm.free(a)


def test_a_rejected_draft_trims_only_the_requests_own_blocks():
    bm = BlockManager(TINY, 4, 256, prefix_caching=True)
    toks = prompt(70)
    a, _ = start(bm, 0, toks)
    b, cached = start(bm, 1, toks[:64] + [5, 6])
    assert cached == 64
    held = {r: list(p) for r, p in b.compressed_pages.items()}
    for _ in range(40):                  # decode steps verifying 5 drafts, 1 kept each time
        feed(bm, b, [9], drafts=5, kept=1)
        census(bm, [a, b])
        assert all(b.compressed_pages[r][:len(held[r])] == held[r] for r in held)
    bm.free(a)
    bm.free(b)
    census(bm, [])


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_every_block_accounted(seed):
    """Requests sharing prefixes start, grow (with rejected drafts), are preempted (freed and
    started again from their history), finish; the pools are small enough that cached blocks are
    evicted all the time."""
    rng = random.Random(seed)
    bm = BlockManager(TINY, 4, 256, cache_tokens=300, prefix_caching=True)
    bases = [prompt(rng.randrange(40, 120), salt=s) for s in range(3)]
    live: dict[int, Sequence] = {}
    rid, hits, evicted = 0, 0, []
    evict = bm.cache.evict
    bm.cache.evict = lambda key: evicted.append(key) or evict(key)
    for _ in range(300):
        op = rng.random()
        try:
            if op < 0.3 and len(live) < 4:
                base = rng.choice(bases)
                toks = base[:rng.randrange(1, len(base))] + prompt(rng.randrange(1, 30), salt=rid + 10)
                seq, cached = start(bm, rid, toks)
                assert cached % G == 0 and cached < len(toks) and seq.tokens == toks
                hits += cached > 0
                live[rid] = seq
                rid += 1
            elif op < 0.8 and live:
                seq = live[rng.choice(list(live))]
                if seq.kv_len < 240:
                    feed(bm, seq, [rng.randrange(V)], drafts=rng.randrange(0, 4), kept=1)
            elif live:
                victim = live.pop(rng.choice(list(live)))
                bm.free(victim)
                if rng.random() < 0.5 and len(live) < 4:      # preempted: recomputed from its history
                    seq, cached = start(bm, rid, victim.tokens + [1])
                    live[rid] = seq
                    rid += 1
        except PoolExhausted:          # a failed start or step took nothing
            pass
        census(bm, list(live.values()))
    for seq in live.values():
        bm.free(seq)
    census(bm, [])
    assert bm.in_use()[0] == 0
    assert hits and evicted, "the traffic hit cached prefixes and evicted cached blocks"


# ---- a request served from a cached prefix equals the same request computed whole ------------------------
CTX, NEW = 256, 6
BASE = prompt(100)
# where a prompt leaves BASE: odd, inside a ratio-2 page (32 tokens) and a ratio-1 page (16); a
# window page edge; 2 past a span edge (the rows after the cut read a 4-gram reaching into the
# prefix); a span edge; inside the first span; the whole of BASE resent with more (the next turn)
DIVERGE = (77, 80, 66, 96, 40, 100)
SAMPLED = SamplingParams(temperature=0.9, top_k=50, seed=11)


def variants() -> list[list[int]]:
    return [BASE[:d] + prompt(14, salt=d + 1) for d in DIVERGE]


def run(engine, prompts, sampling=None, drafter=None, budget=24, cls=Scheduler, new=NEW, **kw):
    jobs = requests_for(prompts, sampling, new, None)
    sched = cls(engine, drafter(engine) if drafter else None, keep_logits=True, budget=budget, **kw)
    sched.run(jobs)
    return jobs, sched


def expected_cut(prompt_: list[int], before: list[list[int]], min_feed: int = 1, size: int = G) -> int:
    """The longest prefix shared with a history computed before, in whole spans of size, leaving
    min_feed (histories of one hash chain: check_cached)."""
    common = max((next((i for i, (a, b) in enumerate(zip(prompt_, h)) if a != b), min(len(prompt_), len(h)))
                  for h in before), default=0)
    return min(common, len(prompt_) - min_feed) // size * size


MODES = {"greedy": (None, None), "sampled": (SAMPLED, None), "ngram": (None, lambda e: NgramDrafter(3)),
         "dspark": (None, dspark_drafter), "dspark-sampled": (SAMPLED, dspark_drafter)}
# what a mode's answers equal: greedy drafts change no token or logit (tests/test_speculative.py), so
# greedy n-gram and DSpark answers are plain greedy's; a sampling request's drafts change its draws
ORACLE = {"greedy": "greedy", "sampled": "sampled", "ngram": "greedy", "dspark": "greedy",
          "dspark-sampled": "dspark-sampled"}
_answers: dict = {}


def oracle_answers(oracle, mode: str, prompts: list[list[int]]) -> list:
    key = (id(oracle), ORACLE[mode], tuple(map(tuple, prompts)))
    if key not in _answers:
        _answers[key] = run(oracle, prompts, *MODES[ORACLE[mode]])[0]
        oracle.taps = ()
    return _answers[key]


def check_cached(engine, oracle, mode: str, computed: dict[int, list[list[int]]] | None = None):
    """BASE once per DP group, then every variant (one batch, chunks of 24 rows beside decode rows) on
    the caching engine; each variant starts after the longest prefix, in whole spans, it shares with
    what its own DP group computed before it started (``computed``: per group, the histories this
    engine ran to their end in earlier calls, updated here; and the prompts of variants that started
    earlier in that group: cache-aware placement decides which group), and its tokens and final
    logits equal the oracle's, which caches nothing."""
    sampling, drafter = MODES[mode]
    prompts = variants()
    computed = {} if computed is None else computed
    try:
        warm, first = run(engine, [BASE] * len(engine.host.tables), sampling, drafter, cls=Recording)
        del engine.run
        got, sched = run(engine, prompts, sampling, drafter, cls=Recording)
    finally:
        engine.__dict__.pop("run", None)          # the engine's own method again
    for w in warm:
        computed.setdefault(first.groups[w.id], []).append(BASE + w.made[:-1])
    started = {rid: s for s, step in enumerate(sched.steps) for rid, _, cut in step if cut is not None}
    want = oracle_answers(oracle, mode, prompts)
    cfg = engine.cfg
    # one hash chain: a prompt shorter than the window (keyed apart) with its answer ends before a span
    assert all(len(p) >= cfg.sliding_window or len(p) + NEW <= span(cfg) for p in prompts + [BASE])
    min_feed = cfg.sliding_window if drafter is dspark_drafter else 1
    for g, w, p in zip(got, want, prompts):
        group = sched.groups[g.id]
        before = computed.get(group, []) + [q for o, q in zip(got, prompts)
                                            if sched.groups[o.id] == group and started[o.id] < started[g.id]]
        assert g.cached == expected_cut(p, before, min_feed, span(cfg))
        assert g.made == w.made
        assert torch.equal(g.final_logits, w.final_logits)
    for g, p in zip(got, prompts):
        computed.setdefault(sched.groups[g.id], []).append(p + g.made[:-1])
    assert sched.prefix_hits == sum(g.cached for g in got) > 0
    assert sched.prefix_queries == sum(map(len, prompts))
    if drafter is not None:
        assert sched.spec.drafted > 0
    assert engine.blocks_in_use()[0] == 0
    engine.taps, engine.dspark = (), False


_oracles: dict = {}


def oracle_of(cfg):
    """The engine caching nothing whose answers the caching one's equal, one per config."""
    if cfg not in _oracles:
        _oracles[cfg] = ReferenceEngine(cfg, seed=0, max_batch=8, max_context=CTX)
    return _oracles[cfg]


@pytest.fixture(scope="module")
def oracle():
    return oracle_of(TINY)


# window 16 (TINY's: window and Top-K in one 64-slot tile) and, under -m slow (12 min of this loaded
# machine for greedy alone), 64 (+ Top-K 16: two tiles, where the window list's width moves the
# compressed slots between tiles; a cached start at window 64 runs by default in
# tests/test_chunked_window.py)
WINDOWS = ([pytest.param(TINY, m, id=f"w16-{m}") for m in MODES]
           + [pytest.param(W64, m, id=f"w64-{m}", marks=pytest.mark.slow) for m in MODES])


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("cfg,mode", WINDOWS)
def test_reference_cached_prefix_equals_the_whole_prompt(cfg, mode):
    check_cached(ReferenceEngine(cfg, seed=0, max_batch=8, max_context=CTX, prefix_caching=True), oracle_of(cfg),
                 mode)


@pytest.mark.timeout(1200)
def test_dp2_each_group_reuses_the_prefix_it_computed(oracle):
    """DP2, BASE alone (group 0 caches it), then two variants in one step of 24 rows: the first goes
    to group 0, which caches their prefix; the second would too, but group 0 has no rows left this
    step, so it goes to the least loaded group, 1, and computes the prefix there. Then two more
    sharing no more with BASE than that prefix (66 and 40 tokens of it): both groups hold what they
    share, so they go by load, one per group, and start after it."""
    engine = dp2_engine()
    try:
        run(engine, [BASE])
        got, sched = run(engine, variants()[:2], SAMPLED, cls=Recording)
        del engine.run
        assert [sched.groups[j.id] for j in got] == [0, 1] and [j.cached for j in got] == [64, 0]
        more, sched = run(engine, [variants()[2], variants()[4]], SAMPLED, cls=Recording)
        del engine.run
        assert [sched.groups[j.id] for j in more] == [0, 1] and [j.cached for j in more] == [64, 32]
        want = oracle_answers(oracle, "sampled", variants())
        for g, w in zip(got + more, want[:2] + [want[2], want[4]]):
            assert g.made == w.made and torch.equal(g.final_logits, w.final_logits)
        assert engine.blocks_in_use()[0] == 0
    finally:
        engine.close()


def dp2_engine(max_batch: int = 8) -> GraphEngine:
    """DP2 with prefix caching; max_batch over both groups (each holds half)."""
    return GraphEngine(TINY, Topology(1, 2, 2), EngineConfig(seed=0, executor="threads", max_batch=max_batch,
                                                             max_context=CTX, prefix_caching=True))


LAYOUTS = [("threads", Topology(4, 1, 4), "sharded"), ("threads", Topology(4, 1, 4), "replicated"),
           ("distributed", Topology(2, 2, 4), "sharded")]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("executor,topo,wiring", LAYOUTS, ids=lambda v: str(v))
def test_every_layout_cached_prefix_equals_the_whole_prompt(executor, topo, wiring, oracle):
    engine = GraphEngine(TINY, topo, EngineConfig(seed=0, executor=executor, wiring=wiring, max_batch=8,
                                                  max_context=CTX, prefix_caching=True))
    try:
        computed: dict[int, list[list[int]]] = {}
        for mode in MODES:
            check_cached(engine, oracle, mode, computed)
    finally:
        engine.close()


class Censused(Scheduler):
    """After every step, each group's blocks are counted against its requests' pages (census)."""

    def step(self):
        turn = super().step()
        for table in self.engine.host.tables:
            census(table.blocks, list(table.requests.values()))
        return turn


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("cfg", [pytest.param(TINY, id="w16"), pytest.param(W64, id="w64", marks=pytest.mark.slow)])
def test_shared_prefixes_under_eviction_and_preemption_equal_their_solo_runs(cfg):
    """10 requests, two by two over five 70-token prefixes, in pools of 128 tokens: cached blocks are
    evicted, requests are preempted and recomputed (from cached spans where they survive). Oracle:
    the same batch with room for every request and nothing cached (a request's tokens do not depend
    on its batch, tests/test_admission.py)."""
    oracle = oracle_of(cfg)
    engine = ReferenceEngine(cfg, seed=0, max_batch=8, max_context=CTX, cache_tokens=128, prefix_caching=True)
    evicted = []
    evict = engine.host.tables[0].blocks.cache.evict
    engine.host.tables[0].blocks.cache.evict = lambda key: evicted.append(key) or evict(key)
    heads = [prompt(70, salt=s) for s in range(5)]
    prompts = [heads[i // 2 % 5] + prompt(3 + i % 11, salt=40 + i) for i in range(10)]
    got, sched = run(engine, prompts, SAMPLED, cls=Censused, new=12)
    want, _ = run(oracle, prompts, SAMPLED, new=12)
    assert [g.made for g in got] == [w.made for w in want]
    assert all(torch.equal(g.final_logits, w.final_logits) for g, w in zip(got, want))
    assert sched.victims and evicted and sched.prefix_hits > 0
    # a recompute is not a new request: each prompt is looked up, and its cached part counted, once
    # (at its first admission), whatever its readmissions find cached
    assert {v.id for v, _ in sched.victims} & {g.id for g in got if g.preemptions}
    assert sched.prefix_queries == sum(map(len, prompts))
    assert sched.prefix_hits == sum(g.cached for g in got)
    assert all(g.cached < len(g.prompt) for g in got)
    assert engine.blocks_in_use()[0] == 0
    census(engine.host.tables[0].blocks, [])


@pytest.mark.timeout(900)
def test_a_rejected_draft_after_a_cached_prefix_leaves_the_shared_blocks_as_they_were(oracle):
    engine = ReferenceEngine(TINY, seed=0, max_batch=8, max_context=CTX, prefix_caching=True)
    run(engine, [BASE])
    q = BASE[:77] + prompt(20, salt=3)
    hit = engine.host.tables[0].blocks.cache.lookup(q, len(q) - 1)
    assert hit.length == 64
    bs = TINY.block_size
    shared = {}                                   # cache name -> its rows in the hit's blocks
    for name, (kind, _, ratio) in cache_names(TINY).items():
        blocks = list(hit.window.values()) if kind == kv_cache.WINDOW else hit.compressed[ratio]
        shared[name] = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in blocks])
    before = {n: [t[rows].clone() for t in engine.caches.committed[n]] for n, rows in shared.items()}
    written = []
    put = engine.caches.put
    engine.caches.put = lambda name, slots, *a: written.append((name, slots.clone())) or put(name, slots, *a)
    wrong = OracleDrafter(lambda job, room: [(job.last + 1 + i) % V for i in range(room)])
    got, sched = run(engine, [q], drafter=lambda e: wrong)
    want, _ = run(oracle, [q])
    assert got[0].cached == 64 and got[0].made == want[0].made
    assert sched.spec.drafted > sched.spec.accepted          # drafts were rejected
    for name, slots in written:
        if name in shared:
            assert not torch.isin(slots.long(), shared[name]).any(), f"a write into a shared row of {name}"
    for n, rows in shared.items():
        assert all(torch.equal(t[rows], b) for t, b in zip(engine.caches.committed[n], before[n])), n


@pytest.mark.timeout(900)
def test_the_server_reports_cached_prompt_tokens_in_usage_and_metrics(oracle):
    """serve caches by default: a prompt sent again, and one sharing 77 tokens with it, are answered
    with the tokens of the uncached engine and report their cached tokens in usage (OpenAI's
    prompt_tokens_details.cached_tokens, streamed and not) and in vLLM's prefix-cache counters."""
    httpx = pytest.importorskip("httpx")
    from test_serve_hostile import Served
    from test_serve_metrics import _scrape, _value
    server = Served("--max-context", str(CTX), "--metrics-names", "vllm", "--served-model-name", "tiny")
    first, again, other = BASE + prompt(9, salt=2), BASE + prompt(9, salt=2), BASE[:77] + prompt(9, salt=3)
    try:
        answers = []
        for p, stream in ((first, False), (again, False), (other, True)):
            body = {"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            if not stream:
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=600).json()
                answers.append((r["choices"][0]["token_ids"], r["usage"]))
                continue
            ids, usage = [], None
            with httpx.stream("POST", server.url + "/v1/completions", timeout=600,
                              json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        ids += event["choices"][0]["token_ids"] if event["choices"] else []
                        usage = event.get("usage") or usage
            answers.append((ids, usage))
        m = _scrape(server)
    finally:
        server.stop()
    cached = [u["prompt_tokens_details"]["cached_tokens"] for _, u in answers]
    assert cached == [0, 96, 64]
    assert [a for a, _ in answers] == oracle.generate([first, again, other], 4)
    on = dict(model_name="tiny", engine="0")
    probe = 1                              # the start-up probe's one-token prompt
    assert _value(m, "vllm:prefix_cache_queries_total", **on) == len(first) + len(again) + len(other) + probe
    assert _value(m, "vllm:prefix_cache_hits_total", **on) == 96 + 64
    assert schema.usage(5, 2) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}   # caching off


@pytest.mark.timeout(900)
def test_tenants_with_their_own_cache_salt_never_share_a_cached_prefix():
    """A server run with --require-cache-salt: a request without vLLM's cache_salt (or with one that
    is not a non-empty string) is a 400 naming it; the same prompt under another tenant's salt finds
    nothing cached (cached_tokens 0: it learns nothing of what the other sent), under its own salt
    again the whole spans it computed before; the answers are the same tokens."""
    httpx = pytest.importorskip("httpx")
    from test_serve_hostile import Served
    server = Served("--max-context", str(CTX), "--require-cache-salt")
    p = BASE + prompt(9, salt=2)
    try:
        body = {"prompt": p, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        for salt in (None, 5, "", ["a"]):
            status, r = server.post("/v1/completions", {**body, **({} if salt is None else {"cache_salt": salt})})
            assert (status, r["error"]["param"]) == (400, "cache_salt"), r
        answers = []
        for salt in ("alice", "bob", "alice", "bob", "carol"):
            status, r = server.post("/v1/completions", {**body, "cache_salt": salt})
            assert status == 200, r
            answers.append((r["choices"][0]["token_ids"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
    finally:
        server.stop()
    assert [cached for _, cached in answers] == [0, 0, 96, 96, 0]
    assert len({tuple(ids) for ids, _ in answers}) == 1


@pytest.mark.timeout(900)
def test_a_lost_card_replays_a_request_that_shared_cached_pages(oracle):
    """A card loses its State while a request decodes over shared pages: the recovery replays the
    request's whole history into fresh tables (a fresh cache) and its answer is unchanged."""
    from dsv41.cluster import registry
    engine = GraphEngine(TINY, Topology(1, 1, 1), EngineConfig(seed=0, executor="threads", max_batch=8,
                                                               max_context=CTX, prefix_caching=True))

    class Losing(Scheduler):
        lost = False

        def step(self):
            turn = super().step()
            if not self.lost and any(j.made for j in self.running.values()):
                registry.find(engine.id).states.pop(0)
                self.lost = True
            return turn
    try:
        run(engine, [BASE])
        got, _ = run(engine, variants()[:1], cls=Losing)
        assert got[0].cached == 64 and engine.recoveries
        assert got[0].made == oracle_answers(oracle, "greedy", variants())[0].made
        assert engine.blocks_in_use()[0] == 0
    finally:
        engine.close()


# ---- requests arriving together compute their shared prefix once ---------------------------------------
HEAD = prompt(70, salt=9)                  # shared by A, B, D and (its first 40 tokens) E; nothing cached yet
TOGETHER = {"A": HEAD + prompt(9, salt=1), "B": HEAD + prompt(12, salt=2), "C": prompt(40, salt=7),
            "D": HEAD + prompt(9, salt=1), "E": HEAD[:40] + prompt(10, salt=3)}
# A computes HEAD's spans 0..64; B and D (D is A again, as n > 1 samples are) start after them, E after
# the span 0..32 it shares (its cut must leave a row: 49 tokens); C shares nothing
CUTS = {"A": 0, "B": 64, "C": 0, "D": 64, "E": 32}


class Recording(Scheduler):
    """Keeps, per step, the parts the engine ran: (request id, rows fed, the cached prefix it started
    after, or None for a request already running); and the DP group each request started in."""

    def __init__(self, engine, *a, **kw):
        super().__init__(engine, *a, **kw)
        self.steps: list[list[tuple[int, int, int | None]]] = []
        self.groups: dict[int, int] = {}
        run = engine.run

        def recorded(parts, phase):
            out = run(parts, phase)
            self.steps.append([(p.id, len(p.tokens), len(p.cached or []) if p.start else None) for p in parts])
            self.groups.update((p.id, engine.host.group_of(p.id)) for p in parts if p.start)
            return out
        engine.run = recorded


def solo_answers(oracle, prompts: list[list[int]], sampling) -> list:
    """Each prompt alone on the engine that caches nothing (memoised)."""
    out = []
    for p in prompts:
        key = (id(oracle), "solo", sampling is None, tuple(p))
        if key not in _answers:
            _answers[key] = run(oracle, [p], sampling)[0][0]
        out.append(_answers[key])
    return out


def check_together(engine, oracle, sampling, budget: int, names=tuple(TOGETHER)):
    """TOGETHER (the requests named) submitted at once: the shared spans are computed once (each
    request starts after CUTS and is fed only the rest of its prompt), every answer equals its solo
    run; per step the names of the requests it started, and the scheduler."""
    names = list(names)
    prompts = [TOGETHER[n] for n in names]
    try:
        got, sched = run(engine, prompts, sampling, budget=budget, cls=Recording)
    finally:
        del engine.run                    # the engine's own method again
    ids = {j.id: n for n, j in zip(names, got)}
    assert [j.cached for j in got] == [CUTS[n] for n in names]
    assert sched.prefix_hits == sum(CUTS[n] for n in names) and sched.prefix_queries == sum(map(len, prompts))
    fed = {n: 0 for n in names}
    for step in sched.steps:
        for rid, rows, cut in step:
            fed[ids[rid]] += rows
            if cut is not None:
                assert cut == CUTS[ids[rid]], ids[rid]
    for n, j in zip(names, got):        # its prompt past the cut, then one row per later token
        assert fed[n] == len(TOGETHER[n]) - CUTS[n] + len(j.made) - 1, n
    for j, w in zip(got, solo_answers(oracle, prompts, sampling)):
        assert j.made == w.made and torch.equal(j.final_logits, w.final_logits)
    assert engine.blocks_in_use()[0] == 0
    return [[ids[rid] for rid, _, cut in step if cut is not None] for step in sched.steps], sched


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_requests_sent_together_compute_their_shared_prefix_once(oracle, mode):
    """One step's budget holds every prompt: A and C (which shares nothing) start in the first step,
    the requests sharing A's uncached spans wait for them and start in the next."""
    engine = ReferenceEngine(TINY, seed=0, max_batch=8, max_context=CTX, prefix_caching=True)
    started, _ = check_together(engine, oracle, MODES[mode][0], budget=CAPACITIES["tiny"].prefill_max_tokens)
    assert started[:2] == [["A", "C"], ["B", "D", "E"]]


@pytest.mark.timeout(900)
def test_a_chunked_shared_prefix_is_waited_for_to_its_last_span(oracle):
    """Chunks of 48 rows: A's first chunk fills the first step and caches span 0..32, its second
    span 32..64; B and D, cached 0..32 but not 32..64, wait for A's second chunk (C, sharing
    nothing, takes the room they leave beside it) and start after both spans; E, behind them, starts
    after the one span it shares when the budget has room again."""
    engine = ReferenceEngine(TINY, seed=0, max_batch=8, max_context=CTX, prefix_caching=True)
    started, _ = check_together(engine, oracle, SAMPLED, budget=48)
    assert started[:4] == [["A"], ["C"], ["B", "D"], ["E"]]


@pytest.mark.timeout(900)
def test_requests_sent_together_share_their_prefix_on_a_graph_layout(oracle):
    engine = GraphEngine(TINY, Topology(2, 1, 2), EngineConfig(seed=0, executor="sync", max_batch=8,
                                                               max_context=CTX, prefix_caching=True))
    try:
        started, _ = check_together(engine, oracle, SAMPLED, budget=CAPACITIES["tiny"].prefill_max_tokens)
        assert started[:2] == [["A", "C"], ["B", "D", "E"]]
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_without_prefix_caching_nothing_waits(oracle):
    engine = ReferenceEngine(TINY, seed=0, max_batch=8, max_context=CTX)
    got, sched = run(engine, list(TOGETHER.values()), budget=CAPACITIES["tiny"].prefill_max_tokens, cls=Recording)
    del engine.run
    assert [cut for _, _, cut in sched.steps[0]] == [0] * 5 and all(j.cached == 0 for j in got)


@pytest.mark.timeout(900)
def test_dp2_requests_sharing_a_prefix_go_to_one_group_and_compute_it_once(oracle):
    """DP2, A, B, C and D sent together: A goes to group 0 (the least loaded); B and D share A's
    uncached HEAD, which group 0 is computing, so they go there too (cache-aware placement) and wait
    a step for A's spans; C shares nothing and goes to the least loaded group, 1. HEAD is fed once
    (check_together counts every request's rows: its prompt past its cut, then its decode rows)."""
    engine = dp2_engine()
    try:
        started, sched = check_together(engine, oracle, SAMPLED, budget=CAPACITIES["tiny"].prefill_max_tokens,
                                        names="ABCD")
        assert started[:2] == [["A", "C"], ["B", "D"]]
        assert sorted(sched.groups.values()) == [0, 0, 0, 1]
        assert [g for _, g in sorted(sched.groups.items())] == [0, 0, 1, 0]      # ids in arrival order
    finally:
        engine.close()


@pytest.mark.timeout(900)
def test_dp2_a_request_goes_to_the_group_caching_its_prefix_within_the_load_bound(oracle):
    """C then A on a fresh DP2 engine: C goes to group 0, A to group 1, which caches HEAD's spans
    (0..64) when A finishes. B (HEAD and more) alone then goes to group 1, not to the least loaded
    group 0 it would have gone to by load, and starts after those 64 tokens. Then four prompts on
    HEAD sent together: the first three go to group 1 (loads 0/0, 0/1, 0/2: at most max_batch // 4
    = 2 more than group 0, 8 requests per group); the fourth would make group 1 three ahead, so it
    goes to group 0, which computes HEAD itself. Every answer equals its solo run."""
    engine = dp2_engine(max_batch=16)
    quad = [HEAD + prompt(8 + k, salt=20 + k) for k in range(4)]
    try:
        warm, sched = run(engine, [TOGETHER["C"], TOGETHER["A"]], SAMPLED, cls=Recording)
        del engine.run
        assert [sched.groups[j.id] for j in warm] == [0, 1]
        got, sched = run(engine, [TOGETHER["B"]], SAMPLED, cls=Recording)
        del engine.run
        assert sched.groups[got[0].id] == 1 and got[0].cached == 64
        four, sched = run(engine, quad, SAMPLED, budget=CAPACITIES["tiny"].prefill_max_tokens, cls=Recording)
        del engine.run
        assert [sched.groups[j.id] for j in four] == [1, 1, 1, 0]
        assert [j.cached for j in four] == [64, 64, 64, 0]
        assert [n for _, n, cut in sched.steps[0]] == [len(p) - c for p, c in zip(quad, [64, 64, 64, 0])]
        for j, w in zip(warm + got + four, solo_answers(oracle, [TOGETHER["C"], TOGETHER["A"], TOGETHER["B"]] + quad,
                                                        SAMPLED)):
            assert j.made == w.made and torch.equal(j.final_logits, w.final_logits)
        assert engine.blocks_in_use()[0] == 0
    finally:
        engine.close()


@pytest.mark.timeout(900)
def test_dp2_without_prefix_caching_places_by_load_alone(oracle):
    """Caching off: no request prefers a group; TOGETHER alternates over the groups, group 0 first."""
    engine = GraphEngine(TINY, Topology(1, 2, 2), EngineConfig(seed=0, executor="threads", max_batch=8,
                                                               max_context=CTX))
    try:
        got, sched = run(engine, list(TOGETHER.values()), budget=CAPACITIES["tiny"].prefill_max_tokens, cls=Recording)
        del engine.run
        assert [sched.groups[j.id] for j in got] == [0, 1, 0, 1, 0] and all(j.cached == 0 for j in got)
    finally:
        engine.close()
