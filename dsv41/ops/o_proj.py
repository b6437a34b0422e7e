"""Grouped output projection: inverse RoPE, per-group wo_a (BF16), then the MXFP8 wo_b partial."""
from __future__ import annotations

import torch

from dsv41.ops.packed import PackedMatrix, products
from dsv41.ops.quant import mxfp8_qdq, round_bf16
from dsv41.ops.rope import apply_rope


def o_proj_partial(attended, cos, sin, wo_a, wo_b) -> torch.Tensor:
    """FP32 partial [T, D] of this rank's heads; the TP sum of partials is rounded to BF16 once.

    attended [T, Hl, hd] BF16; wo_a [Gl, o_lora, group_in] dense, or the checkpoint's
    [Gl*o_lora, group_in] as a ``PackedMatrix``; wo_b [D, Gl*o_lora] this rank's input columns.
    Each group's wo_a product is an FP32 sum in ``matmul_t``'s order, rounded to BF16; each output
    group's wo_b product is one too, kept FP32, and the groups are summed as a pairwise tree
    (``tree_sum``), so that with the ranks' partials summed the same way the result does not depend on
    how the groups are split over TP ranks (TP divides o_groups; both are powers of two).
    """
    t = attended.shape[0]
    a = apply_rope(attended, cos, sin, inverse=True)
    a = a.reshape(t, -1, wo_a.shape[-1])
    per_group = _groups(wo_a, a.shape[1])
    z = round_bf16(torch.cat(products([(a[:, g], w) for g, w in enumerate(per_group)]), 1))
    zq, r = mxfp8_qdq(z), per_group[0].shape[0]   # quantizer groups of 32 never straddle two o_groups
    return tree_sum(products([(zq[:, g * r:(g + 1) * r], _cols(wo_b, g * r, (g + 1) * r))
                              for g in range(len(per_group))]))


def _groups(wo_a, groups: int) -> list:
    """Each group's [o_lora, group_in] matrix."""
    if isinstance(wo_a, PackedMatrix):
        r = wo_a.shape[0] // groups
        return [wo_a.rows(g * r, (g + 1) * r) for g in range(groups)]
    return list(wo_a)


def _cols(w, a: int, b: int):
    return w.cols(a, b) if isinstance(w, PackedMatrix) else w[:, a:b]


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
