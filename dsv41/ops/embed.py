"""Token embedding and the 4-lane pack of the residual stream."""
from __future__ import annotations

import torch


def embed_rows(input_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
    """Embedding rows widened to FP32; ids are clamped into [0, vocab-1] (-1 -> 0)."""
    return embed_weight[input_ids.long().clamp(0, embed_weight.shape[0] - 1)].float()


def shard_rows(ids: torch.Tensor, shard, first: int) -> torch.Tensor:
    """One card's share of a row lookup in a table split by rows: FP32 [*ids.shape, width] with the
    rows of ids in [first, first + len(shard)) and -0.0 everywhere else.

    -0.0 is the filler because x + (-0.0) == x for every x, -0.0 and NaN included, so summing the
    shares of all shards (in any order) gives the whole table's lookup bit for bit."""
    ids = ids.long()
    out = torch.full((*ids.shape, shard.shape[1]), -0.0)
    mine = (ids >= first) & (ids < first + shard.shape[0])
    out[mine] = shard[ids[mine] - first].float()
    return out


def embed_shard(input_ids: torch.Tensor, shard, first: int, vocab: int) -> torch.Tensor:
    """A vocabulary shard's share of ``embed_rows`` (ids clamped against the whole vocabulary)."""
    return shard_rows(input_ids.long().clamp(0, vocab - 1), shard, first)


def pack_lanes(rows: torch.Tensor, hc: int) -> torch.Tensor:
    """Copy each row to every lane of the residual stream -> [T, hc, D] (bit-exact)."""
    return rows.unsqueeze(1).expand(-1, hc, -1).contiguous()


def pack_x_hc(input_ids: torch.Tensor, embed_weight: torch.Tensor, hc: int) -> torch.Tensor:
    return pack_lanes(embed_rows(input_ids, embed_weight), hc)
