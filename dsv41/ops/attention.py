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

from dsv41.ops.quant import round_bf16

TILE = 64


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
    t, h, d = q.shape
    n = int(valid.any(0).nonzero().max()) + 1 if t and bool(valid.any()) else 0   # trailing -1 tiles change nothing
    qd = q.double()
    m = torch.full((t, h), -1e30)
    den = torch.zeros(t, h)
    num = torch.zeros(t, h, d)
    for start in range(0, n, TILE):
        k = keys[:, start:start + TILE].double()
        ok = valid[:, start:start + TILE].unsqueeze(1)                       # [T, 1, tile]
        logits = torch.einsum("thd,tkd->thk", qd, k).float() * scale
        logits = logits.masked_fill(~ok, -1e30)
        m_new = torch.maximum(m, logits.amax(-1))
        c = torch.exp(m - m_new)
        p = torch.exp(logits - m_new.unsqueeze(-1)) * ok
        den = den * c + p.double().sum(-1).float()
        num = num * c.unsqueeze(-1) + torch.einsum("thk,tkd->thd", round_bf16(p).double(), k).float()
        m = m_new
    den = den + torch.exp(sink.float().unsqueeze(0) - m)
    out = num / den.unsqueeze(-1)
    has_key = valid.any(1).view(t, 1, 1)
    return round_bf16(torch.where(has_key, out, torch.zeros_like(out)))
