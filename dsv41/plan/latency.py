"""What a deployment takes per step, not only its roofline: a latency model on the planned graph.

Every node is a kernel group: the launch gaps of the kernels a serving stack runs for it
(``NodeKind.launches``, the rule in ``dsv41.kernels.record``), then, if it receives bytes from other
cards, the fixed cost of that primitive (``sync``: its alpha, the device-side wait of the hand-off)
and the time its bytes take (``collectives``: bytes / beta), then its body, max(bytes / achievable
bandwidth, FLOPs / achievable rate), where "achievable" is the profile's fraction for the node
kind's latency class (``NodeKind.latency``); a profile whose kernels decode weights on every use
(``weight_use_ns``, the ``cpu`` profile) adds that decode, per value read, to the compute side. The
primitives are fit to microbenchmarks (``dsv41.plan.primitives``, cited in the profiles):

- a ``collective`` node kind (``NodeKind.comm``: ``tp.all_gather`` / ``tp.reduce_scatter``, and the
  exact owner all-reduce, an all-gather) and every other gather (``lm_head.argmax``): one collective
  call each (``NodeKind.calls``: ``tp.all_reduce`` two alphas, reduce-scatter then all-gather);
- an ``all_to_all`` kind (``moe.experts``, the dispatch receive, and ``moe.combine``): one all-to-all
  call over the EP ranks taking part, its alpha by that rank count; intra- and inter-node peers on
  their own links at once.

How a layer's data crosses cards is the ``scheme`` (``SCHEMES``), a property of the serving stack,
not of the graph: ``all_to_all`` prices the graph's own hand-offs as above (the sharded wiring: the
attention input all-gathered, its output reduce-scattered, MoE rows dispatched and combined, which
is what SGLang and vLLM run with DP attention and an all-to-all MoE backend such as DeepEP);
``all_reduce`` prices what a TP deployment without an all-to-all backend runs (SGLang's
``DeepseekV2MoE.forward_normal`` with ``--moe-a2a-backend none``, vLLM's ``FusedMoE`` at DP 1): every
card of the TP group holds every row, so nothing is gathered or dispatched (``tp.all_gather`` and the
experts' receive cost nothing), and the attention output and the experts' partial sums are each one
all-reduce over the group (``tp.reduce_scatter`` and ``moe.combine`` priced as that call:
``primitives.all_reduce_alpha`` and a ring's 2 (n - 1) / n of the rows' bytes).

The link is inter-node when any peer sits on another node (cards are numbered node by node). MoE
load imbalance: the busiest EP rank receives ``imbalance`` times the mean (token, expert) pairs, so
every card's expert compute (a ``NodeKind.routed`` kind) and all-to-all bytes are scaled by it (the
step waits on the busiest at the combine).

Host: a per-step cost before any kernel can start, then either one graph replay (``graph``: every
kernel is queued ahead) or one issue per kernel in each card's order (``eager``: a kernel cannot
start before the host has issued it); after the last kernel, the sampled tokens' sync to the host.
The step is the simulated makespan plus that sync; on a profile whose cards share a host's cores
(``shared_cores``: this CPU's cards are threads or processes on its 2 cores), no shorter than the
cards' summed node time over those cores (``cores``: what that adds). Its breakdown is taken along the critical path
(which waits on nothing, so it has no idle), and per card along its own timeline (where idle is time
spent waiting on peers).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dsv41.kernels.kinds import KINDS
from dsv41.plan.primitives import all_reduce_alpha
from dsv41.plan.roofline import critical_path, simulate

PARTS = ("compute", "memory", "launch", "sync", "collectives", "host", "idle", "cores")
DISPATCH = ("graph", "eager")
SCHEMES = ("all_to_all", "all_reduce")
# Fixed costs the sensitivity table varies: what each scales.
FIXED_TERMS = {
    "launch": "device gap per kernel (launch_us)",
    "kernels": "kernels per node (NodeKind.launches)",
    "collective": "TP collective alpha (small-message floor)",
    "a2a": "dispatch/combine alpha per call",
    "host": "host work per step and graph replay / eager issue",
    "token_sync": "sampled-token sync per step",
    "imbalance": "MoE load imbalance (the excess over 1)",
}


@dataclass(frozen=True)
class Parts:
    """One node's time, in the order it is spent: launch, the hand-off's fixed cost (sync), its
    bytes (collectives), then the body."""
    launch: float
    collectives: float
    body: float
    bound: str            # "compute" or "memory": what limits the body
    sync: float = 0.0

    @property
    def total(self) -> float:
        return self.launch + self.sync + self.collectives + self.body


def body_us(cost, dev, klass: str, load: float = 1.0) -> tuple[float, str]:
    """``load`` scales the FLOPs (the busiest rank's share of the routed pairs); the weight bytes a
    card reads do not grow with it."""
    bw_frac, rate_frac = dev.efficiency[klass]
    memory = (cost.bytes_read + cost.bytes_written) / (dev.hbm_bytes_per_s * bw_frac)
    compute = load * sum(f / (dev.flops_per_s[kind] * rate_frac) for kind, f in cost.flops.items())
    compute += sum(n * dev.weight_use_ns.get(fmt, 0.0) for fmt, n in cost.decoded.items()) * 1e-9
    return max(memory, compute) * 1e6, ("compute" if compute > memory else "memory")


def node_body_us(kernel: str, cost, dev, load: float = 1.0) -> tuple[float, str]:
    """A node's body from the profile's measured operator for its kind, else the roofline."""
    op = dev.operators.get(kernel)
    if op is None:
        return body_us(cost, dev, KINDS[kernel].latency, load)
    return op.us(cost.bytes_read + cost.bytes_written, sum(cost.flops.values()), sum(cost.decoded.values()), load)


def peers(node, graph) -> list[int]:
    """Cards other than the node's own that send it an input."""
    cards = {graph.nodes[i].card for i in node.inputs if i in graph.nodes}
    return sorted(cards - {node.card})


def collective_call_us(calls: int, remote: bool, link_bytes: float, dev, scale: dict | None = None
                       ) -> tuple[float, float]:
    """(fixed cost, bytes time) in µs of ``calls`` TP collective calls receiving ``link_bytes`` in all;
    ``remote``: a peer sits on another node."""
    prim = (dev.inter if remote else dev.intra).collective
    return calls * prim.alpha_us * (scale or {}).get("collective", 1.0), link_bytes / prim.bytes_per_s * 1e6


def a2a_call_us(local: int, remote: int, link_bytes: float, dev, scale: dict | None = None) -> tuple[float, float]:
    """(fixed cost, bytes time) in µs of one dispatch or combine receiving ``link_bytes`` from ``local``
    peers on the card's node and ``remote`` on others, each link carrying its peers' share at once."""
    ranks = local + remote + 1
    alpha = (dev.inter if remote else dev.intra).a2a.at(ranks).alpha_us * (scale or {}).get("a2a", 1.0)
    times = [link_bytes * n / (local + remote) / link.a2a.at(ranks).bytes_per_s * 1e6
             for n, link in ((local, dev.intra), (remote, dev.inter)) if n]
    return alpha, max(times)


def all_reduce_call_us(ranks: int, remote: bool, output_bytes: float, dev, scale: dict | None = None
                       ) -> tuple[float, float]:
    """(fixed cost, bytes time) in µs of one all-reduce over ``ranks`` of ``output_bytes`` per rank
    (one rank's share of the rows): a ring receives 2 (n - 1) / n of all ranks' rows, 2 (n - 1) times
    one rank's."""
    if ranks <= 1:
        return 0.0, 0.0
    prim = (dev.inter if remote else dev.intra).collective
    alpha = all_reduce_alpha(prim.alpha_us, ranks) * (scale or {}).get("collective", 1.0)
    return alpha, 2 * (ranks - 1) * output_bytes / prim.bytes_per_s * 1e6


def link_us(node, link_bytes: float, others: list[int], dev, scale: dict | None = None) -> tuple[float, float]:
    """(fixed cost, bytes time) in µs of what a node receives from ``others``."""
    if not link_bytes or not others:
        return 0.0, 0.0
    home = node.card // dev.cards_per_node
    remote = [c for c in others if c // dev.cards_per_node != home]
    kind = KINDS[node.kernel]
    if kind.comm != "all_to_all":
        return collective_call_us(kind.calls(node) if kind.calls else 1, bool(remote), link_bytes, dev, scale)
    return a2a_call_us(len(others) - len(remote), len(remote), link_bytes, dev, scale)


def all_reduce_us(node, output_bytes: int, others: list[int], dev, scale: dict | None = None) -> tuple[float, float]:
    """(fixed cost, bytes time) in µs of one all-reduce of the rows a node outputs over it and ``others``."""
    home = node.card // dev.cards_per_node
    return all_reduce_call_us(len(others) + 1, any(c // dev.cards_per_node != home for c in others),
                              output_bytes, dev, scale)


# under the all_reduce scheme: rows every card already holds, and the all-reduces that replace a hand-off
_HELD = ("tp.all_gather",)
_ALL_REDUCED = ("tp.reduce_scatter", "tp.all_reduce", "moe.combine")


def node_parts(graph, costs, dev, imbalance: float = 1.0, scale: dict | None = None,
               scheme: str = "all_to_all") -> dict[str, Parts]:
    if scheme not in SCHEMES:
        raise ValueError(f"--scheme: must be one of {list(SCHEMES)}, got {scheme!r}")
    scale = scale or {}
    reduce = scheme == "all_reduce"
    gap = dev.launch_us * scale.get("launch", 1.0)
    per_node = scale.get("kernels", 1.0)
    load = 1.0 + (imbalance - 1.0) * scale.get("imbalance", 1.0)
    parts = {}
    for key, node in graph.nodes.items():
        cost = costs[key]
        kind = KINDS[node.kernel]
        if reduce and node.kernel in _HELD:
            parts[key] = Parts(0.0, 0.0, 0.0, "memory")
            continue
        moe = kind.comm == "all_to_all"
        body, bound = node_body_us(node.kernel, cost, dev, load if kind.routed else 1.0)
        if reduce and node.kernel in _ALL_REDUCED:
            sync, wire = all_reduce_us(node, cost.output_bytes, peers(node, graph), dev, scale)
        elif reduce and moe:     # the experts' rows are already on the card
            sync, wire = 0.0, 0.0
        else:
            sync, wire = link_us(node, cost.link * (load if moe else 1.0), peers(node, graph), dev, scale)
        parts[key] = Parts(gap * kind.kernels * per_node, wire, body, bound, sync)
    return parts


def release_times(graph, dev, dispatch: str, host_scale: float = 1.0) -> dict[str, float]:
    """When the host has issued each node: after the step's host work, one graph replay, or one
    eager issue per kernel the node launches, in the card's order."""
    if dispatch not in DISPATCH:
        raise ValueError(f"--dispatch: must be one of {list(DISPATCH)}, got {dispatch!r}")
    if dispatch == "graph":
        start = (dev.host_step_us + dev.graph_launch_us) * host_scale
        return dict.fromkeys(graph.nodes, start)
    issued = defaultdict(lambda: dev.host_step_us * host_scale)
    release = {}
    for key in graph.topo_order():
        node = graph.nodes[key]
        issued[node.card] += dev.host_launch_us * host_scale * KINDS[node.kernel].kernels
        release[key] = issued[node.card]
    return release


@dataclass
class StepLatency:
    parts: dict            # node key -> Parts
    times: dict            # node key -> (start, end) µs
    release: dict          # node key -> issue time µs
    path: list             # critical path, node keys
    token_sync_us: float = 0.0   # after the last kernel: the sampled tokens reach the host
    cores_us: float = 0.0        # cards sharing a host's cores: how far their summed work outlasts the timeline

    @property
    def kernels_end_us(self) -> float:
        return max(end for _, end in self.times.values())

    @property
    def step_us(self) -> float:
        return self.kernels_end_us + self.cores_us + self.token_sync_us

    def on_path(self) -> dict[str, float]:
        """The step split along the critical path: host before its first node, then each node's
        parts, then the token sync (counted as sync)."""
        out = dict.fromkeys(PARTS, 0.0)
        out["host"] = self.times[self.path[0]][0]
        out["sync"] = self.token_sync_us
        out["cores"] = self.cores_us
        for key in self.path:
            p = self.parts[key]
            out["launch"] += p.launch
            out["sync"] += p.sync
            out["collectives"] += p.collectives
            out[p.bound] += p.body
        return out

    def per_card(self, graph) -> dict[int, dict[str, float]]:
        """Each card's step time split by what it is doing: a moment counts once, for the most
        useful thing running (compute, memory, collectives, launch, in that order); a gap is host when
        the next kernel waited for its issue, else idle (waiting on peers); every card waits out the
        token sync at the end."""
        by_card = defaultdict(list)
        for key in self.times:
            by_card[graph.nodes[key].card].append(key)
        out = {}
        for c, keys in sorted(by_card.items()):
            out[c] = _card_breakdown(keys, self.parts, self.times, self.release, self.kernels_end_us)
            out[c]["sync"] += self.token_sync_us
            out[c]["cores"] += self.cores_us
        return out


_PRIORITY = ("compute", "memory", "collectives", "sync", "launch")


def _card_breakdown(keys, parts, times, release, step_end: float) -> dict[str, float]:
    intervals = []   # (start, end, category)
    for k in keys:
        p, t = parts[k], times[k][0]
        for cat, d in (("launch", p.launch), ("sync", p.sync), ("collectives", p.collectives), (p.bound, p.body)):
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


def step_latency(graph, costs, dev, dispatch: str = "graph", imbalance: float = 1.0,
                 scale: dict | None = None, scheme: str = "all_to_all") -> StepLatency:
    """``scale``: fixed-cost term (a key of FIXED_TERMS) -> multiplier, for the sensitivity table."""
    scale = scale or {}
    unknown = set(scale) - set(FIXED_TERMS)
    if unknown:
        raise ValueError(f"scale: unknown terms {sorted(unknown)}; allowed {list(FIXED_TERMS)}")
    parts = node_parts(graph, costs, dev, imbalance, scale, scheme)
    release = release_times(graph, dev, dispatch, scale.get("host", 1.0))
    times = simulate(graph, {k: p.total for k, p in parts.items()}, release)
    lat = StepLatency(parts, times, release, critical_path(graph, times),
                      dev.token_sync_us * scale.get("token_sync", 1.0))
    if dev.shared_cores:
        start = min(s for s, _ in times.values())
        lat.cores_us = max(0.0, start + sum(p.total for p in parts.values()) / dev.shared_cores - lat.kernels_end_us)
    return lat

