"""Node and Graph: every stage a node, every producer/consumer dependency an explicit edge.

A node produces one value. Cache writes produce a version token; every reader of that cache
takes the token as an input, so the graph (never the order of a list) says who runs first.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Node:
    key: str                       # reads like a path: "L24/attn/index#0@c3"
    kernel: str                    # the executable kernel's name
    inputs: tuple[str, ...]        # keys of producer nodes or graph literals
    card: int
    layer: int | None = None
    attrs: dict = field(default_factory=dict, compare=False, hash=False)


class GraphError(ValueError):
    pass


class Graph:
    def __init__(self, phase: str):
        self.phase = phase
        self.nodes: dict[str, Node] = {}
        self.literals: dict[str, object] = {}       # host inputs (step metadata), keyed like nodes
        self._duplicates: list[str] = []

    def add(self, key: str, kernel: str, inputs=(), card: int = 0, layer: int | None = None, **attrs) -> str:
        if key in self.nodes or key in self.literals:
            self._duplicates.append(key)
        self.nodes[key] = Node(key, kernel, tuple(inputs), card, layer, attrs)
        return key

    def literal(self, key: str, value, card: int = 0) -> str:
        if key in self.nodes or key in self.literals:
            self._duplicates.append(key)
        self.literals[key] = (value, card)
        return key

    # ---- structure ---------------------------------------------------------------------------
    def consumers(self) -> dict[str, list[str]]:
        out = defaultdict(list)
        for n in self.nodes.values():
            for i in n.inputs:
                out[i].append(n.key)
        return out

    def topo_order(self) -> list[str]:
        """Kahn's algorithm in insertion order; raises GraphError naming a node on a cycle."""
        indeg = {k: sum(1 for i in n.inputs if i in self.nodes) for k, n in self.nodes.items()}
        cons = self.consumers()
        ready = deque(k for k, d in indeg.items() if d == 0)
        order = []
        while ready:
            k = ready.popleft()
            order.append(k)
            for c in cons.get(k, ()):
                indeg[c] -= 1
                if indeg[c] == 0:
                    ready.append(c)
        if len(order) != len(self.nodes):
            stuck = next(k for k, d in indeg.items() if d > 0)
            raise GraphError(f"cycle: node {stuck} is on or behind a dependency cycle")
        return order

    def sinks(self) -> list[str]:
        cons = self.consumers()
        return [k for k in self.nodes if k not in cons]

    def kernels(self) -> set[str]:
        return {n.kernel for n in self.nodes.values()}

    # ---- validation ----------------------------------------------------------------------------
    def validate(self, topology) -> "Graph":
        """Reject a malformed graph with a message naming the node."""
        if self._duplicates:
            raise GraphError(f"two producers of one key: {self._duplicates[0]}")
        for n in self.nodes.values():
            if n.card not in topology.cards:
                raise GraphError(f"node {n.key}: card {n.card} outside the topology (cards 0..{topology.ep - 1})")
            for i in n.inputs:
                if i not in self.nodes and i not in self.literals:
                    raise GraphError(f"node {n.key}: input {i} has no producer")
        self.topo_order()
        self._check_cache_edges()
        self._check_collectives()
        return self

    def _check_cache_edges(self):
        publishers = defaultdict(list)
        for n in self.nodes.values():
            for name in n.attrs.get("publishes", ()):
                publishers[(n.card, name)].append(n.key)
        for n in self.nodes.values():
            for name in n.attrs.get("reads", ()):
                for pub in publishers.get((n.card, name), ()):
                    if pub not in n.inputs:
                        raise GraphError(f"node {n.key}: reads cache {name} without the version edge from {pub}")
            for name in n.attrs.get("reads_previous", ()):
                for pub in publishers.get((n.card, name), ()):
                    if n.key not in self.nodes[pub].inputs:
                        raise GraphError(f"node {n.key}: reads the previous {name} but its writer {pub} "
                                         f"does not wait for it")

    def _check_collectives(self):
        """A collective's members are the nodes the builder gave its ``instance`` (and ``group``); the
        graph knows no kernel names (the node kind records, above it, say which kinds are collectives)."""
        instances = defaultdict(list)
        for n in self.nodes.values():
            if "instance" in n.attrs:
                instances[n.attrs["instance"]].append(n)
        for inst, members in instances.items():
            group = tuple(members[0].attrs["group"])
            present = sorted(m.card for m in members)
            if present != sorted(group):
                missing = sorted(set(group) - set(present))
                raise GraphError(f"node {members[0].key}: collective {inst} is missing participant card(s) {missing}")
            for m in members:
                sources = {self._card_of(i) for i in m.inputs}
                if not set(group) <= sources:
                    missing = sorted(set(group) - sources)
                    raise GraphError(f"node {m.key}: collective {inst} takes no input from card(s) {missing}")

    def _card_of(self, key: str) -> int:
        return self.nodes[key].card if key in self.nodes else self.literals[key][1]

    # ---- export --------------------------------------------------------------------------------
    def to_dot(self) -> str:
        lines = ["digraph dsv41 {", "  rankdir=TB; node [shape=box, fontsize=9];"]
        by_card = defaultdict(list)
        for n in self.nodes.values():
            by_card[n.card].append(n)
        for card, nodes in sorted(by_card.items()):
            lines.append(f'  subgraph "cluster_c{card}" {{ label="card {card}";')
            lines += [f'    "{n.key}" [label="{n.key}\\n{n.kernel}"];' for n in nodes]
            lines.append("  }")
        for n in self.nodes.values():
            lines += [f'  "{i}" -> "{n.key}";' for i in n.inputs if i in self.nodes]
        lines.append("}")
        return "\n".join(lines)
