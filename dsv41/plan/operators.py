"""Per-operator device profiles: measured operator latencies by shape, a source per measurement, and
the form fitted between the measured shapes.

A profile's ``operators`` maps a graph node kind (``kernels.kinds.KINDS``) to an ``Operator``: the
points measured for it (each the time of ``calls`` nodes of that kind at one shape and format, with
the bytes, FLOPs and decoded weight values the plan gives those nodes, and where the time comes
from) and the fit through them, per node

    us = fixed_us + bytes / bytes_per_s + flops / flops_per_s + weight values x value_ns

(additive: a kernel group whose fixed part, streaming and arithmetic do not hide each other, which
is what a measured point at a small shape shows: its time is mostly the fixed part). The terms are
fitted by non-negative least squares on the relative error over the points. A term the points do not
pin (fewer points than terms, or a feature that does not vary) takes the profile's roofline rate
for it (HBM bandwidth and FLOP rate at the kind's achievable fractions), so one measured point fixes
the fixed part at that shape and the roofline extrapolates from it, the way ``primitives.fit`` falls
back to the link's bandwidth.

A node kind without an entry is priced by the roofline (``latency.body_us``) and reported as
unmeasured (``coverage``; ``--plan --explain``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

FORM = "fixed_us + bytes / bytes_per_s + flops / flops_per_s + weight values x value_ns"
TERMS = ("calls", "bytes", "flops", "values")


@dataclass(frozen=True)
class Point:
    """One measurement: ``us`` for ``calls`` nodes of the kind, which the plan says move ``bytes``,
    compute ``flops`` and decode ``values`` weight values, at the shape ``shape`` names."""
    calls: float
    bytes: float
    flops: float
    values: float
    us: float
    shape: str
    source: str

    def features(self) -> tuple[float, ...]:
        return (self.calls, self.bytes, self.flops, self.values)


@dataclass(frozen=True)
class Operator:
    """A node kind's fitted latency (per node) and the points it is fitted on."""
    kind: str
    fixed_us: float
    us_per_byte: float
    us_per_flop: float
    us_per_value: float
    points: tuple
    pinned: tuple        # the terms the points pinned; the rest are the profile's roofline rates

    def us(self, nbytes: float, flops: float, values: float, load: float = 1.0) -> tuple[float, str]:
        """A node's time and what bounds its variable part; ``load`` scales its FLOPs (the busiest EP
        rank's share of routed pairs, as ``latency.body_us``)."""
        memory = nbytes * self.us_per_byte
        compute = load * flops * self.us_per_flop + values * self.us_per_value
        return self.fixed_us + memory + compute, ("compute" if compute > memory else "memory")

    @property
    def source(self) -> str:
        return "; ".join(dict.fromkeys(p.source for p in self.points))


def fit(kind: str, points, roofline: tuple[float, float, float]) -> Operator:
    """The operator through ``points``; ``roofline``: (µs per byte, per FLOP, per weight value) the
    profile's roofline prices, for the terms the points do not pin."""
    if not points:
        raise ValueError(f"operators.{kind}: needs at least one measured point")
    x = np.array([p.features() for p in points], dtype=float)
    t = np.array([p.us for p in points], dtype=float)
    # a term is pinned when its feature varies across the points independently of the fixed part
    free = [0] + [j for j in (1, 2, 3) if np.ptp(x[:, j] / x[:, 0]) > 1e-9 * max(1.0, np.abs(x[:, j]).max())]
    free = free[:len(points)]
    coef = np.array([0.0, *roofline])
    held = [j for j in range(4) if j not in free]
    rest = t - x[:, held] @ coef[held]
    coef[free] = _nnls_relative(x[:, free], rest, t)
    return Operator(kind, float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), tuple(points),
                    tuple(TERMS[j] for j in free))


def _nnls_relative(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin over c >= 0 of sum(((a c - b) / t)^2), by trying every set of active columns (at most four)."""
    w = a / t[:, None]
    r = b / t
    best, best_err = np.zeros(a.shape[1]), float(r @ r)
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            c, *_ = np.linalg.lstsq(w[:, cols], r, rcond=None)
            if (c < 0).any():
                continue
            full = np.zeros(a.shape[1])
            full[list(cols)] = c
            err = float(np.sum((w @ full - r) ** 2))
            if err < best_err - 1e-15:
                best, best_err = full, err
    return best


def roofline_rates(dev, klass: str) -> tuple[float, float, float]:
    """(µs per byte, per FLOP at the ``mx`` rate, per decoded weight value) of the profile's roofline for
    a node kind's latency class: what a term the points do not pin takes."""
    bw_frac, rate_frac = dev.efficiency[klass]
    per_value = max(dev.weight_use_ns.values(), default=0.0) * 1e-3
    return 1e6 / (dev.hbm_bytes_per_s * bw_frac), 1e6 / (dev.flops_per_s["mx"] * rate_frac), per_value


def fit_all(raw: dict, dev_without_operators) -> dict[str, Operator]:
    """Node kind -> Operator from {kind: [Point, ...]}, each fitted against the profile's roofline."""
    from dsv41.kernels.kinds import KINDS
    return {kind: fit(kind, pts, roofline_rates(dev_without_operators, KINDS[kind].latency))
            for kind, pts in sorted(raw.items())}


def coverage(kernels, dev) -> dict[str, str]:
    """Node kind -> where its time comes from: the measured entry's source, or ``unmeasured`` (the
    roofline fallback)."""
    ops = dev.operators
    return {k: (f"measured: {ops[k].source}" if k in ops else "unmeasured: roofline fallback")
            for k in sorted(set(kernels))}
