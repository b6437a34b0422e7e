"""LM head: selected rows of the final-normed hidden state times head.weight, greedy argmax."""
from __future__ import annotations

import torch

from dsv41.ops.projections import matmul_t


def select_rows(hidden: torch.Tensor, logit_row_indices: torch.Tensor) -> torch.Tensor:
    """Rows by index; -1 gives an all-zero row; other indices are clamped into [0, T-1]."""
    idx = logit_row_indices.long()
    rows = hidden[idx.clamp(0, max(hidden.shape[0] - 1, 0))] if hidden.shape[0] else \
        torch.zeros(idx.shape[0], hidden.shape[1])
    return rows * (idx >= 0).unsqueeze(-1)


def logits_shard(rows: torch.Tensor, head_shard: torch.Tensor) -> torch.Tensor:
    """FP32 logits for one vocab shard (rows of head.weight)."""
    return matmul_t(rows, head_shard)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """First index of the maximum logit (lowest id on ties)."""
    return torch.argmax(logits, dim=-1)
