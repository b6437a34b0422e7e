"""RoPE (spec 01 §3, 02 §2): plain and compressed-YaRN tables, row materialization, rotation."""
import math

import pytest
import torch

from dsv41.config import FLASH, TINY
from dsv41.ops import rope
from _spec_ref import bf16_64


def _freqs_ref(cfg, compressed: bool) -> torch.Tensor:
    """Spec 01 §3 in float64: base^(-2i/dim); compressed: YaRN blend with low/high from corr()."""
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freq = [base ** (-2.0 * i / dim) for i in range(dim // 2)]
    if compressed:
        def corr(rot):
            return dim * math.log(cfg.original_max_position_embeddings / (2 * math.pi * rot)) / (2 * math.log(base))
        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), dim - 1)
        out = []
        for i, f in enumerate(freq):
            ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
            out.append(f * (1 - ramp) + f / cfg.rope_factor * ramp)
        freq = out
    return torch.tensor(freq, dtype=torch.float64)


def test_flash_yarn_low_high_are_15_and_25():
    base, dim = FLASH.compress_rope_theta, FLASH.qk_rope_head_dim
    corr = lambda rot: dim * math.log(65536 / (2 * math.pi * rot)) / (2 * math.log(base))  # noqa: E731
    assert max(math.floor(corr(32)), 0) == 15 and min(math.ceil(corr(1)), 63) == 25
    ramp = rope.yarn_ramp(dim, base, FLASH.rope_factor, FLASH.original_max_position_embeddings,
                          FLASH.beta_fast, FLASH.beta_slow)
    want = torch.tensor([min(max((i - 15) / 10, 0.0), 1.0) for i in range(32)])
    assert torch.allclose(ramp, want, atol=1e-7, rtol=0)
    assert (ramp[:16] == 0).all() and (ramp[25:] == 1).all()


@pytest.mark.parametrize("cfg", [FLASH, TINY], ids=["flash", "tiny"])
@pytest.mark.parametrize("profile", [rope.PLAIN, rope.COMPRESSED])
def test_tables_match_formula(cfg, profile):
    cap = 300
    cos, sin = rope.precompute_rope_tables(cfg, cap, profile)
    half = cfg.qk_rope_head_dim // 2
    assert cos.shape == (cap, half) and sin.shape == (cap, half)
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32
    freq = _freqs_ref(cfg, profile == rope.COMPRESSED)
    # row 1 is exactly the FP32 frequency: recover it and compare with the float64 formula
    got = torch.atan2(sin[1].double(), cos[1].double())
    assert torch.allclose(got, freq, rtol=2e-6, atol=0)
    # angle = p * freq (FP32 outer product): errors are the frequency's relative error (bounded
    # above), one FP32 rounding of the angle, and FP32 cos/sin (two ulps at 1)
    angle = torch.outer(torch.arange(cap, dtype=torch.float64), freq)
    tol = angle * (2e-6 + 2 ** -24) + 2 * 2 ** -23
    assert ((cos.double() - torch.cos(angle)).abs() <= tol).all()
    assert ((sin.double() - torch.sin(angle)).abs() <= tol).all()
    assert (cos[0] == 1).all() and (sin[0] == 0).all()


def test_compressed_profile_keeps_low_and_divides_high_frequencies():
    cap = 4
    plain_c = rope.precompute_rope_tables(FLASH, cap, rope.PLAIN)
    comp_c = rope.precompute_rope_tables(FLASH, cap, rope.COMPRESSED)
    f_plain = torch.atan2(plain_c[1][1].double(), plain_c[0][1].double())
    f_comp = torch.atan2(comp_c[1][1].double(), comp_c[0][1].double())
    base16 = torch.tensor([160000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    assert torch.allclose(f_plain, torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)],
                                                dtype=torch.float64), rtol=2e-6)
    assert torch.allclose(f_comp[:16], base16[:16], rtol=2e-6)            # i <= 15 unchanged
    assert torch.allclose(f_comp[25:], base16[25:] / 16, rtol=2e-6)       # i >= 25 divided by 16
    mid = f_comp[16:25] / base16[16:25]
    assert (mid < 1).all() and (mid > 1 / 16).all() and (mid[1:] < mid[:-1]).all()


def test_profile_per_ratio():
    assert rope.profile_for(0) == rope.PLAIN
    assert rope.profile_for(1) == rope.COMPRESSED and rope.profile_for(2) == rope.COMPRESSED
    with pytest.raises(ValueError, match="profile"):
        rope.precompute_rope_tables(TINY, 4, "yarn")


# ---- row materialization ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tables():
    return rope.precompute_rope_tables(TINY, 64, rope.COMPRESSED)


def test_gather_rows_negative_is_identity(tables):
    cos, sin = tables
    pos = torch.tensor([[3, -1], [0, 63]], dtype=torch.int32)
    c, s = rope.gather_rope_rows(cos, sin, pos)
    assert c.shape == (2, 2, cos.shape[1]) and c.dtype == torch.float32
    assert torch.equal(c[0, 0], cos[3]) and torch.equal(s[1, 1], sin[63])
    assert (c[0, 1] == 1).all() and (s[0, 1] == 0).all()
    c, s = rope.gather_rope_rows(cos, sin, torch.zeros(0, dtype=torch.int64))
    assert c.shape == (0, cos.shape[1])


def test_materialize_rows(tables):
    cos, sin = tables
    half = cos.shape[1]
    pos = torch.tensor([5, -1, 17, -7, 40, 2], dtype=torch.int64)
    out_c = torch.full((6, half), 7.0)
    out_s = torch.full((6, half), -7.0)
    rope.materialize_rope_rows(cos, sin, pos, 4, out_c, out_s)
    assert torch.equal(out_c[0], cos[5]) and torch.equal(out_s[2], sin[17])
    assert (out_c[1] == 1).all() and (out_s[1] == 0).all()          # negative -> identity
    assert (out_c[3] == 1).all() and (out_s[3] == 0).all()
    assert (out_c[4:] == 7.0).all() and (out_s[4:] == -7.0).all()   # rows past num_tokens untouched


def test_materialize_zero_tokens_does_nothing(tables):
    cos, sin = tables
    out_c, out_s = torch.full((3, cos.shape[1]), 9.0), torch.full((3, cos.shape[1]), 9.0)
    # even an out-of-range position is not looked at when no row is active
    rope.materialize_rope_rows(cos, sin, torch.tensor([1000, 1, 2]), 0, out_c, out_s)
    assert (out_c == 9.0).all() and (out_s == 9.0).all()


def test_materialize_errors(tables):
    cos, sin = tables
    half = cos.shape[1]
    out_c, out_s = torch.zeros(3, half), torch.zeros(3, half)
    with pytest.raises(ValueError, match="position_ids"):
        rope.materialize_rope_rows(cos, sin, torch.tensor([1, 64, 2]), 3, out_c, out_s)
    with pytest.raises(ValueError, match="position_ids"):
        rope.gather_rope_rows(cos, sin, torch.tensor([64]))
    for n in (-1, 4):
        with pytest.raises(ValueError, match="num_tokens"):
            rope.materialize_rope_rows(cos, sin, torch.tensor([1, 2, 3]), n, out_c, out_s)
    assert (out_c == 0).all()


# ---- rotation ------------------------------------------------------------------------------------

def _rotate_ref(x, cos, sin, inverse=False):
    """Adjacent pairs (2i, 2i+1) of the last 2*half dims: (a c - b s, b c + a s), float64 then BF16."""
    x = x.double()
    out = x.clone()
    t = x.shape[0]
    half = cos.shape[1]
    start = x.shape[-1] - 2 * half
    for i in range(half):
        c = cos[:, i].double().reshape(t, *([1] * (x.dim() - 2)))
        s = sin[:, i].double().reshape(t, *([1] * (x.dim() - 2)))
        if inverse:
            s = -s
        a, b = x[..., start + 2 * i], x[..., start + 2 * i + 1]
        out[..., start + 2 * i] = a * c - b * s
        out[..., start + 2 * i + 1] = b * c + a * s
    return bf16_64(out)


def test_apply_rope_vs_pairwise_formula(tables):
    cos_t, sin_t = tables
    g = torch.Generator().manual_seed(0)
    x = bf16_64(torch.randn(5, 3, 64, generator=g)).float()     # [T, H, head_dim], BF16 values
    pos = torch.tensor([0, 1, 13, -1, 63])
    cos, sin = rope.gather_rope_rows(cos_t, sin_t, pos)
    y = rope.apply_rope(x, cos, sin)
    want = _rotate_ref(x, cos, sin)
    # FP32 vs exact float64 may differ by one BF16 rounding step
    diff = (y.double() - want).abs()
    assert (diff <= want.abs() * 2 ** -7 + 1e-30).all()
    assert (y.double() == want).float().mean() > 0.99
    # only the last rope dims rotate; the first (nope) dims pass through bit-exactly
    rope_dim = 2 * cos.shape[1]
    assert torch.equal(y[..., : 64 - rope_dim], x[..., : 64 - rope_dim])
    assert not torch.equal(y[1, :, 64 - rope_dim:], x[1, :, 64 - rope_dim:])
    assert torch.equal(y[3], x[3]) and torch.equal(y[0], x[0])     # identity rows (pos -1 and 0)
    assert torch.equal(y.double(), bf16_64(y))


def test_apply_rope_2d_and_inverse_undoes(tables):
    cos_t, sin_t = tables
    g = torch.Generator().manual_seed(1)
    x = bf16_64(torch.randn(6, 64, generator=g)).float()         # the single KV head [T, head_dim]
    cos, sin = rope.gather_rope_rows(cos_t, sin_t, torch.tensor([2, 9, 30, 31, 50, 63]))
    y = rope.apply_rope(x, cos, sin)
    back = rope.apply_rope(y, cos, sin, inverse=True)
    # two BF16 roundings: |back - x| <= 2^-7 * max|x| per row (BF16 half-ulp, twice, times |rot|<=1)
    tol = x.abs().amax(-1, keepdim=True) * 2 ** -7
    assert ((back - x).abs() <= tol).all()
    inv_ref = _rotate_ref(y, cos, sin, inverse=True)
    assert ((rope.apply_rope(y, cos, sin, inverse=True).double() - inv_ref).abs() <= inv_ref.abs() * 2 ** -7 + 1e-30).all()
