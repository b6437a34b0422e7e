"""Manifold-constrained hyper-connections: mixes (with Sinkhorn), collapse (pre), expand (post).

The residual stream x_hc is [T, hc, D] FP32 holding BF16-representable values. V4.1 delays the pre
mix: a sub-layer collapses with the pre mix produced by the previous mHC site and hands its own
forward (``delayed`` below); the final collapse uses the last pre mix and has no parameters.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv41.cpu.mix_kernels import normalise
from dsv41.ops.pointwise import sigmoid
from dsv41.ops.projections import matmul_t
from dsv41.ops.quant import round_bf16


def sinkhorn(comb0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (+eps), one column normalisation, then iters-1 (row, column) normalisations, each
    in FP32: a lane sum from lane 0 up, + eps, then the division (``mix_kernels.normalise``)."""
    c = (torch.softmax(comb0.float(), dim=-1) + eps).contiguous()
    normalise(c.numpy(), iters, np.float32(eps))
    return c


def hc_mixes(x_hc: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_eps: float, hc_eps: float, iters: int):
    """(pre [T,hc], post [T,hc], comb [T,hc,hc]) FP32; comb[t, j, k]: from lane j to lane k."""
    t, hc, d = x_hc.shape
    f = x_hc.reshape(t, hc * d).float()
    inv = torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + norm_eps)
    m = matmul_t(f, fn) * inv
    pre = sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb0 = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(t, hc, hc)
    return pre, post, sinkhorn(comb0, iters, hc_eps)


def hc_pre(x_hc: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the lanes with the pre mix: FP32 weighted sum, rounded to BF16 -> [T, D]."""
    return round_bf16((x_hc * pre.unsqueeze(-1)).sum(1))


def hc_post(sub: torch.Tensor, x_hc: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[t,k] = post[t,k]*sub[t] + sum_j comb[t,j,k]*x_hc[t,j], rounded to BF16 (stored FP32).

    The lane mix accumulates in FP64 and rounds to FP32 once (batch-independent)."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.double(), x_hc.double()).float()
    return round_bf16(post.unsqueeze(-1) * sub.unsqueeze(1) + mixed)


def initial_pre(t: int, hc: int) -> torch.Tensor:
    """The one-hot lane-0 pre mix the first sub-layer collapses with."""
    p = torch.zeros(t, hc)
    p[:, 0] = 1.0
    return p


def hc_head(x_hc: torch.Tensor, last_pre: torch.Tensor) -> torch.Tensor:
    """Final collapse: no learned parameters in V4.1, just the last delayed pre mix."""
    return hc_pre(x_hc, last_pre)


def lane_mean(x_hc: torch.Tensor) -> torch.Tensor:
    """The mean of the lanes [T, hc, D] -> [T, D] BF16 (DSpark's tap of a layer's input stream). The
    lanes hold BF16 values, so their FP64 sum is exact: one rounding to FP32, the division by hc
    (a power of two) exact, then BF16."""
    return round_bf16(x_hc.double().sum(1).float() / x_hc.shape[1])
