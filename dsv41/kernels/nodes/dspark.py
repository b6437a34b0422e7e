"""DSpark's taps: the stream entering each DSpark target layer, lane-averaged on the card that holds
its rows; the step hands them back so the drafter can seed its windows with the rows a step kept."""
from __future__ import annotations

from dsv41.kernels.cost import Cost, meta, nbytes
from dsv41.kernels.record import NodeKind
from dsv41.model.dspark import DSpark


def tap(st, node, x):
    return DSpark.tap(x)


def tap_cost(ctx, node, x):
    t, hc, d = x.shape
    return Cost(meta(t, d), act_read=nbytes(x), flops={"vector": t * hc * d})


RECORDS = (
    NodeKind("dspark.tap", tap, tap_cost, launches=(1, "lane mean"), comm="none",
             no_pypto_parts="a lane mean of the stream: no pypto kernel for it"),
)
