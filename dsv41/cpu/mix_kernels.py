"""The mHC comb mix's Sinkhorn normalisations as one compiled pass: the same FP32 operations in the
same order as Torch's (a sum over 4 lanes runs lane 0 to lane 3, then + eps, then the division), so
the same bits (``tests/test_mhc_norm.py`` holds it to the Torch loop), without ~80 small Torch ops
per mix."""
from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def normalise(c, iters, eps):
    """In place on c FP32 [T, n, n]: one column normalisation, then iters-1 (row, column) ones; eps
    an FP32."""
    t, n, _ = c.shape
    for r in range(t):
        for it in range(iters):
            if it:
                for i in range(n):
                    s = c[r, i, 0]
                    for j in range(1, n):
                        s += c[r, i, j]
                    s += eps
                    for j in range(n):
                        c[r, i, j] /= s
            for j in range(n):
                s = c[r, 0, j]
                for i in range(1, n):
                    s += c[r, i, j]
                s += eps
                for i in range(n):
                    c[r, i, j] /= s
