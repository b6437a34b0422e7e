"""A weight matrix held in its checkpoint format, multiplied tile by tile as it is decoded.

``PackedMatrix`` keeps the stored bytes (MXFP8 E4M3 with 32x32 E8M0 block scales, packed MXFP4 with
per-row group-32 E8M0 scales, BF16, FP32) and computes ``a @ w^T`` the way ``ops.projections.matmul_t``
defines it (every product and the sum in FP64, rounded to FP32 once) without ever holding the whole
decoded matrix: a tile of rows small enough to stay in the core's cache is decoded to FP64 and
multiplied while it is there. Decoding the whole matrix first wrote and read it back through memory
at 8 B a value, on every use; at FLASH widths that, not the arithmetic, was the step.

How a tile decodes (each the cheapest of the forms measured here, ``bench/cpu_rates.py``):

- FP8: an E4M3 byte sign-extended to 16 bits and shifted left by 7, with bit 14 cleared, is the FP16
  whose value is the E4M3 value times 2^-8 (the FP16 exponent field holds the E4M3 one, subnormals
  included); it widens exactly to FP64, where the block's scale 2^(s-119), built from its exponent
  bits, multiplies it. That is the exact product E4M3 x 2^(s-127); ``quant``'s decoders form it in
  FP32, where it is exact as well (at most 4 significant bits, none below 2^-139) unless it
  overflows, so the two agree bit for bit. A matrix with a scale code above 246 (where 448 x
  2^(s-127) overflows FP32) or an E4M3 NaN byte is decoded by ``quant``'s table instead.
- FP4: one lookup per packed byte in ``quant``'s table of (scale code, byte) -> the byte's two scaled
  values (the decoders' own FP32 products in FP64), read as one 16-byte element.
- BF16, FP32: widened to FP64.

``tests/test_packed.py`` holds every byte at every scale to the formats' definitions.
"""
from __future__ import annotations

import torch

from dsv41.ops.quant import FP4_PAIRS_BY_SCALE, block_mxfp8_decode64, expert_mxfp4_decode64

TILE_VALUES = 1 << 19     # values per decoded tile: 4 MiB in FP64, in the L3 (bench/cpu_roofline.py: 2^16-2^21
                          # measured, 2^19-2^20 fastest with other work on the cores; smaller tiles pay per-op costs)
_FP8_SHIFT = 8            # the FP16 form of an E4M3 byte carries its value times 2^-8
_FAST_SCALE_MAX = 246     # largest E8M0 code for which 448 x 2^(s-127) is a finite FP32 (so the FP32 products
                          # the decoders form are exact, and equal to the FP64 ones formed here)


def _pow2(codes: torch.Tensor, shift: int) -> torch.Tensor:
    """E8M0 codes -> FP64 2^(s-127+shift), built from the exponent bits."""
    return ((codes.view(torch.uint8).to(torch.int64) + (896 + shift)) << 52).view(torch.float64)


# (scale code << 8 | packed byte) -> the byte's two scaled E2M1 values as one complex128 element (two
# FP64 halves, low nibble first): one lookup per byte writes both decoded values in place
_FP4_PAIRS64 = FP4_PAIRS_BY_SCALE.view(torch.complex128).reshape(-1)


class _Scratch:
    """One product's tile buffers, reused by each of its tiles: a fresh allocation per tile costs page
    faults on every tile (buffers this size come from ``mmap`` whenever the allocator gives memory back)."""

    def __init__(self, fmt: str, rows: int, k: int):
        self.f64 = torch.empty(rows, k, dtype=torch.float64)
        if fmt == "fp8":
            self.i16 = torch.empty(rows, k, dtype=torch.int16)
            self.f32 = torch.empty(rows, k, dtype=torch.float32)
        elif fmt == "fp4":
            self.i32 = torch.empty(rows, k // 32, 16, dtype=torch.int32)


class PackedMatrix:
    """[N, K] weight in checkpoint format ``fmt`` ('fp8', 'fp4', 'bf16', 'f32'); see the module.
    ``exact_tables`` is for slices of a checked matrix (None: check this one)."""

    def __init__(self, fmt: str, payload: torch.Tensor, scale: torch.Tensor | None = None,
                 exact_tables: bool | None = None):
        if fmt not in ("fp8", "fp4", "bf16", "f32"):
            raise ValueError(f"PackedMatrix: fmt must be fp8, fp4, bf16 or f32, got {fmt!r}")
        self.fmt, self.payload, self.scale = fmt, payload, scale
        k = payload.shape[1] * (2 if fmt == "fp4" else 1)
        self.shape = torch.Size((payload.shape[0], k))
        self._exact_tables = self._needs_tables() if exact_tables is None else exact_tables

    def _needs_tables(self) -> bool:
        if self.fmt != "fp8":
            return False
        if self.scale.numel() and int(self.scale.view(torch.uint8).max()) > _FAST_SCALE_MAX:
            return True
        return bool(((self.payload.view(torch.uint8) & 0x7F) == 0x7F).any())   # E4M3 NaN

    def rows(self, a: int, b: int) -> "PackedMatrix":
        """Rows [a, b) (whole 32-row blocks for fp8)."""
        scale = None if self.scale is None else self.scale[a // 32:b // 32] if self.fmt == "fp8" else self.scale[a:b]
        return PackedMatrix(self.fmt, self.payload[a:b], scale, self._exact_tables)

    def cols(self, a: int, b: int) -> "PackedMatrix":
        """Columns [a, b) (whole 32-column groups for fp8 and fp4)."""
        if self.scale is None:
            return PackedMatrix(self.fmt, self.payload[:, a:b], None, False)
        half = 2 if self.fmt == "fp4" else 1
        return PackedMatrix(self.fmt, self.payload[:, a // half:b // half], self.scale[:, a // 32:b // 32],
                            self._exact_tables)

    def _tile_rows(self) -> int:
        rows = max(1, TILE_VALUES // max(1, self.shape[1]))
        rows = max(32, rows - rows % 32) if self.fmt == "fp8" else rows
        return min(rows, self.shape[0])

    def _tile(self, a: int, b: int, scratch: _Scratch) -> torch.Tensor:
        """Rows [a, b) decoded to FP64 [b - a, K] in ``scratch`` (fp8: a and b on 32-row blocks)."""
        out = scratch.f64[:b - a]
        if self._exact_tables:
            p = self.rows(a, b)
            return out.copy_(block_mxfp8_decode64(p.payload, p.scale.view(torch.uint8)))
        if self.fmt == "fp8":
            x = scratch.i16[:b - a]
            x.copy_(self.payload[a:b].view(torch.int8))
            x <<= 7
            x &= -16385                    # 0xBFFF: clear bit 14, which a negative byte's sign extension set
            out.copy_(scratch.f32[:b - a].copy_(x.view(torch.float16)))
            s = _pow2(self.scale[a // 32:b // 32], _FP8_SHIFT)
            out.view((b - a) // 32, 32, -1, 32).mul_(s[:, None, :, None])
        elif self.fmt == "fp4":
            idx = scratch.i32[:b - a]
            idx.copy_(self.payload[a:b].view(torch.uint8).view(idx.shape))
            idx += (self.scale[a:b].view(torch.uint8).to(torch.int32) << 8)[:, :, None]
            torch.index_select(_FP4_PAIRS64, 0, idx.view(-1), out=out.view(torch.complex128).view(-1))
        else:
            out.copy_(self.payload[a:b])
        return out

    def _whole(self) -> torch.Tensor:
        """The matrix decoded at once by ``quant``'s tables: for one that fits a tile, whose cost is
        the number of Torch ops (TINY, SMALL, a TP shard's small matrices), not its bytes."""
        if self.fmt == "fp8":
            return block_mxfp8_decode64(self.payload, self.scale.view(torch.uint8))
        if self.fmt == "fp4":
            return expert_mxfp4_decode64(self.payload, self.scale.view(torch.uint8))
        return self.payload.double()

    def _tiles(self):
        """The FP64 tiles, top to bottom; each is overwritten by the next."""
        step = self._tile_rows()
        if step >= self.shape[0]:
            yield self._whole()
            return
        scratch = _Scratch(self.fmt, step, self.shape[1])
        for a in range(0, self.shape[0], step):
            yield self._tile(a, min(self.shape[0], a + step), scratch)

    def dense(self) -> torch.Tensor:
        """The whole matrix decoded to FP64 (what ``weights.decode_tensor`` gives for it)."""
        return torch.cat([t.clone() for t in self._tiles()])

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ self^T in FP64, rounded to FP32 once -> [M, N]."""
        x64 = x.double()
        parts = [torch.mm(x64, t.t()) for t in self._tiles()]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).float()


def matrix(weights, key: str):
    """The weight ``key`` as a product takes it: in its checkpoint format where ``weights`` holds
    those (``CardWeights.matrix``), else the decoded tensor of a plain mapping
    (``weights.decode_checkpoint``, as the DSpark tests build their blocks)."""
    get = getattr(weights, "matrix", None)
    return get(key) if get is not None else weights[key]
