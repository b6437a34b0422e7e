"""The indexer's dots as an FP32 product where its bounds prove them exact, else in FP64: the scores'
bits equal those of the FP64 product for every query row (``ops.indexer.index_scores``)."""
import math

import pytest
import torch

from dsv41.ops import indexer, kv_cache
from dsv41.ops.indexer import index_scores
from dsv41.cpu.key_kernels import ZERO_LOW
from dsv41.ops.quant import mxfp4_qdq, round_bf16

FMT = kv_cache.FORMATS[kv_cache.INDEX]


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _bf16(x):
    return x.to(torch.bfloat16).float()


def _reference(q, w, payload, scale, rows):
    """Keys as ``kv_cache.read`` gives them, every dot in FP64 (one einsum for all rows, as the indexer
    took them before), then the recipe: bf16(FP32(dot)), ReLU, bf16(FP32 product with w), the FP64 sum
    over ascending heads from +0.0, bf16(FP32(sum)); -inf where rows < 0."""
    keys = kv_cache.read(payload, scale, FMT, rows)
    dots = torch.einsum("thd,tpd->thp", q.double(), keys.double())
    total = torch.zeros(rows.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        term = _bf16(torch.relu(_bf16(dots[:, h].float())) * w[:, h:h + 1].float())
        total = total + term.double()
    return torch.where(rows >= 0, _bf16(total.float()), torch.tensor(-math.inf))


def _same_bits(a, b):
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _cache(r, d, seed, spread=0):
    """r random index keys, each 32-group scaled by 2^[-spread, spread], in a new cache."""
    g = _g(seed)
    values = torch.randn(r, d, generator=g)
    if spread:
        values = values * 2.0 ** torch.randint(-spread, spread + 1, (r, d // 32), generator=g).repeat_interleave(32, 1)
    payload, scale = FMT.empty(r, d)
    kv_cache.publish(payload, scale, FMT, torch.arange(r), values)
    return payload, scale


def _query(t, nh, d, seed, fp4=True):
    q = torch.randn(t, nh, d, generator=_g(seed))
    q = round_bf16(mxfp4_qdq(q.reshape(t, -1))).reshape(t, nh, d) if fp4 else round_bf16(q)
    return q, round_bf16(torch.randn(t, nh, generator=_g(seed + 1)) * 0.1)


@pytest.fixture
def exact_spy(monkeypatch):
    """Every ``_exact_rows`` answer of the calls that follow, concatenated over blocks."""
    seen = []

    def spy(*args):
        out = real(*args)
        seen.append(out.clone())
        return out
    real = indexer._exact_rows
    monkeypatch.setattr(indexer, "_exact_rows", spy)
    return seen


def _rows(t, p, r, seed, shared=True, holes=0.0):
    """Query rows over p positions of cache rows < r: consecutive rows of one request read the same rows
    (the decode's copy) when shared; a fraction ``holes`` of positions invisible (-1)."""
    g = _g(seed)
    rows = torch.randperm(r, generator=g)[:p].repeat(t, 1) if shared else torch.randint(0, r, (t, p), generator=g)
    lens = torch.randint(p // 2, p + 1, (t, 1), generator=g)
    visible = (torch.arange(p) < lens) & (torch.rand(t, p, generator=g) >= holes)
    return torch.where(visible, rows, -1)


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("holes", [0.0, 0.3], ids=["causal", "reindex"])
def test_fp32_dots_give_the_fp64_bits(t, holes, exact_spy, monkeypatch):
    # several blocks and a short last one; rows with -1 positions, and (holes) rows whose visible keys
    # are packed first, as REINDEX rows' are. A dot of zeros may be -0.0 in one product and +0.0 in the
    # other: the head sum from +0.0 absorbs the sign
    nh, d, p, r = 16, 128, 45, 300
    monkeypatch.setattr(indexer, "KEY_BLOCK", 16)
    payload, scale = _cache(r, d, 1, spread=3)
    payload[::7] = 0                                # zero keys, a zero head, a zero row: signed zero dots
    q, w = _query(t, nh, d, 2)
    q[:, 2], q[t // 2] = 0.0, -0.0 * q[t // 2].abs()
    for shared in (True, False):
        rows = _rows(t, p, r, 3 + t, shared, holes)
        exact_spy.clear()
        assert _same_bits(index_scores(q, w, payload, scale, rows), _reference(q, w, payload, scale, rows))
        assert exact_spy and all(bool(e.all()) for e in exact_spy)        # the FP32 product computed these


def test_full_key_block():
    t, nh, d, r = 4, 64, 128, 4500
    payload, scale = _cache(r, d, 4)
    q, w = _query(t, nh, d, 5)
    rows = _rows(t, 2 * indexer.KEY_BLOCK + 100, r, 6, shared=False)
    assert _same_bits(index_scores(q, w, payload, scale, rows), _reference(q, w, payload, scale, rows))


def test_a_row_the_bounds_cannot_prove_takes_the_fp64_product(exact_spy, monkeypatch):
    # row 1's head 3: groups 1 and 2 of 2^30 times the other groups' size that cancel (every key's
    # groups 1 and 2 are alike), so the exact dot is the small groups' and an FP32 sum that carried the
    # large ones rounded it away
    t, nh, d, p, r = 4, 8, 128, 300, 300
    payload, scale = _cache(r, d, 7)
    payload[:, 32:48], scale[:, 2] = payload[:, 16:32], scale[:, 1]
    q, w = _query(t, nh, d, 8)
    q[1, 3, 32:64] *= 2.0 ** 30
    q[1, 3, 64:96] = -q[1, 3, 32:64]
    rows = _rows(t, p, r, 9, shared=False)
    keys = kv_cache.read(payload, scale, FMT, rows[1:2])
    fp32 = torch.bmm(q[1:2], keys.mT)[0, 3]
    fp64 = torch.einsum("hd,pd->hp", q[1].double(), keys[0].double())[3]
    assert not torch.equal(_bf16(fp32), _bf16(fp64.float()))          # an FP32 product's scores would differ
    assert _same_bits(index_scores(q, w, payload, scale, rows), _reference(q, w, payload, scale, rows))
    assert [e.tolist() for e in exact_spy] == [[True, False, True, True]]
    # with every row taken as proven, the FP32 product's scores are not the reference's
    monkeypatch.setattr(indexer, "_exact_rows", lambda q_bounds, low, size: torch.ones(t, dtype=torch.bool))
    assert not _same_bits(index_scores(q, w, payload, scale, rows), _reference(q, w, payload, scale, rows))


def test_fp32_matmul_below_highest_precision_takes_the_fp64_product(exact_spy):
    t, nh, d, p, r = 3, 8, 64, 40, 200
    payload, scale = _cache(r, d, 10)
    q, w = _query(t, nh, d, 11)
    rows = _rows(t, p, r, 12)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        got = index_scores(q, w, payload, scale, rows)
    finally:
        torch.set_float32_matmul_precision(before)
    assert not exact_spy
    assert _same_bits(got, _reference(q, w, payload, scale, rows))


def test_bf16_query_gives_the_fp64_bits(exact_spy):
    # fp4_query=False (the pypto C2A variant): full BF16 significands, whose bounds often fail: both
    # products in one call
    t, nh, d, p, r = 8, 16, 128, 200, 400
    payload, scale = _cache(r, d, 13, spread=2)
    q, w = _query(t, nh, d, 14, fp4=False)
    q[::2] = round_bf16(q[::2] * 2.0 ** -20 + 1.0)            # even rows: a wide exponent spread per head
    rows = _rows(t, p, r, 15, shared=False)
    assert _same_bits(index_scores(q, w, payload, scale, rows), _reference(q, w, payload, scale, rows))
    taken = torch.cat(exact_spy)
    assert taken.any() and not taken.all()


def test_key_bounds_bound_the_decoded_keys():
    """decode_index_rows' low[t, j] and size[t, j]: every element of the key is a multiple of 2^low and
    at most size * 2^low in magnitude, and neither bound is loose by more than the OR of a group's codes
    allows (codes 3 and 4 OR to 7: 2^-1 below its lowest bit, 6.0 over 2.0); inf for a key with an inf;
    zero keys (and -1 rows) ZERO_LOW, 0."""
    from dsv41.cpu.key_kernels import decode_index_rows
    d, r = 64, 40
    payload, scale = _cache(r, d, 16, spread=40)
    payload[3], scale[3] = 0, 0                                              # a zero key
    payload[4, :16], scale[4, 1] = 0, 0                                      # a zero group beside others
    scale[5, 0], scale[6, 1] = 1, 254                                        # tiny values; 6 x 2^127 is inf
    rows = torch.cat([torch.arange(r), torch.tensor([-1])]).reshape(1, -1)
    keys = torch.empty(1, r + 1, d)
    low, size = torch.empty(1, r + 1, dtype=torch.long), torch.empty(1, r + 1, dtype=torch.float64)
    decode_index_rows(payload.numpy(), scale.numpy(), rows.numpy(), *indexer._key_tables(), 32, keys.numpy(),
                      low.numpy(), size.numpy())
    want = kv_cache.read(payload, scale, FMT, rows)
    assert torch.equal(keys, want)                                           # -1 rows: +0.0 here, -0.0 there
    for j in range(r + 1):
        k = want[0, j].double()
        if not torch.isfinite(k).all():
            assert size[0, j] == math.inf
        elif not k.any():
            assert low[0, j] == ZERO_LOW and size[0, j] == 0
        else:
            units = torch.ldexp(k, -low[0, j])
            assert torch.equal(units, units.round())
            ints = [int(u) for u in units.abs().tolist() if u]
            assert min((i & -i).bit_length() - 1 for i in ints) <= 3      # Lk, found by the OR of codes
            assert max(ints) <= float(size[0, j]) <= 4 * max(ints)
    assert low[0, 5] < -120 and size[0, 6] == math.inf


def test_exact_rows_is_the_three_bound_checks_at_their_edges():
    """``_exact_rows``' compiled pass against the three checks written as Torch ops, on bounds drawn
    around each edge (2^24 units, the -149 unit, the 127 top), with zero keys, inf sizes and rows of
    zeros (q_size 0, ZERO_LOW) among them."""
    g = _g(90)
    t, n = 64, 48
    q_low = torch.randint(-160, -100, (t,), generator=g)
    q_high = q_low + torch.randint(0, 40, (t,), generator=g)
    q_size = torch.ldexp(torch.rand(t, generator=g, dtype=torch.float64) + 0.5, torch.randint(8, 16, (t,), generator=g))
    q_low[:4], q_high[:4], q_size[:4] = ZERO_LOW, -ZERO_LOW, 0.0                         # rows of zeros
    low = torch.randint(-20, 60, (t, n), generator=g)
    size = torch.ldexp(torch.rand(t, n, generator=g, dtype=torch.float64) + 0.5,
                       torch.randint(4, 12, (t, n), generator=g))
    zero = torch.rand(t, n, generator=g) < 0.2
    low[zero], size[zero] = ZERO_LOW, 0.0
    size[torch.rand(t, n, generator=g) < 0.01] = math.inf
    low[8:12], size[8:12] = ZERO_LOW, 0.0                                                # blocks of zero keys
    for row, (lk, lq, top) in enumerate([(0, -149, -125), (0, -150, -125), (103, 0, 0), (104, 0, 0)], 12):
        low[row], size[row] = lk, 1.0                                   # unit 2^-149 and 2^-150; top 127, 128
        q_low[row], q_high[row], q_size[row] = lq, top, 1.0
    q_size[16:18] = 2.0 ** 10
    size[16, 0], size[17, 0] = 2.0 ** 14, 2.0 ** 14 - 2.0 ** -38                        # 2^24 units; just under
    q_low[16:18], q_high[16:18], low[16:18], size[16:18, 1:] = 0, 0, 0, 1.0
    k_high = torch.where(low < ZERO_LOW, low, -ZERO_LOW).amax(1)
    want = ((q_size * size.amax(1) < 2.0 ** 24) & (q_low + low.amin(1) >= -149) & (q_high + k_high + 24 <= 127))
    got = indexer._exact_rows((q_low, q_high, q_size), low, size)
    assert torch.equal(got, want)
    assert want[12:18].tolist() == [True, False, True, False, False, True]
    assert want[18:].any() and not want[18:].all()
