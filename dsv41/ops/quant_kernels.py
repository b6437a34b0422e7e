"""The MXFP8 activation fake-quantization (``ops.quant.mxfp8_qdq``) as one compiled pass a group of
32 values: the same FP32 operations as the Torch ops it replaced (amax, the floor, the multiply by
FP32 1/448, the power-of-two ceiling on the bits, the division, the clamp to +-448, E4M3's
round-to-nearest-even, the multiply back), so the same bits, NaN and infinities included
(``tests/test_quant.py``). Those ops made about ten passes over the values; this pass takes a
half to a third of the time of the same rule as Torch ops (``python bench/activation_quant.py``).

Compiled once per machine (``cache=True``), without the GIL, no ``parallel=True`` (see
``ops.key_kernels``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

_E4M3_MAX = np.float32(448.0)
_SUBNORMAL_ROUND = np.float32(16384.0)        # 2^14: its FP32 ulp is 2^-9, E4M3's subnormal step
_MIN_NORMAL_BITS = np.uint32(0x3C800000)      # 2^-6, E4M3's smallest normal, as FP32 bits
_SIGN, _MAGNITUDE, _INF = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)


@njit(cache=True, nogil=True, error_model="numpy")      # x / 0 is IEEE, as in Torch
def mxfp8_qdq_rows(x, out, group, floor, inv_max):
    """out [R, C] = x [R, C] FP32 fake-quantized per row in groups of ``group`` columns; ``floor``
    and ``inv_max`` the FP32 amax floor and 1/448. Each step is a loop over the group the compiler
    vectorises: the amax as the largest magnitude's bits (a NaN's are above every number's, so a
    NaN is the amax, as in Torch), E4M3's rounding on the bits (3 significand bits, ties to even; a
    carry may reach the exponent, never past 448), its subnormals by adding and taking away 2^14."""
    scale = np.empty(1, np.float32)
    scale_bits = scale.view(np.uint32)
    small = np.empty(group, np.float32)
    small_bits = small.view(np.uint32)
    for r in range(x.shape[0]):
        for g0 in range(0, x.shape[1], group):
            xs, os = x[r, g0:g0 + group], out[r, g0:g0 + group]
            xb, ob = xs.view(np.uint32), os.view(np.uint32)
            top = np.uint32(0)
            for c in range(group):
                top = max(top, xb[c] & _MAGNITUDE)
            scale_bits[0] = top
            amax = max(scale[0], floor) if scale[0] == scale[0] else scale[0]
            scale[0] = amax * inv_max
            scale_bits[0] = (scale_bits[0] + np.uint32(0x7FFFFF)) & _INF
            s = scale[0]
            for c in range(group):
                v = min(max(xs[c] / s, -_E4M3_MAX), _E4M3_MAX) if xs[c] == xs[c] else xs[c]
                os[c] = v
                small[c] = (abs(v) + _SUBNORMAL_ROUND) - _SUBNORMAL_ROUND
            for c in range(group):
                b = ob[c]
                mag = b & _MAGNITUDE
                normal = (mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
                rounded = normal if mag >= _MIN_NORMAL_BITS else small_bits[c]
                ob[c] = (rounded if mag <= _INF else b) | (b & _SIGN)
            for c in range(group):
                os[c] *= s
