"""Automatic prefix caching for one DP group's block pools: the pages of a prompt prefix already
computed are shared, read-only, by every later request that starts with the same tokens.

Granularity (the *span*). V4.1 keeps more than a KV cache per prefix, and a prefix is reusable only
at a cut where everything the rest of the prompt reads is in whole pages nobody writes again:

- compressed KV and index-key rows: a ratio-r page holds ``block_size`` rows of r tokens each, so
  it is complete only at multiples of ``r * block_size`` tokens (ratio 2: 2 x block_size);
- the ratio-2 compressor's ring: a request resuming at an odd position needs its predecessor's
  (kv, score) in its own ring; at an even cut nothing is read from it, so a fresh ring is exact;
- window KV: position L reads positions L-window+1 .. L-1, so the cut keeps the window pages of
  those positions (they end at the cut: the request writes only pages after it);
- Engram: its n-gram hashes are made on the host from the token history, which the request holds
  whole (the prefix's tokens included);
- the last position's hyper-connection lanes and logits: at least one prompt row is always fed;
- DSpark's window (the stages' rings of the last ``window`` rows): rebuilt from the rows fed after
  the cut, so with DSpark drafting the scheduler feeds at least ``window`` rows (``min_feed``).

So the span is the least common multiple of the compressed pages' token spans, rounded up to reach
back one window: 2 x block_size for V4.1 (32 tokens on TINY, 256 on FLASH). Nothing is recomputed
or copied at a cut and nothing is written into a shared page.

A row's bits also depend on its request's prompt length where that is shorter than the window: the
attention lists min(prompt, window) window slots on a prompt's rows and the whole window after
(``ops.metadata``), and rounds per 64-slot tile of that list. So the hash chain of a prompt shorter
than the window starts from its length (``chain_start``): its spans (all past its prompt, since a span
reaches back a window) are found only by a request with the same prompt length, its own recompute
after preemption, and never by a longer prompt, whose one-step prefill lists the whole window on
those rows. Prompts of a window or more share one chain.

A cached *entry* is one span of a prefix, keyed by a chain hash of the tokens up to its end (as
vLLM's block hashes): its compressed pages and the window pages a cut at its end reads. Blocks are
reference counted by the requests holding them; a block nobody holds stays in its pool's LRU with
its content until a request needs a block and the free list is empty (evicting it drops its entry).
Each DP group keeps its own cache over its own pools (its cards' memory): the same prefix is
computed once per group that serves it.
"""
from __future__ import annotations

import array
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from dsv41.config import ModelConfig


def span(cfg: ModelConfig) -> int:
    """Tokens per cached entry: a cut at a multiple of it is exact (see the module docstring)."""
    bs = cfg.block_size
    unit = bs * math.lcm(*sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids} | {1}))
    return unit * max(1, math.ceil((cfg.sliding_window - 1) / unit))


def chain(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a span given the hash of the prefix before it (the first span's parent: the root)."""
    return hashlib.blake2b(parent + array.array("q", tokens).tobytes(), digest_size=16).digest()


def root(salt: str | None) -> bytes:
    """The root of a cache salt: b"" unsalted, else a hash of vLLM's ``cache_salt`` (its own domain,
    so no salt's root is a span's hash). Every span hash chains from it (``chain_start``), so prompts under
    two salts never share a span, and under one salt share as unsalted ones do."""
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"dsv41-cache-salt").digest()


def chain_start(cfg: ModelConfig, prompt_len: int, salt_root: bytes = b"") -> bytes:
    """The parent of the first span of a request whose prompt has prompt_len tokens, under its salt's
    root: the root itself for a prompt of a window or more, else chained with the prompt's length
    (module docstring) as a two-token pseudo-span (-1, prompt_len), which no real span (whole spans of
    token ids >= 0) can hash to."""
    return salt_root if prompt_len >= cfg.sliding_window else chain(salt_root, [-1, prompt_len])


def span_hashes(tokens: list[int], size: int, parent: bytes = b"") -> list[bytes]:
    """The chained hash of each whole span of ``size`` tokens (the same in every DP group's cache),
    from the chain's start ``parent``."""
    out = []
    for i in range(len(tokens) // size):
        parent = chain(parent, tokens[i * size:(i + 1) * size])
        out.append(parent)
    return out


@dataclass
class Hit:
    """A cached prefix: its length in tokens, its entries' hashes (oldest first) and the pages a
    request starting after it holds (compressed pages in order; the window pages by logical page).
    ahead: (end, hash) of each whole span of the looked-up tokens past the cut, the ones a request
    fed them registers as its rows reach each end (the scheduler's in-step sharing reads them)."""
    length: int = 0
    hashes: list[bytes] = field(default_factory=list)
    compressed: dict[int, list[int]] = field(default_factory=dict)
    window: dict[int, int] = field(default_factory=dict)
    ahead: list[tuple[int, bytes]] = field(default_factory=list)

    def blocks(self):
        """(pool key, block) of every page the hit holds."""
        yield from (("window", b) for b in self.window.values())
        yield from ((r, b) for r, bs in self.compressed.items() for b in bs)


class PrefixCache:
    """The cached entries of one group's pools, the holders of every shared block and the LRU of
    the blocks nobody holds. ``free`` is the group's free lists (pool key -> blocks)."""

    def __init__(self, cfg: ModelConfig, free: dict):
        self.cfg, self.span, self.free = cfg, span(cfg), free
        self.entries: dict[bytes, dict] = {}            # hash -> {pool key: blocks}
        self.owner: dict[tuple, bytes] = {}             # (pool key, block) -> the entry holding it
        self.refs: dict[tuple, int] = {}                # (pool key, block) -> requests holding it
        self.idle = {key: OrderedDict() for key in free if key != "state"}  # pool key -> blocks nobody holds, oldest first

    # ---- pages of a span ---------------------------------------------------------------------------
    def _pages(self, i: int) -> dict:
        """Logical pages of span i a cut at its end keeps: {ratio: range, "window": range}."""
        bs, w, g = self.cfg.block_size, self.cfg.sliding_window, self.span
        end = (i + 1) * g
        out = {r: range(i * g // (r * bs), end // (r * bs)) for r in self.idle if r != "window"}
        out["window"] = range(max(0, end - w + 1) // bs, (end - 1) // bs + 1) if w > 1 else range(0)
        return out

    # ---- lookups -----------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], limit: int, hashes: list[bytes] | None = None, root: bytes = b"") -> Hit:
        """The longest cached prefix of tokens no longer than limit (a multiple of the span), and
        the spans of tokens past it; hashes: the tokens' ``span_hashes`` from ``root`` (the request's
        ``chain_start``), when already computed."""
        hit = Hit()
        for i, parent in enumerate(span_hashes(tokens, self.span, root) if hashes is None else hashes):
            if not hit.ahead and (i + 1) * self.span <= limit and parent in self.entries:
                hit.hashes.append(parent)
            else:
                hit.ahead.append(((i + 1) * self.span, parent))
        for h in hit.hashes:
            for key, blocks in self.entries[h].items():
                if key != "window":
                    hit.compressed.setdefault(key, []).extend(blocks)
        if hit.hashes:         # only the last span's window pages are read after the cut
            hit.window = dict(zip(self._pages(len(hit.hashes) - 1)["window"], self.entries[hit.hashes[-1]]["window"]))
        hit.length = len(hit.hashes) * self.span
        return hit

    def revived(self, hit: Hit) -> dict:
        """Blocks per pool key a hit takes out of the LRU (they count against the free blocks)."""
        out: dict = {}
        for key, b in hit.blocks():
            if self.refs.get((key, b), 0) == 0:
                out[key] = out.get(key, 0) + 1
        return out

    def idle_blocks(self, key) -> int:
        return len(self.idle.get(key, ()))

    # ---- holders -----------------------------------------------------------------------------------
    def hold(self, key, blk: int):
        """One more request holds a cached block (it leaves the LRU)."""
        n = self.refs[(key, blk)]
        if n == 0:
            del self.idle[key][blk]
        self.refs[(key, blk)] = n + 1

    def shared(self, key, blk: int) -> bool:
        """Whether the block is (or was) cached: its holders are counted here."""
        return (key, blk) in self.refs

    def unhold(self, key, blk: int):
        """A request let go of a counted block: cached, it joins the LRU's newest end when nobody
        holds it; no longer cached, it goes back to the free list."""
        n = self.refs[(key, blk)] - 1
        if n:
            self.refs[(key, blk)] = n
        elif (key, blk) in self.owner:
            self.refs[(key, blk)] = 0
            self.idle[key][blk] = None
        else:
            del self.refs[(key, blk)]
            self.free[key].append(blk)

    def evict(self, key) -> int:
        """The least recently used idle block of a pool, its entry dropped (raises IndexError: none)."""
        if not self.idle[key]:
            raise IndexError(key)
        blk, _ = self.idle[key].popitem(last=False)
        del self.refs[(key, blk)]
        self._drop(self.owner[(key, blk)])
        return blk

    def _drop(self, h: bytes):
        for key, blocks in self.entries.pop(h).items():
            for b in blocks:
                self.owner.pop((key, b), None)
                if self.refs.get((key, b)) == 0:     # idle: plain free now
                    del self.refs[(key, b)], self.idle[key][b]
                    self.free[key].append(b)

    # ---- registering -------------------------------------------------------------------------------
    def register(self, seq):
        """Enter the spans seq completed (its caches hold rows up to kv_len) under their chain hashes;
        a span already cached (computed twice) keeps the first copy, seq's own stays its own."""
        while (len(seq.hashes) + 1) * self.span <= seq.kv_len:
            i = len(seq.hashes)
            h = chain(seq.hashes[-1] if i else chain_start(self.cfg, seq.prompt_len, seq.cache_root),
                      seq.tokens[i * self.span:(i + 1) * self.span])
            seq.hashes.append(h)
            if h in self.entries:
                continue
            pages = self._pages(i)
            entry = {r: [seq.compressed_pages[r][p] for p in pages[r]] for r in pages if r != "window"}
            entry["window"] = [seq.window_pages[p] for p in pages["window"]]
            self.entries[h] = entry
            for key, blocks in entry.items():
                for b in blocks:
                    self.owner[(key, b)] = h
                    self.refs.setdefault((key, b), 1)   # seq held it alone until now
