"""Token embedding and the 4-lane pack of the residual stream."""
from __future__ import annotations

import torch


def embed_rows(input_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
    """Embedding rows widened to FP32; ids are clamped into [0, vocab-1] (-1 -> 0)."""
    return embed_weight[input_ids.long().clamp(0, embed_weight.shape[0] - 1)].float()


def pack_lanes(rows: torch.Tensor, hc: int) -> torch.Tensor:
    """Copy each row to every lane of the residual stream -> [T, hc, D] (bit-exact)."""
    return rows.unsqueeze(1).expand(-1, hc, -1).contiguous()


def pack_x_hc(input_ids: torch.Tensor, embed_weight: torch.Tensor, hc: int) -> torch.Tensor:
    return pack_lanes(embed_rows(input_ids, embed_weight), hc)
