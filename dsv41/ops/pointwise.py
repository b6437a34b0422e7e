"""Sigmoid, softplus and SiLU evaluated in FP64 and rounded to FP32.

Torch's FP32 versions of these take a different code path (scalar instead of vector) for the tail
elements of a tensor, so an element's value depends on how many elements share its tensor: a row
computed on a sequence-parallel slab, on one MoE owner's rows or in one expert's batch would differ
in the last ulp from the same row in the full batch (measured on this AVX-512 CPU). The FP64
versions differ only in FP64 ulps, which the rounding to FP32 removes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.double()).float()


def softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x.double()).float()


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x.double()).float()
