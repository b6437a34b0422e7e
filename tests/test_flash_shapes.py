"""The released widths run for real (slow): graph executors equal the reference bit for bit at FLASH
width, TP1 and TP4/DP2/EP8, on reduced FLASH checkpoints (and decoding at 16K of drawn context), and
each card holds the plan's weight bytes.

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

from dsv41.checkpoint.writer import write_checkpoint
from dsv41.config import FLASH, Topology
from dsv41.plan.sizing import weights_by_kind
from dsv41.run import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("flash-L3")
    cfg = write_checkpoint(FLASH.reduced(layers=3, experts=8, engram_rows=4099), path, seed=0)
    return path, cfg


def _run(capsys, path, *layout) -> dict:
    assert main(["--checkpoint", str(path), "--batch", "2", "--prompt-len", "8", "--new-tokens", "2", "--json",
                 *layout]) == 0
    return json.loads(capsys.readouterr().out)


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
