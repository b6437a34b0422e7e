"""MX linears and the Q / KV projections with RoPE (all attention modes share them)."""
from __future__ import annotations

import torch

from dsv41.ops.norm import rms_norm
from dsv41.ops.quant import mxfp8_qdq, round_bf16
from dsv41.ops.rope import apply_rope


def mx_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """MXFP8-weight linear with dynamic MXFP8 activations, FP32 result (not rounded).

    x is rounded to BF16 then quantized per row in groups of 32 (ceil rule); w is the dequantized
    [N, K] weight. One FP32 matmul replaces the per-group partial sums: the same exact products,
    summed in a different FP32 order (an ulp-level choice; the graph uses this same function).
    """
    return mxfp8_qdq(round_bf16(x)) @ w.t()


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """BF16/FP32-weight linear, FP32 accumulation, FP32 result."""
    return x.float() @ w.float().t()


def q_proj(x, wq_a, q_norm, wq_b, cos, sin, eps: float, n_heads: int, head_dim: int):
    """qr = RMSNorm(bf16(x wq_a)) (also the index-query latent); q = RoPE(bf16(qr wq_b)) per head.

    wq_b may be a TP shard (n_heads local heads). No per-head q normalisation in V4.1.
    """
    qr = rms_norm(round_bf16(mx_linear(x, wq_a)), q_norm, eps)
    q = round_bf16(mx_linear(qr, wq_b)).reshape(x.shape[0], n_heads, head_dim)
    return qr, apply_rope(q, cos, sin)


def kv_proj(x, wkv, kv_norm, cos, sin, eps: float) -> torch.Tensor:
    """The single shared KV head (K = V): RoPE(RMSNorm(bf16(x wkv))) -> [T, head_dim] BF16."""
    kv = rms_norm(round_bf16(mx_linear(x, wkv)), kv_norm, eps)
    return apply_rope(kv, cos, sin)
