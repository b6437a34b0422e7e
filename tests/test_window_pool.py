"""The window pool holds what one step can need, not a whole context: a long drawn history keeps
only its window's pages, and the biggest steps the scheduler allows never exhaust the pool."""
from __future__ import annotations

import math
import random

from dsv41.config import FLASH, TINY
from dsv41.engine.blocks import window_pages
from dsv41.capacity import capacity_of
from dsv41.engine.protocol import parts_of
from dsv41.engine.requests import RequestTable


def test_pool_is_bounded_by_the_longest_step_plus_the_window():
    for cfg in (TINY, FLASH):
        top = capacity_of(cfg).prefill_max_tokens
        full = math.ceil(cfg.max_position_embeddings / cfg.block_size) + 1
        assert window_pages(cfg, cfg.max_position_embeddings, top) == \
            math.ceil((top + cfg.sliding_window - 1) / cfg.block_size) + 1 < full
        assert window_pages(cfg, 3 * cfg.block_size, top) == 4      # a short context: all of its pages
    assert window_pages(FLASH, FLASH.max_position_embeddings, 4096) == 34


def test_largest_steps_to_the_end_of_the_context_never_exhaust_the_pool():
    cfg, batch = TINY, 2
    top = capacity_of(cfg).prefill_max_tokens
    rng = random.Random(0)
    table = RequestTable(cfg, batch, cfg.max_position_embeddings)
    step = table.plan(parts_of([(None, [1] * (top // batch))] * batch), "prefill")
    table.commit(step)
    rids = step.rids
    while True:
        room = cfg.max_position_embeddings - max(table.requests[r].kv_len for r in rids)
        n = min(room, rng.choice([1, cfg.block_size - 1, top // batch]))
        if n <= 0:
            break
        table.commit(table.plan(parts_of([(r, [1] * n) for r in rids]), "prefill"))
        held = [len(table.requests[r].window_pages) for r in rids]
        assert max(held) <= window_pages(cfg, cfg.max_position_embeddings, top)
    assert table.requests[rids[0]].kv_len == cfg.max_position_embeddings


def test_a_drawn_history_longer_than_one_step_leaves_what_its_chunked_prefill_would():
    """start_at over a history of several prefill steps: the same pages and blocks as prefilling it in
    steps of prefill_max_tokens, and no more window pages than one step needs."""
    cfg = TINY
    top = capacity_of(cfg).prefill_max_tokens
    n = cfg.max_position_embeddings - 10
    drawn = RequestTable(cfg, 1, cfg.max_position_embeddings)
    started = drawn.start_at([0], [[1] * n])
    prefilled = RequestTable(cfg, 1, cfg.max_position_embeddings)
    rid = None
    for done in range(0, n, top):
        step = prefilled.plan(parts_of([(rid, [1] * min(top, n - done))]), "prefill")
        prefilled.commit(step)
        rid = step.rids[0]
    a, b = started.requests[started.rids[0]], prefilled.requests[rid]
    assert (a.kv_len, a.window_pages, a.compressed_pages) == (b.kv_len, b.window_pages, b.compressed_pages)
    assert len(a.window_pages) <= window_pages(cfg, cfg.max_position_embeddings, top)
