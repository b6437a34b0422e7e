"""Requests started at a drawn context (``Engine.start_at_context`` / ``prefill(..., context=N)``).

At context 200 on TINY a request is past its 16-row window, holds 100 ratio-2 and 200 ratio-1
compressed rows (Top-K 8 and the candidate blocks select among them), and with a 256-byte score
budget every query row is its own index chunk.
"""
from dataclasses import replace

import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.engine.layout import Part
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import new_id
from dsv41.engine.requests import RequestTable
from dsv41.model import caches as cache
from dsv41.ops.indexer import score_chunks

CFG = replace(TINY, index_score_budget_bytes=256)
CONTEXT = 200
PROMPTS = [[5, 9, 2], [7], [11, 3, 8, 1]]


def _run(engine, steps: int = 3) -> list[torch.Tensor]:
    out = engine.prefill(PROMPTS, context=CONTEXT)
    logits, rids = [out.logits], out.request_ids
    for _ in range(steps):
        out = engine.decode(out.last, rids)
        logits.append(out.logits)
    return logits


def test_the_score_budget_splits_a_decode_step_into_chunks():
    width = CONTEXT                  # ratio-1 rows a decode query reads, at least
    assert len(score_chunks(len(PROMPTS), width, CFG.index_score_budget_bytes, CFG.index_score_leaf)) == len(PROMPTS)


@pytest.fixture(scope="module")
def reference_logits():
    engine = ReferenceEngine(CFG, seed=0, max_batch=3, max_context=CONTEXT + 16)
    return _run(engine)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 2)])
def test_graph_equals_reference_at_a_drawn_context(reference_logits, tp, dp):
    engine = GraphEngine(CFG, Topology(tp, dp, tp * dp), EngineConfig(seed=0, executor="sync", max_batch=3,
                                                                      max_context=CONTEXT + 16))
    try:
        got = _run(engine)
    finally:
        engine.close()
    for step, (a, b) in enumerate(zip(reference_logits, got)):
        assert torch.equal(a, b), f"step {step}: graph tp={tp} dp={dp} differs from the reference"


def test_filled_state_is_what_a_prefill_leaves_and_decodes_finite():
    engine = ReferenceEngine(CFG, seed=3, max_batch=2, max_context=CONTEXT + 8)
    rids = engine.start_at_context([new_id(), new_id()], CONTEXT)
    # the host state equals a real prefill plan of the same histories (but for the flag that says
    # the history was drawn)
    table = RequestTable(CFG, 2, CONTEXT + 8)
    table.commit(table.plan([Part(r, engine.host.tables[0].requests[r].tokens, start=True) for r in rids], "prefill"))
    for seq in table.requests.values():
        seq.from_context = True
    assert table.requests == engine.host.tables[0].requests and table.pools == engine.host.tables[0].pools
    assert [engine.host.tables[0].requests[r].kv_len for r in rids] == [CONTEXT, CONTEXT]
    # every compressed row of each request is written (a drawn row is never all zeros), nothing past them
    for s in CFG.kv_source_layer_ids:
        r = CFG.compress_ratios[s]
        payload, _ = engine.caches.read(cache.compressed(s))
        written = payload.view(-1, CFG.block_size, payload.shape[1]).ne(0).any(-1)
        for rid in rids:
            pages = engine.host.tables[0].requests[rid].compressed_pages[r]
            rows = written[pages].flatten()
            assert rows[: CONTEXT // r].all() and not rows[CONTEXT // r:].any()
    window, _ = engine.caches.read(cache.window(0))
    for rid in rids:
        pages = engine.host.tables[0].requests[rid].window_pages
        rows = window.view(-1, CFG.block_size, window.shape[1]).float().ne(0).any(-1)[list(pages.values())]
        assert rows.flatten()[: CONTEXT - min(pages) * CFG.block_size].all()
        assert min(pages) * CFG.block_size <= CONTEXT - CFG.sliding_window
    out = engine.decode([1, 2], rids)
    assert torch.isfinite(out.logits).all()
    assert [engine.host.tables[0].requests[r].kv_len for r in rids] == [CONTEXT + 1] * 2


def test_a_context_past_the_capacity_is_refused():
    engine = ReferenceEngine(CFG, seed=0, max_batch=1, max_context=64)
    with pytest.raises(ValueError, match=r"context: must be in \[1, 63\]"):
        engine.start_at_context([new_id()], 64)
    assert engine.active == []
