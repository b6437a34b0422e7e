"""Independent reference arithmetic for the tests, written from the spec (not from dsv41.ops).

Everything here works in float64 with explicit rounding rules, so a test that compares an op against
these helpers checks the op's arithmetic rather than re-running the op's own code.
"""
from __future__ import annotations

import math

import torch

FP4_LEVELS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def bf16_64(x: torch.Tensor) -> torch.Tensor:
    """Exact round-to-nearest-even to 8 significant bits (BF16) of float64 values, kept float64."""
    x = x.double()
    m, e = torch.frexp(x)                      # x = m * 2^e, |m| in [0.5, 1)
    return torch.ldexp(torch.round(m * 256.0), e - 8)   # torch.round: ties to even


def is_bf16(x: torch.Tensor) -> bool:
    return torch.equal(x.double(), bf16_64(x))


def e4m3_64(x: torch.Tensor) -> torch.Tensor:
    """RNE to float8 e4m3fn (3 mantissa bits, min normal 2^-6, step 2^-9 below), saturating at 448."""
    x = x.double().clamp(-448.0, 448.0)
    a = x.abs()
    _, e = torch.frexp(a)                      # leading bit is 2^(e-1)
    q = torch.ldexp(torch.ones_like(a), (e - 1).clamp_min(-6) - 3)
    return torch.copysign(torch.round(a / q) * q, x)


def ceil_log2_exact(v: float) -> int:
    """ceil(log2(v)) for a positive float, exact (frexp on the double)."""
    m, e = math.frexp(v)
    return e - 1 if m == 0.5 else e


def mxfp8_qdq_64(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Spec 02 §2 / 03 §4.3: per group s = 2^ceil(log2(max(amax,1e-4)/448)), e4m3(clamp(v/s)) * s."""
    x = x.double()
    g = x.reshape(*x.shape[:-1], -1, group)
    amax = g.abs().amax(-1).clamp_min(1e-4)
    exps = torch.tensor([ceil_log2_exact(float(a) / 448.0) for a in amax.flatten()],
                        dtype=torch.float64).reshape(amax.shape)
    s = torch.pow(2.0, exps).unsqueeze(-1)
    return (e4m3_64(g / s) * s).reshape(x.shape)


def mx_linear_64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """MXLinear: x rounded to BF16, MXFP8 quantize-dequantize per 32-group, times W^T (exact, float64)."""
    return mxfp8_qdq_64(bf16_64(x)) @ w.double().t()


def fp4_code_ref(v: float) -> int:
    """E2M1 code of v already in [-6, 6]: nearest level, midpoint ties to the even code; bit 3 = sign."""
    a = abs(v)
    best = min(range(8), key=lambda i: (abs(FP4_LEVELS[i] - a), i % 2))
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    return best | sign


def fp4_value_ref(code: int) -> float:
    mag = FP4_LEVELS[code & 7]
    return -mag if code & 8 else mag


def rms_norm_64(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-20) -> torch.Tensor:
    x = x.double()
    return bf16_64(x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double())


def assert_rows_close(actual: torch.Tensor, ref: torch.Tensor, what: str = "rows"):
    """Seed acceptance per row (leading dim): RMS(err) <= 1e-6 + 0.01 RMS(ref) and
    max|err| <= 1e-5 + 0.05 RMS(ref); non-finite fails; no averaging across rows."""
    a = actual.double().reshape(actual.shape[0], -1)
    r = ref.double().reshape(ref.shape[0], -1)
    assert a.shape == r.shape, (a.shape, r.shape)
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = a - r
    rms_ref = r.pow(2).mean(-1).sqrt()
    rms_err = err.pow(2).mean(-1).sqrt()
    peak = err.abs().amax(-1)
    bad_rms = rms_err > 1e-6 + 0.01 * rms_ref
    bad_peak = peak > 1e-5 + 0.05 * rms_ref
    bad = torch.nonzero(bad_rms | bad_peak).flatten().tolist()
    assert not bad, (f"{what}: rows {bad[:8]} out of bounds; rms_err/rms_ref="
                     f"{(rms_err / rms_ref.clamp_min(1e-30))[bad[:8]].tolist()}, "
                     f"peak/rms_ref={(peak / rms_ref.clamp_min(1e-30))[bad[:8]].tolist()}")


def bf16_ulp_close(actual: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0, floor: float = 0.0):
    """|a - r| <= ulps * ulp_bf16(|r|) (+ floor): allows a one-step BF16 rounding flip between an FP32
    computation and the exact float64 one."""
    r = ref.double()
    _, e = torch.frexp(r.abs())
    ulp = torch.ldexp(torch.ones_like(r), e - 8)
    diff = (actual.double() - r).abs()
    ok = diff <= ulps * ulp + floor
    assert ok.all(), f"max excess {(diff - ulps * ulp - floor).max().item()} at {torch.nonzero(~ok)[:4].tolist()}"
