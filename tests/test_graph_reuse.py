"""A step reuses the built, validated and planned graph of its shape: bit-identical to rebuilding,
with requests joining and leaving so shapes change and come back."""
import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology


def _session(engine):
    """prefill 2 -> decode x2 -> a third request joins -> decode -> it leaves -> decode (a shape seen before)."""
    logits, reused = [], []

    def record(out):
        logits.append(out)
        reused.append(engine.last_stats["graph_reused"])
        return torch.argmax(out, -1).tolist()

    toks = record(engine.prefill([[5, 9, 100, 7], [11, 2, 3]]).logits)
    first = list(engine.last_request_ids)
    for _ in range(2):
        toks = record(engine.decode(toks, first).logits)
    joined = record(engine.prefill([[42, 17]]).logits)
    rids = first + engine.last_request_ids
    toks = record(engine.decode(toks + joined, rids).logits)
    engine.release(rids[-1])
    record(engine.decode(toks[:2], first).logits)
    return logits, reused


@pytest.mark.timeout(300)
def test_reused_graphs_give_the_bits_of_rebuilt_ones():
    topo = Topology(1, 2, 2)
    cached = GraphEngine(TINY, topo, EngineConfig(seed=0, executor="threads", max_batch=4, max_context=16))
    rebuilt = GraphEngine(TINY, topo, EngineConfig(seed=0, executor="threads", max_batch=4, max_context=16,
                                                   graph_cache=0))
    a, reused = _session(cached)
    b, never = _session(rebuilt)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) == 6
    assert reused == [False, False, True, False, False, True] and not any(never)
    for e in (cached, rebuilt):
        e.close()
