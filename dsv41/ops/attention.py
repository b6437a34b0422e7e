"""Sparse attention over window rows + selected compressed rows, with per-head sinks.

One softmax covers both sources and the sink; K = V (the shared 512-d head). The order follows the
official kernel (spec 04 §2.9): each row's raw slot list [window slots | compressed slots], invalid
(-1) entries left in place, is tiled 64 entries at a time; an online max/denominator in FP32,
probabilities rounded to BF16 before the PV product, and the sink added to the denominator at the
end (no re-max). A row with no valid key outputs exactly 0.

The QK and PV contractions and the tile's probability sum accumulate in FP64 and round to FP32
once, so a row's result does not depend on how many rows or heads are computed together.
"""
from __future__ import annotations

import torch

from dsv41.cpu import cores
from dsv41.cpu.key_kernels import decode_slot_rows
from dsv41.ops import kv_cache
from dsv41.ops.quant import round_bf16

TILE = 64
ROW_BLOCK_BYTES = 4 << 20    # a query block's FP64 keys: one row at FLASH's 640 x 512 slots (in cache)


def slot_list(win_keys: torch.Tensor, win_valid: torch.Tensor, cmp_keys: torch.Tensor, cmp_valid: torch.Tensor,
              win_width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The official kernel's list per row: its first win_width[t] window slots, then the compressed
    slots, then the remaining (invalid) window slots -> keys [T, W+K, d], valid [T, W+K].

    The official prefill lists min(prompt length, window) window slots and decode the whole window
    (W); where that is narrower than W the compressed slots move forward and land in other tiles.
    """
    t, w = win_valid.shape
    k = cmp_valid.shape[1]
    keys, valid = torch.cat([win_keys, cmp_keys], 1), torch.cat([win_valid, cmp_valid], 1)
    ww = win_width.long().unsqueeze(1)
    if t == 0 or bool((ww == w).all()):
        return keys, valid
    if bool(win_valid[torch.arange(w).unsqueeze(0) >= ww].any()):
        raise ValueError("win_width: a valid window slot lies beyond the row's window width")
    col = torch.arange(w + k).unsqueeze(0)
    idx = torch.where(col < ww, col, torch.where(col < ww + k, w + col - ww, col - k))
    return torch.gather(keys, 1, idx.unsqueeze(-1).expand(-1, -1, keys.shape[2])), torch.gather(valid, 1, idx)


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, d] BF16, keys [T, K, d] BF16 (also the values; the raw slot list, invalid entries in
    place), valid bool [T, K], sink [H] -> [T, H, d]."""
    def keys_of(a: int, b: int, slots: int) -> torch.Tensor:
        out = torch.zeros(b - a, slots, keys.shape[2], dtype=torch.float64)
        width = min(slots, keys.shape[1])
        out[:, :width] = keys[a:b, :width]
        return out

    return _attend(q, valid, sink, scale, keys_of)


def sparse_attention_cached(q: torch.Tensor, window: tuple, compressed: tuple | None, rows: torch.Tensor,
                            from_compressed: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """``sparse_attention`` over keys read from the caches: slot j of row t is cache row rows[t, j] (-1:
    invalid) of the compressed cache where from_compressed[t, j], else of the window cache. window and
    compressed are the caches' (payload, scale) parts (compressed None when no slot reads it). Each
    query block's keys are decoded from the cache bytes once, straight to FP64."""
    win, cmp = kv_cache.FORMATS[kv_cache.WINDOW], kv_cache.FORMATS[kv_cache.COMPRESSED]
    if compressed is None:
        compressed = cmp.empty(0, q.shape[2])
    parts = (window[0].view(torch.uint8).numpy(), window[1].numpy(), compressed[0].numpy(),
             compressed[1].view(torch.uint8).numpy())
    tables = (kv_cache.value_table(kv_cache.WINDOW).numpy(), kv_cache.value_table(kv_cache.COMPRESSED).numpy(),
              win.group, cmp.group)
    rows = rows.long()

    def keys_of(a: int, b: int, slots: int) -> torch.Tensor:
        width = min(slots, rows.shape[1])
        r = torch.full((b - a, slots), -1, dtype=torch.long)
        r[:, :width] = rows[a:b, :width]
        flag = torch.zeros(b - a, slots, dtype=torch.bool)
        flag[:, :width] = from_compressed[a:b, :width]
        out = torch.empty(b - a, slots, q.shape[2], dtype=torch.float64)
        decode_slot_rows(*parts, r.numpy(), flag.numpy(), *tables, out.numpy())
        return out

    return _attend(q, rows >= 0, sink, scale, keys_of)


def _attend(q: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float, keys_of) -> torch.Tensor:
    """The leaf a query block at a time; keys_of(a, b, slots) gives rows [a, b)'s first ``slots`` keys
    as FP64 [b - a, slots, d] (zeros past the list).

    Within a block every tile is computed at once: the QK and PV products are batches of the per-tile
    products (the same [H, d] x [d, 64] and [H, 64] x [64, d] FP64 products, so the same sums), the
    running max is a cumulative max over the tiles' maxima, the exponentials are element-wise; only
    the rescaled FP32 sums run tile after tile."""
    t, h, d = q.shape
    n = int(valid.any(0).nonzero().max()) + 1 if t and bool(valid.any()) else 0   # trailing -1 tiles change nothing
    tiles = -(-n // TILE)
    out = torch.zeros(t, h, d)
    if not tiles:
        return out
    width = min(valid.shape[1], tiles * TILE)                   # slots read; the last tile may be short
    last = width - (tiles - 1) * TILE
    ok = torch.zeros(t, tiles * TILE, dtype=torch.bool)
    ok[:, :width] = valid[:, :width]
    step = max(1, ROW_BLOCK_BYTES // (tiles * TILE * d * 8))

    def rows_of(lo: int, hi: int) -> None:
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            kv = keys_of(a, b, tiles * TILE).view(b - a, tiles, TILE, d)
            okb = ok[a:b].view(b - a, tiles, 1, TILE)
            logits = torch.matmul(q[a:b].double().unsqueeze(1), kv.transpose(-1, -2)).float() * scale  # [rows, tiles, H, 64]
            logits = logits.masked_fill(~okb, -1e30)
            m = torch.cummax(torch.cat([torch.full((b - a, 1, h), -1e30), logits.amax(-1)], 1), 1).values
            p = torch.exp(logits - m[:, 1:].unsqueeze(-1)) * okb
            sums = p.double().sum(-1).float()
            if last < TILE:                                         # the short tile sums its own slots only
                sums[:, -1] = p[:, -1, :, :last].contiguous().double().sum(-1).float()
            pv = torch.matmul(round_bf16(p).double(), kv).float()   # [rows, tiles, H, d]
            c = torch.exp(m[:, :-1] - m[:, 1:])
            den, num = torch.zeros(b - a, h), torch.zeros(b - a, h, d)
            for i in range(tiles):
                den = den * c[:, i] + sums[:, i]
                num = num * c[:, i].unsqueeze(-1) + pv[:, i]
            den = den + torch.exp(sink.float().unsqueeze(0) - m[:, -1])
            has_key = valid[a:b].any(1).view(b - a, 1, 1)
            out[a:b] = torch.where(has_key, num / den.unsqueeze(-1), torch.zeros(()))

    shares = min(cores.cores(), t) if t * tiles * TILE * d * h >= cores.SPLIT_MULTIPLIES else 1
    cores.run_shares(rows_of, cores.bounds(t, shares))     # rows are independent: the same bits
    return round_bf16(out)
