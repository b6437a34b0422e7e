"""One record per graph node kind: everything the runtime, the check, the plan and the pypto
simulation know about a kernel name. The records live by subject in ``kernels/nodes/``; the
registry of them all is ``kernels/kinds.KINDS``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

LATENCY_CLASSES = ("matmul", "gather", "vector")   # the keys of a DeviceProfile's efficiency


@dataclass(frozen=True)
class NodeKind:
    name: str                            # the kernel name graph nodes carry (``node.kernel``)
    run: Callable                        # (state, node, *inputs) -> value: the Torch kernel
    cost: Callable                       # (ctx, node, *inputs) -> kernels.cost.Cost
    latency: str = "vector"              # which of the profile's achievable fractions bound its body
    device_time: Callable | None = None  # (state, node, args, pypto mode) -> simulated µs or None
    pypto: Callable | None = None        # node-level pypto form for the check: (state, node, *args) ->
    #                                      (pypto kernel, inputs, extra shapes, dtypes, outputs -> value)
    no_pypto: str = ""                   # why a kernel pypto does simulate has no node-level form
    effects: bool = False                # writes caches: running it again (the check) would stage twice
    compare: Callable | None = None      # (state, node, actual, golden) -> Verdict where equality is too strict

    def __post_init__(self):
        if self.latency not in LATENCY_CLASSES:
            raise ValueError(f"NodeKind {self.name!r}: latency must be one of {LATENCY_CLASSES}, "
                             f"got {self.latency!r}")
        if self.pypto is not None and self.no_pypto:
            raise ValueError(f"NodeKind {self.name!r}: a node-level pypto form and a reason it has none")


def at_rows(rows: Callable) -> Callable:
    """A device_time that simulates the node's pypto parts (``pypto.backend.node_parts``, keyed by
    the kernel name) at ``rows(node, args)`` rows; no rows, no time."""
    def device_time(st, node, args, mode):
        from dsv41.kernels.pypto.backend import node_time_us   # pypto's modules load on first use

        n = rows(node, args)
        if not n:
            return None
        return node_time_us(node.kernel, st.cfg, n, st.topo.tp, st.topo.ep, mode=mode)
    return device_time
