"""TP collectives: all-gather of slab rows, reduce-scatter and all-reduce of partials."""
from __future__ import annotations

import torch

from dsv41.config import slab
from dsv41.kernels.cost import BF16_BYTES, F32_BYTES, Cost, meta
from dsv41.kernels.record import NodeKind
from dsv41.ops.o_proj import reduce_partials


def all_gather(st, node, *slabs):
    """Rank-ordered concatenation of every rank's active slab rows."""
    return torch.cat(slabs, 0)


def all_gather_cost(ctx, node, *slabs):
    rows = sum(s.shape[0] for s in slabs)
    own = slabs[ctx.tp_rank].shape[0]
    return Cost(meta(rows, slabs[0].shape[1]), link=(rows - own) * slabs[0].shape[1] * BF16_BYTES)


def reduce_scatter(st, node, *partials):
    """FP32 sum in rank order, one BF16 rounding, keep this rank's slab."""
    first, count = slab(partials[0].shape[0], st.topo.tp, st.tp_rank)
    return reduce_partials(list(partials))[first:first + count]


def reduce_scatter_cost(ctx, node, *partials):
    t, d = partials[0].shape
    width = slab(t, ctx.topo.tp, ctx.tp_rank)[1]
    ring = (ctx.topo.tp - 1) * -(-t // ctx.topo.tp) * d
    return Cost(meta(width, d), link=ring * F32_BYTES, flops={"vector": len(partials) * t * d})


def all_reduce(st, node, *parts):
    """Attention: sum FP32 partials in rank order, round once. MoE: rows are owner-disjoint
    BF16 values scattered into zeros and summed, which is exact."""
    if "owners" not in node.attrs:
        return reduce_partials(list(parts))
    full = torch.zeros(node.attrs["rows"], parts[0].shape[1])
    for rows, part in zip(node.attrs["owners"], parts):
        full[rows] += part
    return full


def all_reduce_cost(ctx, node, *parts):
    tp = ctx.topo.tp
    if "owners" in node.attrs:
        rows, d = node.attrs["rows"], parts[0].shape[1]
        own = len(node.attrs["owners"][ctx.tp_rank])
        return Cost(meta(rows, d), link=(rows - own) * d * BF16_BYTES, flops={"vector": len(parts) * rows * d})
    t, d = parts[0].shape
    ring = (tp - 1) * -(-t // tp) * d
    return Cost(meta(t, d), link=ring * (F32_BYTES + BF16_BYTES), flops={"vector": len(parts) * t * d})


# one kernel of the collective library; its time is the link's (plan/latency), not a compute kernel's
COLLECTIVE = dict(launches=(1, "collective"), comm="collective",
                  no_pypto_parts="a collective: priced by the link, not simulated as a kernel")

RECORDS = (
    NodeKind("tp.all_gather", all_gather, all_gather_cost, **COLLECTIVE),
    NodeKind("tp.reduce_scatter", reduce_scatter, reduce_scatter_cost, **COLLECTIVE),
    # reduce-scatter then all-gather: two calls, but the exact owner all-reduce is one all-gather
    NodeKind("tp.all_reduce", all_reduce, all_reduce_cost, calls=lambda node: 1 if "owners" in node.attrs else 2,
             **COLLECTIVE),
)
