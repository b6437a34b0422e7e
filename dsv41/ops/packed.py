"""A weight matrix held in its checkpoint format, multiplied tile by tile as it is decoded.

``PackedMatrix`` keeps the stored bytes (MXFP8 E4M3 with 32x32 E8M0 block scales, packed MXFP4 with
per-row group-32 E8M0 scales, BF16, FP32) and computes ``a @ w^T`` the way ``ops.projections.matmul_t``
defines it (every product and the sum in FP64, rounded to FP32 once) without ever holding the whole
decoded matrix: a tile of rows small enough to stay in the core's cache is decoded to FP64 and
multiplied while it is there. Decoding the whole matrix first wrote and read it back through memory
at 8 B a value, on every use; at FLASH widths that, not the arithmetic, was the step.

A tile decodes with bit moves and one small table, never a per-value index into a big one:

- an E4M3 byte sign-extended to 16 bits and shifted left by 7, with bit 14 cleared, is the FP16 whose
  value is the E4M3 value times 2^-8 (the FP16 exponent field holds the E4M3 one, subnormals included),
  widened exactly to FP64;
- a packed E2M1 byte looks up its two values as one 16-byte element of a 256-entry table;
- the E8M0 scale, a power of two built from its exponent bits, multiplies the FP64 values.

Each value is then the exact product ``value x 2^(s-127)``. ``quant``'s decoders form that product in
FP32, where it is exact as well (at most 4 significant bits, none below 2^-139) unless it overflows,
so the two agree bit for bit (``tests/test_packed.py`` holds them to the table decoders over every
byte and scale). A matrix with a scale code above 246 (where 448 x 2^(s-127) overflows FP32) or an
E4M3 NaN byte is decoded by those tables instead.
"""
from __future__ import annotations

import torch

from dsv41.ops.quant import block_mxfp8_decode64, expert_mxfp4_decode64, fp4_values, unpack_nibbles

TILE_VALUES = 1 << 19     # values per decoded tile: 4 MiB in FP64, in the L3 (bench/cpu_roofline.py: 2^16-2^21
                          # measured, 2^19-2^20 fastest with other work on the cores; smaller tiles pay per-op costs)
_FP8_SHIFT = 8            # the FP16 form of an E4M3 byte carries its value times 2^-8
_FAST_SCALE_MAX = 246     # largest E8M0 code for which 448 x 2^(s-127) is a finite FP32 (so the FP32 products
                          # the decoders form are exact, and equal to the FP64 ones formed here)


def _pow2(codes: torch.Tensor, shift: int) -> torch.Tensor:
    """E8M0 codes -> FP64 2^(s-127+shift), built from the exponent bits."""
    return ((codes.view(torch.uint8).to(torch.int64) + (896 + shift)) << 52).view(torch.float64)


def _fp8_fp16(payload: torch.Tensor) -> torch.Tensor:
    x = payload.view(torch.int8).to(torch.int16)
    x <<= 7
    x &= -16385                      # 0xBFFF: clear bit 14, which a negative byte's sign extension set
    return x.view(torch.float16)


def _fp4_pair_table() -> torch.Tensor:
    """Packed byte -> its (low, high) E2M1 values as one complex128 element (two FP64 halves), so
    one lookup per byte writes both values in place."""
    pairs = fp4_values(unpack_nibbles(torch.arange(256, dtype=torch.uint8)[:, None]))
    return pairs.double().contiguous().view(torch.complex128).reshape(256)


_FP4_PAIRS64 = _fp4_pair_table()


class PackedMatrix:
    """[N, K] weight in checkpoint format ``fmt`` ('fp8', 'fp4', 'bf16', 'f32'); see the module."""

    def __init__(self, fmt: str, payload: torch.Tensor, scale: torch.Tensor | None = None):
        if fmt not in ("fp8", "fp4", "bf16", "f32"):
            raise ValueError(f"PackedMatrix: fmt must be fp8, fp4, bf16 or f32, got {fmt!r}")
        self.fmt, self.payload, self.scale = fmt, payload, scale
        k = payload.shape[1] * (2 if fmt == "fp4" else 1)
        self.shape = torch.Size((payload.shape[0], k))
        self._exact_tables = fmt in ("fp8", "fp4") and self._needs_tables()

    def _needs_tables(self) -> bool:
        if self.scale.numel() and int(self.scale.view(torch.uint8).max()) > _FAST_SCALE_MAX:
            return True
        if self.fmt == "fp8":
            return bool(((self.payload.view(torch.uint8) & 0x7F) == 0x7F).any())   # E4M3 NaN
        return False

    def rows(self, a: int, b: int) -> "PackedMatrix":
        """Rows [a, b) (whole 32-row blocks for fp8)."""
        if self.fmt == "fp8":
            return PackedMatrix("fp8", self.payload[a:b], self.scale[a // 32:b // 32])
        return PackedMatrix(self.fmt, self.payload[a:b], None if self.scale is None else self.scale[a:b])

    def cols(self, a: int, b: int) -> "PackedMatrix":
        """Columns [a, b) (whole 32-column groups for fp8 and fp4)."""
        if self.fmt == "fp8":
            return PackedMatrix("fp8", self.payload[:, a:b], self.scale[:, a // 32:b // 32])
        if self.fmt == "fp4":
            return PackedMatrix("fp4", self.payload[:, a // 2:b // 2], self.scale[:, a // 32:b // 32])
        return PackedMatrix(self.fmt, self.payload[:, a:b])

    def _tile_rows(self) -> int:
        rows = max(1, TILE_VALUES // max(1, self.shape[1]))
        return max(32, rows - rows % 32) if self.fmt == "fp8" else rows

    def _values(self, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) as FP64 values before their scales (fp8: times 2^-8), [b - a, K]."""
        if self.fmt == "fp8":
            return _fp8_fp16(self.payload[a:b]).float().double()
        if self.fmt == "fp4":
            idx = self.payload[a:b].view(torch.uint8).reshape(-1).to(torch.int32)
            return _FP4_PAIRS64.index_select(0, idx).view(torch.float64).view(b - a, -1)
        return self.payload[a:b].double()

    def tile64(self, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) decoded to FP64 [b - a, K] (fp8: a and b on 32-row blocks)."""
        if self._exact_tables:
            p = self.rows(a, b)
            decode = block_mxfp8_decode64 if self.fmt == "fp8" else expert_mxfp4_decode64
            return decode(p.payload, p.scale.view(torch.uint8))
        v = self._values(a, b)
        if self.fmt == "fp8":
            s = _pow2(self.scale[a // 32:b // 32], _FP8_SHIFT)
            v.view((b - a) // 32, 32, -1, 32).mul_(s[:, None, :, None])
        elif self.fmt == "fp4":
            s = _pow2(self.scale[a:b], 0)
            v.view(b - a, s.shape[1], -1).mul_(s[:, :, None])
        return v

    def dense(self) -> torch.Tensor:
        """The whole matrix decoded to FP64 (what ``weights.decode_tensor`` gives for it)."""
        if self.fmt in ("bf16", "f32"):
            return self.payload.double()
        n, step = self.shape[0], self._tile_rows()
        return torch.cat([self.tile64(a, min(n, a + step)) for a in range(0, n, step)])

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ self^T in FP64, rounded to FP32 once -> [M, N]."""
        x64 = x.double()
        n, step = self.shape[0], self._tile_rows()
        parts = [torch.mm(x64, self.tile64(a, min(n, a + step)).t()) for a in range(0, n, step)]
        return torch.cat(parts, dim=1).float()
