"""PyPTO backend: kernel registry, simulated device time, functional verification, NPU check.

Values always come from the Torch backend; pypto only contributes time (``sim_time_us``: SIM cost
model on CPU, measured on an NPU with ``mode="npu"``). Module map:
  specs   - per-kernel argument layouts, goldens (dsv41.ops), the registry PYPTO_KERNELS
  kernels - the @pypto.frontend.jit factories (imported only in a worker)
  worker  - the subprocess that runs pypto, its console sent to a log file
  sim     - the memory + disk cache and the worker client
  verify  - pypto values vs Torch goldens
  env     - run folder, python3 shim, calculator build, check_npu
"""
from __future__ import annotations

from dsv41.kernels.pypto.env import check_npu
from dsv41.kernels.pypto.sim import (BACKEND_MODES, SimCache, close_workers, default_cache, device_time_us,
                                     sim_time_us)
from dsv41.kernels.pypto.specs import PYPTO_KERNELS, KernelSpec, cache_key
from dsv41.kernels.pypto.verify import verify_kernel

__all__ = ["BACKEND_MODES", "PYPTO_KERNELS", "KernelSpec", "SimCache", "cache_key",
           "check_npu", "close_workers", "default_cache", "device_time_us", "node_parts", "node_time_us",
           "sim_time_us", "verify_kernel"]


def node_parts(cfg, rows: int, tp: int = 1, ep: int | None = None) -> dict[str, list[tuple[str, dict]]]:
    """The pypto kernel calls that stand for one graph node on one card, for ``rows`` tokens per DP group.

    Keyed by the graph's node kernel; a node's pypto time is the sum over its parts (``node_time_us``).
    Each node kind's record says what it simulates as (``NodeKind.pypto_parts``, ``kernels/nodes/``);
    ep defaults to tp.
    """
    from dsv41.kernels.kinds import KINDS   # the records import nothing of pypto: no cycle
    return {name: kind.pypto_parts(cfg, rows, tp, ep or tp) for name, kind in KINDS.items() if kind.pypto_parts}


def node_time_us(node_kernel: str, cfg, rows: int, tp: int = 1, ep: int | None = None, **kw) -> float | None:
    """Summed pypto µs of a graph node's parts; None if it has no pypto form or any part failed.

    kw go to ``sim_time_us`` (mode, cache, simulate).
    """
    parts = node_parts(cfg, rows, tp, ep).get(node_kernel)
    if not parts:
        return None
    times = [sim_time_us(k, s, **kw) for k, s in parts]
    return None if any(t is None for t in times) else sum(times)
