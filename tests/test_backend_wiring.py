"""--backend pypto-sim in graph runs: values from Torch, simulated µs per pypto-backed node in the
step summary and in the node spans."""
import pytest
import torch

import dsv41.kernels.pypto.backend as pypto_backend
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.cluster import registry
from dsv41.config import TINY, Topology
from dsv41.kernels.device_time import node_sim_us
from dsv41.telemetry.session import TraceSession

PROMPTS = [[5, 9, 100, 7, 3], [11, 2]]


@pytest.fixture
def fake_cost_model(monkeypatch):
    """Stand-in for the pypto cost model: µs = rows (so the summary is checkable by hand)."""
    calls = []

    def fake(node_kernel, cfg, rows, tp=1, ep=None, **kw):
        calls.append((node_kernel, rows))
        return float(rows)
    monkeypatch.setattr(pypto_backend, "node_time_us", fake)
    return calls


def _tokens(engine):
    logits = engine.prefill(PROMPTS).logits
    return [torch.argmax(engine.decode(torch.argmax(logits, -1).tolist()).logits, -1).tolist()]


def test_pypto_sim_keeps_values_and_reports_device_time(fake_cost_model):
    topo = Topology(2, 1, 2)
    plain = _tokens(GraphEngine(TINY, topo, EngineConfig(executor="sync", max_batch=2, max_context=16)))
    engine = GraphEngine(TINY, topo, EngineConfig(executor="sync", max_batch=2, max_context=16, backend="pypto-sim"))
    trace = TraceSession(engine)
    try:
        assert _tokens(engine) == plain
        stats = engine.last_stats
        assert {"norm.rms", "hc.pre", "hc.post", "attn.q_proj", "moe.gate", "lm_head.shard"} <= set(stats["pypto_kernels"])
        assert "hc.mixes" not in stats["pypto_kernels"] and "attn.index" not in stats["pypto_kernels"]
        # decode: 2 rows, sharded over TP2 -> 1 local row per card for every mHC node
        per_card = {}
        for card, kernel, us in registry.find(engine.id).hooks.sim_log.values():
            per_card[card] = per_card.get(card, 0.0) + us
        assert stats["device_sim_us"] == max(per_card.values()) > 0
        spans = [r for r in trace.collect() if r["attributes"].get("dsv41.span") == "node"]
        sim = [r for r in spans if r["attributes"]["dsv41.device.source"] == "pypto"]
        assert sim and all(r["attributes"]["dsv41.kernel"] in stats["pypto_kernels"] for r in sim)
    finally:
        trace.close()


def test_nodes_without_pypto_form_get_none(fake_cost_model):
    engine = GraphEngine(TINY, Topology(1, 1, 1), EngineConfig(executor="sync", max_batch=1, max_context=8))
    engine.prefill([[1, 2, 3]])
    node = engine.last_graph.nodes["L0/attn/mixes@c0"]
    assert node_sim_us(engine.states()[0], node, [torch.zeros(3, 4, TINY.hidden_size)]) is None


def test_pypto_npu_fails_clearly_without_an_npu():
    with pytest.raises(RuntimeError, match="pypto-npu needs an Ascend NPU and torch_npu"):
        GraphEngine(TINY, Topology(1, 1, 1), EngineConfig(executor="sync", backend="pypto-npu"))
