"""The checkpoint reader's value check (``reader._bad_values``): one max over each chunk of the bits
finds every code the format may not hold, and passes every one it may."""
from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint import reader


def _with(dtype: torch.dtype, bits_type: torch.dtype, codes: list[int], n: int = 1000) -> torch.Tensor:
    """n zero values of ``dtype`` with ``codes`` (as its bits) at the end."""
    bits = torch.zeros(n, dtype=bits_type)
    bits[n - len(codes):] = torch.tensor(codes, dtype=torch.int64).to(bits_type)
    return bits.view(dtype).reshape(10, n // 10)


# dtype, its bits, the largest allowed codes (either sign), each code that may not appear
CASES = [
    (torch.bfloat16, torch.int16, [0x7F7F, -0x80 - 1], [0x7F80, 0x7FC0, -0x80, -0x40, 0x7FFF]),
    (torch.float32, torch.int32, [0x7F7FFFFF, -0x00800001], [0x7F800000, 0x7FC00000, -0x00800000, -1]),
    (torch.float8_e4m3fn, torch.uint8, [0x7E, 0xFE], [0x7F, 0xFF]),
    (torch.float8_e8m0fnu, torch.uint8, [0xFE, 0x00], [0xFF]),
]


@pytest.mark.parametrize("dtype, bits_type, allowed, bad", CASES)
def test_every_disallowed_code_is_found_in_any_chunk(monkeypatch, dtype, bits_type, allowed, bad):
    monkeypatch.setattr(reader, "_CHUNK", 64)            # the bad value lies in the last of 16 chunks
    assert reader._bad_values(_with(dtype, bits_type, allowed)) is None
    for code in bad:
        t = _with(dtype, bits_type, allowed + [code])
        mask, _ = reader._bad_values(t)
        assert mask.shape == t.shape and mask.reshape(-1).nonzero().reshape(-1).tolist() == [999], hex(code)
    assert reader._bad_values(torch.zeros(0, dtype=dtype)) is None
