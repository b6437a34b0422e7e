"""Simulated device time of a graph node from the PyPTO backend (``--backend pypto-sim``).

Values always come from the Torch kernels; this only asks the node kind's record what its pypto form
is and at how many rows the node ran, and pypto how long that takes (through the pypto cache). Kinds with no pypto
form get None and run on Torch alone.
"""
from __future__ import annotations

from dsv41.kernels.kinds import KINDS

BACKENDS = ("torch", "pypto-sim", "pypto-npu")


def node_sim_us(st, node, args, backend: str = "pypto-sim") -> float | None:
    """The node's simulated µs on its card: its record's pypto parts at the rows it ran (None when it
    has no pypto form or no rows)."""
    kind = KINDS[node.kernel]
    rows = kind.sim_rows(st, node, args) if kind.sim_rows is not None else 0
    if not rows:
        return None
    from dsv41.kernels.pypto.backend import node_time_us   # pypto's modules load on first use
    return node_time_us(node.kernel, st.cfg, rows, st.topo.tp, st.topo.ep, mode=_mode(backend))


def _mode(backend: str) -> str:
    return "npu" if backend == "pypto-npu" else "sim"
