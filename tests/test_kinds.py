"""Every kernel name the graph builders emit has one complete NodeKind record, and every record
declares each per-kind fact (launch count, comm class, pypto parts or why it has none)."""
import pytest

from dsv41.config import TINY, Topology
from dsv41.graph.build import REPLICATED, SHARDED, build
from dsv41.kernels.kinds import KINDS
from dsv41.kernels.nodes.attention import LEAF_MODES
from dsv41.kernels.record import COMM_CLASSES, LATENCY_CLASSES, NodeKind
from dsv41.plan.step import step_inputs

TOPO = Topology(2, 2, 4)


def graphs(phase: str, rows: int):
    for wiring in (SHARDED, REPLICATED):
        for dspark in (False, True):
            steps = {g: step_inputs(TINY, 3, rows, 40, phase) for g in range(TOPO.dp)}
            yield build(TINY, TOPO, steps, wiring, phase, dspark)


def emitted(phase: str, rows: int) -> set[str]:
    return {node.kernel for graph in graphs(phase, rows) for node in graph.nodes.values()}


@pytest.mark.parametrize("phase,rows", [("decode", 1), ("prefill", 24)])
def test_every_emitted_kernel_has_a_complete_record(phase, rows):
    for name in emitted(phase, rows):
        kind = KINDS.get(name)
        assert kind is not None, f"{name}: the builder emits it but no record names it"
        assert kind.name == name and callable(kind.run) and callable(kind.cost), name
        assert kind.latency in LATENCY_CLASSES, name
        assert kind.pypto is None or callable(kind.pypto), name
        assert kind.sim_rows is None or callable(kind.sim_rows), name


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_record_declares_its_per_kind_facts(name):
    kind = KINDS[name]
    count, what = kind.launches
    assert isinstance(count, int) and count >= 1 and what, f"{name}: launches (kernels, operations)"
    assert kind.kernels == count
    assert kind.comm in COMM_CLASSES, name
    # pypto parts, or the reason it has none; the rows they run at come with them
    assert (kind.pypto_parts is not None) != bool(kind.no_pypto_parts), name
    assert (kind.pypto_parts is None) == (kind.sim_rows is None), name


def test_a_record_missing_a_fact_is_refused():
    full = dict(launches=(1, "norm"), comm="none", no_pypto_parts="none written")
    NodeKind("x", print, print, **full)
    for missing, message in (("launches", "launches must be"), ("comm", "comm must be one of"),
                             ("no_pypto_parts", "exactly one of pypto_parts")):
        with pytest.raises(ValueError, match=message):
            NodeKind("x", print, print, **{k: v for k, v in full.items() if k != missing})
    for bad in ((0, "none"), (2, ""), (1.5, "half"), (3,)):
        with pytest.raises(ValueError, match="launches must be"):
            NodeKind("x", print, print, **dict(full, launches=bad))
    with pytest.raises(ValueError, match="comm must be one of"):
        NodeKind("x", print, print, **dict(full, comm="broadcast"))
    with pytest.raises(ValueError, match="collective calls on a kind whose comm is 'none'"):
        NodeKind("x", print, print, **dict(full, calls=lambda node: 2))
    with pytest.raises(ValueError, match="exactly one of pypto_parts"):
        NodeKind("x", print, print, **dict(full, pypto_parts=print, sim_rows=print))
    with pytest.raises(ValueError, match="go together"):
        NodeKind("x", print, print, **dict(full, no_pypto_parts="", pypto_parts=print))


@pytest.mark.parametrize("phase,rows", [("decode", 1), ("prefill", 24)])
def test_collective_kinds_are_the_nodes_the_builder_makes_collectives(phase, rows):
    """The graph checks a collective by the group the builder wrote on its members (it knows no kernel
    names); the records' ``comm`` must name exactly the kinds the builder emits that way."""
    for graph in graphs(phase, rows):
        members = {n.kernel for n in graph.nodes.values() if "instance" in n.attrs}
        assert members and all("group" in n.attrs for n in graph.nodes.values() if "instance" in n.attrs)
        emitted_kinds = graph.kernels()
        assert members == {k for k in emitted_kinds if KINDS[k].comm == "collective"}


def test_every_attention_mode_has_a_leaf_record():
    assert len(LEAF_MODES) == 6
    assert {f"attn.leaf.{mode}" for mode in LEAF_MODES} <= set(KINDS)
    # the builder names a layer's leaf after its spec's mode: each layer's mode is one of the six
    assert {spec.kind for spec in TINY.layers} <= set(LEAF_MODES)


def test_records_refuse_an_unknown_latency_class():
    with pytest.raises(ValueError, match="latency must be one of"):
        NodeKind("x", print, print, launches=(1, "norm"), comm="none", no_pypto_parts="none written",
                 latency="scalar")
