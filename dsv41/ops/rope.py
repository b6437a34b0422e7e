"""RoPE: half-width FP32 tables (plain and compressed-YaRN profiles), row materialization, rotation.

Rotation is on adjacent pairs (2i, 2i+1) of the last ``rope_dim`` channels; the first channels pass
through. Negative positions mean "identity" (cos 1, sin 0): unpublished compressed tokens use them.
"""
from __future__ import annotations

import math

import torch

from dsv41.ops.quant import round_bf16

PLAIN, COMPRESSED = "plain", "compressed"


def yarn_ramp(rope_dim: int, base: float, factor: float, orig_max: int, beta_fast: int, beta_slow: int):
    """Per-frequency interpolation weight in [0, 1]: 0 keeps the frequency, 1 divides it by factor."""
    def corr(rot: float) -> float:
        return rope_dim * math.log(orig_max / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    i = torch.arange(rope_dim // 2, dtype=torch.float32)
    return ((i - low) / max(high - low, 1e-3)).clamp(0, 1)


def precompute_rope_tables(cfg, capacity: int, profile: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin tables [capacity, rope_dim // 2] for one profile.

    plain: theta = rope_theta, no YaRN (layers with ratio 0).
    compressed: theta = compress_rope_theta with YaRN (no mscale), for every compressed layer.
    """
    if profile not in (PLAIN, COMPRESSED):
        raise ValueError(f"profile must be {PLAIN!r} or {COMPRESSED!r}, got {profile!r}")
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if profile == COMPRESSED else cfg.rope_theta
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if profile == COMPRESSED:
        ramp = yarn_ramp(dim, base, cfg.rope_factor, cfg.original_max_position_embeddings,
                         cfg.beta_fast, cfg.beta_slow)
        freq = freq / cfg.rope_factor * ramp + freq * (1 - ramp)
    angle = torch.outer(torch.arange(capacity, dtype=torch.float32), freq)
    return torch.cos(angle), torch.sin(angle)


def profile_for(ratio: int) -> str:
    return PLAIN if ratio == 0 else COMPRESSED


def _check_positions(position_ids: torch.Tensor, capacity: int, field: str = "position_ids"):
    if position_ids.numel() and int(position_ids.max()) >= capacity:
        raise ValueError(f"{field}: positions must be < table capacity {capacity}, "
                         f"got {int(position_ids.max())}")


def gather_rope_rows(freqs_cos, freqs_sin, position_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for each position ([*pos.shape, half] FP32); negative positions give identity rows."""
    _check_positions(position_ids, freqs_cos.shape[0])
    pos = position_ids.long()
    valid = (pos >= 0).unsqueeze(-1)
    idx = pos.clamp_min(0)
    cos = torch.where(valid, freqs_cos[idx], torch.ones((), dtype=torch.float32))
    sin = torch.where(valid, freqs_sin[idx], torch.zeros((), dtype=torch.float32))
    return cos, sin


def materialize_rope_rows(freqs_cos, freqs_sin, position_ids, num_tokens: int, rope_cos, rope_sin) -> None:
    """Write rows [0, num_tokens) of rope_cos/rope_sin from the full tables; later rows untouched.

    The caller owns the [T, half] outputs; zero active tokens does no row work.
    """
    t = position_ids.shape[0]
    if not 0 <= num_tokens <= t:
        raise ValueError(f"num_tokens: must be in [0, {t}], got {num_tokens}")
    if rope_cos.shape != (t, freqs_cos.shape[1]) or rope_sin.shape != rope_cos.shape:
        raise ValueError(f"rope_cos/rope_sin: must be [{t}, {freqs_cos.shape[1]}], got "
                         f"{tuple(rope_cos.shape)} / {tuple(rope_sin.shape)}")
    if num_tokens == 0:
        return
    cos, sin = gather_rope_rows(freqs_cos, freqs_sin, position_ids[:num_tokens])
    rope_cos[:num_tokens] = cos
    rope_sin[:num_tokens] = sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*half channels of x ([T, ..., dim]) with rows cos/sin [T, half]; FP32, then BF16."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    nope, rot = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
    return round_bf16(torch.cat([nope, out], -1))
