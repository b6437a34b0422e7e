"""Grouped output projection: inverse RoPE, per-group wo_a (BF16), then the MXFP8 wo_b partial."""
from __future__ import annotations

import torch

from dsv41.ops.projections import matmul_t
from dsv41.ops.quant import mxfp8_qdq, round_bf16
from dsv41.ops.rope import apply_rope


def o_proj_partial(attended, cos, sin, wo_a, wo_b) -> torch.Tensor:
    """FP32 partial [T, D] of this rank's heads; the TP sum of partials is rounded to BF16 once.

    attended [T, Hl, hd] BF16; wo_a [Gl, o_lora, group_in] (dequantized to BF16 values at load);
    wo_b [D, Gl*o_lora] this rank's input columns. Each output group's wo_b product is accumulated
    in FP64 and rounded to FP32, and the groups are summed as a pairwise tree (``tree_sum``), so
    that with the ranks' partials summed the same way the result does not depend on how the groups
    are split over TP ranks (TP divides o_groups; both are powers of two).
    """
    t = attended.shape[0]
    a = apply_rope(attended, cos, sin, inverse=True)
    groups = wo_a.shape[0]
    a = a.reshape(t, groups, -1)
    z = round_bf16(torch.einsum("tgi,gri->tgr", a.double(), wo_a.double()).float()).reshape(t, -1)
    zq, r = mxfp8_qdq(round_bf16(z)), wo_a.shape[1]   # quantizer groups of 32 never straddle two o_groups
    return tree_sum([matmul_t(zq[:, g * r:(g + 1) * r], wo_b[:, g * r:(g + 1) * r]) for g in range(groups)])


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """FP32 pairwise sum ((p0 + p1) + (p2 + p3)) ...: for a power-of-two count, splitting the list into
    equal contiguous shares, tree-summing each and tree-summing the results gives the same bits."""
    while len(parts) > 1:
        if len(parts) % 2:
            raise ValueError(f"tree_sum: needs a power-of-two number of parts, got {len(parts)}")
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def reduce_partials(partials: list[torch.Tensor]) -> torch.Tensor:
    """TP reduction: the FP32 pairwise tree over ranks 0..TP-1, one BF16 rounding."""
    return round_bf16(tree_sum(list(partials)))
