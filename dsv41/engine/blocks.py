"""Paged-cache blocks of one DP group: the free pools, what a sequence holds, and reservations a
step can take back.

A step reserves the pages its rows need before it runs (``reserve``); every block it takes is
logged, so ``Reservation.undo`` puts each back where it came from (a failed step) and ``trim``
returns those past the rows a step kept (a verify step's rejected drafts). Pools hand out blocks
from the front, and a returned reservation goes back to the front: after an undo the pools are
exactly as before.

With prefix caching (``prefix_cache.PrefixCache``) a sequence may also hold cached blocks other
sequences hold too: those are counted by the cache, never written (they hold rows before the
sequence's kv_len) and never handed back to a free list while anyone holds them; a block nobody
holds stays cached until a pool runs out of free blocks and evicts its least recently used one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dsv41.config import ModelConfig
from dsv41.capacity import capacity_of
from dsv41.engine.prefix_cache import Hit, PrefixCache
from dsv41.engine.sequence import Sequence


class PoolExhausted(ValueError):
    """A pool has too few free blocks for the step (the scheduler preempts; a direct caller is told)."""


@dataclass
class Pools:
    window: list[int]
    compressed: dict[int, list[int]]        # ratio -> free blocks
    state: list[int]
    cache: PrefixCache | None = None        # the cached blocks (prefix caching on)


HELD = "held"       # a reservation's log entry for a cached block a new sequence holds


@dataclass
class Reservation:
    """Blocks one step took, oldest first: (pool key, sequence, page or None, block); a cached block
    a sequence started to hold: (HELD, sequence, pool key, block)."""
    taken: list = field(default_factory=list)

    def undo(self, pools: Pools):
        for key, seq, page, blk in reversed(self.taken):
            _give_back(pools, key, seq, page, blk)
        self.taken = []


def _pool(pools: Pools, key) -> list[int]:
    return pools.window if key == "window" else pools.state if key == "state" else pools.compressed[key]


def _put(pools: Pools, key, blk: int, front: bool = False):
    """A block a sequence let go of: a cached one is the cache's to keep, any other is free."""
    if pools.cache is not None and pools.cache.shared(key, blk):
        pools.cache.unhold(key, blk)
    elif front:
        _pool(pools, key).insert(0, blk)
    else:
        _pool(pools, key).append(blk)


def _take(pools: Pools, key) -> int:
    """A free block, or (none free) the least recently used cached block nobody holds."""
    free = _pool(pools, key)
    if free:
        return free.pop(0)
    if pools.cache is not None and pools.cache.idle_blocks(key):
        return pools.cache.evict(key)
    raise PoolExhausted("batch: window cache pool exhausted" if key == "window" else
                        "batch: no free compressor state block" if key == "state" else
                        f"batch: ratio-{key} compressed cache pool exhausted")


def _give_back(pools: Pools, key, seq: Sequence, page, blk: int):
    if key == HELD:
        key, pages = page, seq.window_pages if page == "window" else seq.compressed_pages[page]
        if key == "window":
            del pages[next(p for p, b in pages.items() if b == blk)]
        else:
            pages.remove(blk)
        pools.cache.unhold(key, blk)
        return
    if key == "window":
        del seq.window_pages[page]
    elif key != "state":
        seq.compressed_pages[key].pop()
    _put(pools, key, blk, front=True)

def window_pages(cfg: ModelConfig, max_context: int, step_rows: int) -> int:
    """Window pages one request can hold at once. Before a step it holds the pages from its earliest
    window position on; a step of n new tokens adds pages up to its last, so at most
    ceil((n + window - 1) / block) + 1, with n <= step_rows (the capacity's ``prefill_max_tokens``),
    and never more than its whole context's. A drawn 1M-token history (``start_at``) keeps 34 FLASH
    pages a layer, not 8,193."""
    bs = cfg.block_size
    return min(math.ceil(max_context / bs), math.ceil((step_rows + cfg.sliding_window - 1) / bs)) + 1


class BlockManager:
    def __init__(self, cfg: ModelConfig, max_batch: int, max_context: int, cache_tokens: int | None = None,
                 prefix_caching: bool = False, step_rows: int | None = None):
        """cache_tokens: the tokens the compressed pools hold over all requests (default: every
        request at max_context); fewer makes the scheduler preempt when requests grow.
        prefix_caching: keep the pages of completed prompt spans for later requests (evicted,
        least recently used first, when a pool has no free block left). step_rows: the rows of the
        longest step (default: the model's capacity, ``dsv41.capacity``)."""
        self.cfg = cfg
        bs = cfg.block_size
        if step_rows is None:
            step_rows = capacity_of(cfg).prefill_max_tokens
        self.window_per_request = window_pages(cfg, max_context, step_rows)
        self.window_blocks = max_batch * self.window_per_request
        if cache_tokens is None:
            sizes = lambda r: max_batch * math.ceil(max_context // r / bs + 1)    # noqa: E731
        else:
            sizes = lambda r: math.ceil(cache_tokens // r / bs) + max_batch       # noqa: E731
        self.compressed_blocks = {r: sizes(r) for r in sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids})}
        self.state_blocks = max_batch
        self.pools = Pools(list(range(self.window_blocks)),
                           {r: list(range(n)) for r, n in self.compressed_blocks.items()},
                           list(range(self.state_blocks)))
        if prefix_caching:
            self.pools.cache = PrefixCache(cfg, {"window": self.pools.window, "state": self.pools.state,
                                                 **self.pools.compressed})

    @property
    def cache(self) -> PrefixCache | None:
        return self.pools.cache

    def _window_range(self, kv_len: int, n_new: int) -> range:
        bs, w = self.cfg.block_size, self.cfg.sliding_window
        return range(max(0, kv_len - w + 1) // bs, (kv_len + n_new - 1) // bs + 1)

    def _compressed_need(self, kv_len: int, ratio: int) -> int:
        return math.ceil(kv_len // ratio / self.cfg.block_size)

    def needs(self, seq: Sequence | None, n_new: int, hit: Hit | None = None) -> dict:
        """Blocks per pool key a sequence (None: a new one, after hit's cached prefix if given) must
        take to feed n_new more rows; a hit's cached blocks nobody holds count too (they leave the
        LRU the free counts include)."""
        if seq is not None:
            kv, window, pages = seq.kv_len, seq.window_pages, seq.compressed_pages
        elif hit is not None:
            kv, window, pages = hit.length, hit.window, hit.compressed
        else:
            kv, window, pages = 0, {}, {}
        out = {"window": sum(p not in window for p in self._window_range(kv, n_new))}
        for r in self.pools.compressed:
            out[r] = max(0, self._compressed_need(kv + n_new, r) - len(pages.get(r, [])))
        out["state"] = 1 if seq is None else 0
        if seq is None and hit is not None:
            for key, n in self.cache.revived(hit).items():
                out[key] += n
        return out

    def needs_started(self, drawn: int, n_new: int) -> dict:
        """Blocks a new request started at ``drawn`` tokens of history (``RequestTable.start_at``)
        takes with them and its first n_new rows: its compressed pages exactly, its window pages at
        most what one request holds at once."""
        out = self.needs(None, drawn + n_new)
        out["window"] = min(out["window"], self.window_per_request)
        return out

    def holds(self, context: int) -> int:
        """How many requests of ``context`` tokens the pools hold at once (fed in steps the window pool
        allows), at most the batch they are sized for."""
        need = self.needs_started(context, 0)
        sizes = {"window": self.window_blocks, "state": self.state_blocks, **self.compressed_blocks}
        return min(sizes[k] // n for k, n in need.items() if n)

    def fits(self, needs: list[dict]) -> bool:
        """Whether the free pools hold the summed needs of several sequences."""
        total: dict = {}
        for need in needs:
            for k, n in need.items():
                total[k] = total.get(k, 0) + n
        return all(self.free_blocks(k) >= n for k, n in total.items())

    def free_blocks(self, key) -> int:
        """Blocks a pool can hand out: free, or cached with nobody holding them."""
        return len(_pool(self.pools, key)) + (self.cache.idle_blocks(key) if self.cache is not None else 0)

    def take_state(self, seq: Sequence, res: Reservation):
        seq.state_block = _take(self.pools, "state")
        res.taken.append(("state", seq, None, seq.state_block))

    def attach(self, seq: Sequence, hit: Hit, res: Reservation):
        """A new sequence (its tokens the hit's prefix) holds the hit's cached pages and starts after
        them: its caches read those rows, and it writes only past them (logged in res)."""
        seq.window_pages = dict(hit.window)
        seq.compressed_pages = {r: list(b) for r, b in hit.compressed.items()}
        seq.kv_len, seq.hashes = hit.length, list(hit.hashes)
        for key, blk in hit.blocks():
            self.cache.hold(key, blk)
            res.taken.append((HELD, seq, key, blk))

    def reserve(self, seq: Sequence, n_new: int, res: Reservation):
        """The pages seq needs for n_new more rows, logged in res (raises PoolExhausted, having
        taken part of them: the caller undoes res)."""
        for page in self._window_range(seq.kv_len, n_new):
            if page not in seq.window_pages:
                seq.window_pages[page] = blk = _take(self.pools, "window")
                res.taken.append(("window", seq, page, blk))
        for r in self.pools.compressed:
            pages = seq.compressed_pages.setdefault(r, [])
            while len(pages) < self._compressed_need(seq.kv_len + n_new, r):
                pages.append(blk := _take(self.pools, r))
                res.taken.append((r, seq, None, blk))

    def trim(self, seq: Sequence, res: Reservation):
        """After seq kept fewer rows than res reserved: give back, newest first, the blocks res took
        for seq past its kv_len."""
        bs = self.cfg.block_size
        last_page = (seq.kv_len - 1) // bs
        keep = []
        for entry in reversed(res.taken):
            key, owner, page, blk = entry
            extra = owner is seq and key != HELD and ((key == "window" and page > last_page) or
                                      (key not in ("window", "state")
                                       and len(seq.compressed_pages[key]) > self._compressed_need(seq.kv_len, key)))
            if extra:
                _give_back(self.pools, key, seq, page, blk)
            else:
                keep.append(entry)
        res.taken = keep[::-1]

    def release_stale(self, seq: Sequence):
        """Pages wholly before the next step's earliest window position go back to the pool."""
        keep_from = max(0, seq.kv_len - self.cfg.sliding_window + 1) // self.cfg.block_size
        for page in [p for p in seq.window_pages if p < keep_from]:
            _put(self.pools, "window", seq.window_pages.pop(page))

    def register(self, seq: Sequence):
        """Cache the spans seq's rows completed (prefix caching on; not a drawn-context request's)."""
        if self.cache is not None and not seq.from_context:
            self.cache.register(seq)

    def free(self, seq: Sequence):
        self._let_go("window", list(seq.window_pages.values()))
        for r, pages in seq.compressed_pages.items():
            self._let_go(r, pages)
        self.pools.state.append(seq.state_block)
        seq.window_pages, seq.compressed_pages, seq.state_block = {}, {}, -1

    def _let_go(self, key, blocks: list[int]):
        """A sequence's blocks of one pool back: its own to the free list in order, cached ones to the
        cache newest first (a prefix's later spans become the least recently used)."""
        cache = self.cache
        shared = [cache is not None and cache.shared(key, b) for b in blocks]
        _pool(self.pools, key).extend(b for b, s in zip(blocks, shared) if not s)
        for blk, s in zip(reversed(blocks), reversed(shared)):
            if s:
                cache.unhold(key, blk)

    def in_use(self) -> tuple[int, int]:
        """(blocks held by sequences, blocks in all pools): window, compressed and state; a cached
        block nobody holds is not in use."""
        total = self.window_blocks + sum(self.compressed_blocks.values()) + self.state_blocks
        free = sum(self.free_blocks(k) for k in ["window", "state", *self.pools.compressed])
        return total - free, total


def least_cache_tokens(cfg: ModelConfig, max_batch: int, context: int, step_rows: int | None = None) -> int:
    """The fewest tokens a DP group's pools may be sized to hold (``BlockManager``'s cache_tokens) for
    one request of ``context`` tokens to fit in them alone: with fewer, that request never fits, and
    a server would fail it at its first step. Found by halving, on the pools' own arithmetic."""
    low, high = 1, max_batch * context
    while low < high:
        mid = (low + high) // 2
        if BlockManager(cfg, max_batch, context, mid, step_rows=step_rows).holds(context):
            high = mid
        else:
            low = mid + 1
    return low
