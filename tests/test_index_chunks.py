"""Chunking index scoring under the score budget is pure memory bounding: results equal one chunk."""
from dataclasses import replace

import torch

from dsv41.config import TINY
from dsv41.ops.indexer import score_chunks
from dsv41.engine.reference import ReferenceEngine


def test_chunked_scoring_equals_unchunked():
    prompt = torch.randint(0, TINY.vocab_size, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    assert len(score_chunks(64, 64, TINY.index_score_budget_bytes, TINY.index_score_leaf)) > 1
    whole = replace(TINY, index_score_budget_bytes=1 << 30)
    assert len(score_chunks(64, 64, whole.index_score_budget_bytes, whole.index_score_leaf)) == 1
    a = ReferenceEngine(TINY, seed=0, max_batch=1, max_context=80).prefill([prompt]).logits
    b = ReferenceEngine(whole, seed=0, max_batch=1, max_context=80).prefill([prompt]).logits
    assert torch.equal(a, b)


def test_scoring_keys_a_block_at_a_time_equals_all_at_once(monkeypatch):
    """Index keys read and scored in blocks of 5 positions (prefill: up to 32 compressed keys a row,
    so several blocks, a short last one) give the logits of one block holding them all."""
    from dsv41.ops import indexer
    prompt = torch.randint(0, TINY.vocab_size, (64,), generator=torch.Generator().manual_seed(6)).tolist()
    whole = ReferenceEngine(TINY, seed=0, max_batch=1, max_context=80).prefill([prompt]).logits
    monkeypatch.setattr(indexer, "KEY_BLOCK", 5)
    blocked = ReferenceEngine(TINY, seed=0, max_batch=1, max_context=80).prefill([prompt]).logits
    assert torch.equal(blocked, whole)
