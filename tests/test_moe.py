"""MoE (spec 03 §2-3, 04 §1 6a-6d): router, SwiGLU expert with the clamp, dispatch and combine."""
import math

import torch
import torch.nn.functional as F

from dsv41.config import FLASH, TINY
from dsv41.ops.moe import combine, dispatch_rows, expert, experts_grouped, route
from selection import assert_same_selection
from _spec_ref import bf16_64, is_bf16, mx_linear_64, mxfp8_qdq_64


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _route_ref(x, w, b, k, scaling):
    z = x.double() @ w.double().t()
    sp = torch.clamp_min(z, 0) + torch.log1p(torch.exp(-z.abs()))
    s = torch.sqrt(sp)
    c = s + b.double()
    idx, wts = [], []
    for i in range(x.shape[0]):
        pick = sorted(range(w.shape[0]), key=lambda e: (-float(c[i, e]), e))[:k]
        tot = sum(float(s[i, e]) for e in pick)
        idx.append(pick)
        wts.append([scaling * float(s[i, e]) / (tot + 1e-20) for e in pick])
    return torch.tensor(idx), torch.tensor(wts, dtype=torch.float64), c


def test_route_vs_independent():
    t, d, e = 32, TINY.hidden_size, TINY.n_routed_experts
    x = bf16_64(torch.randn(t, d, generator=_g(0))).float()
    w = bf16_64(torch.randn(e, d, generator=_g(1)) * d ** -0.5).float()
    b = torch.randn(e, generator=_g(2)) * 0.1
    idx, wts = route(x, w, b, TINY.num_experts_per_tok, TINY.routed_scaling_factor)
    ridx, rw, biased = _route_ref(x, w, b, 6, 1.5)
    assert idx.shape == (t, 6) and wts.dtype == torch.float32
    assert_same_selection(idx.long(), ridx, biased, "router")    # equal up to swaps among tied scores
    assert (torch.gather(biased, 1, idx.long()).diff(dim=1) <= 0).all()   # descending biased score
    same = (idx.long() == ridx).all(1)                              # weights align where no tie was swapped
    assert same.any() and torch.allclose(wts.double()[same], rw[same], rtol=1e-6, atol=0)
    assert torch.allclose(wts.double().sum(-1), torch.full((t,), 1.5, dtype=torch.float64), rtol=1e-6)
    assert FLASH.routed_scaling_factor == 1.5 and FLASH.num_experts_per_tok == 6


def test_route_bias_only_selects():
    d, e = 8, 16
    x = torch.ones(1, d)
    w = torch.zeros(e, d)
    w[:6] = 1.0                                                   # experts 0..5 have the big score
    b = torch.zeros(e)
    b[13] = 100.0                                                 # expert 13 selected through its bias only
    idx, wts = route(x, w, b, 6, 1.5)
    assert idx[0, 0].item() == 13
    s_big = math.sqrt(F.softplus(torch.tensor(8.0, dtype=torch.float64)).item())
    s_zero = math.sqrt(math.log(2.0))
    # weights from the unbiased scores: 13 has s(0), the five others s(8)
    tot = s_zero + 5 * s_big
    assert math.isclose(wts[0, 0].item(), 1.5 * s_zero / tot, rel_tol=1e-6)
    assert all(math.isclose(v, 1.5 * s_big / tot, rel_tol=1e-6) for v in wts[0, 1:].tolist())
    assert sorted(idx[0, 1:].tolist()) == [0, 1, 2, 3, 4]         # expert 5 pushed out by the bias


def test_route_ties_go_to_smaller_id():
    d, e = 4, 16
    x = torch.ones(2, d)
    w = torch.zeros(e, d)
    b = torch.full((e,), -10.0)
    b[[0, 1, 2, 4, 5]] = 10.0
    b[[3, 7, 11]] = 5.0                                           # a three-way tie for the last slot
    idx, _ = route(x, w, b, 6, 1.5)
    assert idx[0].tolist() == [0, 1, 2, 4, 5, 3]
    b2 = torch.zeros(e)                                           # everything tied: lowest six ids
    idx, wts = route(x, w, b2, 6, 1.5)
    assert idx[1].tolist() == [0, 1, 2, 3, 4, 5]
    assert ((wts.double() - 0.25).abs() <= 4 * 2 ** -24 * 0.25).all()     # 1.5 s / 6 s in FP32: a few ulps


def test_expert_clamps_gate_above_only_and_up_both_sides():
    # x = e_0 makes g_i = w1[i, 0] and u_i = w3[i, 0] exactly; w2 = I exposes h per 32-group
    d, inter = 64, 96
    x = torch.zeros(1, d)
    x[0, 0] = 1.0
    w1, w3 = torch.zeros(inter, d), torch.zeros(inter, d)
    w1[0, 0], w3[0, 0] = 20.0, 15.0          # group 0: gate clamped to 10, up clamped to 10
    w1[32, 0], w3[32, 0] = -20.0, 10.0       # group 1: gate NOT clamped below: silu(-20) * 10
    w1[64, 0], w3[64, 0] = 1.0, -15.0        # group 2: up clamped at -10
    w2 = torch.eye(inter)
    y = expert(x, w1, w2, w3, 10.0)
    assert is_bf16(y)

    def h(g, u):
        g, u = min(g, 10.0), max(min(u, 10.0), -10.0)
        return g / (1 + math.exp(-g)) * u

    hv = torch.zeros(1, inter, dtype=torch.float64)
    hv[0, 0], hv[0, 32], hv[0, 64] = h(20, 15), h(-20, 10), h(1, -15)
    want = bf16_64(mxfp8_qdq_64(bf16_64(hv)))
    # identity w2 and clamped inputs: every step is exactly computable
    assert torch.equal(y.double(), want)
    assert abs(y[0, 32].item()) < 1e-6                           # a lower clamp would give -4.5e-3
    assert 90 < y[0, 0].item() < 110 and -8 < y[0, 64].item() < -6.5
    # the routing weight scales h before w2 (a power of two commutes with the MXFP8 steps)
    y_half = expert(x, w1, w2, w3, 10.0, weight=torch.tensor([0.5]))
    assert torch.equal(y_half, y * 0.5)


def test_expert_vs_independent():
    t, d, inter = 6, 64, 64
    x = bf16_64(torch.randn(t, d, generator=_g(3))).float()
    w1 = torch.randn(inter, d, generator=_g(4)) * 3 * d ** -0.5
    w3 = torch.randn(inter, d, generator=_g(5)) * 3 * d ** -0.5
    w2 = torch.randn(d, inter, generator=_g(6)) * inter ** -0.5
    wt = torch.rand(t, generator=_g(7))
    y = expert(x, w1, w2, w3, 10.0, weight=wt)
    g = bf16_64(mx_linear_64(x, w1)).clamp(max=10.0)
    u = bf16_64(mx_linear_64(x, w3)).clamp(-10.0, 10.0)
    hv = g * torch.sigmoid(g) * u * wt.double().unsqueeze(1)
    ref = bf16_64(mx_linear_64(bf16_64(hv), w2))
    # Same rounding points; only silu(g)*u*w is FP32 against float64. That can flip one BF16 value of
    # h where it sits on a rounding boundary (one E4M3 step after the MXFP8 quantization), moving its
    # row by a few ulps: bound 4 BF16 ulps of the row RMS and at most one row not bit-equal.
    err = (y.double() - ref).abs()
    rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
    assert (err <= 4 * torch.ldexp(torch.ones_like(rms), torch.frexp(rms)[1] - 8)).all()
    assert int((err > 0).any(-1).sum()) <= 1


def test_dispatch_rows_in_token_slot_order():
    idx = torch.tensor([[3, 1], [1, 5], [5, 3]])
    rows = dispatch_rows(idx, range(8))
    assert set(rows) == {1, 3, 5}
    assert rows[1][0].tolist() == [0, 1] and rows[1][1].tolist() == [1, 0]
    assert rows[3][0].tolist() == [0, 2] and rows[3][1].tolist() == [0, 1]
    assert rows[5][0].tolist() == [1, 2] and rows[5][1].tolist() == [1, 0]


def test_combine_ascending_expert_id_then_shared_one_rounding():
    big = 2.0 ** 24
    # insertion order 5, 9, 2 would give (big - big) + 1 = 1; ascending id 2, 5, 9: (1 + big) - big = 0
    routed = {5: (torch.tensor([0]), torch.tensor([[big]])),
              9: (torch.tensor([0]), torch.tensor([[-big]])),
              2: (torch.tensor([0]), torch.tensor([[1.0]]))}
    assert combine(routed, torch.zeros(1, 1)).item() == 0.0
    # the shared expert is added after all routed rows
    routed = {0: (torch.tensor([0]), torch.tensor([[big]])), 1: (torch.tensor([0]), torch.tensor([[-big]]))}
    assert combine(routed, torch.ones(1, 1)).item() == 1.0
    # one BF16 rounding of the FP32 sum: row 1 = 3 + 3*2^-8 -> 3 + 2^-6 (rounding after every add
    # would stay at 3); row 0 = 1 + 2^-8 is a midpoint -> ties to even -> 1
    routed = {0: (torch.tensor([0, 1]), torch.tensor([[1.0], [3.0]])),
              4: (torch.tensor([1]), torch.tensor([[2.0 ** -8]])),
              6: (torch.tensor([1]), torch.tensor([[2.0 ** -8]]))}
    out = combine(routed, torch.tensor([[2.0 ** -8], [2.0 ** -8]]))
    assert out.tolist() == [[1.0], [3.0 + 2.0 ** -6]]
    assert is_bf16(out)


def test_experts_grouped_gives_each_row_the_bits_of_its_expert_alone():
    d, inter, counts, ids = 64, 64, [3, 1, 5], [7, 2, 11]
    x = bf16_64(torch.randn(sum(counts), d, generator=_g(8)) * 4).float()
    wt = torch.rand(sum(counts), generator=_g(9))
    ws = {e: {"w1": torch.randn(inter, d, generator=_g(10 + e)) * 3 * d ** -0.5,
              "w3": torch.randn(inter, d, generator=_g(30 + e)) * 3 * d ** -0.5,
              "w2": torch.randn(d, inter, generator=_g(50 + e)) * inter ** -0.5} for e in ids}
    y = experts_grouped(x, wt, ids, counts, lambda e, name: ws[e][name], 10.0)
    first = 0
    for e, n in zip(ids, counts):
        rows = slice(first, first + n)
        alone = expert(x[rows], ws[e]["w1"], ws[e]["w2"], ws[e]["w3"], 10.0, wt[rows])
        assert torch.equal(y[rows].view(torch.int32), alone.view(torch.int32))
        first += n
