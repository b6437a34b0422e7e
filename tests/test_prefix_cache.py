"""Prefix caching: the block machinery (this part) and a request served from a cached prefix against
the same request on a fresh engine (below).

The block part drives one group's ``BlockManager`` as the request table does (reserve, publish,
register, release stale pages) and checks the cache's bookkeeping against a count kept here: every
block is exactly one of free, cached with nobody holding it, or held, and a held block's count is
the number of sequences whose pages name it; a shared block is never handed out, written or put on a
free list while a sequence holds it; everything returns at the end."""
import random

import pytest

from dsv41.config import FLASH, TINY
from dsv41.engine.blocks import BlockManager, PoolExhausted, Reservation
from dsv41.engine.prefix_cache import span
from dsv41.engine.sequence import Sequence

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


def start(bm: BlockManager, rid: int, tokens: list[int], limit: int | None = None) -> tuple[Sequence, int]:
    """A new sequence over tokens' longest cached prefix (at most limit tokens), fed the rest."""
    res = Reservation()
    seq = Sequence(rid, [])
    hit = bm.cache.lookup(tokens, len(tokens) - 1 if limit is None else limit)
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
    assert bm.in_use()[0] == 0 and bm.cache.stats()["entries"] == 100 // G + 1   # b's span 64..95 cached too


def test_the_cut_leaves_a_row_to_feed_and_a_miss_is_a_miss():
    bm = BlockManager(TINY, 4, 256, prefix_caching=True)
    toks = prompt(64)
    a, _ = start(bm, 0, toks)
    assert bm.cache.lookup(toks, 63).length == 32      # the whole prompt cached, but one row must be fed
    assert bm.cache.lookup(toks + [1], 64).length == 64
    assert bm.cache.lookup([toks[0] ^ 1] + toks[1:], 63).length == 0
    assert bm.cache.lookup(toks, 31).length == 0
    bm.free(a)


def test_eviction_takes_the_least_recently_used_block_nobody_holds():
    bm = BlockManager(TINY, 2, 256, cache_tokens=192, prefix_caching=True)
    a, _ = start(bm, 0, prompt(129))
    bm.free(a)
    entries = bm.cache.stats()["entries"]
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
