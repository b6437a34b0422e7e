"""Quantized paged caches: encode on publish, decode on read (the device ABI's formats).

Caches are flat [rows, width] views of [blocks, block_size, 1, width]; a physical row id is
block * block_size + offset. Publication writes only rows with slot >= 0; every other byte stays.

| cache       | payload                     | scale                          |
| window KV   | FP8 E4M3 [rows, hd]         | E8M0 u8 [rows, hd/32]          |
| compressed  | packed E2M1 u8 [rows, hd/2] | FP8 E4M3 [rows, hd/16]         |
| index keys  | packed E2M1 u8 [rows, d/2]  | E8M0 u8 [rows, d/32]           |
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsv41.ops.quant import (E4M3_VALUES, E8M0_VALUES, FP4_PAIRS, mxfp4_decode, mxfp4_encode, mxfp8_decode,
                             mxfp8_encode, round_bf16)

WINDOW, COMPRESSED, INDEX = "window", "compressed", "index"


@dataclass(frozen=True)
class CacheFormat:
    kind: str
    group: int

    def empty(self, rows: int, width: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group
        if self.kind == WINDOW:
            return (torch.zeros(rows, width, dtype=torch.float8_e4m3fn, device=device),
                    torch.full((rows, width // g), 127, dtype=torch.uint8, device=device))
        scale_dtype = torch.float8_e4m3fn if self.kind == COMPRESSED else torch.uint8
        return (torch.zeros(rows, width // 2, dtype=torch.uint8, device=device),
                torch.zeros(rows, width // g, dtype=scale_dtype, device=device))

    def encode(self, values: torch.Tensor):
        if self.kind == WINDOW:
            return mxfp8_encode(values, self.group)
        return mxfp4_encode(values, self.group, "e4m3" if self.kind == COMPRESSED else "e8m0")

    def decode(self, payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.kind == WINDOW:
            return round_bf16(mxfp8_decode(payload, scale, self.group))
        return round_bf16(mxfp4_decode(payload, scale, self.group))

    def row_bytes(self, width: int) -> int:
        payload = width if self.kind == WINDOW else width // 2
        return payload + width // self.group


FORMATS = {WINDOW: CacheFormat(WINDOW, 32), COMPRESSED: CacheFormat(COMPRESSED, 16), INDEX: CacheFormat(INDEX, 32)}


@functools.cache
def value_table(kind: str) -> torch.Tensor:
    """(scale byte, payload byte) -> the payload byte's value(s) as ``read`` decodes them (the FP32
    product, rounded to BF16), in FP64: [256, 256] for the window's FP8 bytes, [256, 256, 2] (a packed
    byte's low and high element) for the FP4 caches. A compiled decoder looks values up here."""
    scales = E8M0_VALUES if kind in (WINDOW, INDEX) else E4M3_VALUES
    payload = E4M3_VALUES if kind == WINDOW else FP4_PAIRS
    shape = (256,) + (1,) * payload.dim()
    return round_bf16(payload.unsqueeze(0) * scales.reshape(shape)).double().contiguous()


def publish(payload: torch.Tensor, scale: torch.Tensor, fmt: CacheFormat, slots: torch.Tensor,
            values: torch.Tensor) -> None:
    """Encode the rows of values whose slot >= 0 and write them in place; nothing else changes."""
    keep = slots >= 0
    if not keep.any():
        return
    s = slots[keep].long()
    if int(s.max()) >= payload.shape[0]:
        raise ValueError(f"slots: must be < cache rows {payload.shape[0]}, got {int(s.max())}")
    p, sc = fmt.encode(values[keep])
    payload[s] = p
    scale[s] = sc


def read(payload: torch.Tensor, scale: torch.Tensor, fmt: CacheFormat, rows: torch.Tensor) -> torch.Tensor:
    """Decoded BF16-valued rows [*rows.shape, width]; row id -1 reads as zeros."""
    flat = rows.reshape(-1).long()
    ok = flat >= 0
    vals = fmt.decode(payload[flat.clamp_min(0)], scale[flat.clamp_min(0)])
    vals = vals * ok.unsqueeze(-1)
    return vals.reshape(*rows.shape, vals.shape[-1])
