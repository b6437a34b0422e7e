"""RMSNorm with the checkpoint's eps (1e-20): FP32 statistics, output rounded to BF16."""
from __future__ import annotations

import torch

from dsv41.ops.quant import round_bf16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(x * rsqrt(mean(x^2) + eps) * w). With eps = 1e-20 an all-zero row stays 0 (no NaN)."""
    x = x.float()
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return round_bf16(x * inv * weight.float())
