"""Simulated device time of a graph node from the PyPTO backend (``--backend pypto-sim``).

Values always come from the Torch kernels; this only asks the node kind's record how long its pypto
form would take for the node's actual row count (through the pypto cache). Kinds with no pypto
form get None and run on Torch alone.
"""
from __future__ import annotations

from dsv41.kernels.kinds import KINDS

BACKENDS = ("torch", "pypto-sim", "pypto-npu")


def node_sim_us(st, node, args, backend: str = "pypto-sim") -> float | None:
    """The node's simulated µs on its card, or None when it has no pypto form."""
    device_time = KINDS[node.kernel].device_time
    return None if device_time is None else device_time(st, node, args, _mode(backend))


def _mode(backend: str) -> str:
    return "npu" if backend == "pypto-npu" else "sim"
