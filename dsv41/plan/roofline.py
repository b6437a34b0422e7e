"""Roofline latency per node and a simulated per-card timeline of a step.

A node takes max(HBM bytes / bandwidth, sum over FLOP kinds of FLOPs / rate) plus the bytes it
receives over the interconnect / link bandwidth. Each card runs two streams: collectives (node kinds
whose ``NodeKind.comm`` is ``collective``) on ``comm``, everything else on ``compute``; a node starts
when its inputs are done and its stream is free. The makespan is the roofline step (``dsv41.plan.latency`` adds what a deployment pays on top,
on the same timeline); the memory-bound floor is the busiest card's bytes / bandwidth, with no
compute, links or dependencies.
"""
from __future__ import annotations

from collections import defaultdict

from dsv41.kernels.kinds import KINDS
from dsv41.plan.profile_file import load_profile
from dsv41.plan.profiles import PROFILES, DeviceProfile
from dsv41.plan.sizing import NodeCost

STREAMS = ("compute", "comm")


def profile(name: str) -> DeviceProfile:
    """A built-in profile by name, or an operator's own from a ``.json`` / ``.toml`` file."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith((".json", ".toml")):
        return load_profile(name)
    raise ValueError(f"--device-profile: must be one of {sorted(PROFILES)} or a .json / .toml profile file, "
                     f"got {name!r}")


def stream(kernel: str) -> str:
    return "comm" if KINDS[kernel].comm == "collective" else "compute"


def node_us(cost: NodeCost, dev: DeviceProfile) -> float:
    memory = (cost.bytes_read + cost.bytes_written) / dev.hbm_bytes_per_s
    compute = sum(f / dev.flops_per_s[kind] for kind, f in cost.flops.items())
    return (max(memory, compute) + cost.link / dev.link_bytes_per_s) * 1e6


def simulate(graph, durations: dict[str, float], release: dict[str, float] | None = None
             ) -> dict[str, tuple[float, float]]:
    """Node key -> (start µs, end µs), list-scheduled in topological order; a node starts when its
    inputs and its stream are done and, with ``release``, not before the host has issued it."""
    release = release or {}
    free: dict[tuple, float] = defaultdict(float)
    times: dict[str, tuple[float, float]] = {}
    for key in graph.topo_order():
        n = graph.nodes[key]
        lane = (n.card, stream(n.kernel))
        ready = max((times[i][1] for i in n.inputs if i in times), default=0.0)
        start = max(ready, free[lane], release.get(key, 0.0))
        times[key] = (start, start + durations[key])
        free[lane] = times[key][1]
    return times


def critical_path(graph, times: dict[str, tuple[float, float]]) -> list[str]:
    """The chain of nodes that ends last: each one waited on its latest input or on its stream; it
    begins at a node that waited for nothing but the host (its issue, or the step's start)."""
    by_lane = defaultdict(list)
    for key in times:
        n = graph.nodes[key]
        by_lane[(n.card, stream(n.kernel))].append(key)
    previous = {k: lane[i - 1] for lane in by_lane.values() for i, k in enumerate(lane) if i}
    key = max(times, key=lambda k: times[k][1])
    path = [key]
    while True:
        start = times[key][0]
        inputs = [i for i in graph.nodes[key].inputs if i in times]
        latest = max(inputs, key=lambda i: times[i][1], default=None)
        if latest is not None and times[latest][1] == start:
            key = latest
        elif key in previous and times[previous[key]][1] == start:
            key = previous[key]
        else:
            return path[::-1]
        path.append(key)
