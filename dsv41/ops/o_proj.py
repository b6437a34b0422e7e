"""Grouped output projection: inverse RoPE, per-group wo_a (BF16), then the MXFP8 wo_b partial."""
from __future__ import annotations

import torch

from dsv41.ops.quant import mxfp8_qdq, round_bf16
from dsv41.ops.rope import apply_rope


def o_proj_partial(attended, cos, sin, wo_a, wo_b) -> torch.Tensor:
    """FP64 partial [T, D] of this rank's heads; the TP sum of partials is rounded to BF16 once.

    attended [T, Hl, hd] BF16; wo_a [Gl, o_lora, group_in] (dequantized to BF16 values at load);
    wo_b [D, Gl*o_lora] this rank's input columns. The partial stays FP64 (mx_linear without its
    FP32 rounding): summing FP32 partials would round once per rank and make the result depend on
    how the heads are split over TP ranks; FP64 sums of these few-bit products are exact in practice.
    """
    t = attended.shape[0]
    a = apply_rope(attended, cos, sin, inverse=True)
    groups = wo_a.shape[0]
    a = a.reshape(t, groups, -1)
    z = round_bf16(torch.einsum("tgi,gri->tgr", a.double(), wo_a.double()).float()).reshape(t, -1)
    return mxfp8_qdq(z).double() @ wo_b.double().t()


def reduce_partials(partials: list[torch.Tensor]) -> torch.Tensor:
    """TP reduction: FP64 sum in rank order 0..TP-1, rounded to FP32 and then to BF16 once."""
    acc = partials[0].double()
    for p in partials[1:]:
        acc = acc + p
    return round_bf16(acc.float())
