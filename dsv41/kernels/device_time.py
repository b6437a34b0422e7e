"""Simulated device time of a graph node from the PyPTO backend (``--backend pypto-sim``).

Values always come from the Torch kernels; this only asks the pypto cost model (through its cache)
how long the node's pypto form would take for the node's actual row count. Nodes whose kernel has
no pypto form get None and run on Torch alone.
"""
from __future__ import annotations

import math

BACKENDS = ("torch", "pypto-sim", "pypto-npu")


def _rows(node, args) -> int | None:
    k = node.kernel
    if k in ("norm.rms", "norm.final", "hc.pre", "hc.head", "attn.q_proj", "attn.kv_proj", "attn.o_proj"):
        return args[0].shape[0]
    if k == "hc.post":
        return args[1].shape[0]
    if k == "rope.rows":
        return args[0].md.num_tokens
    if k == "moe.gate":
        return len(node.attrs["rows"])
    if k == "moe.shared":
        return args[0][0].shape[0]
    if k == "lm_head.shard":
        return args[1].md.num_requests
    return None


def node_sim_us(st, node, args, backend: str = "pypto-sim") -> float | None:
    """The node's simulated µs on its card, or None when it has no pypto form."""
    from dsv41.kernels.pypto.backend import node_time_us

    cfg, tp, ep = st.cfg, st.topo.tp, st.topo.ep
    if node.kernel.startswith("attn.leaf."):
        step = args[1]
        keys = cfg.sliding_window + (cfg.index_topk if len(args) > 3 else 0)
        per_tile = node_time_us("attn.tile", cfg, step.md.num_tokens, tp, ep, mode=_mode(backend))
        return None if per_tile is None else per_tile * math.ceil(keys / 64)
    if node.kernel == "moe.experts":
        pairs = sum(len(d[dst][0]) for d in args for dst in d)
        rows = max(1, math.ceil(pairs / ((ep // tp) * cfg.num_experts_per_tok)))
        return node_time_us("moe.experts", cfg, rows, tp, ep, mode=_mode(backend))
    rows = _rows(node, args)
    if rows is None or rows == 0:
        return None
    return node_time_us(node.kernel, cfg, rows, tp, ep, mode=_mode(backend))


def _mode(backend: str) -> str:
    return "npu" if backend == "pypto-npu" else "sim"
