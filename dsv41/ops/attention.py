"""Sparse attention over window rows + selected compressed rows, with per-head sinks.

One softmax covers both sources and the sink; K = V (the shared 512-d head). The order follows the
official kernel: the valid keys of [window | compressed] are tiled 64 at a time with no padding
between the sources, an online max/denominator in FP32, probabilities rounded to BF16 before the
PV product, and the sink added to the denominator at the end (no re-max). A row with no valid key
outputs exactly 0.
"""
from __future__ import annotations

import torch

from dsv41.ops.quant import round_bf16

TILE = 64


def compact_keys(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable-move each row's valid keys to the front: [T, K, d], [T, K]."""
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    keys = torch.gather(keys, 1, order.unsqueeze(-1).expand_as(keys))
    return keys, torch.gather(valid, 1, order)


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, d] BF16, keys [T, K, d] BF16 (also the values), valid bool [T, K], sink [H] -> [T, H, d]."""
    t, h, d = q.shape
    keys, valid = compact_keys(keys, valid)
    n = int(valid.sum(1).max()) if t else 0
    m = torch.full((t, h), -1e30)
    den = torch.zeros(t, h)
    num = torch.zeros(t, h, d)
    for start in range(0, n, TILE):
        k = keys[:, start:start + TILE]
        ok = valid[:, start:start + TILE].unsqueeze(1)                       # [T, 1, tile]
        logits = torch.einsum("thd,tkd->thk", q, k) * scale
        logits = logits.masked_fill(~ok, -1e30)
        m_new = torch.maximum(m, logits.amax(-1))
        c = torch.exp(m - m_new)
        p = torch.exp(logits - m_new.unsqueeze(-1)) * ok
        den = den * c + p.sum(-1)
        num = num * c.unsqueeze(-1) + torch.einsum("thk,tkd->thd", round_bf16(p), k)
        m = m_new
    den = den + torch.exp(sink.float().unsqueeze(0) - m)
    out = num / den.unsqueeze(-1)
    has_key = valid.any(1).view(t, 1, 1)
    return round_bf16(torch.where(has_key, out, torch.zeros_like(out)))
