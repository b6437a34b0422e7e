"""A compiled product for weights in their checkpoint formats: each weight value is decoded in a
register and multiplied with every activation row while its bytes are in cache, so a decode step
reads each weight byte once from memory and never writes a decoded value.

A value decodes by integer arithmetic alone, which the compiler vectorises (a table lookup per
value does not): its significand with the implicit one, times a power of two whose exponent folds
the value's own exponent, the block's E8M0 scale and its sign, built as FP64 bits. Every decoded
value is exact in FP64 (at most 4 significant bits), so it is ``ops.quant``'s decoded value wherever
that decoder's FP32 product is exact; ``PackedMatrix`` sends the rest (scales that overflow FP32,
NaN codes) to the table decoders.

Each output is an FP64 sum over K of exact FP64 products (FP8 or FP4 times an MXFP8 activation has
at most 8 significant bits, BF16 or FP32 times FP32 at most 48), in an order the compiler fixes for
the row length K and the CPU's vector width. Rows are taken ``GROUP`` at a time (a short batch
padded with zero rows), so every row runs the same instructions: a row's result does not depend on
how many rows, cards or threads share the call.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

FP8, FP4, BF16, F32 = 0, 1, 2, 3
GROUP = 4          # activation rows per pass over a weight row: one decode feeds four sums


@intrinsic
def _as_f64(typingctx, bits):
    """The FP64 whose bits are the int64 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))
    return types.float64(types.int64), codegen


@intrinsic
def _as_f32(typingctx, bits):
    """The FP32 whose bits are the int32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


@njit(nogil=True)
def _e2m1(c, s):
    """E2M1 code c (sign in bit 3) x 2^(s-127) = mant * 2^(max(e,1) - 2 + s - 127), exact in FP64."""
    e = (c >> 1) & 3
    mant = (c & 1) | (np.int64(e != 0) << 1)
    return np.float64(mant) * _as_f64(((max(e, np.int64(1)) + s + 894) << 52) | ((c & 8) << 60))


@njit(nogil=True)
def _value(fmt, prow, srow, j):
    """Weight value j of one row, exact in FP64."""
    if fmt == FP8:        # E4M3 x 2^(s-127) = mant * 2^(max(e,1) - 10 + s - 127)
        b = np.int64(prow[j])
        e = (b >> 3) & 15
        mant = (b & 7) | (np.int64(e != 0) << 3)
        return np.float64(mant) * _as_f64(((max(e, np.int64(1)) + np.int64(srow[j >> 5]) + 886) << 52)
                                          | ((b & 128) << 56))
    if fmt == BF16:
        return np.float64(_as_f32(np.int32(np.int64(prow[j]) << 16)))
    return np.float64(prow[j])


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def product_rows(fmt, payload, scale, scale_div, x, out, r0, r1):
    """out[:, n] = x @ w[n] for weight rows n in [r0, r1): payload [N, *] the row's stored values
    (u8 E4M3 bytes, u8 packed E2M1 pairs, u16 BF16 bits or FP32), scale u8 [N / scale_div, K/32]
    E8M0 codes (unused for BF16/FP32); x FP64 [M, K] with M a multiple of GROUP (for FP4 its even
    columns, then its odd ones: ``even_odd``); out FP64 [M, N]."""
    m, k = x.shape
    for n in range(r0, r1):
        # a column slice's rows are strided: one contiguous row lets the loops below vectorise
        prow, srow = np.ascontiguousarray(payload[n]), np.ascontiguousarray(scale[n // scale_div])
        for g in range(0, m, GROUP):
            x0, x1, x2, x3 = x[g], x[g + 1], x[g + 2], x[g + 3]
            c0 = c1 = c2 = c3 = 0.0
            if fmt == FP4:     # byte i holds columns 2i (low nibble) and 2i + 1: x comes split (even_odd)
                h = k >> 1
                for i in range(h):
                    b, s = np.int64(prow[i]), np.int64(srow[i >> 4])
                    lo, hi = _e2m1(b & 15, s), _e2m1(b >> 4, s)
                    c0 += x0[i] * lo + x0[h + i] * hi
                    c1 += x1[i] * lo + x1[h + i] * hi
                    c2 += x2[i] * lo + x2[h + i] * hi
                    c3 += x3[i] * lo + x3[h + i] * hi
            else:
                for j in range(k):
                    w = _value(fmt, prow, srow, j)
                    c0 += x0[j] * w
                    c1 += x1[j] * w
                    c2 += x2[j] * w
                    c3 += x3[j] * w
            out[g, n], out[g + 1, n], out[g + 2, n], out[g + 3, n] = c0, c1, c2, c3


def even_odd(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the FP4 loop reads it: columns 0, 2, 4, ... then 1, 3, 5, ... (contiguous loads for
    the two nibbles of each byte)."""
    return np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)
