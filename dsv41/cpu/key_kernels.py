"""Compiled passes over cached keys for the indexer and the attention leaf.

Keys are read from their cache bytes once per query block and decoded by one lookup per byte into
``kv_cache.value_table`` (the BF16 values ``kv_cache.read`` gives): the attention leaf's to FP64, the
indexer's to FP32 (its table's FP32 copy) with the bounds that prove its FP32 dots exact, and the
indexer's per-score arithmetic after its dot runs in one pass over the block. The contractions
themselves stay Torch's (an FP64 one with the same shapes, so the same summation order and bits, as
before), and so do the leaf's exponentials: Torch's ``exp`` is not the C library's, bit for bit. BF16
roundings here are round-to-nearest-even on the FP32 bits, as Torch does them.

Compiled once per machine (``cache=True``), without the GIL so a threaded executor's cards run
these at once; no ``parallel=True`` (numba's workqueue layer aborts under concurrent callers).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

NEG_INF = -np.inf


@njit(cache=True, nogil=True, inline="always")
def _bf16_bits(bits):
    """FP32 bits -> the bits of the BF16 value nearest (ties to even), as an FP32 pattern; NaN stays NaN."""
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint32(0x7FC00000)
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


@njit(cache=True, nogil=True)
def round_bf16_inplace(x):
    """Round an FP32 array to BF16 values in place (``ops.quant.round_bf16``)."""
    bits = x.view(np.uint32)
    for i in range(bits.shape[0]):
        bits[i] = _bf16_bits(bits[i])


@njit(cache=True, nogil=True, inline="always")
def _decode_fp4_row(payload, scale, r, table, group, out):
    """Packed E2M1 row r (element 2i in byte i's low nibble) with one scale byte per ``group``
    elements -> out, by ``kv_cache.value_table`` (scale byte, payload byte) -> the two values."""
    half = group // 2
    for g in range(scale.shape[1]):
        tab = table[scale[r, g]]
        for i in range(half):
            b = payload[r, g * half + i]
            out[g * group + 2 * i] = tab[b, 0]
            out[g * group + 2 * i + 1] = tab[b, 1]


ZERO_LOW = 1 << 20     # a zero's "lowest set bit": above every value's, so a minimum over values skips it


@njit(cache=True, nogil=True, inline="always")
def _low_bit(bits):
    """e with the FP32 value of ``bits`` an odd integer times 2^e (nonzero, finite values)."""
    mantissa = bits & np.uint32(0x7FFFFF)
    field = np.int64((bits >> np.uint32(23)) & np.uint32(0xFF))
    if field == 0:
        return np.int64(-149) + np.int64(trailing_zeros(mantissa))
    return field - 150 + np.int64(trailing_zeros(mantissa | np.uint32(0x800000)))


@njit(cache=True, nogil=True, inline="always")
def _bound(magnitude_sum, low):
    """The sum in units of 2^low, inf if not finite (an inf or NaN operand: never provably exact)."""
    v = np.ldexp(magnitude_sum, -low)
    return v if np.isfinite(v) else np.inf


@njit(cache=True, nogil=True)
def query_bounds(q, low, high, size):
    """Per query row t of q FP32 [T, H, d]: over its heads with a nonzero element, the least and the
    greatest Lq (the least exponent of a lowest set bit over the head's elements: each element is an
    integer times 2^Lq) into low[t], high[t], and the greatest sum of |q| in units of 2^Lq into size[t]
    (exact below 2^53, and monotone above, so a comparison with 2^24 is exact). A row of zeros: ZERO_LOW,
    -ZERO_LOW, 0."""
    bits = q.view(np.uint32)
    for t in range(q.shape[0]):
        low[t], high[t], size[t] = ZERO_LOW, -ZERO_LOW, 0.0
        for h in range(q.shape[1]):
            lq = ZERO_LOW
            total = 0.0
            for i in range(q.shape[2]):
                if bits[t, h, i] & np.uint32(0x7FFFFFFF):
                    lq = min(lq, _low_bit(bits[t, h, i]))
                    total += abs(np.float64(q[t, h, i]))
            if lq < ZERO_LOW:
                low[t] = min(low[t], lq)
                high[t] = max(high[t], lq)
                size[t] = max(size[t], _bound(total, lq))


@njit(cache=True, nogil=True)
def _code_bounds(values, lows, mags):
    """lows[s, o], mags[s, o]: the least lowest-set-bit exponent and the greatest magnitude of the values
    under scale byte s of the nonzero E2M1 magnitude codes c within the bits of o (c & ~o == 0, sign
    either way), read off ``values`` (byte c decodes its low nibble, code c, first). Zeros: ZERO_LOW and
    0; inf or NaN: magnitude inf."""
    bits = values.view(np.uint32)
    for s in range(values.shape[0]):
        for o in range(8):
            lows[s, o], mags[s, o] = ZERO_LOW, 0.0
            for c in range(1, 8):
                if c & ~o == 0:
                    for code in (c, c | 8):
                        b = bits[s, code, 0]
                        if b & np.uint32(0x7FFFFFFF):
                            lows[s, o] = min(lows[s, o], _low_bit(b))
                            v = abs(np.float64(values[s, code, 0]))
                            mags[s, o] = max(mags[s, o], v if np.isfinite(v) else np.inf)


def index_key_tables(value_table):
    """The index format's ``kv_cache.value_table`` (FP64) -> what ``decode_index_rows`` looks up: the
    values in FP32 (BF16 values: exact) and ``_code_bounds``'s two tables."""
    values = np.ascontiguousarray(value_table, dtype=np.float32)
    lows = np.empty((values.shape[0], 8), np.int64)
    mags = np.empty((values.shape[0], 8), np.float64)
    _code_bounds(values, lows, mags)
    return values, lows, mags


@njit(cache=True, nogil=True)
def decode_index_rows(payload, scale, rows, values, lows, mags, group, out, low, size):
    """out[t, j] = the index key at cache row rows[t, j] as ``kv_cache.read`` gives it (BF16 values),
    in FP32; zeros where rows[t, j] < 0. low[t, j] = a lower bound on its Lk (each nonzero element is
    an integer times 2^Lk; ZERO_LOW for a zero key) and size[t, j] an upper bound on its greatest
    magnitude in units of 2^low[t, j] (inf if an element is inf or NaN; 0 for a zero key).

    payload u8 [R, d/2], scale u8 [R, d/group], rows i64 [T, n], the tables of ``index_key_tables``,
    out FP32 [T, n, d], low i64 [T, n], size FP64 [T, n]. A group's bounds are those of every code
    within the OR of its magnitude codes (a superset of the codes it holds): an OR of its bytes, 8 at a
    time (group a multiple of 16). A lookup a byte for the exact set nearly doubled the decode's time;
    on drawn keys the looser bound raised a block's greatest size from about 2^5 to 2^5.6, far below
    what the 2^24 check leaves. A row the previous query row also read (a prefill's rows of one
    request) is copied, not decoded again. A byte's two FP32 values are one 64-bit word of the table
    (low nibble first), moved by one load and one store (16% faster than two of each, Zen 3)."""
    t_rows, n = rows.shape
    words, per = payload.view(np.uint64), group // 16        # a group's bytes as 64-bit words
    pairs = values.reshape(-1).view(np.uint64)               # [scale byte * 256 + payload byte]
    out_pairs = out.reshape(t_rows, n, -1).view(np.uint64)
    half = group // 2
    for t in range(t_rows):
        for j in range(n):
            r = rows[t, j]
            if r < 0:
                out[t, j, :] = 0.0
                low[t, j], size[t, j] = ZERO_LOW, 0.0
            elif t and rows[t - 1, j] == r:
                out[t, j, :] = out[t - 1, j, :]
                low[t, j], size[t, j] = low[t - 1, j], size[t - 1, j]
            else:
                lk = ZERO_LOW
                top = 0.0
                for g in range(scale.shape[1]):
                    s = np.int64(scale[r, g])
                    for i in range(g * half, (g + 1) * half):
                        out_pairs[t, j, i] = pairs[(s << 8) + payload[r, i]]
                    o = np.uint64(0)
                    for i in range(g * per, (g + 1) * per):
                        o |= words[r, i]
                    o |= o >> np.uint64(32)
                    o |= o >> np.uint64(16)
                    o |= o >> np.uint64(8)
                    o = (o | o >> np.uint64(4)) & np.uint64(7)
                    lk = min(lk, lows[s, o])
                    top = max(top, mags[s, o])
                low[t, j], size[t, j] = lk, _bound(top, lk) if lk < ZERO_LOW else 0.0


@njit(cache=True, nogil=True)
def exact_rows(q_low, q_high, q_size, low, size, out):
    """out[t]: whether query row t's bounds (``query_bounds``) and the block's keys' (``low``, ``size``
    [T, n] of ``decode_index_rows``) prove every dot exact in FP32: max SA * max BM < 2^24, min Lq +
    min Lk >= -149, max Lq + max Lk (over nonzero keys) + 24 <= 127 (``indexer._exact_rows``). One
    pass, where the same as Torch ops took about 40 us a block."""
    for t in range(low.shape[0]):
        k_min, k_max, s_max = ZERO_LOW, -ZERO_LOW, 0.0
        for j in range(low.shape[1]):
            k_min = min(k_min, low[t, j])
            if low[t, j] < ZERO_LOW:
                k_max = max(k_max, low[t, j])
            s_max = max(s_max, size[t, j])
        out[t] = q_size[t] * s_max < 2.0 ** 24 and q_low[t] + k_min >= -149 and q_high[t] + k_max + 24 <= 127


@njit(cache=True, nogil=True)
def index_score_epilogue(dots, w, rows, out):
    """out[t, j] = bf16(sum_h bf16(relu(bf16(dots[t, h, j])) * w[t, h])), the head sum in FP64 over
    ascending heads; -inf where rows[t, j] < 0. dots FP64 or FP32 [T, H, n] (compiled for each; the
    first step's FP32 rounding is then the identity), w FP32 [T, H], out FP32 [T, n]. The sum starts at
    +0.0, so a zero dot's sign never reaches the score."""
    t_rows, h_n, n = dots.shape
    f = np.empty(n, np.float32)
    s = np.empty(n, np.float64)
    for t in range(t_rows):
        s[:] = 0.0
        for h in range(h_n):
            wh = w[t, h]
            for j in range(n):
                f[j] = np.float32(dots[t, h, j])
            round_bf16_inplace(f)
            for j in range(n):
                v = f[j]
                if v < 0:
                    v = np.float32(0.0)
                f[j] = v * wh
            round_bf16_inplace(f)
            for j in range(n):
                s[j] += np.float64(f[j])
        for j in range(n):
            f[j] = np.float32(s[j])
        round_bf16_inplace(f)
        for j in range(n):
            out[t, j] = f[j] if rows[t, j] >= 0 else NEG_INF


@njit(cache=True, nogil=True)
def decode_slot_rows(win_payload, win_scale, cmp_payload, cmp_scale, rows, compressed, win_table, cmp_table,
                     win_group, cmp_group, out):
    """out[t, j] = the attention key of slot j of row t as ``kv_cache.read`` gives it (BF16 values), in
    FP64; zeros where rows[t, j] < 0: a window row (E4M3 bytes, an E8M0 scale per ``win_group``) or,
    where compressed[t, j], a compressed row (packed E2M1, an E4M3 scale per ``cmp_group``).

    The FP8 parts come as their bytes; win_table FP64 [256, 256] and cmp_table FP64 [256, 256, 2] are
    the formats' ``kv_cache.value_table``; out FP64 [T, n, d]."""
    t_rows, n = rows.shape
    d = out.shape[2]
    for t in range(t_rows):
        for j in range(n):
            r = rows[t, j]
            if r < 0:
                out[t, j, :] = 0.0
            elif compressed[t, j]:
                _decode_fp4_row(cmp_payload, cmp_scale, r, cmp_table, cmp_group, out[t, j])
            else:
                for g in range(d // win_group):
                    tab = win_table[win_scale[r, g]]
                    for i in range(g * win_group, (g + 1) * win_group):
                        out[t, j, i] = tab[win_payload[r, i]]
