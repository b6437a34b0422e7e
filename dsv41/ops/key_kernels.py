"""Compiled passes over cached keys: the indexer's scores and the attention leaf's two contractions.

Each reads a key from its cache bytes once per query block, decodes it (table lookups, then the BF16
rounding ``kv_cache.read`` applies) and does all of that key's arithmetic while it is in cache, so no
[heads x keys] intermediate exists. The arithmetic is the Torch golden's, value for value: products
of BF16 values are exact in FP64, every contraction accumulates in FP64 in a fixed order (over the
contracted index, ascending; never dependent on how many rows or heads run together), is rounded to
FP32 once, and BF16 roundings are round-to-nearest-even on the FP32 bits as Torch does them. The
exponentials stay in Torch (``ops.attention``): its ``exp`` is not the C library's, bit for bit.

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


@njit(cache=True, nogil=True)
def decode_index_rows(payload, scale, rows, pairs, e8m0, group, out):
    """out[t, j] = the index key at cache row rows[t, j] as BF16-valued FP64 (zeros where rows[t, j] < 0):
    ``kv_cache.read`` of the INDEX format (packed E2M1 x E8M0, rounded to BF16), widened.

    payload u8 [R, d/2], scale u8 [R, d/group], rows i64 [T, n], pairs FP32 [256, 2] (a packed byte's
    two E2M1 values), e8m0 FP32 [256], out FP64 [T, n, d]. A row the previous query row also read
    (a prefill's rows of one request) is copied, not decoded again."""
    t_rows, n = rows.shape
    half = payload.shape[1]
    tmp = np.empty(2 * half, np.float32)
    for t in range(t_rows):
        for j in range(n):
            r = rows[t, j]
            if r < 0:
                out[t, j, :] = 0.0
            elif t and rows[t - 1, j] == r:
                out[t, j, :] = out[t - 1, j, :]
            else:
                for i in range(half):
                    s = e8m0[scale[r, (2 * i) // group]]
                    b = payload[r, i]
                    tmp[2 * i] = pairs[b, 0] * s
                    tmp[2 * i + 1] = pairs[b, 1] * s
                round_bf16_inplace(tmp)
                for i in range(2 * half):
                    out[t, j, i] = tmp[i]


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
def decode_slot_rows(win_payload, win_scale, cmp_payload, cmp_scale, rows, compressed, e4m3, e8m0, pairs,
                     win_group, cmp_group, out):
    """out[t, j] = the attention key of slot j of row t as BF16-valued FP64 (zeros where rows[t, j] < 0):
    a window row (MXFP8: E4M3 x E8M0 per ``win_group``) or, where compressed[t, j], a compressed row
    (packed E2M1 x E4M3 per ``cmp_group``), each rounded to BF16 as ``kv_cache.read`` does.

    The FP8 parts come as their u8 codes; e4m3 and e8m0 FP32 [256] decode them, pairs FP32 [256, 2]
    a packed byte's two E2M1 values; out FP64 [T, n, d]."""
    t_rows, n = rows.shape
    d = out.shape[2]
    tmp = np.empty(d, np.float32)
    for t in range(t_rows):
        for j in range(n):
            r = rows[t, j]
            if r < 0:
                out[t, j, :] = 0.0
                continue
            if compressed[t, j]:
                for i in range(d // 2):
                    s = e4m3[cmp_scale[r, (2 * i) // cmp_group]]
                    b = cmp_payload[r, i]
                    tmp[2 * i] = pairs[b, 0] * s
                    tmp[2 * i + 1] = pairs[b, 1] * s
            else:
                for i in range(d):
                    tmp[i] = e4m3[win_payload[r, i]] * e8m0[win_scale[r, i // win_group]]
            round_bf16_inplace(tmp)
            for i in range(d):
                out[t, j, i] = tmp[i]


@njit(cache=True, nogil=True)
def leaf_logits(qt, keys, valid, scale, tile, logits, running_max):
    """The leaf's first pass: logits[t, h, s] = fp32(q_th . k_ts) * scale (FP64 dot, ascending over d),
    -1e30 where slot s is invalid or past the keys; running_max[t, i + 1, h] = the max of
    running_max[t, i, h] and tile i's logits (NaN sticks, as ``torch.maximum``), running_max[t, 0] = -1e30.

    qt FP64 [T, d, H] (the query transposed), keys FP64 [T, K, d], valid bool [T, K], scale FP32,
    logits FP32 [T, H, tiles * tile], running_max FP32 [T, tiles + 1, H]."""
    t_rows, d, h_n = qt.shape
    k_n = keys.shape[1]
    tiles = running_max.shape[1] - 1
    masked = np.float32(-1e30)
    acc = np.empty(h_n, np.float64)
    for t in range(t_rows):
        running_max[t, 0, :] = masked
        for i in range(tiles):
            for s in range(i * tile, (i + 1) * tile):
                if s < k_n and valid[t, s]:
                    acc[:] = 0.0
                    for k in range(d):
                        kv = keys[t, s, k]
                        for h in range(h_n):
                            acc[h] += qt[t, k, h] * kv
                    for h in range(h_n):
                        logits[t, h, s] = np.float32(acc[h]) * scale
                else:
                    logits[t, :, s] = masked
            for h in range(h_n):
                m = running_max[t, i, h]
                for s in range(i * tile, (i + 1) * tile):
                    v = logits[t, h, s]
                    if v > m or v != v:
                        m = v
                running_max[t, i + 1, h] = m


@njit(cache=True, nogil=True)
def leaf_values(keys, probs, rescale, prob_sums, tile, num, den):
    """The leaf's second pass, tile after tile: den = den * c + prob_sums[tile] and
    num = num * c + fp32(sum_s probs[s] k_s) (FP64 sum ascending over the tile's slots), c the
    tile's rescale of the running max. FP32 products and sums one at a time, as Torch's.

    keys FP64 [T, K, d], probs FP32 [T, H, tiles * tile] (BF16-valued, 0 where invalid), rescale FP32
    [T, tiles, H], prob_sums FP32 [T, H, tiles]; num FP32 [T, H, d] and den FP32 [T, H] out."""
    t_rows, k_n, d = keys.shape
    h_n = num.shape[1]
    tiles = rescale.shape[1]
    acc = np.empty((h_n, d), np.float64)
    for t in range(t_rows):
        num[t] = 0.0
        den[t] = 0.0
        for i in range(tiles):
            acc[:] = 0.0
            for s in range(i * tile, min((i + 1) * tile, k_n)):
                for h in range(h_n):
                    p = np.float64(probs[t, h, s])
                    for k in range(d):
                        acc[h, k] += p * keys[t, s, k]
            for h in range(h_n):
                c = rescale[t, i, h]
                den[t, h] = den[t, h] * c + prob_sums[t, h, i]
                for k in range(d):
                    num[t, h, k] = num[t, h, k] * c + np.float32(acc[h, k])
