"""Tie-aware comparison of selections (Top-K positions, candidate blocks, router experts).

BF16 index scores tie exactly and often (mostly at 0 after the ReLU), and the official code breaks
ties however `topk(sorted=False)` likes while dsv41 takes the lowest positions. Two selections
therefore agree when they differ only by swaps among equal scores: per row, the selected sets
have the same size and the entries in one set but not the other carry the same multiset of scores.
"""
from __future__ import annotations

import torch


def tie_mismatch_rows(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor) -> list[int]:
    """Rows where selections a and b ([T, k] ids, any order, -1 = none) differ by more than swaps
    among equal scores ([T, n], indexed by id)."""
    bad = []
    for t in range(a.shape[0]):
        sa = {int(i) for i in a[t].tolist() if i >= 0}
        sb = {int(i) for i in b[t].tolist() if i >= 0}
        if sa == sb:
            continue
        only_a = sorted(scores[t, i].item() for i in sa - sb)
        only_b = sorted(scores[t, i].item() for i in sb - sa)
        if len(sa) != len(sb) or only_a != only_b:
            bad.append(t)
    return bad


def block_selection(mask: torch.Tensor, block: int) -> torch.Tensor:
    """A candidate mask [T, P] as its kept block ids [T, nb] (-1 = not kept)."""
    t, p = mask.shape
    nb = -(-p // block)
    padded = torch.zeros(t, nb * block, dtype=torch.bool)
    padded[:, :p] = mask
    kept = padded.reshape(t, nb, block).any(-1)
    ids = torch.arange(nb).expand(t, nb)
    return torch.where(kept, ids, torch.full_like(ids, -1))
