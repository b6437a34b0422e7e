"""The MXFP8 activation fake-quantization (``ops.quant.mxfp8_qdq``) as one compiled pass a group of
32 values: the same FP32 operations as the Torch ops it replaced (amax, the floor, the multiply by
FP32 1/448, the power-of-two ceiling on the bits, the division, the clamp to +-448, E4M3's
round-to-nearest-even, the multiply back), so the same bits, NaN and infinities included
(``tests/test_quant.py``). Those ops made about ten passes over the values; this pass takes a
half to a third of the time of the same rule as Torch ops (``python bench/activation_quant.py``).

Compiled once per machine (``cache=True``), without the GIL, no ``parallel=True`` (see
``cpu.key_kernels``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

_E4M3_MAX = np.float32(448.0)
_SUBNORMAL_ROUND = np.float32(16384.0)        # 2^14: its FP32 ulp is 2^-9, E4M3's subnormal step
_MIN_NORMAL_BITS = np.uint32(0x3C800000)      # 2^-6, E4M3's smallest normal, as FP32 bits
_SIGN, _MAGNITUDE, _INF = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)


@njit(cache=True, nogil=True, inline="always")
def _pow2_ceil_bits(bits):
    """The bits of 2^ceil(log2(v)) for a positive normal FP32 v whose result is normal (``quant.pow2_ceil``):
    adding 2^23 - 1 carries into the exponent exactly when the significand is not zero."""
    return (bits + np.uint32(0x7FFFFF)) & _INF


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
            scale_bits[0] = _pow2_ceil_bits(scale_bits[0])
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


@njit(cache=True, nogil=True, inline="always")
def _e4m3_byte(bits, value):
    """The float8_e4m3fn byte of a finite FP32 of magnitude at most 448 (``bits`` its bits): round to
    nearest, ties to even, as Torch's cast; a zero keeps its sign."""
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    mag = bits & _MAGNITUDE
    if mag >= _MIN_NORMAL_BITS:
        r = (mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
        exponent = (r >> np.uint32(23)) - np.uint32(120)          # FP32's bias 127, E4M3's 7
        return np.uint8(sign | (exponent << np.uint32(3)) | ((r >> np.uint32(20)) & np.uint32(7)))
    steps = ((abs(value) + _SUBNORMAL_ROUND) - _SUBNORMAL_ROUND) * np.float32(512.0)     # of 2^-9
    return np.uint8(sign | np.uint32(steps))


@njit(cache=True, nogil=True, inline="always")
def _scratch(n):
    """n quotients and one scale in FP32, with views of their bits (the kernels round on the bits)."""
    q, v = np.empty(n, np.float32), np.empty(1, np.float32)
    return q, q.view(np.uint32), v, v.view(np.uint32)


@njit(cache=True, nogil=True)
def fp8_blocks(w, payload, scale, rows, cols, floor, inv_max):
    """payload [N, K] (E4M3 bytes) and scale [N / rows, K / cols] (E8M0 codes) of FP32 w [N, K] in
    blocks of rows x cols, by ``ops.quant``'s rule: the scale 2^ceil(log2(max(amax, floor) x
    inv_max)) (its bits rounded up to a power of two: exact for these normal values), each value
    divided by it, clamped to +-448 and rounded to E4M3. False, as soon as a block holds a
    non-finite value (whose Torch result the caller takes instead)."""
    bits = w.view(np.uint32)
    q, q_bits, v, v_bits = _scratch(cols)
    for bi in range(w.shape[0] // rows):
        for bj in range(w.shape[1] // cols):
            c0 = bj * cols
            top = np.uint32(0)
            for r in range(bi * rows, bi * rows + rows):
                for c in range(c0, c0 + cols):
                    top = max(top, bits[r, c] & _MAGNITUDE)
            if top >= _INF:
                return False
            v_bits[0] = top
            v[0] = max(v[0], floor) * inv_max
            v_bits[0] = _pow2_ceil_bits(v_bits[0])
            s = v[0]
            scale[bi, bj] = np.uint8(v_bits[0] >> np.uint32(23))
            for r in range(bi * rows, bi * rows + rows):
                for c in range(cols):
                    q[c] = min(max(w[r, c0 + c] / s, -_E4M3_MAX), _E4M3_MAX)
                for c in range(cols):
                    payload[r, c0 + c] = _e4m3_byte(q_bits[c], q[c])
    return True


_FP4_MAX = np.float32(6.0)


@njit(cache=True, nogil=True, inline="always")
def _fp4_code(bits, value):
    """The E2M1 code of an FP32 in [-6, 6]: the midpoints below |value| counted, a tie counting only
    on an odd midpoint (so it lands on the even code); the sign bit as bit 3 (-0 included)."""
    a = abs(value)
    code = (np.uint8(a > np.float32(0.25)) + np.uint8(a >= np.float32(0.75)) + np.uint8(a > np.float32(1.25))
            + np.uint8(a >= np.float32(1.75)) + np.uint8(a > np.float32(2.5)) + np.uint8(a >= np.float32(3.5))
            + np.uint8(a > np.float32(5.0)))
    return np.uint8(code | ((bits >> np.uint32(31)) << np.uint32(3)))


@njit(cache=True, nogil=True)
def fp4_groups(x, payload, scale, group, e4m3_scale, floor, e4m3_values):
    """Packed E2M1 payload [R, C / 2] (element 2j in the low nibble) and scale [R, C / group] of FP32
    x [R, C] in groups of ``group`` along a row, by ``ops.quant.mxfp4_encode``'s rule: with E8M0
    scales (``e4m3_scale`` False) 2^ceil(log2(max(amax, floor) / 6)); with E4M3 scales the E4M3
    rounding of max(amax / 6, floor) (``e4m3_values`` the FP32 value of each byte). Each value is
    divided by the scale, clamped to +-6 and rounded to E2M1. False, as soon as a group holds a
    non-finite value (whose Torch result the caller takes instead)."""
    bits = x.view(np.uint32)
    q, q_bits, v, v_bits = _scratch(group)
    for r in range(x.shape[0]):
        for g in range(x.shape[1] // group):
            c0 = g * group
            top = np.uint32(0)
            for c in range(c0, c0 + group):
                top = max(top, bits[r, c] & _MAGNITUDE)
            if top >= _INF:
                return False
            v_bits[0] = top
            if e4m3_scale:
                v[0] = min(max(v[0] / _FP4_MAX, floor), _E4M3_MAX)
                code = _e4m3_byte(v_bits[0], v[0])
                s = e4m3_values[code]
            else:
                v[0] = max(v[0], floor) / _FP4_MAX
                v_bits[0] = _pow2_ceil_bits(v_bits[0])
                code = np.uint8(v_bits[0] >> np.uint32(23))
                s = v[0]
            scale[r, g] = code
            for c in range(group):
                q[c] = min(max(x[r, c0 + c] / s, -_FP4_MAX), _FP4_MAX)
            for c in range(0, group, 2):
                high = _fp4_code(q_bits[c + 1], q[c + 1])
                payload[r, (c0 + c) // 2] = _fp4_code(q_bits[c], q[c]) | (high << np.uint8(4))
    return True
