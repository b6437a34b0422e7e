"""What a deployment takes per step, not only its roofline: a latency model on the planned graph.

Every node is a kernel: a fixed launch gap, then the time its bytes cross the links (collectives and
all-to-all receives, alpha-beta), then its body, max(bytes / achievable bandwidth, FLOPs / achievable
rate), where "achievable" is the profile's fraction for the node kind's latency class
(``NodeKind.latency``). Links:

- ``tp.all_gather`` / ``tp.reduce_scatter`` (and the exact owner all-reduce, an all-gather): a ring of
  p-1 steps, or one step on a full mesh; ``tp.all_reduce``: reduce-scatter then all-gather, twice that;
- every other node that receives bytes from peers (``moe.experts`` dispatch, ``moe.combine``,
  ``lm_head.argmax``): pairwise all-to-all, one step per peer; intra- and inter-node peers run on
  their own links at once, the bytes split by the peer count on each.

Each step costs one hop latency; the bytes cross at the link's achievable bandwidth. The link is
inter-node when any peer sits on another node (cards are numbered node by node).

Host: a per-step cost before any kernel can start, then either one graph replay (``graph``: every
kernel is queued ahead) or one issue per kernel in each card's order (``eager``: a kernel cannot
start before the host has issued it). The step is the simulated makespan; its breakdown is taken
along the critical path (which waits on nothing, so it has no idle), and per card along its own
timeline (where idle is time spent waiting on peers).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dsv41.graph.graph import COLLECTIVES
from dsv41.kernels.kinds import KINDS
from dsv41.plan.roofline import critical_path, simulate

PARTS = ("compute", "memory", "launch", "collectives", "host", "idle")
DISPATCH = ("graph", "eager")


@dataclass(frozen=True)
class Parts:
    """One node's time, in the order it is spent: launch, collectives, then the body."""
    launch: float
    collectives: float
    body: float
    bound: str            # "compute" or "memory": what limits the body

    @property
    def total(self) -> float:
        return self.launch + self.collectives + self.body


def body_us(cost, dev, klass: str) -> tuple[float, str]:
    bw_frac, rate_frac = dev.efficiency[klass]
    memory = (cost.bytes_read + cost.bytes_written) / (dev.hbm_bytes_per_s * bw_frac)
    compute = sum(f / (dev.flops_per_s[kind] * rate_frac) for kind, f in cost.flops.items())
    return max(memory, compute) * 1e6, ("compute" if compute > memory else "memory")


def peers(node, graph) -> list[int]:
    """Cards other than the node's own that send it an input."""
    cards = {graph.nodes[i].card for i in node.inputs if i in graph.nodes}
    return sorted(cards - {node.card})


def link_us(node, link_bytes: int, others: list[int], dev) -> float:
    """Alpha-beta time of the bytes a node receives from ``others``."""
    if not link_bytes or not others:
        return 0.0
    home = node.card // dev.cards_per_node
    remote = [c for c in others if c // dev.cards_per_node != home]
    if node.kernel in COLLECTIVES:
        link = dev.inter if remote else dev.intra
        steps = len(others) if link.algorithm == "ring" else 1
        if node.kernel == "tp.all_reduce" and "owners" not in node.attrs:
            steps *= 2
        return steps * link.hop_us + link_bytes / link.achievable * 1e6
    local = len(others) - len(remote)
    times = [n * link.hop_us + link_bytes * n / len(others) / link.achievable * 1e6
             for n, link in ((local, dev.intra), (len(remote), dev.inter)) if n]
    return max(times)


def node_parts(graph, costs, dev) -> dict[str, Parts]:
    parts = {}
    for key, node in graph.nodes.items():
        cost = costs[key]
        body, bound = body_us(cost, dev, KINDS[node.kernel].latency)
        parts[key] = Parts(dev.launch_us, link_us(node, cost.link, peers(node, graph), dev), body, bound)
    return parts


def release_times(graph, dev, dispatch: str) -> dict[str, float]:
    """When the host has issued each node: after the step's host work, one graph replay, or one
    eager issue per kernel in the card's order."""
    if dispatch not in DISPATCH:
        raise ValueError(f"--dispatch: must be one of {list(DISPATCH)}, got {dispatch!r}")
    if dispatch == "graph":
        start = dev.host_step_us + dev.graph_launch_us
        return dict.fromkeys(graph.nodes, start)
    issued = defaultdict(lambda: dev.host_step_us)
    release = {}
    for key in graph.topo_order():
        card = graph.nodes[key].card
        issued[card] += dev.host_launch_us
        release[key] = issued[card]
    return release


@dataclass
class StepLatency:
    parts: dict            # node key -> Parts
    times: dict            # node key -> (start, end) µs
    release: dict          # node key -> issue time µs
    path: list             # critical path, node keys

    @property
    def step_us(self) -> float:
        return max(end for _, end in self.times.values())

    def on_path(self) -> dict[str, float]:
        """The step split along the critical path: host before its first node, then each node's parts."""
        out = dict.fromkeys(PARTS, 0.0)
        out["host"] = self.times[self.path[0]][0]
        for key in self.path:
            p = self.parts[key]
            out["launch"] += p.launch
            out["collectives"] += p.collectives
            out[p.bound] += p.body
        return out

    def per_card(self, graph) -> dict[int, dict[str, float]]:
        """Each card's step time split by what it is doing: a moment counts once, for the most
        useful thing running (compute, memory, collectives, launch, in that order); a gap is host when
        the next kernel waited for its issue, else idle (waiting on peers)."""
        by_card = defaultdict(list)
        for key in self.times:
            by_card[graph.nodes[key].card].append(key)
        end = self.step_us
        return {c: _card_breakdown(keys, self.parts, self.times, self.release, end)
                for c, keys in sorted(by_card.items())}


_PRIORITY = ("compute", "memory", "collectives", "launch")


def _card_breakdown(keys, parts, times, release, step_end: float) -> dict[str, float]:
    intervals = []   # (start, end, category)
    for k in keys:
        p, t = parts[k], times[k][0]
        for cat, d in (("launch", p.launch), ("collectives", p.collectives), (p.bound, p.body)):
            if d > 0:
                intervals.append((t, t + d, cat))
            t += d
    starts_at = defaultdict(list)
    for k in keys:
        starts_at[times[k][0]].append(k)
    cuts = sorted({0.0, step_end} | {a for a, _, _ in intervals} | {b for _, b, _ in intervals})
    out = dict.fromkeys(PARTS, 0.0)
    by_start = sorted(intervals)
    active, i = [], 0
    for a, b in zip(cuts, cuts[1:]):
        while i < len(by_start) and by_start[i][0] <= a:
            active.append(by_start[i])
            i += 1
        active = [iv for iv in active if iv[1] > a]
        cats = {iv[2] for iv in active}
        cat = next((c for c in _PRIORITY if c in cats), None)
        if cat is None:
            nxt = by_start[i][0] if i < len(by_start) else None     # sorted: the next interval to begin
            waited_on_host = nxt is not None and any(release[k] == nxt for k in starts_at[nxt])
            cat = "host" if waited_on_host else "idle"
        out[cat] += b - a
    return out


def step_latency(graph, costs, dev, dispatch: str = "graph") -> StepLatency:
    parts = node_parts(graph, costs, dev)
    release = release_times(graph, dev, dispatch)
    times = simulate(graph, {k: p.total for k, p in parts.items()}, release)
    return StepLatency(parts, times, release, critical_path(graph, times))

