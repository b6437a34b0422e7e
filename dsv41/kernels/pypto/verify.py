"""Functional check: pypto's output values (pass-verify calculator on the tensor graph) vs the Torch golden.

The values come from pypto's torch-based interpreter of the kernel's op graph, not from an AICore
emulation: this checks the kernel's math and layout, not device rounding.
"""
from __future__ import annotations

import time

import torch

from dsv41.kernels.verdict import rows_verdict
from dsv41.kernels.pypto.specs import PYPTO_KERNELS
from dsv41.kernels.pypto.sim import worker


def row_check(actual: torch.Tensor, ref: torch.Tensor) -> dict:
    """DESIGN §7 acceptance per row (``check.rows_verdict``: the bounds --check applies), with the
    largest absolute error and the fraction of exact elements."""
    a, r = actual.float(), ref.float()
    v = rows_verdict(a.reshape(r.shape), r)
    diff = (a.reshape(r.shape) - r).abs()
    return {"ok": v.ok, "max_abs": float(diff.max()) if diff.numel() else 0.0, "worst_rms_ratio": v.rms_ratio,
            "exact_frac": float((diff == 0).float().mean()) if diff.numel() else 1.0}


def verify_kernel(kernel: str, inputs: dict | None = None, *, shapes: dict | None = None, dtypes=None,
                  seed: int = 0, mode: str = "verify") -> dict:
    """Run ``kernel`` through pypto and compare every output with the Torch golden.

    mode "verify": SIM with the pass-verify calculator (CPU); "npu": the real device (needs torch_npu).

    inputs: tensors by argument name, natural or layout shapes (None: seeded random inputs at
    ``shapes`` or the spec's small example shapes). Returns {kernel, shapes, ok, outputs: {name:
    row_check}, error, wall_s}; ok is False with ``error`` set when pypto failed.
    """
    spec = PYPTO_KERNELS[kernel]
    if inputs is None:
        shapes = shapes or spec.example
        inputs = spec.random_inputs(shapes, dtypes, seed)
    elif shapes is None:
        shapes = spec.infer(inputs)
    s, d = spec.normalize(shapes, dtypes)
    args = spec.to_layout(inputs, s, d)
    layout = spec.args(s, d)
    named = {a.name: t for a, t in zip(layout, args) if a.kind != "out"}
    golden = spec.golden(named, s, d)
    t0 = time.perf_counter()
    if mode not in ("verify", "npu"):
        raise ValueError(f"mode: must be 'verify' or 'npu', got {mode!r}")
    reply = worker(mode).run(kernel, s, d, args)
    result = {"kernel": kernel, "shapes": s, "dtypes": d, "ok": False, "outputs": {}, "error": None,
              "wall_s": round(time.perf_counter() - t0, 3)}
    if not reply.get("ok"):
        result["error"] = reply.get("error", "unknown failure")
        return result
    result["outputs"] = {name: row_check(reply["outputs"][name], ref) for name, ref in golden.items()}
    result["ok"] = all(o["ok"] for o in result["outputs"].values())
    return result
