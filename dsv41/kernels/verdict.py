"""Comparing a node's value with its golden: exact for integers, booleans and other values, the
seed's per-row bounds for float tensors (RMS(err) <= 1e-6 + 0.01 RMS(ref), max|err| <= 1e-5 + 0.05
RMS(ref)). A record's own ``compare`` builds on these where equality is too strict."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

RMS_BOUND, MAX_BOUND = 0.01, 0.05


@dataclass
class Verdict:
    ok: bool = True
    exact: bool = True
    rms_ratio: float = 0.0      # worst row RMS(err) / RMS(ref)
    max_ratio: float = 0.0      # worst row max|err| / RMS(ref)
    why: str = ""

    def merge(self, other: "Verdict", where: str) -> None:
        if not other.ok and self.ok:
            self.why = f"{where}: {other.why}"
        self.ok &= other.ok
        self.exact &= other.exact
        self.rms_ratio = max(self.rms_ratio, other.rms_ratio)
        self.max_ratio = max(self.max_ratio, other.max_ratio)


def rows_verdict(actual: torch.Tensor, ref: torch.Tensor) -> Verdict:
    """The seed's per-row bounds on a float tensor (rows = leading dim)."""
    if actual.shape != ref.shape:
        return Verdict(False, False, why=f"shape {tuple(actual.shape)} != {tuple(ref.shape)}")
    if torch.equal(actual, ref):
        return Verdict()
    a = actual.double().reshape(max(1, ref.shape[0]) if ref.dim() else 1, -1)
    r = ref.double().reshape(a.shape)
    if not torch.isfinite(a).all():
        return Verdict(False, False, float("inf"), float("inf"), "non-finite values")
    err = a - r
    rms_ref = r.pow(2).mean(-1).sqrt()
    rms_err, peak = err.pow(2).mean(-1).sqrt(), err.abs().amax(-1)
    bad = (rms_err > 1e-6 + RMS_BOUND * rms_ref) | (peak > 1e-5 + MAX_BOUND * rms_ref)
    scale = rms_ref.clamp_min(1e-30)
    v = Verdict(not bool(bad.any()), False, float((rms_err / scale).max()), float((peak / scale).max()))
    if not v.ok:
        row = int(torch.nonzero(bad)[0])
        v.why = (f"row {row}: RMS(err)/RMS(ref) = {float(rms_err[row] / scale[row]):.3g}, "
                 f"max|err|/RMS(ref) = {float(peak[row] / scale[row]):.3g}")
    return v


def compare(actual, ref) -> Verdict:
    """Walk two node values of the same structure."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return Verdict(False, False, why=f"{type(actual).__name__} where a tensor was expected")
        if ref.is_floating_point():
            return rows_verdict(actual.float() if actual.dtype != ref.dtype else actual, ref)
        same = actual.shape == ref.shape and torch.equal(actual, ref)
        return Verdict(same, same, why="" if same else "integer/boolean values differ")
    if isinstance(ref, (tuple, list)):
        v = Verdict()
        if not isinstance(actual, (tuple, list)) or len(actual) != len(ref):
            return Verdict(False, False, why="structure differs")
        for i, (a, r) in enumerate(zip(actual, ref)):
            v.merge(compare(a, r), f"[{i}]")
        return v
    if isinstance(ref, dict):
        if not isinstance(actual, dict) or set(actual) != set(ref):
            return Verdict(False, False, why="keys differ")
        v = Verdict()
        for k in ref:
            v.merge(compare(actual[k], ref[k]), f"[{k!r}]")
        return v
    if dataclasses.is_dataclass(ref) and not isinstance(ref, type):
        if type(actual) is not type(ref):
            return Verdict(False, False, why="type differs")
        return compare(vars(actual), vars(ref))
    try:
        same = actual is ref or bool(actual == ref)
    except (RuntimeError, TypeError, ValueError):   # objects holding tensors: not a node value to compare
        same = actual is ref
    return Verdict(bool(same), bool(same), why="" if same else "values differ")
