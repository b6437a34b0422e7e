"""KV compressors of the FULL layers: ratio 2 (gated pair pooling + state ring) and ratio 1.

Both are pure: they return the latents and, for ratio 2, the ring writes to stage; the caller
applies the writes at commit. The ring holds per request ``state_capacity`` rows of [kv | score]
(FP32) at slot p mod capacity; every row's write is returned, with its token row, so that a step
that publishes only a prefix of its rows leaves the ring as a step of that prefix would. The official code keeps a 2-slot carry; the ring size is an engine
choice (4 here, as the device ABI) and does not change the math.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.ops.norm import rms_norm
from dsv41.ops.projections import dense_linear
from dsv41.ops.quant import round_bf16


@dataclass(frozen=True)
class Compressed:
    latent: torch.Tensor        # [T, hd] BF16-valued, unrotated; zero where nothing closes
    closes: torch.Tensor        # bool [T]: this token closes a group (publishes a compressed row)
    ring_slots: torch.Tensor    # i64 [N] flat ring rows (block * capacity + p % capacity)
    ring_rows: torch.Tensor     # [N, 2*hd] FP32 [kv | score]
    ring_token_rows: torch.Tensor   # i64 [N] the token row of each ring write


def compress_ratio2(x, wkv, wgate, norm_w, eps: float, md, ring: torch.Tensor, state_table: torch.Tensor,
                    capacity: int) -> Compressed:
    """Pool position pairs (2g, 2g+1) at the odd position with a per-channel softmax over the pair.

    x [T, D] BF16 normalized input; wkv/wgate FP32 [hd, D]; ring [blocks*capacity, 2*hd] FP32.
    A token's partner is the previous row of its chunk, or the ring row (p-1) mod capacity at the
    start of a chunk. All ring reads precede the writes; every valid row is written, in row order, so
    the later position wins a slot (the store keeps the last writer of a slot).
    """
    t = x.shape[0]
    hd = wkv.shape[0]
    kv, sc = dense_linear(x, wkv), dense_linear(x, wgate)
    pos = md.position_ids.long()
    req = md.token_to_req_indices.long()
    qsl = md.query_start_loc.long()
    blk = state_table[req, 0].long() if t else torch.zeros(0, dtype=torch.long)
    n_blocks = ring.shape[0] // capacity
    valid = (pos >= 0) & (blk >= 0) & (blk < n_blocks)
    closes = valid & (pos % 2 == 1)
    rows = torch.arange(t)
    first = rows == qsl[:-1][req] if t else torch.zeros(0, dtype=torch.bool)
    ring_idx = (blk.clamp_min(0) * capacity + (pos - 1) % capacity)
    from_ring = ring[ring_idx] if t else torch.zeros(0, 2 * hd)
    prev = torch.cat([torch.zeros(1, 2 * hd), torch.cat([kv, sc], 1)[:-1]]) if t else torch.zeros(0, 2 * hd)
    partner = torch.where(first.unsqueeze(1), from_ring, prev)
    kv_p, sc_p = partner[:, :hd], partner[:, hd:]
    m = torch.maximum(sc_p, sc)
    e0, e1 = torch.exp(sc_p - m), torch.exp(sc - m)
    pooled = round_bf16((e0 * kv_p + e1 * kv) / (e0 + e1))
    latent = rms_norm(pooled, norm_w, eps) * closes.unsqueeze(1)

    slots = (blk * capacity + pos % capacity)[valid]
    return Compressed(latent, closes, slots, torch.cat([kv, sc], 1)[valid], rows[valid])


def compress_ratio1(x, wkv, norm_w, eps: float, md) -> Compressed:
    """Every token publishes RMSNorm(bf16(x wkv)); no gate, no pooling, no state."""
    latent = rms_norm(round_bf16(dense_linear(x, wkv)), norm_w, eps)
    closes = md.position_ids >= 0
    return Compressed(latent, closes, torch.zeros(0, dtype=torch.long), torch.zeros(0, 2 * latent.shape[1]),
                      torch.zeros(0, dtype=torch.long))


def index_key(latent, wk, k_norm, eps: float) -> torch.Tensor:
    """Index key from the unrotated latent: RMSNorm(bf16(latent wk)); RoPE is applied by the caller."""
    return rms_norm(round_bf16(dense_linear(latent, wk)), k_norm, eps)
