"""Weights multiplied in their checkpoint formats (``ops.packed``, ``cpu.fused_product``): the fused
decode multiplies by the values of the format's definition bit for bit, and the product is the FP32
sum in the defined order (``_fp32_sum.defined_sum``, written here with an exact FP32 FMA) over the whole decoded
matrix, within FP32 summation's error bound of the exact product, each row's bits independent of the
batch, the split and the format."""
from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from dsv41.checkpoint.shards import DrawnCheckpoint, read_card
from dsv41.config import TINY, Topology
from dsv41.cpu import cores, fused_product
from dsv41.ops import packed
from dsv41.ops.packed import PackedMatrix, dense_f32
from dsv41.ops.quant import block_mxfp8_decode64, expert_mxfp4_decode64
from _fp32_sum import defined_sum, fma32, round32, within_fp32_bound
from _spec_ref import fp4_value_ref


def _e4m3_value(byte: int) -> float:
    """An E4M3 (fn) byte's value from its fields: bias 7, subnormals at exponent 0, S.1111.111 NaN."""
    s, e, m = byte >> 7, (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.double().view(torch.int64), b.double().view(torch.int64))


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _through_product(m: PackedMatrix) -> torch.Tensor:
    """The values the fused product multiplies by: x = I picks each column, exactly (every decoded
    value here is an FP32)."""
    return m.matmul_t(torch.eye(m.shape[1])).t().double()


def _fp8_every_byte(scales: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[32 * len(scales), 256]: every byte in every row (a row per 8 codes shifted), one scale code per
    32x32 block column group, blocks cycling through ``scales``."""
    rows = 32 * len(scales)
    payload = ((torch.arange(rows)[:, None] * 8 + torch.arange(256)[None]) % 256).to(torch.uint8)
    codes = torch.tensor(scales, dtype=torch.uint8)
    scale = codes[(torch.arange(len(scales))[:, None] + torch.arange(8)[None]) % len(scales)]
    return payload.view(torch.float8_e4m3fn), scale


def test_fp8_product_decodes_every_byte_at_every_scale_to_its_definition():
    scales = [0, 1, 20, 100, 127, 128, 200, 246]
    payload, scale = _fp8_every_byte(scales)
    byte = payload.view(torch.uint8).long()
    want = torch.tensor([_e4m3_value(b) for b in range(256)], dtype=torch.float64)[byte]
    want = want * torch.pow(2.0, scale.double() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)
    nan = (byte & 0x7F) == 0x7F
    finite = payload.view(torch.uint8).clone()
    finite[nan] = 0x7E          # the fast path is for matrices without NaN bytes
    fast = PackedMatrix("fp8", finite.view(torch.float8_e4m3fn), scale)
    assert not fast._exact_tables
    want_finite = torch.where(nan, torch.tensor([_e4m3_value(0x7E)], dtype=torch.float64)
                              * torch.pow(2.0, scale.double() - 127).repeat_interleave(32, 0)
                              .repeat_interleave(32, 1), want)
    assert torch.equal(_through_product(fast), want_finite)
    # NaN bytes (and scale codes past 246) take the table decode: its values, NaN where the byte is
    slow = PackedMatrix("fp8", payload, scale)
    assert slow._exact_tables
    assert _same_bits(slow.dense(), block_mxfp8_decode64(payload, scale))
    assert torch.equal(slow.dense().isnan(), nan)
    big = PackedMatrix("fp8", finite.view(torch.float8_e4m3fn), torch.full_like(scale, 250))
    assert big._exact_tables and _same_bits(big.dense(), block_mxfp8_decode64(big.payload, big.scale))


def test_one_nan_byte_of_either_sign_sends_an_fp8_matrix_to_the_tables():
    """Every finite byte but one, that one 0x7F (+NaN) or 0xFF (-NaN), anywhere in the matrix."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    payload = finite.repeat(32 * 64 // len(finite) + 1)[:32 * 64].reshape(32, 64).contiguous()
    scale = torch.full((1, 2), 127, dtype=torch.uint8)
    assert not PackedMatrix("fp8", payload.view(torch.float8_e4m3fn), scale)._exact_tables
    for nan in (0x7F, 0xFF):
        for at in ((0, 0), (17, 40), (31, 63)):
            p = payload.clone()
            p[at] = nan
            assert PackedMatrix("fp8", p.view(torch.float8_e4m3fn), scale)._exact_tables, (nan, at)


def test_fp4_product_decodes_every_byte_at_every_scale_to_its_definition():
    codes = [0, 1, 60, 127, 128, 200, 246, 252]       # 6 x 2^(252-127) is still a finite FP32
    packed_bytes = torch.arange(256, dtype=torch.uint8).repeat(len(codes), 1)     # [8, 256] -> K = 512
    scale = torch.tensor(codes, dtype=torch.uint8)[:, None].repeat(1, 16)
    scale[:, 1::2] = scale[:, 1::2].flip(0)                                    # mixed codes within a row
    pairs = torch.tensor([[fp4_value_ref(b & 15), fp4_value_ref(b >> 4)] for b in range(256)], dtype=torch.float64)
    want = pairs[packed_bytes.long()].reshape(len(codes), 512) * \
        torch.pow(2.0, scale.double() - 127).repeat_interleave(32, 1)
    fast = PackedMatrix("fp4", packed_bytes.view(torch.int8), scale)
    assert not fast._exact_tables and torch.equal(_through_product(fast), want)
    # scale codes past 252 (the FP32 products overflow) take the table decode: its values, inf included
    every = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
    m = PackedMatrix("fp4", torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.int8), every)
    assert m._exact_tables and _same_bits(m.dense(), expert_mxfp4_decode64(m.payload, m.scale))


def _matrices(n: int, k: int, seed: int) -> dict[str, PackedMatrix]:
    from dsv41.ops.quant import block_mxfp8_encode, expert_mxfp4_encode
    w = torch.randn(n, k, generator=_g(seed)) * k ** -0.5
    p8, s8 = block_mxfp8_encode(w)
    p4, s4 = expert_mxfp4_encode(w)
    return {"fp8": PackedMatrix("fp8", p8, s8), "fp4": PackedMatrix("fp4", p4.view(torch.int8), s4),
            "bf16": PackedMatrix("bf16", w.to(torch.bfloat16)), "f32": PackedMatrix("f32", w)}


@pytest.mark.portable
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_product_is_the_defined_fp32_sum_over_the_whole_matrix(rows):
    """Every format, a short batch and a long one (passes of up to four rows): the bits of the defined
    sum over the whole decoded matrix, whatever the format holding the values, within FP32
    summation's bound of the exact product; each row of x its bits alone."""
    x = torch.randn(rows, 256, generator=_g(rows)).to(torch.bfloat16).float()
    for fmt, m in _matrices(160, 256, 7).items():
        d = m.dense().float()
        got = m.matmul_t(x)
        assert got.dtype == torch.float32 and torch.equal(got, defined_sum(x, d)), fmt
        assert torch.equal(dense_f32(d).matmul_t(x), got), fmt
        assert within_fp32_bound(got, x, d), fmt
        assert torch.equal(torch.cat([m.matmul_t(x[i:i + 1]) for i in range(rows)]), got), fmt


def test_a_product_split_over_threads_gives_the_bits_of_one(monkeypatch):
    x = torch.randn(5, 256, generator=_g(3))
    whole = {fmt: m.matmul_t(x) for fmt, m in _matrices(96, 256, 5).items()}
    monkeypatch.setattr(packed, "_SPLIT_VALUES", 1)
    monkeypatch.setattr(cores, "cores", lambda: 3)
    for fmt, m in _matrices(96, 256, 5).items():
        assert torch.equal(m.matmul_t(x), whole[fmt]), fmt


def test_products_spread_over_threads_give_each_products_bits(monkeypatch):
    """A list of products in runs over three cores (formats and row counts mixed, a dense matrix among
    them): each result is its own ``matmul_t``, in order."""
    ms = list(_matrices(96, 256, 21).values())
    pairs = [(torch.randn(rows, 256, generator=_g(22 + i)), m) for i, (rows, m) in enumerate(zip((1, 5, 2, 3), ms))]
    pairs.append((torch.randn(2, 256, generator=_g(30)), ms[0].dense()))
    want = [w.matmul_t(x) if isinstance(w, PackedMatrix) else dense_f32(w).matmul_t(x) for x, w in pairs]
    monkeypatch.setattr(packed, "_SPLIT_VALUES", 1)
    monkeypatch.setattr(cores, "cores", lambda: 3)
    got = packed.products(pairs)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_row_and_column_slices_are_the_dense_slices():
    for fmt, m in _matrices(96, 128, 8).items():
        d = m.dense()
        assert torch.equal(m.rows(32, 96).dense(), d[32:96]), fmt
        assert torch.equal(m.cols(64, 128).dense(), d[:, 64:128]), fmt
        x = torch.randn(2, 64, generator=_g(9))
        assert torch.equal(m.cols(0, 64).matmul_t(x), defined_sum(x, d[:, :64])), fmt
        assert torch.equal(m.cols(64, 128).matmul_t(x), defined_sum(x, d[:, 64:])), fmt


def test_bad_format_is_refused_in_one_line():
    with pytest.raises(ValueError, match="fmt must be fp8, fp4, bf16 or f32, got 'int4'"):
        PackedMatrix("int4", torch.zeros(2, 2, dtype=torch.uint8))


def test_card_matrices_decode_to_the_cards_weights():
    """Every matrix a block multiplies by, on a TP2 card: what ``matrix`` multiplies is what
    ``__getitem__`` decodes (wo_a there as [groups, o_lora, group_in])."""
    cfg, topo = TINY, Topology(2, 2, 4)
    w = read_card(DrawnCheckpoint(cfg, 0), topo, 1)
    keys = [k for k in w if isinstance(w[k], torch.Tensor) and w[k].dim() >= 2      # not the lookup tables
            and not k.endswith(("q_weight", "k_weight"))]
    assert any(".experts." in k for k in keys) and "head.weight" in keys and "layers.0.attn.wo_a" in keys
    for k in keys:
        assert torch.equal(w.matrix(k).dense().reshape(w[k].shape), w[k]), k
    assert w.matrix("head.weight") is w.matrix("head.weight")    # made once per key


def _available(fmt: str) -> list[str]:
    return [v for v in fused_product.VARIANTS[fmt] if v != "table" or fused_product.permute_width()]


@pytest.mark.portable
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_every_decode_variant_gives_the_same_bits(rows):
    """The FP16-bit decode, FP8's scale carried by x and FP4's permute table: one result, bit for bit,
    over weight-row ranges that start and end inside a group of four and a 32-row block."""
    x = torch.randn(rows, 256, generator=_g(40 + rows)).to(torch.bfloat16).float()
    for fmt in ("fp8", "fp4"):
        m = _matrices(160, 256, 11)[fmt]
        assert len(_available(fmt)) >= 1
        for r0, r1 in ((0, 160), (3, 70), (29, 35), (61, 62)):
            got = [m.sums(x, r0, r1, v) for v in _available(fmt)]
            for g in got[1:]:
                assert np.array_equal(g.view(np.int32), got[0].view(np.int32)), (fmt, r0, r1)
            # and each output row is the same whether it shared its pass or not
            alone = np.concatenate([m.sums(x[i:i + 1], r0, r1, None) for i in range(rows)])
            assert np.array_equal(alone.view(np.int32), got[0].view(np.int32)), (fmt, r0, r1)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_code_compiled_for_a_cpu_without_avx512_gives_the_same_bits(rows):
    """The same IR compiled for an AVX2 CPU (``haswell``: 256-bit vectors, no AVX-512, the FP4 table byte
    shuffles in the decode's own column order), run here, gives this CPU's bits for every decode: the sum order is
    written in the IR, not chosen by the vector width."""
    x = torch.randn(rows, 256, generator=_g(60 + rows)).to(torch.bfloat16).float()
    for fmt, m in _matrices(96, 256, 23).items():
        for variant in fused_product.VARIANTS[fmt]:
            here = m.sums(x, 3, 90, variant)
            avx2 = m.sums(x, 3, 90, variant, model="haswell")
            assert np.array_equal(avx2.view(np.int32), here.view(np.int32)), (fmt, variant)


def _over_k_tiles(rows: int, seed: int) -> tuple[torch.Tensor, dict[str, PackedMatrix]]:
    """x [rows, K + 5] and 96-row matrices of every format over K = two whole K tiles and part of a
    third, and bf16 and f32 ones with 5 columns past the last block (their x is x[:, :K])."""
    k = 32 * (2 * fused_product.TILE + 6)
    x = torch.randn(rows, k + 5, generator=_g(seed + rows)).to(torch.bfloat16).float()
    ms = _matrices(96, k, seed + 1)
    w = torch.randn(96, k + 5, generator=_g(seed + 2)) * k ** -0.5
    ms.update({"bf16 tail": PackedMatrix("bf16", w.to(torch.bfloat16)), "f32 tail": PackedMatrix("f32", w)})
    return x, ms


@pytest.mark.portable
@pytest.mark.parametrize("rows", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("chunk", ["default", "32 rows"])
def test_products_over_several_k_tiles_are_the_defined_sum(rows, chunk, monkeypatch):
    """K over two whole K tiles and part of a third (``fused_product.TILE`` blocks each), and bf16
    and f32 columns past the last block: every decode, for this CPU and for an AVX2 one (on both,
    passes of more than one row run tile by tile, a 32-row block row at a time), gives the defined
    sum over weight-row ranges that start and end inside a group and a block row, each output row
    the bits of its row alone; also with the passes taking the weight rows in chunks of 32."""
    if chunk != "default":
        monkeypatch.setattr(fused_product, "CHUNK_BYTES", 1)
    x, ms = _over_k_tiles(rows, 80)
    for name, m in ms.items():
        xk, d = x[:, :m.shape[1]], m.dense().float()
        for r0, r1 in ((0, 96), (3, 70), (29, 35), (61, 62)):
            want = defined_sum(xk, d[r0:r1]).numpy()
            for model in (None, "haswell"):
                for variant in fused_product.VARIANTS[m.fmt]:
                    if variant == "table" and not fused_product.permute_width(model):
                        continue
                    got = m.sums(xk, r0, r1, variant, model)
                    assert np.array_equal(got.view(np.int32), want.view(np.int32)), (name, r0, r1, model, variant)
            alone = np.concatenate([m.sums(xk[i:i + 1], r0, r1, None) for i in range(rows)])
            assert np.array_equal(alone.view(np.int32), want.view(np.int32)), (name, r0, r1)


def test_fp8_prescale_is_only_used_where_it_is_exact():
    """x so large or so small that x times the FP8 stand-in's 2^k (``stand_in``: 8 with AVX-512's FP16
    decode, 120 with AVX2's BF16 one) and a block scale leaves the normal FP32 range takes the
    in-register scale: the product is still the defined sum over the decoded matrix, bit for bit."""
    k = fused_product.stand_in("fp8", fused_product.permute_width())
    m = _matrices(64, 128, 12)["fp8"]
    scale, payload = m.scale.clone(), m.payload.view(torch.uint8).clone()
    scale[0, 0], scale[1, 3] = 248 - k, 0       # x carries 2^121 in one block, 2^(k - 127) in another
    payload[:32, :32] = 0x38                    # 1.0 in both, so that x times the values stays finite
    payload[32:, 96:] = 0x38
    m = PackedMatrix("fp8", payload.view(torch.float8_e4m3fn), scale)
    base = torch.randn(2, 128, generator=_g(13))
    assert fused_product.prescale_safe(base.numpy(), (100, 248 - k))     # ordinary x carries the top one
    tiny = torch.zeros(2, 128)
    tiny[:, 96:] = -torch.arange(1, 33) * 2.0 ** -149      # subnormal x: its products round to -0.0
    for x in (base * 2.0 ** 10, tiny):          # scaled, x would overflow, or flush to +0.0
        assert not fused_product.prescale_safe(x.numpy(), m.codes)
        assert fused_product.pick_variant("fp8", x.numpy(), m.codes) == "shifts"
        got = m.matmul_t(x)
        assert torch.equal(got.view(torch.int32), defined_sum(x, m.dense().float()).view(torch.int32))
        # carried by x, the scale would have overflowed or lost the sign of zero
        forced = torch.from_numpy(m.sums(x, 0, 64, "prescaled"))
        assert not torch.equal(forced.view(torch.int32), got.view(torch.int32))
    # and a scale code past 254 - k could not be carried at all
    assert not fused_product.prescale_safe(base.numpy(), (1, 255 - k))


def test_bf16_and_f32_columns_past_the_last_block():
    """K = 70: two whole blocks and six more columns, summed after them."""
    w = torch.randn(40, 70, generator=_g(14))
    x = torch.randn(3, 70, generator=_g(15))
    for m in (PackedMatrix("bf16", w.to(torch.bfloat16)), PackedMatrix("f32", w)):
        assert torch.equal(m.matmul_t(x), defined_sum(x, m.dense())), m.fmt


def test_bad_variant_is_refused_in_one_line():
    m = _matrices(32, 64, 16)["fp8"]
    with pytest.raises(ValueError, match=r"variant must be one of \('prescaled', 'shifts'\) for fp8"):
        m.sums(torch.zeros(1, 64), 0, 32, "table")


def test_compiled_kernels_are_reused_from_the_cache_folder(tmp_path, monkeypatch):
    """A process that finds a kernel's code in the cache (same IR, CPU and compiler) loads it without
    compiling, and gets the same bits."""
    m = _matrices(64, 128, 17)["fp8"]
    x = torch.randn(2, 128, generator=_g(18))
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_product, "_compiled", {})
    first = m.matmul_t(x)
    assert list(tmp_path.glob("*.o"))
    monkeypatch.setattr(fused_product, "_compiled", {})

    def no_compiler(*a, **k):
        raise AssertionError("compiled again although the cache holds the code")
    monkeypatch.setattr(fused_product.llvm, "create_pass_builder", no_compiler)
    assert torch.equal(m.matmul_t(x), first)
    monkeypatch.undo()


def test_a_damaged_cached_kernel_is_compiled_again(tmp_path, monkeypatch):
    m = _matrices(64, 128, 19)["fp4"]
    x = torch.randn(1, 128, generator=_g(20))
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_product, "_compiled", {})
    first = m.matmul_t(x)
    for f in tmp_path.glob("*.o"):
        f.write_bytes(f.read_bytes()[:100] + b"garbage")
    monkeypatch.setattr(fused_product, "_compiled", {})
    assert torch.equal(m.matmul_t(x), first)
    assert all(hashlib.sha256(f.read_bytes()[32:]).digest() == f.read_bytes()[:32] for f in tmp_path.glob("*.o"))


def test_the_reference_fma_rounds_once():
    """``fma32`` against exact rational arithmetic, on random triples and on ones whose FP64 sum lands
    on an FP32 midpoint (where rounding twice would go wrong)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(400).astype(np.float32)
    b = (rng.standard_normal(400) * 2.0 ** rng.integers(-30, 30, 400)).astype(np.float32)
    c = (rng.standard_normal(400) * 2.0 ** rng.integers(-30, 30, 400)).astype(np.float32)
    # (1 + 2^-15)(1 - 2^-15) 2^-24 = 2^-24 - 2^-54: the FP64 sum with c lands on the FP32 midpoint
    # below or above c, and only the lost 2^-54 says which way (ties to even would pick the other)
    up, down = 2.0 ** -12 * (1 + 2.0 ** -15), 2.0 ** -12 * (1 - 2.0 ** -15)
    a = np.concatenate([a, np.float32([up, -up])])
    b = np.concatenate([b, np.float32([down, down])])
    c = np.concatenate([c, np.float32([1 + 2.0 ** -23, 1 + 3 * 2.0 ** -23])])
    assert list(fma32(a[-2:], b[-2:], c[-2:])) == [np.float32(1 + 2.0 ** -23), np.float32(1 + 3 * 2.0 ** -23)]
    want = [round32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert np.array_equal(fma32(a, b, c).view(np.int32), np.array(want, np.float32).view(np.int32))
