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

import numpy as np
import torch

from dsv41.ops import kv_cache
from dsv41.ops.key_kernels import decode_slot_rows, leaf_logits, leaf_values
from dsv41.ops.quant import E4M3_VALUES, E8M0_VALUES, FP4_PAIRS, round_bf16

TILE = 64
ROW_BLOCK_BYTES = 4 << 20    # a query block's FP64 keys: one row at FLASH's 640 x 512 slots, in L2/L3


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
    return _attend(q, valid, sink, scale, lambda a, b: keys[a:b].double().contiguous())


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
    tables = (E4M3_VALUES.numpy(), E8M0_VALUES.numpy(), FP4_PAIRS.numpy(), win.group, cmp.group)
    rows, from_compressed = rows.long().contiguous(), from_compressed.contiguous()

    def keys(a: int, b: int) -> torch.Tensor:
        out = torch.empty(b - a, rows.shape[1], q.shape[2], dtype=torch.float64)
        decode_slot_rows(*parts, rows[a:b].numpy(), from_compressed[a:b].numpy(), *tables, out.numpy())
        return out

    return _attend(q, rows >= 0, sink, scale, keys)


def _attend(q: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float, keys_of) -> torch.Tensor:
    """The leaf over query blocks; keys_of(a, b) gives rows [a, b)'s keys as FP64 [b - a, K, d].

    A block's keys are read by two compiled passes while in cache (``ops.key_kernels``): the logits
    and the running max per tile, then the values. The exponentials between them are Torch's, on all
    of the block's tiles at once (element-wise: the same bits as tile by tile)."""
    t, h, d = q.shape
    k = valid.shape[1]
    n = int(valid.any(0).nonzero().max()) + 1 if t and bool(valid.any()) else 0   # trailing -1 tiles change nothing
    tiles = -(-n // TILE)
    out = torch.zeros(t, h, d)
    if not tiles:
        return out
    qt = q.double().transpose(1, 2).contiguous()
    valid = valid.contiguous()
    ok = torch.zeros(t, tiles * TILE, dtype=torch.bool)
    ok[:, :min(k, tiles * TILE)] = valid[:, :tiles * TILE]
    last = min(k, tiles * TILE) - (tiles - 1) * TILE            # slots in the last tile (the old slice's width)
    step = max(1, ROW_BLOCK_BYTES // max(1, k * d * 8))
    for a in range(0, t, step):
        b = min(a + step, t)
        kv = keys_of(a, b)
        logits = torch.empty(b - a, h, tiles * TILE)
        running = torch.empty(b - a, tiles + 1, h)
        leaf_logits(qt[a:b].numpy(), kv.numpy(), valid[a:b].numpy(), np.float32(scale), TILE, logits.numpy(),
                    running.numpy())
        m = running[:, 1:].transpose(1, 2).unsqueeze(-1)                          # [rows, H, tiles, 1]
        p = torch.exp(logits.view(b - a, h, tiles, TILE) - m) * ok[a:b].view(b - a, 1, tiles, TILE)
        sums = p.double().sum(-1).float()
        if last < TILE:
            sums[..., -1] = p[..., -1, :last].contiguous().double().sum(-1).float()
        num, den = torch.empty(b - a, h, d), torch.empty(b - a, h)
        leaf_values(kv.numpy(), round_bf16(p).view(b - a, h, tiles * TILE).numpy(),
                    torch.exp(running[:, :-1] - running[:, 1:]).numpy(), sums.numpy(), TILE, num.numpy(), den.numpy())
        den = den + torch.exp(sink.float().unsqueeze(0) - running[:, -1])
        has_key = valid[a:b].any(1).view(b - a, 1, 1)
        out[a:b] = torch.where(has_key, num / den.unsqueeze(-1), torch.zeros(()))
    return round_bf16(out)
