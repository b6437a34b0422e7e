"""Compiled passes over cached keys for the indexer and the attention leaf.

The keys are read from their cache bytes once per query block and decoded straight to FP64 (one
lookup per byte in ``kv_cache.value_table``: the values ``kv_cache.read`` gives), and the indexer's per-score arithmetic
after its FP64 dot runs in one pass over the block. The FP64 contractions themselves stay Torch's
(the same products, shapes and so summation order as before, hence the same bits), and so do the
leaf's exponentials: Torch's ``exp`` is not the C library's, bit for bit. BF16 roundings here are
round-to-nearest-even on the FP32 bits, as Torch does them.

Compiled once per machine (``cache=True``), without the GIL so a threaded executor's cards run
these at once; no ``parallel=True`` (numba's workqueue layer aborts under concurrent callers).
"""
from __future__ import annotations

import numpy as np
from numba import njit

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


@njit(cache=True, nogil=True)
def decode_index_rows(payload, scale, rows, table, group, out):
    """out[t, j] = the index key at cache row rows[t, j] as ``kv_cache.read`` gives it (BF16 values),
    in FP64; zeros where rows[t, j] < 0.

    payload u8 [R, d/2], scale u8 [R, d/group], rows i64 [T, n], table FP64 [256, 256, 2] (the INDEX
    format's ``kv_cache.value_table``), out FP64 [T, n, d]. A row the previous query row also read
    (a prefill's rows of one request) is copied, not decoded again."""
    t_rows, n = rows.shape
    for t in range(t_rows):
        for j in range(n):
            r = rows[t, j]
            if r < 0:
                out[t, j, :] = 0.0
            elif t and rows[t - 1, j] == r:
                out[t, j, :] = out[t - 1, j, :]
            else:
                _decode_fp4_row(payload, scale, r, table, group, out[t, j])


@njit(cache=True, nogil=True)
def index_score_epilogue(dots, w, rows, out):
    """out[t, j] = bf16(sum_h bf16(relu(bf16(dots[t, h, j])) * w[t, h])), the head sum in FP64 over
    ascending heads; -inf where rows[t, j] < 0. dots FP64 [T, H, n], w FP32 [T, H], out FP32 [T, n]."""
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
