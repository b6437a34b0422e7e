"""Every kernel name the graph builders emit has one complete NodeKind record."""
import pytest

from dsv41.config import TINY, Topology
from dsv41.graph.build import REPLICATED, SHARDED, build
from dsv41.kernels.kinds import KINDS
from dsv41.kernels.nodes.attention import LEAF_MODES
from dsv41.kernels.record import LATENCY_CLASSES, NodeKind
from dsv41.plan.step import step_inputs

TOPO = Topology(2, 2, 4)


def emitted(phase: str, rows: int) -> set[str]:
    kernels = set()
    for wiring in (SHARDED, REPLICATED):
        steps = {g: step_inputs(TINY, TOPO.tp, 3, rows, 40, phase) for g in range(TOPO.dp)}
        kernels |= {node.kernel for node in build(TINY, TOPO, steps, wiring, phase).nodes.values()}
    return kernels


@pytest.mark.parametrize("phase,rows", [("decode", 1), ("prefill", 24)])
def test_every_emitted_kernel_has_a_complete_record(phase, rows):
    for name in emitted(phase, rows):
        kind = KINDS.get(name)
        assert kind is not None, f"{name}: the builder emits it but no record names it"
        assert kind.name == name and callable(kind.run) and callable(kind.cost), name
        assert kind.latency in LATENCY_CLASSES, name
        assert kind.pypto is None or callable(kind.pypto), name
        assert kind.device_time is None or callable(kind.device_time), name


def test_every_attention_mode_has_a_leaf_record():
    assert len(LEAF_MODES) == 6
    assert {f"attn.leaf.{mode}" for mode in LEAF_MODES} <= set(KINDS)
    # the builder names a layer's leaf after its spec's mode: each layer's mode is one of the six
    assert {spec.kind for spec in TINY.layers} <= set(LEAF_MODES)


def test_records_refuse_an_unknown_latency_class():
    with pytest.raises(ValueError, match="latency must be one of"):
        NodeKind("x", print, print, latency="scalar")
