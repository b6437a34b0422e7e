"""The released widths run for real: graph executors equal the reference bit for bit at FLASH width,
TP1 and TP4/DP2/EP8, on reduced FLASH models (decoding at 16K of drawn context in the default run;
the rest, on written checkpoints, is slow), and each card holds the plan's weight bytes.

Three layers (SWA, SWA with Engram, the first ratio-2 FULL layer), 8 experts and Engram tables of
4,099 rows keep it to a few GB; the hidden size, heads, LoRA ranks, indexer, window and vocabulary
are FLASH's. Run 2 of docs/flash-shapes.md, one layer with all 384 routed experts (a 10 GB
checkpoint, ~9 min to write here), runs dispatch, grouped experts and combine at the released expert
count on EP8. ``bench/flash_shapes.py`` runs the same comparison on any reduced model (run 1, all
40 layers, is measured there: a step is minutes).
"""
from __future__ import annotations

import json

import pytest
import torch

from dsv41.checkpoint.headers import without_dspark
from dsv41.checkpoint.writer import write_checkpoint
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import FLASH, Topology
from dsv41.engine.reference import ReferenceEngine
from dsv41.plan.sizing import weights_by_kind
from dsv41.run import main
from dsv41.weights import init_checkpoint


class _HeldDraw:
    """A weight source holding one draw in memory, so the test's three engines read the same tensors
    without drawing them three times or writing them to disk."""
    token_map = None

    def __init__(self, cfg):
        self.cfg, self.tensors = cfg, init_checkpoint(cfg, 0)

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str, index: tuple = ()) -> torch.Tensor:
        return self.tensors[name][index]


@pytest.mark.timeout(900)
def test_flash_width_decodes_at_16k_context_equal_to_the_reference_on_tp1_and_tp4_dp2():
    """Three FLASH-width layers (two SWA layers, one with Engram, then the first ratio-2 FULL layer:
    its compressor and indexer score 8,192 compressed keys for Top-K 512), two requests at 16,384
    tokens of drawn context: the one-token prompt step and one decode step give the reference's
    logits bytes on sync TP1 and threads TP4/DP2/EP8 (one request per DP group). The backbone alone, as
    served from a folder without DSpark's stages: plain decode does not run them, and they were a third
    of the values drawn (the draw is most of the test's time)."""
    cfg = without_dspark(FLASH.reduced(layers=3, experts=8, engram_rows=4099))
    source, context = _HeldDraw(cfg), 16384

    def steps(engine) -> list[torch.Tensor]:
        first = engine.prefill([[7], [11]], context=context).logits
        ids = list(engine.last_request_ids)
        second = engine.decode(torch.argmax(first, -1).tolist(), ids).logits
        engine.close()
        return [first, second]

    want = steps(ReferenceEngine(cfg, max_batch=2, max_context=context + 4, checkpoint=source))
    for topo, executor in ((Topology(1, 1, 1), "sync"), (Topology(4, 2, 8), "threads")):
        got = steps(GraphEngine(cfg, topo, EngineConfig(executor=executor, max_batch=2, max_context=context + 4),
                                checkpoint=source))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (topo, executor)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("flash-L3")
    cfg = write_checkpoint(FLASH.reduced(layers=3, experts=8, engram_rows=4099), path, seed=0)
    return path, cfg


def _run(capsys, path, *layout) -> dict:
    assert main(["--checkpoint", str(path), "--batch", "2", "--prompt-len", "8", "--new-tokens", "2", "--json",
                 *layout]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_graph_equals_reference_at_flash_width(capsys, folder):
    path, cfg = folder
    want = _run(capsys, path, "--executor", "reference")
    for executor, tp, dp in (("sync", 1, 1), ("threads", 4, 2)):
        got = _run(capsys, path, "--executor", executor, "--tp", str(tp), "--dp", str(dp))
        assert got["tokens"] == want["tokens"], (executor, tp, dp)
        assert got["last_logits_sha256"] == want["last_logits_sha256"], (executor, tp, dp)
        topo = Topology(tp, dp, tp * dp)
        for card in got["cards"]:
            assert card["weights_bytes"] == sum(weights_by_kind(cfg, topo, card["card"]).values())


@pytest.mark.slow
def test_graph_equals_reference_decoding_at_a_long_context(capsys, folder):
    """16,384 tokens of drawn context: 8,192 ratio-2 compressed rows for the indexer's Top-K 512."""
    path, _ = folder
    _equal_at_a_long_context(capsys, path, 1, "--executor", "sync", "--tp", "1", "--dp", "1")


def _equal_at_a_long_context(capsys, path, batch: int, *layout):
    """``batch`` requests after 16,384 tokens of drawn context: the layout's tokens and logits are the
    reference's."""
    long = ["--checkpoint", str(path), "--batch", str(batch), "--prompt-len", "1", "--new-tokens", "2",
            "--context", "16384", "--json"]
    assert main([*long, "--executor", "reference"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main([*long, *layout]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["tokens"], got["last_logits_sha256"]) == (want["tokens"], want["last_logits_sha256"])


@pytest.fixture(scope="module")
def all_experts(tmp_path_factory):
    path = tmp_path_factory.mktemp("flash-L1-E384")
    cfg = write_checkpoint(FLASH.reduced(layers=1, experts=384, engram_rows=4099), path, seed=0)
    return path, cfg


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_all_384_experts_on_ep8_equal_the_reference(capsys, all_experts):
    path, cfg = all_experts
    want = _run(capsys, path, "--executor", "reference")
    got = _run(capsys, path, "--executor", "threads", "--tp", "4", "--dp", "2")
    assert (got["tokens"], got["last_logits_sha256"]) == (want["tokens"], want["last_logits_sha256"])
    topo = Topology(4, 2, 8)
    for card in got["cards"]:
        assert card["weights_bytes"] == sum(weights_by_kind(cfg, topo, card["card"]).values())
        assert weights_by_kind(cfg, topo, card["card"])["routed_experts"] > 0      # 48 experts each
    _equal_at_a_long_context(capsys, path, 2, "--executor", "threads", "--tp", "4", "--dp", "2")
