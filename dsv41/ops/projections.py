"""MX linears and the Q / KV projections with RoPE (all attention modes share them)."""
from __future__ import annotations

import torch

from dsv41.ops.norm import rms_norm
from dsv41.ops.packed import PackedMatrix, dense_f32
from dsv41.ops.quant import mxfp8_qdq, round_bf16
from dsv41.ops.rope import apply_rope


def matmul_t(a: torch.Tensor, w) -> torch.Tensor:
    """a @ w^T -> FP32: FP32 fused multiply-adds in one fixed order per output (``cpu.fused_product``),
    a and w taken at FP32.

    The order is written in the kernel, so a row's result does not depend on how many rows are
    multiplied together: a row computed on a slab (sequence-parallel) or a subset (one source card's
    MoE rows) has the bits of the same row in a full batch (a BLAS's order changes with the shape, and
    Top-K/router choices amplify such ulps). w is a dense tensor or a ``PackedMatrix`` in its
    checkpoint format, each value decoded in a register inside the product: the same bits as the
    dense matrix of its decoded values.
    """
    return (w if isinstance(w, PackedMatrix) else dense_f32(w)).matmul_t(a)


def mx_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """MXFP8-weight linear with dynamic MXFP8 activations, FP32 result (not rounded).

    x is rounded to BF16 then quantized per row in groups of 32 (ceil rule); w is the dequantized
    [N, K] weight. One accumulation replaces the device's sequential per-group FP32 partial sums:
    the same exact products, summed more accurately (an ulp-level choice).
    """
    return matmul_t(mxfp8_qdq(round_bf16(x)), w)


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """BF16/FP32-weight linear, FP32 accumulation, FP32 result."""
    return matmul_t(x, w)


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
