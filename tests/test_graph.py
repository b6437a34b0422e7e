"""Graph structure: node vocabulary, validation failures (each names the node), exports, submissions."""
import pytest
import torch

from dsv41.cluster.plan import make_plan
from dsv41.config import TINY, Topology
from dsv41.graph.build import build, slab
from dsv41.graph.graph import Graph, GraphError, Node
from dsv41.engine.protocol import parts_of
from dsv41.engine.requests import RequestTable

TOPO = Topology(2, 2, 4)


def _steps(topo, prompt_lens, phase="prefill"):
    tables = [RequestTable(TINY, 4, 128) for _ in range(topo.dp)]
    g = torch.Generator().manual_seed(0)
    steps = {}
    for grp, table in enumerate(tables):
        batch = [(None, torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist()) for n in prompt_lens]
        steps[grp] = table.plan(parts_of(batch), phase).inputs
    return steps


@pytest.fixture(scope="module")
def graph():
    return build(TINY, TOPO, _steps(TOPO, [40, 24]), "sharded", "prefill")


def test_vocabulary_covers_every_stage(graph):
    kernels = graph.kernels()
    expected = {"embed", "engram", "engram.lookup", "hc.pack", "rope.rows", "hc.mixes", "hc.pre", "hc.post", "hc.head", "norm.rms",
                "norm.final", "attn.q_proj", "attn.kv_proj", "attn.compress", "attn.publish", "attn.index",
                "attn.topk", "attn.o_proj", "tp.all_gather", "tp.reduce_scatter", "moe.gate", "moe.dispatch",
                "moe.experts", "moe.combine", "moe.shared", "lm_head.shard", "lm_head.argmax", "cache.commit"}
    expected |= {f"attn.leaf.{k}" for k in ("swa", "c2a_full", "c2a_reuse", "c1a_full", "c1a_reindex", "c1a_reuse")}
    assert expected <= kernels
    replicated = build(TINY, TOPO, _steps(TOPO, [8]), "replicated", "prefill")
    assert "tp.all_reduce" in replicated.kernels() and "tp.all_gather" not in replicated.kernels()


def test_rope_rows_once_per_profile_and_vector(graph):
    rope = [n for n in graph.nodes.values() if n.kernel == "rope.rows"]
    per_card = len(rope) // TOPO.ep
    assert per_card == 2 + len(TINY.kv_source_layer_ids)  # plain, compressed, one per compression source
    users = graph.consumers()
    token_rows = [n for n in rope if n.attrs["vector"] == "token"]
    assert all(len(users[n.key]) >= 6 for n in token_rows)   # shared by every layer using the profile
    source_rows = [n for n in rope if n.attrs["vector"] != "token"]
    assert all(users[n.key] == [f"L{n.attrs['vector']}/attn/publish.compressed@c{n.card}"] for n in source_rows)


def test_index_split_into_chunks_under_budget(graph):
    chunks = [n for n in graph.nodes.values() if n.kernel == "attn.index" and n.layer == 20 and n.card == 0]
    assert len(chunks) > 1  # 64 prompt rows need more than one chunk under TINY's score budget
    rows = [r for n in chunks for r in range(*n.attrs["rows"])]
    assert rows == list(range(64))


def test_validate_accepts_built_graph(graph):
    graph.validate(TOPO)


def test_cache_reads_take_the_publication_edge(graph):
    leaf = graph.nodes["L5/attn/leaf.c2a_reuse@c1"]
    assert "L2/attn/publish.compressed@c1" in leaf.inputs and "L5/attn/publish.window@c1" in leaf.inputs
    assert "L2/attn/topk@c1" in leaf.inputs


def _tiny_graph():
    g = Graph("decode")
    g.literal("step@c0", None, 0)
    g.add("a@c0", "embed", ["step@c0"], 0)
    g.add("b@c0", "hc.pack", ["a@c0"], 0)
    return g


def test_validate_rejects_a_cycle():
    g = _tiny_graph()
    g.nodes["a@c0"] = Node("a@c0", "embed", ("b@c0",), 0)
    with pytest.raises(GraphError, match="cycle: node a@c0"):
        g.validate(Topology(1, 1, 1))


def test_validate_rejects_missing_producer():
    g = _tiny_graph()
    g.add("c@c0", "norm.rms", ["nowhere"], 0)
    with pytest.raises(GraphError, match="node c@c0: input nowhere has no producer"):
        g.validate(Topology(1, 1, 1))


def test_validate_rejects_two_producers():
    g = _tiny_graph()
    g.add("b@c0", "hc.pack", ["a@c0"], 0)
    with pytest.raises(GraphError, match="two producers of one key: b@c0"):
        g.validate(Topology(1, 1, 1))


def test_validate_rejects_card_outside_topology():
    g = _tiny_graph()
    g.add("d@c5", "norm.rms", ["b@c0"], 5)
    with pytest.raises(GraphError, match="node d@c5: card 5 outside"):
        g.validate(Topology(2, 1, 2))


def test_validate_rejects_cache_read_without_version_edge(graph):
    key = "L7/attn/leaf.c2a_reuse@c0"
    n = graph.nodes[key]
    broken = Node(key, n.kernel, tuple(i for i in n.inputs if i != "L2/attn/publish.compressed@c0"), n.card,
                  n.layer, n.attrs)
    graph.nodes[key] = broken
    try:
        with pytest.raises(GraphError, match=f"node {key}: reads cache compressed.2 without the version edge"):
            graph.validate(TOPO)
    finally:
        graph.nodes[key] = n


def test_validate_rejects_collective_missing_participant(graph):
    key = "L3/attn/reduce_scatter@c1"
    n = graph.nodes[key]
    graph.nodes[key] = Node(key, "tp.local_copy", n.inputs, n.card, n.layer, {})  # c1 no longer joins
    try:
        with pytest.raises(GraphError, match=r"collective L3/attn/reduce_scatter@g0 is missing participant card\(s\) \[1\]"):
            graph.validate(TOPO)
        graph.nodes[key] = Node(key, n.kernel, n.inputs[:1], n.card, n.layer, n.attrs)  # drops c1's partial
        with pytest.raises(GraphError, match=f"node {key}: collective .* takes no input from card"):
            graph.validate(TOPO)
    finally:
        graph.nodes[key] = n


def test_slab_ownership_matches_seed_rule():
    assert [slab(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [slab(2, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert [slab(7, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 1)]


def test_exports(graph, tmp_path):
    dot = graph.to_dot()
    assert dot.startswith("digraph") and '"L20/attn/topk@c0"' in dot and "cluster_c3" in dot


@pytest.mark.parametrize("wiring", ["sharded", "replicated"])
def test_sharded_lookups_sum_every_owner(wiring):
    """Embed shares meet in the group's TP transport; every card looks up every group's Engram ids in
    its table slab, and each card of a group adds all cards' shares in card order."""
    g = build(TINY, TOPO, _steps(TOPO, [8]), wiring, "prefill")
    transport = {"sharded": "tp.reduce_scatter", "replicated": "tp.all_reduce"}[wiring]
    for c in TOPO.cards:
        group = TOPO.group_cards(TOPO.dp_group(c))
        pack = g.nodes[f"hc.pack@c{c}"]
        reduce = g.nodes[pack.inputs[0]]
        assert reduce.kernel == transport and reduce.inputs == tuple(f"embed@c{r}" for r in group)
        for layer in TINY.engram_layer_ids:
            node = g.nodes[f"L{layer}/engram@c{c}"]
            shares = tuple(f"L{layer}/engram.lookup@c{e}/g{TOPO.dp_group(c)}" for e in TOPO.cards)
            assert node.inputs[2:] == shares
            assert all(g.nodes[k].kernel == "engram.lookup" and g.nodes[k].card == e for e, k in enumerate(shares))


def test_submissions_group_nodes_and_stay_acyclic(graph):
    plan = make_plan(graph, TOPO)
    assert plan.dask_tasks < len(graph.nodes)
    seen = set()
    for sub in plan.submissions.values():     # insertion order must be a topological order
        assert all(d in seen or d in graph.literals for d in sub.deps)
        seen.add(sub.key)
        first, rest = sub.nodes[0], sub.nodes[1:]
        for node in rest:  # only a submission's first node may take cross-card inputs
            assert all(graph.nodes[i].card == node.card for i in node.inputs if i in graph.nodes)
        assert {n.card for n in sub.nodes} == {sub.card} and first.card == sub.card
    node_plan = make_plan(graph, TOPO, "node")
    assert node_plan.dask_tasks == len(graph.nodes)
