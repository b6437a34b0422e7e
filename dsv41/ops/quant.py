"""MX formats: BF16 rounding, E8M0/E4M3 scales, MXFP8 and packed MXFP4 encode/decode.

Used for the paged caches (encode on publish, decode on read) and for the checkpoint weights.
All scale exponents are exact ceil(log2(.)) computed from the float's exponent bits, never an FP32
``log2`` (which mis-rounds just above a power of two).
"""
from __future__ import annotations

import numpy as np
import torch

from dsv41.cpu.quant_kernels import fp4_groups, fp8_blocks, mxfp8_qdq_rows

E4M3_MAX = 448.0
FP4_MAX = 6.0
FP4_LEVELS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_FP4_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
FP4_E8M0_FLOOR = 6.0 * 2.0 ** -126   # official floor for E8M0-scaled FP4 (index keys, index query)
FP4_E4M3_FLOOR = 6.0 * 2.0 ** -9     # E4M3-scaled FP4 (compressed KV): scale >= 2^-9
_FP4_E8M0_FLOOR32, _FP4_E4M3_FLOOR32 = np.float32(FP4_E8M0_FLOOR), np.float32(FP4_E4M3_FLOOR / FP4_MAX)
MXFP8_AMAX_FLOOR = 1e-4
_INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
_INV_E4M3_MAX32, _AMAX_FLOOR32 = np.float32(1.0 / E4M3_MAX), np.float32(MXFP8_AMAX_FLOOR)   # mxfp8_qdq's


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to BF16 (RNE) and return FP32: the model's rounding points, computed in FP32."""
    return x.to(torch.bfloat16).float()


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(v)) for positive finite v, as int32."""
    mant, exp = torch.frexp(v.double())  # v = mant * 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)


def _e8m0_table() -> torch.Tensor:
    return torch.ldexp(torch.ones(256), torch.arange(256, dtype=torch.int32) - 127)


E8M0_VALUES = _e8m0_table()   # code -> 2^(code-127) in FP32; one lookup decodes any shape


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    return E8M0_VALUES.to(code.device).index_select(0, code.reshape(-1).long()).reshape(code.shape)


def e8m0_from_exp(exp: torch.Tensor) -> torch.Tensor:
    if exp.numel() and (int(exp.min()) < -127 or int(exp.max()) > 127):
        raise ValueError(f"E8M0 exponent out of range [-127, 127]: [{int(exp.min())}, {int(exp.max())}]")
    return (exp + 127).to(torch.uint8)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """RNE cast to float8_e4m3fn with saturation at +-448 (torch's cast alone would give NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_E4M3_VALUES32 = E4M3_VALUES.numpy()       # fp4_groups' E4M3 scales' values


def e4m3_decode(payload: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 payload -> FP32 values by table: the same values as ``payload.float()``, whose
    element-wise cast is several times slower on CPU. Other dtypes are cast as before."""
    if payload.dtype != torch.float8_e4m3fn:
        return payload.float()
    codes = payload.view(torch.uint8).reshape(-1).long()
    return E4M3_VALUES.to(payload.device).index_select(0, codes).reshape(payload.shape)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"last dim {n} is not a multiple of the group size {group}")
    return x.float().reshape(*x.shape[:-1], n // group, group)


# ---- MXFP8 (E4M3 payload, E8M0 scale per group of 32) ----------------------------------------

def mxfp8_encode(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Official act_quant ceil rule: scale = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))."""
    rows = _groups(x, group).reshape(-1, x.shape[-1]).contiguous()
    encoded = _fp8_compiled(rows, 1, group)
    if encoded is None:
        return _mxfp8_encode_ops(x, group)
    payload, scale = encoded
    return payload.reshape(x.shape), scale.reshape(*x.shape[:-1], x.shape[-1] // group)


def _fp8_compiled(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """FP32 w [N, K] encoded in blocks of rows x cols by one compiled pass (``quant_kernels.fp8_blocks``:
    the bytes of the Torch ops below), or None where w holds a non-finite value."""
    payload = torch.empty(w.shape, dtype=torch.uint8)
    scale = torch.empty(w.shape[0] // rows, w.shape[1] // cols, dtype=torch.uint8)
    if not fp8_blocks(w.numpy(), payload.numpy(), scale.numpy(), rows, cols, _AMAX_FLOOR32, _INV_E4M3_MAX32):
        return None
    return payload.view(torch.float8_e4m3fn), scale


def _mxfp8_encode_ops(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mxfp8_encode`` as Torch ops: the result for non-finite values (the reference the compiled
    pass's bytes are tested against)."""
    g = _groups(x, group)
    amax = g.abs().amax(-1).clamp_min(MXFP8_AMAX_FLOOR)
    exp = ceil_log2(amax * _INV_E4M3_MAX)
    payload = e4m3(g / torch.ldexp(torch.ones_like(amax), exp).unsqueeze(-1))
    return payload.reshape(x.shape), e8m0_from_exp(exp)


def mxfp8_decode(payload: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    p = _groups(e4m3_decode(payload), group)
    return (p * e8m0_decode(scale).unsqueeze(-1)).reshape(payload.shape)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) for positive normal FP32 v whose result is normal, from the bits: adding
    2^23 - 1 carries into the exponent exactly when the mantissa is not zero."""
    return ((v.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def mxfp8_qdq(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Dynamic MXFP8 activation fake-quantization (per row, groups of 32 along the last dim):
    ``mxfp8_decode(*mxfp8_encode(x))`` for finite x without materialising the codes. The scale
    2^ceil(log2(amax/448)) is what its E8M0 code decodes to; with amax floored at 1e-4 and finite it
    lies in [2^-22, 2^120], where ``pow2_ceil`` is exact, so the bits are the same in fewer ops: one
    compiled pass (``cpu.quant_kernels``)."""
    rows = _groups(x, group).reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    mxfp8_qdq_rows(rows.numpy(), out.numpy(), group, _AMAX_FLOOR32, _INV_E4M3_MAX32)
    return out.reshape(x.shape)


# ---- FP4 E2M1 --------------------------------------------------------------------------------

def fp4_codes(n: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of n (already scaled into [-6, 6]); midpoint ties go to the even code.

    The code counts the midpoints below |n|: a tie on midpoint i (between codes i and i+1) counts
    only when i is odd, so it lands on the even neighbour. Written as negated comparisons so NaN
    counts every midpoint (code 7, as a sorted search puts it). Seven passes of one compare each
    are ~6x faster on CPU than a search plus a tie fix-up (writing FLASH expert checkpoints)."""
    a = n.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    passed = torch.empty(a.shape, dtype=torch.bool, device=a.device)    # one buffer for the seven passes
    for i, m in enumerate(_FP4_MIDPOINTS.tolist()):
        (torch.lt if i % 2 else torch.le)(a, m, out=passed)
        code += passed.logical_not_()
    return code | (torch.signbit(n).to(torch.uint8) << 3)


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    mag = FP4_LEVELS.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Element 2j in the low nibble, 2j+1 in the high nibble."""
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_encode(x: torch.Tensor, group: int, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 payload [..., n/2] and one scale per group.

    scale_fmt 'e8m0': s = 2^ceil(log2(max(amax, 6*2^-126)/6)), stored as an E8M0 code (uint8).
    scale_fmt 'e4m3': s = e4m3(max(amax/6, 2^-9)), stored as float8_e4m3fn (RNE may give s < amax/6;
    the clamp to +-6 absorbs it).
    One compiled pass (``quant_kernels.fp4_groups``) with the bytes of the Torch ops below, which
    give the result where x holds a non-finite value.
    """
    if scale_fmt not in ("e8m0", "e4m3"):
        raise ValueError(f"scale_fmt must be 'e8m0' or 'e4m3', got {scale_fmt!r}")
    rows = _groups(x, group).reshape(-1, x.shape[-1]).contiguous()
    payload = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=torch.uint8)
    scale = torch.empty(rows.shape[0], rows.shape[1] // group, dtype=torch.uint8)
    e4m3_scale = scale_fmt == "e4m3"
    floor = _FP4_E4M3_FLOOR32 if e4m3_scale else _FP4_E8M0_FLOOR32
    if not fp4_groups(rows.numpy(), payload.numpy(), scale.numpy(), group, e4m3_scale, floor, _E4M3_VALUES32):
        return _mxfp4_encode_ops(x, group, scale_fmt)
    scale = scale.view(torch.float8_e4m3fn) if e4m3_scale else scale
    return payload.reshape(*x.shape[:-1], x.shape[-1] // 2), scale.reshape(*x.shape[:-1], x.shape[-1] // group)


def _mxfp4_encode_ops(x: torch.Tensor, group: int, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``mxfp4_encode`` as Torch ops: the result for non-finite values (the reference the compiled
    pass's bytes are tested against)."""
    g = _groups(x, group)
    amax = g.abs().amax(-1)
    if scale_fmt == "e8m0":
        exp = ceil_log2(amax.clamp_min(FP4_E8M0_FLOOR) / FP4_MAX)
        s, scale = torch.ldexp(torch.ones_like(amax), exp), e8m0_from_exp(exp)
    else:
        scale = e4m3((amax / FP4_MAX).clamp_min(FP4_E4M3_FLOOR / FP4_MAX))
        s = scale.float()
    n = (g / s.unsqueeze(-1)).clamp_(-FP4_MAX, FP4_MAX)
    return pack_nibbles(fp4_codes(n).reshape(x.shape)), scale


def _fp4_pair_table() -> torch.Tensor:
    return fp4_values(unpack_nibbles(torch.arange(256, dtype=torch.uint8)[:, None]))


FP4_PAIRS = _fp4_pair_table()   # packed byte -> its (low, high) E2M1 values


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    v = FP4_PAIRS.to(packed.device).index_select(0, packed.reshape(-1).long())
    v = v.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    s = e8m0_decode(scale) if scale.dtype == torch.uint8 else e4m3_decode(scale)
    return (_groups(v, group) * s.unsqueeze(-1)).reshape(v.shape)


def mxfp4_qdq(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP4 fake-quantization with E8M0 scales (the index query's official rounding)."""
    return mxfp4_decode(*mxfp4_encode(x, group, "e8m0"), group)


# ---- weights (checkpoint layouts, output-major [N, K]) ----------------------------------------

def block_mxfp8_encode(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 payload [N, K] with one E8M0 scale per 32x32 block ([N/32, K/32])."""
    if w.shape[0] % block or w.shape[1] % block:
        raise ValueError(f"w: both dims must be multiples of the block {block}, got {tuple(w.shape)}")
    encoded = _fp8_compiled(w.float().contiguous(), block, block)
    return encoded if encoded is not None else _block_mxfp8_encode_ops(w, block)


def _block_mxfp8_encode_ops(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_mxfp8_encode`` as Torch ops: the result for non-finite values (the reference the
    compiled pass's bytes are tested against)."""
    n, k = w.shape
    b = w.float().reshape(n // block, block, k // block, block)
    amax = b.abs().amax(dim=(1, 3)).clamp_min(MXFP8_AMAX_FLOOR)
    exp = ceil_log2(amax * _INV_E4M3_MAX)
    s = torch.ldexp(torch.ones_like(amax), exp)[:, None, :, None]
    return e4m3(b / s).reshape(n, k), e8m0_from_exp(exp)


def block_mxfp8_decode(payload: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    n, k = payload.shape
    s = e8m0_decode(scale)[:, None, :, None]
    return (e4m3_decode(payload).reshape(n // block, block, k // block, block) * s).reshape(n, k)


def _scaled_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(scale code, payload byte) -> decoded FP64 value(s): every FP32 product the formulas form
    (E4M3 value x 2^(s-127); the two E2M1 values of a packed byte x 2^(s-127)), widened to FP64."""
    scale = E8M0_VALUES[:, None]
    fp8 = (E4M3_VALUES[None, :] * scale).double().reshape(-1)
    fp4 = (FP4_PAIRS[None] * scale[..., None]).double().reshape(-1, 2)
    return fp8, fp4


FP8_BY_SCALE, FP4_PAIRS_BY_SCALE = _scaled_tables()   # index: scale code << 8 | payload byte


def block_mxfp8_decode64(payload: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``block_mxfp8_decode(payload, scale).double()`` in one table lookup per element (weights
    decoded on each use are read in FP64 by the matmuls)."""
    n, k = payload.shape
    idx = payload.view(torch.uint8).to(torch.int32).view(n // block, block, k // block, block) \
        + (scale.view(torch.uint8).to(torch.int32) << 8).view(n // block, 1, k // block, 1)
    return FP8_BY_SCALE.to(payload.device).index_select(0, idx.reshape(-1)).view(n, k)


def expert_mxfp4_decode64(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``expert_mxfp4_decode(packed, scale).double()`` in one table lookup per packed byte."""
    n, half = packed.shape
    idx = packed.view(torch.uint8).to(torch.int32).view(n, scale.shape[1], -1) \
        + (scale.view(torch.uint8).to(torch.int32) << 8).view(n, -1, 1)
    return FP4_PAIRS_BY_SCALE.to(packed.device).index_select(0, idx.reshape(-1)).view(n, 2 * half)


def expert_mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed-expert layout: packed E2M1 [N, K/2] (low nibble = even k), E8M0 scale [N, K/32]."""
    return mxfp4_encode(w, 32, "e8m0")


def expert_mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return mxfp4_decode(packed, scale, 32)
