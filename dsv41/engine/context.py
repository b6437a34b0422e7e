"""Start requests at a long context without running a long prefill.

A request started at context N holds N tokens of history and caches laid out as a prefill of that
history would leave them: the request table's pages (allocated by ``RequestTable.start_at``, the
same allocation a prefill plans), window rows for the positions of its kept window pages, N // r
compressed and index rows per KV source of ratio r, and the ratio-2 compressor ring's last
``state_capacity`` rows. The values are drawn, not computed: standard normal FP32 rows (the scale
of the RMS-normalised rows a prefill publishes), encoded in each cache's ``ops.kv_cache`` format.

Everything drawn is a function of (seed, key, cache name, N) only (key: the request's place among the
requests its engine started, the same on every engine given the same calls), never of where a row is
stored, so engines that place requests differently (the reference's one table, a graph's DP groups
and their TP replicas) hold the same state and their logits compare bit for bit.
"""
from __future__ import annotations

import hashlib

import torch

from dsv41.config import ModelConfig
from dsv41.engine.sequence import Sequence
from dsv41.model import caches as cache
from dsv41.ops import kv_cache
from dsv41.model.staged import StagedTensors

DRAW_ROWS = 16384     # rows drawn at a time: bounds the FP32 transient at 1M context (fixed: values depend on it)


def _generator(seed: int, rid: int, what: str) -> torch.Generator:
    digest = hashlib.sha256(f"dsv41-context/{seed}/{rid}/{what}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def draw_history(cfg: ModelConfig, seed: int, rid: int, n: int) -> list[int]:
    """The N token ids the request drawn under key ``rid`` is taken to have read (Engram hashes the next
    tokens' n-grams over them)."""
    return torch.randint(0, cfg.vocab_size, (n,), generator=_generator(seed, rid, "tokens")).tolist()


def _rows(gen: torch.Generator, count: int, width: int):
    """Standard normal FP32 rows in DRAW_ROWS pieces: (first row, values) per piece."""
    for start in range(0, count, DRAW_ROWS):
        yield start, torch.randn(min(DRAW_ROWS, count - start), width, generator=gen)


def fill_caches(cfg: ModelConfig, seed: int, targets: list[StagedTensors], requests: list[tuple[int, Sequence]]):
    """Write each request's drawn rows into every target (replicas of one DP group's caches).

    requests: (key the values are drawn for, the request's Sequence as ``start_at`` left it). Writes go
    to the committed tensors in place, between steps: staging would clone whole pools (GBs at 1M
    context) for rows no step has to undo.
    """
    bs = cfg.block_size
    for rid, req in requests:
        n = req.kv_len
        for name, (kind, width, ratio) in cache.cache_names(cfg).items():
            if kind == kv_cache.WINDOW:
                first = min(req.window_pages, default=0) * bs
                positions = torch.arange(first, n)
                blocks = torch.tensor([req.window_pages[int(p)] for p in positions // bs], dtype=torch.long)
            else:
                positions = torch.arange(n // ratio)
                pages = torch.tensor(req.compressed_pages.get(ratio, []), dtype=torch.long)
                blocks = pages[positions // bs]
            slots = blocks * bs + positions % bs
            for start, values in _rows(_generator(seed, rid, name), positions.numel(), width):
                for t in targets:
                    payload, scale = t.committed[name]
                    kv_cache.publish(payload, scale, kv_cache.FORMATS[kind], slots[start:start + values.shape[0]],
                                     values)
        for s in cfg.kv_source_layer_ids:
            if cfg.compress_ratios[s] != 2:
                continue
            cap = cfg.state_capacity
            positions = torch.arange(max(0, n - cap), n)
            values = torch.randn(positions.numel(), 2 * cfg.head_dim, generator=_generator(seed, rid, cache.ring(s)))
            for t in targets:
                (ring,) = t.committed[cache.ring(s)]
                ring[req.state_block * cap + positions % cap] = values
