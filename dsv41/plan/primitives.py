"""Fixed costs of the communication primitives, fit to published microbenchmarks.

A call of a primitive (a TP collective, an MoE dispatch or combine) takes ``alpha + bytes / beta``:
``alpha`` is what the call costs with no payload (kernel start, the flag or barrier every rank waits
on, the first hop), ``beta`` the bandwidth the bytes then cross at. Both are fit to the (message
size, time) points a benchmark publishes, by least squares on the relative error so the small
messages (where alpha shows) weigh as much as the large ones. Where the points do not pin the slope
(one message size, or a slope that is not positive because the larger message ran a cheaper kernel),
the link's achievable bandwidth is taken as beta and only alpha is fit.

No point here is a DeepSeek step time or throughput: they are timings of the primitive alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class AlphaBeta:
    alpha_us: float
    bytes_per_s: float

    def us(self, nbytes: float) -> float:
        return self.alpha_us + nbytes / self.bytes_per_s * 1e6


@dataclass(frozen=True)
class Point:
    nbytes: float
    us: float


def fit(points, fallback_bytes_per_s: float) -> AlphaBeta:
    """Least squares of (alpha + bytes / beta - t) / t over the points."""
    w = [1 / p.us ** 2 for p in points]
    sw = sum(w)
    sx = sum(wi * p.nbytes for wi, p in zip(w, points))
    sxx = sum(wi * p.nbytes ** 2 for wi, p in zip(w, points))
    st = sum(wi * p.us for wi, p in zip(w, points))
    sxt = sum(wi * p.nbytes * p.us for wi, p in zip(w, points))
    det = sw * sxx - sx * sx
    if det > 0:
        slope = (sw * sxt - sx * st) / det          # µs per byte
        if slope > 0:
            return AlphaBeta(max(0.0, (st - slope * sx) / sw), 1e6 / slope)
    per_byte = 1e6 / fallback_bytes_per_s
    return AlphaBeta(max(0.0, (st - per_byte * sx) / sw), fallback_bytes_per_s)


@dataclass(frozen=True)
class ByRanks:
    """A primitive whose cost depends on how many ranks take part (an all-to-all over EP ranks):
    one fit per published group size, interpolated in log2(ranks) and held flat beyond the ends."""
    fits: tuple          # ((ranks, AlphaBeta), ...), ranks ascending

    def at(self, ranks: int) -> AlphaBeta:
        pts = self.fits
        if ranks <= pts[0][0]:
            return pts[0][1]
        for (r0, a), (r1, b) in zip(pts, pts[1:]):
            if ranks <= r1:
                t = (math.log2(ranks) - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
                return AlphaBeta(a.alpha_us + t * (b.alpha_us - a.alpha_us),
                                 1 / (1 / a.bytes_per_s + t * (1 / b.bytes_per_s - 1 / a.bytes_per_s)))
        return pts[-1][1]


def moe_imbalance(pairs: float, ranks: int) -> float:
    """Busiest EP rank's routed (token, expert) pairs over the mean, when every rank expects the same
    load (what an expert-placement balancer such as DeepSeek's EPLB aims for) and the pairs fall
    independently: each rank's count is binomial (mean m, sd sqrt(m (1 - 1/ranks))), approximated as
    normal, and the expected largest of ``ranks`` normals is Blom's (1958) plotting position
    inv_Phi((ranks - 0.375) / (ranks + 0.25)) standard deviations above the mean (within 5% of a
    Monte Carlo from ~10 pairs per rank up; below that it underestimates). A lower bound: real
    routing is also skewed in expectation."""
    if ranks <= 1 or pairs <= 0:
        return 1.0
    m = pairs / ranks
    z = NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))
    return 1.0 + z * math.sqrt(m * (1 - 1 / ranks)) / m


# NCCL's own latency model for a ring with the LL protocol over NVLink (src/graph/tuning.cc,
# ncclTopoTuneModel, constants as quoted in NVIDIA/nccl#1334): a base of 6.6 us plus 0.6 us per ring
# step; an all-gather or reduce-scatter takes n - 1 steps, an all-reduce 2 (n - 1), in one call.
NCCL_RING_LL_BASE_US, NCCL_RING_LL_STEP_US = 6.6, 0.6


def all_reduce_alpha(call_alpha_us: float, ranks: int) -> float:
    """The small-message floor of one all-reduce call over ``ranks``, from the profile's floor of one
    gather-type call (``call_alpha_us``) scaled as NCCL's ring model scales 2 (n - 1) steps against n - 1."""
    one = NCCL_RING_LL_BASE_US + (ranks - 1) * NCCL_RING_LL_STEP_US
    return call_alpha_us * (one + (ranks - 1) * NCCL_RING_LL_STEP_US) / one
