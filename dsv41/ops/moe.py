"""Mixture of experts: sqrt-softplus router, SwiGLU experts with the clamp, combine.

Official arithmetic: expert linears take MXFP8-quantized BF16 inputs and give BF16 outputs; h is
rounded to BF16 before w2; the routing weight multiplies h before w2. The combine sums the routed
outputs in ascending expert id in FP32, adds the shared expert, and rounds once.
"""
from __future__ import annotations

import torch

from dsv41.ops.packed import products
from dsv41.ops.pointwise import silu, softplus
from dsv41.ops.projections import matmul_t
from dsv41.ops.quant import mxfp8_qdq, round_bf16


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """(indices [T, k] i64 in descending biased score, weights [T, k] FP32 summing to `scaling`).

    Scores s = sqrt(softplus(x W^T)) in FP32; the bias only selects; weights come from s.
    Ties in the biased score go to the smaller expert id (stable sort).
    """
    return pick_experts(router_scores(x, gate_w), bias, top_k, scaling)


def router_scores(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """s = sqrt(softplus(x W^T)) in FP32 [T, E] (the part pypto's router kernel computes)."""
    return torch.sqrt(softplus(matmul_t(x, gate_w)))


def pick_experts(s: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """``route``'s selection and weights from given scores s [T, E]."""
    biased = s + bias.float()
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    picked = torch.gather(s, 1, idx)
    weights = scaling * picked / (picked.sum(-1, keepdim=True) + 1e-20)
    return idx, weights


def expert(x: torch.Tensor, w1, w2, w3, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU expert on BF16 rows -> BF16 output [T, D]; weight [T] (routed) scales h before w2."""
    ws = {"w1": w1, "w2": w2, "w3": w3}
    return experts_grouped(x, weight, [None], [x.shape[0]], lambda _, name: ws[name], limit)


def experts_grouped(x: torch.Tensor, weight: torch.Tensor | None, expert_ids: list, counts: list[int],
                    linear, limit: float) -> torch.Tensor:
    """``expert`` for rows grouped by expert, in one pass: rows [sum(counts), D] BF16 with routing
    weights [n] (None: unweighted), consecutive ``counts[i]`` rows going to ``expert_ids[i]``;
    ``linear(e, name)`` gives expert e's dequantized w1/w2/w3 when it is used. -> BF16 [n, D] in row order.

    The activation quantizations, the clamp/SwiGLU/weighting and the roundings act per row or per
    element, so they run once over every group's rows; only the matmuls go expert by expert. Each
    row's bits are those its expert gives it alone (matmul_t is independent of the row count).
    """
    xq = mxfp8_qdq(round_bf16(x)).split(counts)
    gu = products([(a, linear(e, name)) for name in ("w1", "w3") for e, a in zip(expert_ids, xq)])
    g, u = torch.cat(gu[:len(xq)]), torch.cat(gu[len(xq):])
    h = silu(round_bf16(g).clamp(max=limit)) * round_bf16(u).clamp(-limit, limit)
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    hq = mxfp8_qdq(round_bf16(h)).split(counts)
    return round_bf16(torch.cat(products([(a, linear(e, "w2")) for e, a in zip(expert_ids, hq)])))


def dispatch_rows(indices: torch.Tensor, expert_ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For each expert id with work: (token rows, slot k) in (t, k) order."""
    out = {}
    for e in expert_ids:
        t, k = torch.nonzero(indices == e, as_tuple=True)
        if t.numel():
            out[int(e)] = (t, k)
    return out


def combine(routed: dict[int, tuple[torch.Tensor, torch.Tensor]], shared: torch.Tensor) -> torch.Tensor:
    """bf16(sum over experts in ascending id of their BF16 rows, in FP32, + shared) -> [T, D].

    routed maps expert id -> (token rows, output rows [n, D]).
    """
    acc = torch.zeros_like(shared)
    for e in sorted(routed):
        rows, y = routed[e]
        acc[rows] += y  # a token picks an expert at most once: rows are unique
    return round_bf16(acc + shared)
