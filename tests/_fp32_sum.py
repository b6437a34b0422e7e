"""The linears' FP32 sum written independently of the kernel (docs/numerics.md, "The linears' order"):
an exact FP32 fused multiply-add from FP64 arithmetic, the order over it, and FP32 summation's error
bound."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """FP32 a * b + c rounded once (round to nearest even): the FP64 sum of the exact FP64 product and
    c, its rounding error from TwoSum deciding the FP32 rounding where the FP64 sum is a midpoint."""
    p = a.astype(np.float64) * b.astype(np.float64)          # exact: 24 + 24 bits
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    below = np.where(r.astype(np.float64) <= s, r, np.nextafter(r, np.float32(-np.inf)))
    above = np.where(r.astype(np.float64) >= s, r, np.nextafter(r, np.float32(np.inf)))
    mid = (below != above) & (s - below.astype(np.float64) == above.astype(np.float64) - s)
    return np.where(mid & (e > 0), above, np.where(mid & (e < 0), below, r))


def defined_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in the order docs/numerics.md defines: per output two 16-lane FP32 FMA
    chains over the 32-column blocks (lane j: column j, and column j + 16), the two added, the 16
    lanes summed as a tree, then the columns past the last block one by one."""
    x, w = x.float().numpy(), w.float().numpy()
    m, k = x.shape
    n = w.shape[0]
    acc = np.zeros((2, m, n, 16), np.float32)
    for b in range(k // 32):
        for h in (0, 1):
            cols = slice(32 * b + 16 * h, 32 * b + 16 * h + 16)
            acc[h] = fma32(x[:, None, cols], w[None, :, cols], acc[h])
    v = acc[0] + acc[1]
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    total = v[..., 0]
    for j in range(k // 32 * 32, k):
        total = fma32(x[:, None, j], w[None, :, j], total)
    return torch.from_numpy(total)


def within_fp32_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """|got - exact| <= gamma_n sum |x w|, n the longest chain of roundings in the order (a lane's
    FMAs, the lanes' add and tree, the tail): FP32 summation's error bound."""
    k = x.shape[1]
    n = k // 32 + 1 + 4 + k % 32 + 1
    u = 2.0 ** -24
    exact = x.double() @ w.double().t()
    bound = n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().t())
    return bool(((got.double() - exact).abs() <= bound).all())


def round32(q: Fraction) -> np.float32:
    """The exact rational q rounded to FP32, to nearest, ties to the even significand."""
    f = np.float32(float(q))
    near = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.int32)) & 1))
