"""Token embedding and the 4-lane pack of the residual stream."""
from __future__ import annotations

import torch


def pack_x_hc(input_ids: torch.Tensor, embed_weight: torch.Tensor, hc: int) -> torch.Tensor:
    """Embedding rows (ids clamped into [0, vocab-1]) widened to FP32 and copied to every lane."""
    ids = input_ids.long().clamp(0, embed_weight.shape[0] - 1)
    rows = embed_weight[ids].float()
    return rows.unsqueeze(1).expand(-1, hc, -1).contiguous()
