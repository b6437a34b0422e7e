"""MX formats (spec 02 §10, 03 §4): E8M0, E4M3, MXFP8, MXFP4 with E8M0 and E4M3 scales, weight layouts."""
import math

import pytest
import torch

from dsv41.ops import quant
from _spec_ref import (bf16_64, ceil_log2_exact, e4m3_64, fp4_code_ref, fp4_value_ref, mxfp8_qdq_64)


def _rand(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


# ---- scalar formats ---------------------------------------------------------------------------

def test_e8m0_decode_known_codes():
    codes = torch.tensor([0, 1, 126, 127, 128, 200, 254], dtype=torch.uint8)
    want = [2.0 ** (c - 127) for c in codes.tolist()]
    assert quant.e8m0_decode(codes).tolist() == want


def test_e8m0_from_exp_round_trip_and_range():
    exp = torch.arange(-127, 128, dtype=torch.int32)
    codes = quant.e8m0_from_exp(exp)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == list(range(0, 255))
    assert torch.equal(quant.e8m0_decode(codes), torch.pow(2.0, exp.double()).float())
    for bad in (-128, 128):
        with pytest.raises(ValueError, match="E8M0"):
            quant.e8m0_from_exp(torch.tensor([0, bad], dtype=torch.int32))


def test_e4m3_saturates_at_448_and_rounds_rne():
    x = torch.tensor([448.0, 449.0, 464.0, 500.0, 1e6, -1e6, -470.0, float("inf")])
    out = quant.e4m3(x).float()
    assert out.tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0, 448.0]
    # RNE on the e4m3 grid against an independent rounding (normal and subnormal range)
    v = torch.cat([_rand(4000, seed=1) * 40, _rand(1000, seed=2) * 0.01, torch.tensor([2 ** -10, 3 * 2 ** -10])])
    assert torch.equal(quant.e4m3(v).double(), e4m3_64(v))
    # midpoints: 17 is between 16 and 18 -> even mantissa 16; 19 between 18 and 20 -> 20
    assert quant.e4m3(torch.tensor([17.0, 19.0, 1.0625, 1.1875])).float().tolist() == [16.0, 20.0, 1.0, 1.25]


def test_ceil_log2_exact_at_powers_of_two_and_just_above():
    pows = torch.tensor([2.0 ** k for k in range(-126, 127, 7)] + [1.0, 0.5, 2.0 ** -149])
    assert quant.ceil_log2(pows).tolist() == [ceil_log2_exact(float(p)) for p in pows]
    assert quant.ceil_log2(torch.tensor([1.0, 2.0, 1024.0])).tolist() == [0, 1, 10]
    above = torch.nextafter(pows[:-1], torch.tensor(float("inf")))
    assert quant.ceil_log2(above).tolist() == [ceil_log2_exact(float(p)) + 1 for p in pows[:-1]]
    below = torch.nextafter(torch.tensor([1.0, 2.0, 8.0]), torch.tensor(0.0))
    assert quant.ceil_log2(below).tolist() == [0, 1, 3]
    r = _rand(2000, seed=3).abs() * 1000 + 1e-6
    assert quant.ceil_log2(r).tolist() == [ceil_log2_exact(float(v)) for v in r]


# ---- MXFP8 ------------------------------------------------------------------------------------

def test_mxfp8_encode_matches_independent_rule():
    x = torch.cat([_rand(6, 128, seed=4), _rand(2, 128, seed=5) * 1e3, _rand(2, 128, seed=6) * 1e-3])
    payload, scale = quant.mxfp8_encode(x)
    assert payload.dtype == torch.float8_e4m3fn and payload.shape == x.shape
    assert scale.dtype == torch.uint8 and scale.shape == (10, 4)
    g = x.double().reshape(10, 4, 32)
    for r in range(10):
        for c in range(4):
            amax = max(float(g[r, c].abs().max()), 1e-4)
            e = ceil_log2_exact(amax / 448.0)
            assert int(scale[r, c]) == e + 127
            want = e4m3_64(g[r, c] / 2.0 ** e)
            assert torch.equal(payload.reshape(10, 4, 32)[r, c].double(), want)
    dq = quant.mxfp8_decode(payload, scale)
    assert torch.equal(dq.double(), mxfp8_qdq_64(x))
    assert torch.equal(quant.mxfp8_qdq(x), dq)


def test_mxfp8_exact_power_of_two_amax_uses_that_exponent():
    # amax exactly 448 * 2^k -> scale 2^k, and the amax element encodes to exactly 448
    for k in (-10, -1, 0, 1, 5):
        x = torch.zeros(1, 32)
        x[0, 3] = 448.0 * 2 ** k
        x[0, 4] = -1.0 * 2 ** k
        payload, scale = quant.mxfp8_encode(x)
        assert int(scale[0, 0]) == 127 + k
        assert payload.float()[0, 3].item() == 448.0 and payload.float()[0, 4].item() == -1.0
    # one ulp above 448 * 2^k -> next exponent
    x = torch.zeros(1, 32)
    x[0, 0] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))
    assert int(quant.mxfp8_encode(x)[1][0, 0]) == 128


def test_mxfp8_amax_floor_1e4():
    x = torch.zeros(2, 64)
    x[1, 32:] = 1e-6
    x[1, 40] = -3e-5
    payload, scale = quant.mxfp8_encode(x)
    floor_code = ceil_log2_exact(1e-4 / 448.0) + 127          # = -22 + 127
    assert floor_code == 105
    assert scale.tolist() == [[floor_code, floor_code], [floor_code, floor_code]]
    assert (payload.float()[0] == 0).all()                    # zeros stay exactly zero (no NaN)
    s = 2.0 ** (floor_code - 127)
    want = e4m3_64(x[1, 32:].double() / s)
    assert torch.equal(payload[1, 32:].double(), want)
    assert torch.isfinite(quant.mxfp8_decode(payload, scale)).all()


def test_mxfp8_qdq_values_idempotent_and_error_bound():
    x = _rand(16, 256, seed=7) * torch.linspace(0.01, 100, 256)
    y = quant.mxfp8_qdq(x)
    assert torch.equal(quant.mxfp8_qdq(y), y)
    # exactly computable: equals the float64 spec rule value for value
    assert torch.equal(y.double(), mxfp8_qdq_64(x))


def test_mxfp8_qdq_edges_match_the_spec_rule_and_torchs_cast():
    """The compiled pass (``cpu.quant_kernels``) on E4M3's ties in every binade and among the
    subnormals, values rounding up into the next binade, signed zeros, tiny and huge scales: the
    FP64 spec rule value for value, zero signs included; with infinities and NaN in a group, what
    Torch's own ops (clamp, the float8 cast) give, NaN for NaN."""
    grid = quant.E4M3_VALUES[torch.isfinite(quant.E4M3_VALUES)].unique()
    pick = torch.randint(len(grid) - 1, (32, 256), generator=torch.Generator().manual_seed(3))
    ties = ((grid[:-1] + grid[1:]) / 2)[pick]
    ties[:, ::32] = 448.0                                   # scale 1: every tie is one on E4M3's grid
    steps = torch.arange(-8192, 8192, 2, dtype=torch.float32)[:8192].reshape(32, 256) * 2.0 ** -16
    steps[:, ::32] = 448.0                                  # subnormals and their ties (2^-10 steps)
    zeros = torch.zeros(2, 64)
    zeros[0, 1::2] = -0.0
    zeros[1] = -1e-30
    zeros[1, 0] = 448.0
    finite = [ties, ties * 2.0 ** -30, ties * 2.0 ** 40, steps, -steps, zeros, _rand(8, 512, seed=8) * 1e-38,
              _rand(8, 512, seed=9) * 1e36]
    for x in finite:
        y = quant.mxfp8_qdq(x)
        assert torch.equal(y.double(), mxfp8_qdq_64(x))
        assert torch.equal(torch.signbit(y), torch.signbit(mxfp8_qdq_64(x)))
    x = _rand(4, 64, seed=10)
    x[0, 3], x[1, 40], x[2, 7], x[3, 0] = float("inf"), float("-inf"), float("nan"), 3e38
    g = x.reshape(4, 2, 32)
    s = quant.pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(quant.MXFP8_AMAX_FLOOR) * quant._INV_E4M3_MAX)
    want = (quant.e4m3(g / s).float() * s).reshape(x.shape)
    got = quant.mxfp8_qdq(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_mxfp8_rejects_ragged_groups():
    with pytest.raises(ValueError, match="group"):
        quant.mxfp8_encode(torch.zeros(2, 33))


# ---- FP4 E2M1 -------------------------------------------------------------------------------------

def test_fp4_levels_and_midpoint_ties_round_to_even():
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert quant.fp4_codes(levels).tolist() == list(range(8))
    assert quant.fp4_values(torch.arange(16, dtype=torch.uint8)).tolist() == \
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert quant.fp4_values(quant.fp4_codes(ties)).tolist() == want
    assert quant.fp4_values(quant.fp4_codes(-ties)).tolist() == [-w for w in want]
    # just off the midpoints goes to the nearest level
    eps = 1e-3
    assert quant.fp4_values(quant.fp4_codes(ties + eps)).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert quant.fp4_values(quant.fp4_codes(ties - eps)).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_fp4_codes_vs_independent_rounding():
    v = torch.cat([torch.linspace(-6, 6, 4801), _rand(500, seed=8).clamp(-6, 6)])
    got = quant.fp4_codes(v).tolist()
    assert got == [fp4_code_ref(float(a)) for a in v]


def test_fp4_sign_bit_and_negative_zero():
    codes = quant.fp4_codes(torch.tensor([-0.0, 0.0, -0.1, 0.1, -6.0]))
    assert codes.tolist() == [0x8, 0x0, 0x8, 0x0, 0xF]
    vals = quant.fp4_values(codes)
    assert vals[0].item() == 0.0 and math.copysign(1.0, vals[0].item()) < 0


def test_nibble_packing_low_is_even_element():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8, 0x0, 0x7]], dtype=torch.uint8)
    packed = quant.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x8F, 0x70]]
    assert torch.equal(quant.unpack_nibbles(packed), codes)


# ---- MXFP4 group encode/decode --------------------------------------------------------------

def _mxfp4_ref(x: torch.Tensor, group: int, fmt: str):
    """(codes, scale values) per spec 02 §10, float64."""
    g = x.double().reshape(*x.shape[:-1], -1, group)
    codes, scales = [], []
    for row in g.reshape(-1, group):
        amax = float(row.abs().max())
        if fmt == "e8m0":
            s = 2.0 ** ceil_log2_exact(max(amax, 6 * 2.0 ** -126) / 6.0)
        else:
            s = float(e4m3_64(torch.tensor(max(amax / 6.0, 2.0 ** -9))))
        scales.append(s)
        codes.extend(fp4_code_ref(float(min(max(v / s, -6.0), 6.0))) for v in row)
    return torch.tensor(codes).reshape(x.shape), torch.tensor(scales, dtype=torch.float64).reshape(g.shape[:-1])


@pytest.mark.parametrize("fmt,group", [("e8m0", 32), ("e4m3", 16)])
def test_mxfp4_encode_decode_vs_independent(fmt, group):
    x = torch.cat([_rand(6, 64, seed=9) * 3, _rand(2, 64, seed=10) * 1e-4])
    x[0, :group] = 0.0                                      # an all-zero group
    packed, scale = quant.mxfp4_encode(x, group, fmt)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert scale.shape == (8, 64 // group)
    assert scale.dtype == (torch.uint8 if fmt == "e8m0" else torch.float8_e4m3fn)
    codes, svals = _mxfp4_ref(x, group, fmt)
    assert torch.equal(quant.unpack_nibbles(packed).long(), codes)
    got_s = quant.e8m0_decode(scale).double() if fmt == "e8m0" else scale.double()
    assert torch.equal(got_s, svals)
    dq = quant.mxfp4_decode(packed, scale, group)
    want = torch.tensor([fp4_value_ref(int(c)) for c in codes.flatten()], dtype=torch.float64).reshape(x.shape)
    want = (want.reshape(8, -1, group) * svals.unsqueeze(-1)).reshape(x.shape)
    assert torch.equal(dq.double(), want)
    assert torch.equal(dq.double(), bf16_64(dq))         # decodes are exactly BF16-representable


def test_mxfp4_e8m0_known_group():
    # amax 6 -> scale 2^0 -> values map straight onto the levels (incl. midpoint ties)
    x = torch.zeros(1, 32)
    x[0, :9] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0])
    packed, scale = quant.mxfp4_encode(x, 32, "e8m0")
    assert scale.tolist() == [[127]]
    assert quant.mxfp4_decode(packed, scale, 32)[0, :9].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0]
    assert packed[0, 0].item() == (0x7 | (0x0 << 4))       # elements 0 (6.0) low, 1 (0.25->0) high
    # amax 12 -> scale 2; amax 7 -> ceil(log2(7/6)) = 1 too; amax exactly 3 -> 2^-1
    for amax, code in [(12.0, 128), (7.0, 128), (3.0, 126), (6.0 * 2 ** -126 / 2, 1), (0.0, 1)]:
        x = torch.zeros(1, 32)
        x[0, 5] = amax
        assert quant.mxfp4_encode(x, 32, "e8m0")[1].tolist() == [[code]]


def test_mxfp4_e4m3_scale_floor_and_rounding():
    x = torch.zeros(2, 16)
    x[1, 0] = 6.0 * 13.0               # amax/6 = 13 -> e4m3(13) = 13 exactly
    x[1, 1] = 6.0 * 13.0 * 0.5
    packed, scale = quant.mxfp4_encode(x, 16, "e4m3")
    assert scale.float().tolist() == [[2.0 ** -9], [13.0]]    # zero group -> floor scale 2^-9
    dq = quant.mxfp4_decode(packed, scale, 16)
    assert dq[0].abs().sum().item() == 0.0
    assert dq[1, :2].tolist() == [78.0, 39.0]
    # RNE of the scale can give s < amax/6: amax/6 = 10.3 -> e4m3 10; v/s = 6.18 clamps to level 6
    x = torch.zeros(1, 16)
    x[0, 1] = -6.0 * 10.3
    x[0, 2] = 1.0
    packed, scale = quant.mxfp4_encode(x, 16, "e4m3")
    assert scale.float().item() == 10.0
    dq = quant.mxfp4_decode(packed, scale, 16)
    assert dq[0, 1].item() == -60.0 and dq[0, 2].item() == 0.0   # 1/10 = 0.1 -> level 0


def test_mxfp4_qdq_is_e8m0_group32():
    x = _rand(4, 128, seed=11)
    assert torch.equal(quant.mxfp4_qdq(x), quant.mxfp4_decode(*quant.mxfp4_encode(x, 32, "e8m0"), 32))


def test_mxfp4_bad_scale_fmt():
    with pytest.raises(ValueError, match="scale_fmt"):
        quant.mxfp4_encode(torch.zeros(1, 32), 32, "e5m2")


# ---- checkpoint weight layouts --------------------------------------------------------------------

def test_block_mxfp8_weight_encode_decode_32x32():
    w = _rand(64, 96, seed=12) * torch.logspace(-3, 1, 64).unsqueeze(1)
    payload, scale = quant.block_mxfp8_encode(w)
    assert payload.shape == (64, 96) and payload.dtype == torch.float8_e4m3fn
    assert scale.shape == (2, 3) and scale.dtype == torch.uint8
    wd = w.double()
    dq = quant.block_mxfp8_decode(payload, scale).double()
    for bn in range(2):
        for bk in range(3):
            blk = wd[bn * 32:(bn + 1) * 32, bk * 32:(bk + 1) * 32]
            e = ceil_log2_exact(max(float(blk.abs().max()), 1e-4) / 448.0)
            assert int(scale[bn, bk]) == e + 127
            want = e4m3_64(blk / 2.0 ** e)
            assert torch.equal(payload[bn * 32:(bn + 1) * 32, bk * 32:(bk + 1) * 32].double(), want)
            assert torch.equal(dq[bn * 32:(bn + 1) * 32, bk * 32:(bk + 1) * 32], want * 2.0 ** e)


def test_expert_mxfp4_layout():
    n, k = 4, 64
    w = torch.zeros(n, k)
    # row 0: group 0 has amax 6 (scale 2^0), group 1 has amax 12 (scale 2^1)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 6.0, -0.5, 1.5, -3.0
    w[0, 32], w[0, 33] = 12.0, 2.0
    w[1:] = _rand(3, k, seed=13)
    packed, scale = quant.expert_mxfp4_encode(w)
    assert packed.shape == (n, k // 2) and scale.shape == (n, k // 32)
    assert packed[0, 0].item() == 0x7 | (0x9 << 4)          # 6.0 low nibble (k=0), -0.5 high (k=1)
    assert packed[0, 1].item() == 0x3 | (0xD << 4)          # 1.5 (k=2), -3.0 (k=3)
    assert packed[0, 16].item() == 0x7 | (0x2 << 4)         # 12/2 = 6, 2/2 = 1
    assert scale[0].tolist() == [127, 128]
    dq = quant.expert_mxfp4_decode(packed, scale)
    assert dq[0, :4].tolist() == [6.0, -0.5, 1.5, -3.0] and dq[0, 32:34].tolist() == [12.0, 2.0]
    # independent decode of the whole tensor: nibble (k even low) * 2^(S[n, k//32]-127)
    want = torch.empty(n, k, dtype=torch.float64)
    for r in range(n):
        for c in range(k):
            byte = int(packed[r, c // 2])
            nib = byte & 0xF if c % 2 == 0 else byte >> 4
            want[r, c] = fp4_value_ref(nib) * 2.0 ** (int(scale[r, c // 32]) - 127)
    assert torch.equal(dq.double(), want)


def test_round_bf16_is_rne():
    x = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, -(1.0 + 2 ** -8)])
    assert quant.round_bf16(x).tolist() == [1.0, 1.0 + 2 ** -6, 1.0 + 2 ** -7, -1.0]
    r = _rand(5000, seed=14) * 100
    assert torch.equal(quant.round_bf16(r).double(), bf16_64(r))


def test_table_decodes_equal_the_formulas_bit_for_bit():
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    formula = torch.ldexp(torch.ones(16, 16), codes.to(torch.int32) - 127)
    assert torch.equal(quant.e8m0_decode(codes).view(torch.int32), formula.view(torch.int32))
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    dq = quant.mxfp4_decode(packed, torch.full((8, 2), 127, dtype=torch.uint8), 32)
    want = [fp4_value_ref(int(b) >> (4 * h) & 0xF) for b in packed.flatten() for h in (0, 1)]
    assert dq.flatten().tolist() == want
    assert torch.signbit(dq.flatten()).tolist() == [math.copysign(1.0, v) < 0 for v in want]


def test_mxfp8_qdq_is_decode_of_encode_bit_for_bit():
    for scale in (1e-9, 1e-3, 1.0, 1e4, 1e30, 3e38):
        x = (_rand(6, 128, seed=15) * scale).clamp(-3.4e38, 3.4e38)
        x[0, :40] = 0.0
        x[2, :32] = 2.0 ** torch.arange(-20, 12).float()   # amax an exact power of two
        want = quant.mxfp8_decode(*quant.mxfp8_encode(x))
        assert torch.equal(quant.mxfp8_qdq(x).view(torch.int32), want.view(torch.int32))


def test_fp64_weight_decodes_equal_the_fp32_formulas_for_every_code_pair():
    """Every (scale code, payload code) pair, NaN codes included, compared bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    scale = codes.reshape(16, 16)
    payload = codes.reshape(8, 32).repeat(4, 1).repeat(16, 16)          # each 32x32 block: all codes
    p8 = payload.view(torch.float8_e4m3fn)
    want = quant.block_mxfp8_decode(p8, scale).double()
    assert torch.equal(quant.block_mxfp8_decode64(p8, scale).view(torch.int64), want.view(torch.int64))
    packed = codes.repeat(256, 1)[:, :128].reshape(256, 128) ^ torch.arange(256, dtype=torch.uint8)[:, None]
    s4 = codes.repeat(256, 1)[:, :8].roll(1, 0) ^ torch.arange(256, dtype=torch.uint8)[:, None]
    want4 = quant.expert_mxfp4_decode(packed, s4).double()
    assert torch.equal(quant.expert_mxfp4_decode64(packed.view(torch.int8), s4).view(torch.int64),
                       want4.view(torch.int64))
    assert set(s4.flatten().tolist()) == set(range(256)) and set(packed.flatten().tolist()) == set(range(256))


def _encoder_inputs() -> list[torch.Tensor]:
    """Rows of 64 FP32 values where the rules have edges: E4M3's and E2M1's ties at many scales, a
    group's amax exactly a power of two times the format's top and just above it, amax at and under
    the floors, signed zeros and values that round to zero, subnormal and huge magnitudes."""
    g = torch.Generator().manual_seed(11)
    grid = quant.E4M3_VALUES[torch.isfinite(quant.E4M3_VALUES)].unique()
    e4m3_ties = ((grid[:-1] + grid[1:]) / 2)[torch.randint(len(grid) - 1, (64, 64), generator=g)]
    e4m3_ties[:, ::32] = 448.0
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    fp4_ties = ((levels[:-1] + levels[1:]) / 2)[torch.randint(7, (64, 64), generator=g)]
    fp4_ties *= torch.where(torch.rand(64, 64, generator=g) < 0.5, -1.0, 1.0)
    fp4_ties[:, ::16] = 6.0
    tops = torch.randn(64, 64, generator=g)
    tops[:, 0] = torch.ldexp(torch.full((64,), 448.0), torch.arange(-32, 32, dtype=torch.int32))
    tops[:, 32] = torch.nextafter(tops[:, 0], torch.tensor(float("inf")))
    zeros = torch.zeros(64, 64)
    zeros[:16, 1::2] = -0.0
    zeros[16:32] = -1e-30
    zeros[16, 0] = 448.0
    zeros[32:48] = 1e-5                                  # under the FP8 amax floor (1e-4)
    zeros[48:] = torch.tensor(6.0 * 2.0 ** -126)         # the FP4 E8M0 floor
    scaled = [e4m3_ties * 2.0 ** p for p in (-40, -12, 0, 9, 30)] + [fp4_ties * 2.0 ** p for p in (-130, -9, 0, 20)]
    return scaled + [tops, zeros, _rand(64, 64, seed=12) * 1e-38, _rand(64, 64, seed=13) * 1e36,
                     _rand(64, 64, seed=14) * 0.02]


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b))


def test_compiled_encoders_give_the_bytes_of_the_torch_ops():
    """``cpu.quant_kernels``' encoders against the Torch ops they replace (themselves held to the
    independent rules above): MXFP8 per row and in 32 x 32 blocks, MXFP4 with E8M0 and E4M3 scales
    in groups of 16 and 32, byte for byte, on every edge input."""
    for x in _encoder_inputs():
        assert _same(quant.mxfp8_encode(x), quant._mxfp8_encode_ops(x, 32))
        assert _same(quant.block_mxfp8_encode(x), quant._block_mxfp8_encode_ops(x, 32))
        for fmt in ("e8m0", "e4m3"):
            for group in (16, 32):
                assert _same(quant.mxfp4_encode(x, group, fmt), quant._mxfp4_encode_ops(x, group, fmt)), (fmt, group)
    batch = _rand(3, 5, 64, seed=15)                     # leading dims kept
    assert _same(quant.mxfp8_encode(batch), quant._mxfp8_encode_ops(batch, 32))
    assert _same(quant.mxfp4_encode(batch, 16, "e4m3"), quant._mxfp4_encode_ops(batch, 16, "e4m3"))
    assert quant.mxfp4_encode(torch.zeros(0, 64), 32, "e8m0")[0].shape == (0, 32)
    with pytest.raises(ValueError, match="block"):
        quant.block_mxfp8_encode(torch.zeros(48, 64))


def test_non_finite_values_take_the_torch_ops_result():
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = _rand(4, 64, seed=16)
        x[2, 40] = bad
        assert _same(quant.mxfp8_encode(x), quant._mxfp8_encode_ops(x, 32))
        for fmt in ("e8m0", "e4m3"):
            assert _same(quant.mxfp4_encode(x, 32, fmt), quant._mxfp4_encode_ops(x, 32, fmt))
        w = _rand(64, 64, seed=17)
        w[33, 5] = bad
        payload, scale = quant.block_mxfp8_encode(w)
        want = quant._block_mxfp8_encode_ops(w, 32)
        assert torch.equal(payload.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1])
