"""From a placed Graph to a Plan: per-card Submissions, each one dask task.

A card's nodes are taken in topological order; a node whose inputs cross from another card starts
a new submission, so external inputs only ever enter at a submission's first node. Every edge
between submissions then goes from an earlier-starting submission to a later-starting one, so the
submission graph is acyclic. ``granularity="node"`` keeps one submission per node (debugging).

A submission's key is ``<kernel>@L<layer>@c<card>-<n>`` after its first node, so dask's
``key_split`` (the dashboard's task-stream and progress grouping) reads ``kernel@Llayer@ccard``. A plan
serves every step of its shape; its dask keys add the engine id and the step (``task_suffix``), unique
across steps, retries and runs sharing one scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsv41.graph.graph import Graph, Node


@dataclass
class Submission:
    key: str
    card: int
    nodes: list[Node]
    deps: list[str] = field(default_factory=list)      # producer submission keys and literal keys
    literals: set[str] = field(default_factory=set)    # the deps that are graph literals
    exports: set[str] = field(default_factory=set)     # node keys consumed outside this submission
    step: int = 0
    phase: str = ""
    engine: str = ""                                   # whose State it runs against
    expect: tuple[str, int] = ("", 0)                  # that State's (build id, generation)
    trace: object = None                               # telemetry's liveness and parent span, when tracing

    @property
    def task_suffix(self) -> str:
        """What the step's dask keys (its submissions' and literals') add to the plan's keys."""
        return f"-{self.engine}-{self.step}" if self.engine else f"-{self.step}"


@dataclass
class Plan:
    graph: Graph
    submissions: dict[str, Submission]
    owner: dict[str, str]                              # node key -> submission key
    outputs: list[str]                                 # node keys the caller reads

    @property
    def dask_tasks(self) -> int:
        return len(self.submissions)


def task_name(node: Node) -> str:
    layer = f"@L{node.layer}" if node.layer is not None else ""
    return f"{node.kernel}{layer}@c{node.card}"


def make_plan(graph: Graph, topology, granularity: str = "submission", outputs=(), step: int = 0) -> Plan:
    if granularity not in ("submission", "node"):
        raise ValueError(f"granularity: must be 'submission' or 'node', got {granularity!r}")
    graph.validate(topology)
    order = graph.topo_order()
    owner: dict[str, str] = {}
    subs: dict[str, Submission] = {}
    current: dict[int, Submission] = {}
    card_of = {k: n.card for k, n in graph.nodes.items()}
    for key in order:
        node = graph.nodes[key]
        crosses = any(card_of.get(i, node.card) != node.card for i in node.inputs if i in graph.nodes)
        sub = current.get(node.card)
        if sub is None or crosses or granularity == "node":
            sub = Submission(f"{task_name(node)}-{len(subs)}", node.card, [], step=step, phase=graph.phase)
            subs[sub.key] = sub
            current[node.card] = sub
        sub.nodes.append(node)
        owner[key] = sub.key
    for sub in subs.values():
        deps = []
        for node in sub.nodes:
            for i in node.inputs:
                dep = owner.get(i, i)
                if dep != sub.key and dep not in deps:
                    deps.append(dep)
                    if dep in graph.literals:
                        sub.literals.add(dep)
                if i in owner and owner[i] != sub.key:
                    subs[owner[i]].exports.add(i)
        sub.deps = deps
    for k in outputs:
        subs[owner[k]].exports.add(k)
    return Plan(graph, subs, owner, list(outputs))
