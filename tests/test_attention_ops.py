"""Attention ops (spec 02): projections, compressor, index query/scores, Top-K, candidate blocks,
score chunking, paged caches, sparse attention and the grouped output projection."""
import math

import pytest
import torch

from dsv41.config import FLASH, SMALL, TINY
from dsv41.ops import kv_cache
from dsv41.ops.attention import slot_list, sparse_attention
from dsv41.ops.compressor import compress_ratio1, compress_ratio2, index_key
from dsv41.ops.indexer import (candidate_mask, index_query, index_scores, physical_rows, score_chunks,
                               topk_positions)
from dsv41.ops.metadata import lower
from dsv41.ops.o_proj import o_proj_partial, reduce_partials, tree_sum
from dsv41.ops.projections import dense_linear, kv_proj, mx_linear, q_proj
from dsv41.ops.rope import COMPRESSED, gather_rope_rows, precompute_rope_tables
from _spec_ref import (FP4_LEVELS, assert_rows_close, bf16_64, bf16_ulp_close, ceil_log2_exact, fp4_code_ref,
                       is_bf16, mx_linear_64, mxfp8_qdq_64, rms_norm_64)

I32 = torch.int32
INF = float("inf")


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _bf(*shape, seed, std=1.0, mean=0.0):
    return bf16_64(torch.randn(*shape, generator=_g(seed)) * std + mean).float()


def _rope_ref(x, cos, sin, inverse=False):
    """float64 adjacent-pair rotation of the last 2*half dims, result rounded to BF16."""
    x = x.double()
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.double().reshape(shape), sin.double().reshape(shape)
    s = -s if inverse else s
    start = x.shape[-1] - 2 * half
    a, b = x[..., start::2], x[..., start + 1::2]
    out = x.clone()
    out[..., start::2] = a * c - b * s
    out[..., start + 1::2] = b * c + a * s
    return bf16_64(out)


@pytest.fixture(scope="module")
def tables():
    return precompute_rope_tables(TINY, 256, COMPRESSED)


# ---- MX linear and projections ----------------------------------------------------------------

def test_mx_linear_vs_exact_mxfp8_contraction():
    x = torch.randn(7, 128, generator=_g(0)) * torch.logspace(-2, 1, 128)
    w = torch.randn(48, 128, generator=_g(1)) * 0.1
    got = mx_linear(x, w)
    want = mx_linear_64(x, w)
    # FP32 accumulation of K exact products: |err| <= K * 2^-24 * sum|a_k w_k|
    mag = mxfp8_qdq_64(bf16_64(x)).abs() @ w.double().abs().t()
    assert ((got.double() - want).abs() <= 128 * 2 ** -24 * mag).all()
    assert got.dtype == torch.float32


def test_dense_linear_fp32():
    x = _bf(4, 64, seed=2)
    w = _bf(16, 64, seed=3)
    got = dense_linear(x, w)
    want = x.double() @ w.double().t()
    assert ((got.double() - want).abs() <= 64 * 2 ** -24 * (x.double().abs() @ w.double().abs().t())).all()


def test_q_and_kv_projection(tables):
    t, d, ql, h, hd = 5, TINY.hidden_size, TINY.q_lora_rank, TINY.num_attention_heads, TINY.head_dim
    x = _bf(t, d, seed=4)
    wq_a = torch.randn(ql, d, generator=_g(5)) * d ** -0.5
    wq_b = torch.randn(h * hd, ql, generator=_g(6)) * ql ** -0.5
    wkv = torch.randn(hd, d, generator=_g(7)) * d ** -0.5
    q_norm, kv_norm = _bf(ql, seed=8, std=0.05, mean=1), _bf(hd, seed=9, std=0.05, mean=1)
    cos, sin = gather_rope_rows(*tables, torch.tensor([0, 3, 17, 100, 255]))
    qr, q = q_proj(x, wq_a, q_norm, wq_b, cos, sin, 1e-20, h, hd)
    kv = kv_proj(x, wkv, kv_norm, cos, sin, 1e-20)
    assert qr.shape == (t, ql) and q.shape == (t, h, hd) and kv.shape == (t, hd)
    assert is_bf16(qr) and is_bf16(q) and is_bf16(kv)
    qr_ref = rms_norm_64(bf16_64(mx_linear_64(x, wq_a)), q_norm)
    bf16_ulp_close(qr, qr_ref, ulps=2)
    # q from the impl's qr (isolates this stage): RoPE(bf16(qr wq_b)), no per-head normalisation
    q_ref = _rope_ref(bf16_64(mx_linear_64(qr, wq_b)).reshape(t, h, hd), cos, sin)
    bf16_ulp_close(q, q_ref, ulps=1)      # FP32 vs FP64 rotation: one rounding flip at most
    nope = hd - TINY.qk_rope_head_dim
    bf16_ulp_close(q[..., :nope], bf16_64(mx_linear_64(qr, wq_b)).reshape(t, h, hd)[..., :nope], ulps=1)
    kv_ref = _rope_ref(rms_norm_64(bf16_64(mx_linear_64(x, wkv)), kv_norm), cos, sin)
    bf16_ulp_close(kv, kv_ref, ulps=1)


# ---- compressor ------------------------------------------------------------------------------

def _md_three_requests(state_rows):
    """req0: prefill positions 0..6; req1: continues at 5 (odd: partner in the ring), 4 tokens;
    req2: continues at 2 with 2 tokens (a chunk shorter than the ring)."""
    return lower(TINY, torch.tensor([0, 7, 11, 13], dtype=I32), torch.tensor([0, 5, 2], dtype=I32),
                 torch.tensor([[0], [1], [2]], dtype=I32),
                 {**{s: torch.tensor([[0], [1], [2]], dtype=I32) for s in (2, 8, 14)},
                  20: torch.tensor([[3], [4], [5]], dtype=I32)},
                 {s: torch.tensor(state_rows, dtype=I32) for s in (2, 8, 14)}, torch.tensor([7, 9, 4], dtype=I32))


@pytest.fixture(scope="module")
def comp_inputs():
    d, hd = TINY.hidden_size, TINY.head_dim
    x = _bf(13, d, seed=10)
    wkv = torch.randn(hd, d, generator=_g(11)) * d ** -0.5
    wgate = torch.randn(hd, d, generator=_g(12)) * d ** -0.5
    norm_w = _bf(hd, seed=13, std=0.05, mean=1)
    ring = torch.randn(3 * 4, 2 * hd, generator=_g(14))
    return x, wkv, wgate, norm_w, ring


def test_compressor_ratio2_pooling_partner_and_ring(comp_inputs):
    x, wkv, wgate, norm_w, ring = comp_inputs
    hd = wkv.shape[0]
    md = _md_three_requests([[2], [0], [1]])
    ring_before = ring.clone()
    out = compress_ratio2(x, wkv, wgate, norm_w, 1e-20, md, ring, md.state_block_tables[2], 4)
    assert torch.equal(ring, ring_before)                        # pure: writes are returned, not applied
    pos = md.position_ids.tolist()
    kv = x.double() @ wkv.double().t()
    sc = x.double() @ wgate.double().t()
    blk = {0: 2, 1: 0, 2: 1}
    first_row = {0: 0, 1: 7, 2: 11}
    req = md.token_to_req_indices.tolist()
    closes = [p % 2 == 1 for p in pos]
    assert out.closes.tolist() == closes
    for t in range(13):
        if not closes[t]:
            assert (out.latent[t] == 0).all()                    # even positions publish nothing
            continue
        if t == first_row[req[t]]:                               # chunk start: partner from the ring
            prow = ring_before[blk[req[t]] * 4 + (pos[t] - 1) % 4].double()
            kv_p, sc_p = prow[:hd], prow[hd:]
        else:
            kv_p, sc_p = kv[t - 1], sc[t - 1]
        m = torch.maximum(sc_p, sc[t])
        e0, e1 = torch.exp(sc_p - m), torch.exp(sc[t] - m)
        pooled = bf16_64((e0 * kv_p + e1 * kv[t]) / (e0 + e1))
        bf16_ulp_close(out.latent[t], rms_norm_64(pooled, norm_w), ulps=2)
    # ring writes: every row, in row order, at slot blk*4 + p % 4, value [kv | sc]; the last writer of
    # a slot is the request's latest position there (the last min(4, chunk) rows of each request)
    assert out.ring_token_rows.tolist() == list(range(13))
    assert out.ring_slots.tolist() == [blk[req[t]] * 4 + pos[t] % 4 for t in range(13)]
    last = {}
    for slot, t in zip(out.ring_slots.tolist(), out.ring_token_rows.tolist()):
        last[slot] = t
    want = {}
    for r, (lo, hi) in enumerate([(0, 7), (7, 11), (11, 13)]):
        for t in range(max(lo, hi - 4), hi):
            want[blk[r] * 4 + pos[t] % 4] = t
    assert last == want
    for t, row in zip(out.ring_token_rows.tolist(), out.ring_rows):
        ref = torch.cat([kv[t], sc[t]])
        mag = torch.cat([x.double().abs() @ wkv.double().abs().t(), x.double().abs() @ wgate.double().abs().t()], 1)[t]
        assert ((row.double() - ref).abs() <= 64 * 2 ** -24 * mag).all()   # FP32 kept, never narrowed
    assert sorted(set(out.ring_slots.tolist())) == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]


def test_compressor_ratio2_inactive_state_block(comp_inputs):
    x, wkv, wgate, norm_w, ring = comp_inputs
    md = _md_three_requests([[2], [-1], [1]])
    out = compress_ratio2(x, wkv, wgate, norm_w, 1e-20, md, ring, md.state_block_tables[2], 4)
    assert not out.closes[7:11].any() and (out.latent[7:11] == 0).all()
    assert sorted(set(out.ring_slots.tolist())) == [6, 7, 8, 9, 10, 11]       # req1 writes nothing


def test_compressor_ratio1_and_index_key(comp_inputs):
    x, wkv, _, norm_w, _ = comp_inputs
    md = _md_three_requests([[2], [0], [1]])
    out = compress_ratio1(x, wkv, norm_w, 1e-20, md)
    assert out.closes.all() and out.ring_slots.numel() == 0
    bf16_ulp_close(out.latent, rms_norm_64(bf16_64(x.double() @ wkv.double().t()), norm_w), ulps=2)
    ihd = TINY.index_head_dim
    wk = _bf(ihd, wkv.shape[0], seed=15, std=0.1)
    k_norm = _bf(ihd, seed=16, std=0.05, mean=1)
    key = index_key(out.latent, wk, k_norm, 1e-20)
    bf16_ulp_close(key, rms_norm_64(bf16_64(out.latent.double() @ wk.double().t()), k_norm), ulps=2)


# ---- index query and scores ------------------------------------------------------------------

def _fp4_e8m0_qdq_ref(v: torch.Tensor, group=32) -> torch.Tensor:
    g = v.double().reshape(-1, group)
    out = torch.empty_like(g)
    for i, row in enumerate(g):
        s = 2.0 ** ceil_log2_exact(max(float(row.abs().max()), 6 * 2.0 ** -126) / 6.0)
        for j, a in enumerate(row.tolist()):
            c = fp4_code_ref(min(max(a / s, -6.0), 6.0))
            out[i, j] = (-1 if c & 8 else 1) * FP4_LEVELS[c & 7] * s
    return out.reshape(v.shape)


def test_index_query_recipe(tables):
    t, d, ql, nh, ihd = 4, TINY.hidden_size, TINY.q_lora_rank, TINY.index_n_heads, TINY.index_head_dim
    qr, x = _bf(t, ql, seed=17), _bf(t, d, seed=18)
    wq_b = torch.randn(nh * ihd, ql, generator=_g(19)) * ql ** -0.5
    wp = _bf(nh, d, seed=20, std=d ** -0.5)
    cos, sin = gather_rope_rows(*tables, torch.tensor([1, 2, 40, 200]))
    q_plain, w = index_query(qr, x, wq_b, wp, cos, sin, nh, ihd, fp4_query=False)
    q_fp4, w2 = index_query(qr, x, wq_b, wp, cos, sin, nh, ihd, fp4_query=True)
    assert q_plain.shape == (t, nh, ihd) and w.shape == (t, nh)
    assert torch.equal(w, w2)
    q_ref = _rope_ref(bf16_64(mx_linear_64(qr, wq_b)).reshape(t, nh, ihd), cos, sin)
    bf16_ulp_close(q_plain, q_ref, ulps=1)
    # official rule: the RoPE'd query is FP4 fake-quantized (group 32 over the flattened heads, E8M0)
    assert torch.equal(q_fp4.double().reshape(t, -1), _fp4_e8m0_qdq_ref(q_plain.reshape(t, -1)))
    assert torch.equal(w.double(), _head_weights_ref(x, wp, nh, ihd))
    # FLASH dims (32 heads x 128): the scaling is exactly 2^-6, so wI = bf16(x wp) / 64 bit-exactly
    wp32 = _bf(32, d, seed=37, std=d ** -0.5)
    wq32 = torch.randn(32 * 128, ql, generator=_g(38)) * ql ** -0.5
    c32, s32 = gather_rope_rows(*precompute_rope_tables(FLASH, 4, COMPRESSED), torch.tensor([0, 1, 2, 3]))
    _, w32 = index_query(qr, x, wq32, wp32, c32, s32, 32, 128)
    assert torch.equal(w32.double(), bf16_64(x.double() @ wp32.double().t()) * 2.0 ** -6)


def _head_weights_ref(x, wp, nh, ihd):
    """Official order: bf16(x wp), times the FP32 scalar ihd^-1/2 * nh^-1/2 (an exact FP64 product
    of an 8-bit and a 24-bit significand), rounded to FP32, then to BF16."""
    c = torch.tensor(ihd ** -0.5 * nh ** -0.5, dtype=torch.float32).double()
    return bf16_64((bf16_64(x.double() @ wp.double().t()) * c).float())


def _index_cache(keys):
    """keys [T, P, d] written to an index cache (row t * P + j) -> (payload, scale, the keys as read back)."""
    t, p, d = keys.shape
    fmt = kv_cache.FORMATS[kv_cache.INDEX]
    payload, scale = fmt.encode(keys.reshape(t * p, d))
    return payload, scale, kv_cache.read(payload, scale, fmt, torch.arange(t * p)).reshape(t, p, d)


def _scores_ref(q, w, keys):
    """S[t, j] = bf16(sum_h bf16(relu(bf16(q_h . k_j)) * w_h)), every sum in FP64."""
    dot = bf16_64(torch.einsum("thd,tpd->thp", q.double(), keys.double()).float())
    term = bf16_64((torch.relu(dot) * w.double().unsqueeze(-1)).float())
    return bf16_64(term.sum(1).float())


@pytest.mark.parametrize("cfg", [TINY, SMALL], ids=["tiny", "small"])
def test_index_head_weights_and_scores_official_rounding(cfg, tables):
    # TINY's factor is 2^-3.5 and SMALL's 2^-4.5: not powers of two, so the second BF16 rounding of
    # the head weights is visible (unlike FLASH's exact 2^-6)
    t, p, d, ql, nh, ihd = 16, 24, cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    qr, x = _bf(t, ql, seed=60), _bf(t, d, seed=61)
    wq_b = torch.randn(nh * ihd, ql, generator=_g(62)) * ql ** -0.5
    wp = _bf(nh, d, seed=63, std=d ** -0.5)
    cos, sin = gather_rope_rows(*precompute_rope_tables(cfg, 64, COMPRESSED), torch.arange(t))
    q, w = index_query(qr, x, wq_b, wp, cos, sin, nh, ihd)
    w_ref = _head_weights_ref(x, wp, nh, ihd)
    assert torch.equal(w.double(), w_ref)
    unrounded = bf16_64(x.double() @ wp.double().t()) * (ihd ** -0.5 * nh ** -0.5)
    assert not torch.equal(w_ref, unrounded)                         # the rounding is not a no-op here
    payload, scale, keys = _index_cache(_bf(t, p, ihd, seed=64))
    rows = torch.arange(t * p).reshape(t, p)
    assert torch.equal(index_scores(q, w, payload, scale, rows).double(), _scores_ref(q, w_ref, keys))


def _dyadic(shape, seed, lo, hi, denom):
    g = _g(seed)
    return torch.randint(lo, hi + 1, shape, generator=g).float() / denom


def test_index_scores_rounding_recipe():
    # dyadic inputs make every FP32 step exact, so the only roundings are the recipe's BF16 ones
    t, nh, d, p = 3, 4, 32, 20
    q = _dyadic((t, nh, d), 21, -16, 16, 8)
    payload, scale, keys = _index_cache(_dyadic((t, p, d), 22, -16, 16, 8))
    w = _dyadic((t, nh), 23, 0, 32, 16)
    visible = torch.rand(t, p, generator=_g(24)) < 0.8
    s = index_scores(q, w, payload, scale, torch.where(visible, torch.arange(t * p).reshape(t, p), -1))
    want = torch.full((t, p), -INF, dtype=torch.float64)
    for i in range(t):
        for j in range(p):
            if not visible[i, j]:
                continue
            total = 0.0
            for h in range(nh):
                dot = float(bf16_64(torch.tensor(sum(float(q[i, h, k]) * float(keys[i, j, k]) for k in range(d)),
                                                 dtype=torch.float64)))
                term = float(bf16_64(torch.tensor(max(dot, 0.0) * float(w[i, h]), dtype=torch.float64)))
                total += term
            want[i, j] = float(bf16_64(torch.tensor(total, dtype=torch.float64)))
    assert torch.equal(s.double(), want)
    # the recipe differs from an unrounded FP32 score on these inputs (the test can see roundings)
    raw = (torch.relu(torch.einsum("thd,tpd->thp", q.double(), keys.double())) * w.double().unsqueeze(-1)).sum(1)
    assert not torch.equal(raw.masked_fill(~visible, -INF), want)


def _index_key_from_bytes(payload_row, scale_row, group=32):
    """One index-cache row decoded by the format's definition: element 2i in byte i's low nibble,
    2i+1 in its high nibble, E2M1 magnitude times 2^(code - 127), rounded to BF16."""
    vals = []
    for i, byte in enumerate(payload_row.tolist()):
        for code in (byte & 0xF, byte >> 4):
            mag = FP4_LEVELS[code & 7] * 2.0 ** (int(scale_row[len(vals) // group]) - 127)
            vals.append(-mag if code & 8 else mag)
    return bf16_64(torch.tensor(vals, dtype=torch.float64))


def test_index_scores_read_each_key_from_the_cache_a_block_at_a_time(monkeypatch):
    """The indexer's pass over the keys (decoded from the cache bytes, a block at a time, rows of one
    request sharing the block's decode, visible keys packed first where no row sees them all) equals
    the unfused formula on keys decoded here: several blocks and a short last one, invisible
    positions, rows of two requests, keys whose magnitudes span 2^-12..2^12."""
    from dsv41.ops import indexer
    t, nh, d, p, r = 5, 8, 64, 23, 40
    g = _g(70)
    values = torch.randn(r, d, generator=g) * 2.0 ** torch.randint(-12, 13, (r, d // 32), generator=g).repeat_interleave(32, 1)
    fmt = kv_cache.FORMATS[kv_cache.INDEX]
    payload, scale = fmt.encode(values)
    slot = torch.stack([torch.randperm(r, generator=g)[:p] for _ in range(2)])       # request -> position -> row
    req = torch.tensor([0, 0, 0, 1, 1])
    lens = torch.tensor([9, 17, 23, 23, 12])
    q = bf16_64(torch.randn(t, nh, d, generator=g)).float()
    w = bf16_64(torch.randn(t, nh, generator=g) * 0.2).float()
    holes = (torch.arange(p) < lens.unsqueeze(1)) & (torch.rand(t, p, generator=g) < 0.85)
    # every row misses some positions (each row's visible keys packed first), then one row sees all
    for visible in (holes, holes | (torch.arange(t) == 3).unsqueeze(1)):
        rows = torch.where(visible, slot[req], -1)
        want = torch.full((t, p), -INF, dtype=torch.float64)
        for i in range(t):
            for j in range(p):
                if visible[i, j]:
                    key = _index_key_from_bytes(payload[rows[i, j]], scale[rows[i, j]])
                    want[i, j] = _scores_ref(q[i:i + 1], w[i:i + 1].double(), key.reshape(1, 1, d))[0, 0]
        assert (want[visible] > 0).any() and torch.isfinite(want[visible]).all()
        for block in (5, 2048):
            monkeypatch.setattr(indexer, "KEY_BLOCK", block)
            assert torch.equal(index_scores(q, w, payload, scale, rows).double(), want)
        # the key blocks split over three cores' shares: the same scores
        from dsv41.cpu import cores
        monkeypatch.setattr(indexer, "KEY_BLOCK", 5)
        monkeypatch.setattr(cores, "SPLIT_MULTIPLIES", 1)
        monkeypatch.setattr(cores, "cores", lambda: 3)
        assert torch.equal(index_scores(q, w, payload, scale, rows).double(), want)
        monkeypatch.undo()


def _topk_ref(scores, k):
    out = []
    for row in scores.tolist():
        elig = [(v, j) for j, v in enumerate(row) if math.isfinite(v)]
        pick = sorted(elig, key=lambda e: (-e[0], e[1]))[:k]
        ids = sorted(j for _, j in pick)
        out.append(ids + [-1] * (k - len(ids)))
    return out


def test_topk_positions_contract():
    g = _g(25)
    t, p, k = 12, 40, 8
    scores = torch.randint(0, 6, (t, p), generator=g).float()       # many ties
    scores[torch.rand(t, p, generator=g) < 0.3] = -INF
    scores[0] = -INF                                                # nothing eligible
    scores[1, :3] = torch.tensor([1.0, 2.0, 3.0])                   # fewer finite than k
    scores[1, 3:] = -INF
    scores[2] = 5.0                                                 # all tied -> lowest positions
    scores[3] = torch.where(torch.arange(p) % 3 == 0, -0.0, -1.5)    # -0.0 ties 0.0; negatives below
    scores[3, 7] = 0.0
    got = topk_positions(scores, k)
    assert got.shape == (t, k)
    assert got.tolist() == _topk_ref(scores, k)
    assert got[0].tolist() == [-1] * k
    assert got[1].tolist() == [0, 1, 2] + [-1] * 5
    assert got[2].tolist() == list(range(8))
    for i in range(t):
        ids = [j for j in got[i].tolist() if j >= 0]
        n_fin = int(torch.isfinite(scores[i]).sum())
        assert len(ids) == min(k, n_fin)
        assert ids == sorted(set(ids))                              # unique, ascending
        assert all(math.isfinite(scores[i, j].item()) for j in ids)
        assert got[i].tolist()[len(ids):] == [-1] * (k - len(ids))  # -1 padded at the end


def test_topk_positions_pick_what_a_stable_descending_sort_picks():
    """The partial selection against the full sort it replaces, on rows of ties, -0.0 beside 0.0,
    negative scores, subnormals, +-inf and NaN (a stable descending sort puts NaN first; the picked
    NaN and -inf positions are then dropped)."""
    g = _g(26)
    t, p, k = 16, 90, 24
    scores = torch.randint(-3, 4, (t, p), generator=g).float() * 0.5
    special = torch.tensor([-0.0, INF, -INF, float("nan"), 1e-40, -1e-40])
    pick = torch.randint(0, 12, (t, p), generator=g)
    scores = torch.where(pick < 6, special[pick.clamp_max(5)], scores)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    want = []
    for i in range(t):
        kept = sorted(j for j in order[i].tolist() if math.isfinite(scores[i, j].item()))
        want.append(kept + [-1] * (k - len(kept)))
    assert topk_positions(scores, k).tolist() == want


def test_topk_k_larger_than_width():
    s = torch.tensor([[3.0, -INF, 1.0]])
    assert topk_positions(s, 5).tolist() == [[0, 2, -1, -1, -1]]


def _candidate_ref(scores, lens, n_blocks, block):
    t, p = scores.shape
    nb = math.ceil(p / block)
    out = torch.zeros(t, p, dtype=torch.bool)
    for i in range(t):
        bs = []
        for b in range(nb):
            vals = scores[i, b * block:(b + 1) * block].tolist()
            bs.append(max(vals + [-INF] * (block - len(vals))))
        L = int(lens[i])
        if L > 0:
            bs[(L - 1) // block] = INF
        order = sorted(range(nb), key=lambda b: (-bs[b], b))[:min(n_blocks, nb)]
        for b in order:
            if bs[b] > -INF:
                out[i, b * block:min((b + 1) * block, p)] = True
    return out


def test_candidate_mask_blocks_pin_and_top():
    g = _g(26)
    t, p, block, nbk = 6, 30, 4, 3
    lens = torch.tensor([30, 13, 1, 0, 9, 22])
    scores = torch.randn(t, p, generator=g)
    scores[torch.arange(p).unsqueeze(0) >= lens.unsqueeze(1)] = -INF
    scores[5, 20:22] = -100.0                                       # newest block scores lowest: pinned anyway
    got = candidate_mask(scores, lens, nbk, block)
    assert got.dtype == torch.bool and got.shape == (t, p)
    assert torch.equal(got, _candidate_ref(scores, lens, nbk, block))
    assert got[5, 20:22].all()                                       # pinned newest block kept
    assert got[2, :4].all() and not got[2, 4:].any()                 # only one finite block
    assert not got[3].any()                                          # L = 0 -> nothing
    assert got[4].sum() <= nbk * block
    # the kept set of a full row is the pinned block + the best other blocks by block max
    bmax = [scores[0, b * 4:(b + 1) * 4].max().item() for b in range(7)]
    best = sorted(range(7), key=lambda b: -bmax[b])
    want_blocks = {7} | set([b for b in best if b != 7][:2])
    assert {j // 4 for j in torch.nonzero(got[0]).flatten().tolist()} == want_blocks


def test_candidate_mask_all_visible_when_few_blocks():
    s = torch.randn(2, 10, generator=_g(27))
    assert candidate_mask(s, torch.tensor([10, 10]), 3, 4).all()


@pytest.mark.parametrize("rows,width,budget,leaf", [(100, 70, 4096, 64), (5, 10, 1 << 20, 64), (7, 1000, 100, 64),
                                                    (0, 10, 4096, 64), (33, 0, 4096, 64)])
def test_score_chunks_cover_rows_and_fit_budget(rows, width, budget, leaf):
    chunks = score_chunks(rows, width, budget, leaf)
    covered = [r for a, b in chunks for r in range(a, b)]
    assert covered == list(range(rows))                              # every row exactly once, in order
    padded = max(1, math.ceil(width / leaf)) * leaf
    for a, b in chunks:
        assert b > a
        assert (b - a) * 4 * padded <= budget or b - a == 1          # fits (a single row always runs)


def test_physical_rows_mapping():
    table = torch.tensor([[3, 1], [0, 2]], dtype=I32)
    pos = torch.tensor([[0, 17, -1], [15, 16, 31]])
    got = physical_rows(pos, torch.tensor([0, 1]), table, 16)
    assert got.tolist() == [[48, 17, -1], [15, 32, 47]]


# ---- paged caches ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,width", [("window", 64), ("compressed", 64), ("index", 32)])
def test_cache_publish_only_addressed_rows(kind, width):
    fmt = kv_cache.FORMATS[kind]
    payload, scale = fmt.empty(10, width)
    payload = torch.randint(0, 255, payload.shape, generator=_g(28), dtype=torch.uint8).view(payload.dtype) \
        if payload.dtype == torch.uint8 else payload
    before = (payload.clone(), scale.clone())
    vals = _bf(3, width, seed=29)
    kv_cache.publish(payload, scale, fmt, torch.tensor([4, -1, 7]), vals)
    untouched = [r for r in range(10) if r not in (4, 7)]
    assert torch.equal(payload[untouched].view(torch.uint8), before[0][untouched].view(torch.uint8))
    assert torch.equal(scale[untouched].view(torch.uint8), before[1][untouched].view(torch.uint8))
    got = kv_cache.read(payload, scale, fmt, torch.tensor([[4, 7, -1]]))
    assert got.shape == (1, 3, width)
    assert (got[0, 2] == 0).all()                                    # -1 reads as zeros
    want = fmt.decode(*fmt.encode(vals[[0, 2]]))
    assert torch.equal(got[0, :2], want)
    with pytest.raises(ValueError, match="slots"):
        kv_cache.publish(payload, scale, fmt, torch.tensor([10]), vals[:1])


def test_cache_layouts():
    assert kv_cache.FORMATS["window"].empty(2, 512)[1].shape == (2, 16)
    p, s = kv_cache.FORMATS["compressed"].empty(2, 512)
    assert p.shape == (2, 256) and s.shape == (2, 32) and s.dtype == torch.float8_e4m3fn
    p, s = kv_cache.FORMATS["index"].empty(2, 128)
    assert p.shape == (2, 64) and s.shape == (2, 4) and s.dtype == torch.uint8
    assert kv_cache.FORMATS["window"].row_bytes(512) == 528
    assert kv_cache.FORMATS["compressed"].row_bytes(512) == 288
    assert kv_cache.FORMATS["index"].row_bytes(128) == 68


# ---- sparse attention -----------------------------------------------------------------------------

def _dense_attention_ref(q, keys, valid, sink, scale, logit_keys=None):
    """Plain softmax over [valid logits, sink] with the sink column dropped (float64); logit_keys
    (default keys) give the logits, keys the values."""
    t, h, d = q.shape
    logit_keys = keys if logit_keys is None else logit_keys
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for i in range(t):
        kk = keys[i][valid[i]].double()
        if kk.shape[0] == 0:
            continue
        logits = (q[i].double() @ logit_keys[i][valid[i]].double().t()) * scale    # [h, n]
        full = torch.cat([logits, sink.double().unsqueeze(1)], 1)
        p = torch.softmax(full, 1)[:, :-1]
        out[i] = p @ kk
    return out


@pytest.fixture(scope="module")
def attn_inputs():
    t, h, d, k = 6, 8, 64, 150
    q = _bf(t, h, d, seed=30, std=2.0)
    keys = _bf(t, k, d, seed=31)
    valid = torch.rand(t, k, generator=_g(32)) < 0.7
    sink = torch.randn(h, generator=_g(33))
    return q, keys, valid, sink, d ** -0.5


def _assert_bf16_p_bound(out, q, keys, valid, sink, scale):
    """Against the FP64 dense softmax, the kernel's only coarse step is BF16 P (relative 2^-9 per
    probability) before the BF16 output rounding: |out - ref| <= 2^-9 sum_k p_k |v_k| (+ FP32 slack)
    + one BF16 ulp of the result."""
    ref = _dense_attention_ref(q, keys, valid, sink, scale)
    weighted = _dense_attention_ref(q, keys.abs(), valid, sink, scale, logit_keys=keys)
    _, e = torch.frexp(ref.abs())
    ulp = torch.ldexp(torch.ones_like(ref), e - 8)
    excess = (out.double() - ref).abs() - (2.0 ** -9 * (1 + 2 ** -10) * weighted + ulp + 1e-30)
    assert (excess <= 0).all(), f"max excess {excess.max().item()}"


def test_sparse_attention_all_valid_equals_dense(attn_inputs):
    q, keys, _, sink, scale = attn_inputs
    valid = torch.ones(keys.shape[:2], dtype=torch.bool)
    out = sparse_attention(q, keys, valid, sink, scale)
    assert out.shape == q.shape and is_bf16(out)
    _assert_bf16_p_bound(out, q, keys, valid, sink, scale)


def test_sparse_attention_masked_keys_equal_dense_over_valid(attn_inputs):
    q, keys, valid, sink, scale = attn_inputs
    valid = valid.clone()
    valid[3] = False                                                 # a row with no valid key
    valid[4] = False
    valid[4, 149] = True                                             # a single key at the very end
    out = sparse_attention(q, keys, valid, sink, scale)
    assert (out[3] == 0).all()                                       # exactly 0
    _assert_bf16_p_bound(out, q, keys, valid, sink, scale)


def test_sparse_attention_rows_split_over_cores_give_the_same_bits(attn_inputs, monkeypatch):
    """The rows in shares on three cores (one share a row block of its own): each row's bits as
    computed in one share, an empty row included."""
    from dsv41.cpu import cores
    from dsv41.ops import attention
    q, keys, valid, sink, scale = attn_inputs
    valid = valid.clone()
    valid[3] = False
    whole = sparse_attention(q, keys, valid, sink, scale)
    monkeypatch.setattr(cores, "SPLIT_MULTIPLIES", 1)
    monkeypatch.setattr(cores, "cores", lambda: 3)
    monkeypatch.setattr(attention, "ROW_BLOCK_BYTES", 1)
    assert torch.equal(sparse_attention(q, keys, valid, sink, scale), whole)


def test_sparse_attention_huge_sink_gives_zero(attn_inputs):
    q, keys, valid, _, scale = attn_inputs
    h = q.shape[1]
    for big in (1000.0, 10000.0):
        out = sparse_attention(q, keys, valid, torch.full((h,), big), scale)
        assert torch.isfinite(out).all()
        assert out.abs().max().item() <= 1e-30


def test_sparse_attention_per_head_sink_only_in_denominator(attn_inputs):
    q, keys, _, _, scale = attn_inputs
    valid = torch.zeros(keys.shape[:2], dtype=torch.bool)
    valid[:, 0] = True                                               # one key: out = K * e^l / (e^l + e^sink)
    sink = torch.linspace(-3, 3, q.shape[1])
    out = sparse_attention(q, keys, valid, sink, scale)
    _assert_bf16_p_bound(out, q, keys, valid, sink, scale)
    ref = _dense_attention_ref(q, keys, valid, sink, scale)
    lg = (q.double() * keys[:, :1].double()).sum(-1) * scale        # [t, h]
    frac = torch.sigmoid(lg - sink.double())
    assert torch.allclose(ref, frac.unsqueeze(-1) * keys[:, :1].double(), atol=1e-12)


# ---- output projection -------------------------------------------------------------------------------

def test_o_proj_partial_and_tp_reduction(tables):
    t, h, hd, g, r, d = 4, TINY.num_attention_heads, TINY.head_dim, TINY.o_groups, TINY.o_lora_rank, TINY.hidden_size
    attended = _bf(t, h, hd, seed=34)
    cos, sin = gather_rope_rows(*tables, torch.tensor([0, 5, 9, 77]))
    wo_a = _bf(g, r, h * hd // g, seed=35, std=(h * hd // g) ** -0.5)
    wo_b = torch.randn(d, g * r, generator=_g(36)) * (g * r) ** -0.5
    full = reduce_partials([o_proj_partial(attended, cos, sin, wo_a, wo_b)])
    a = _rope_ref(attended, cos, sin, inverse=True).reshape(t, g, -1)
    z = bf16_64(torch.einsum("tgi,gri->tgr", a, wo_a.double())).reshape(t, -1)
    ref = bf16_64(mx_linear_64(z, wo_b))
    assert is_bf16(full)
    bf16_ulp_close(full, ref, 1.0)          # RoPE in FP32 vs FP64 may flip a BF16 rounding of z
    # TP=2 and TP=4: each rank owns a share of the heads / groups / wo_b input columns; the tree of
    # the ranks' partials gives the same bits as the single-rank partial
    for tp in (2, 4):
        hl, gl = h // tp, g // tp
        parts = [o_proj_partial(attended[:, i * hl:(i + 1) * hl], cos, sin, wo_a[i * gl:(i + 1) * gl],
                                wo_b[:, i * gl * r:(i + 1) * gl * r]) for i in range(tp)]
        assert torch.equal(reduce_partials(parts), full)


def test_reduce_partials_pairwise_tree_one_rounding():
    a = torch.tensor([[2.0 ** 24]])
    b = torch.tensor([[1.0]])
    c = torch.tensor([[-(2.0 ** 24)]])
    z = torch.zeros(1, 1)
    # (a + b) + (c + 0) = 2^24 - 2^24 = 0 (2^24 + 1 rounds to 2^24); (a + c) + (b + 0) = 1
    assert reduce_partials([a, b, c, z]).item() == 0.0
    assert reduce_partials([a, c, b, z]).item() == 1.0
    # the tree of per-rank trees is the tree of all parts: TP2 shares of four groups sum as TP1 does
    parts = [torch.randn(3, 8, generator=_g(40 + i)) for i in range(8)]
    assert torch.equal(tree_sum(parts), tree_sum([tree_sum(parts[:4]), tree_sum(parts[4:])]))
    assert torch.equal(tree_sum(parts), tree_sum([tree_sum(parts[2 * i:2 * i + 2]) for i in range(4)]))
    with pytest.raises(ValueError, match="power-of-two"):
        tree_sum(parts[:3])
    x = torch.tensor([[1.0 + 2 ** -9]])
    assert reduce_partials([x, torch.zeros(1, 1)]).item() == 1.0    # one BF16 rounding of the sum


def _tiled_attention_ref(q, keys, valid, sink, scale, tile=64):
    """Spec 02 §7 / 04 §2.9 written per row and per head over the list as given: 64-entry tiles,
    running max from -1e30, FP32 denominator of unrounded P, BF16 P in the PV product, sink added
    at the end without a re-max; every dot and tile sum accumulated in FP64 and rounded to FP32."""
    t, h, d = q.shape
    out = torch.zeros(t, h, d)
    for i in range(t):
        if not valid[i].any():
            continue
        for hh in range(h):
            m, den, num = torch.tensor(-1e30), torch.tensor(0.0), torch.zeros(d)
            for s0 in range(0, keys.shape[1], tile):
                k, ok = keys[i, s0:s0 + tile], valid[i, s0:s0 + tile]
                logit = (k.double() @ q[i, hh].double()).float() * scale
                logit = torch.where(ok, logit, torch.tensor(-1e30))
                m_new = torch.maximum(m, logit.max())
                c = torch.exp(m - m_new)
                p = torch.exp(logit - m_new) * ok
                den = den * c + p.double().sum().float()
                pb = p.to(torch.bfloat16).float()
                num = num * c + (pb.double() @ k.double()).float()
                m = m_new
            den = den + torch.exp(sink[hh].float() - m)
            out[i, hh] = num / den
    return out.to(torch.bfloat16).float()


def test_sparse_attention_tiles_the_raw_slot_list():
    # window 64 and Top-K 16: rows whose window is partly filled (prefill rows, a filling decode
    # ring) put compressed slots into the first tile once the -1 entries are compacted away, so
    # compact-then-tile and the official raw-list tiling round P differently
    t, h, d, w, k = 10, 4, 64, 64, 16
    q = _bf(t, h, d, seed=70, std=3.0)
    keys = _bf(t, w + k, d, seed=71)
    fill = torch.tensor([1, 5, 20, 33, 40, 50, 63, 64, 64, 12])
    n_cmp = torch.tensor([16, 3, 16, 9, 16, 0, 16, 16, 5, 16])
    col = torch.arange(w + k)
    valid = torch.where(col < w, col < fill.unsqueeze(1), (col - w) < n_cmp.unsqueeze(1))
    keys = keys * valid.unsqueeze(-1)                                 # -1 slots read as zero rows
    sink = torch.randn(h, generator=_g(72))
    out = sparse_attention(q, keys, valid, sink, d ** -0.5)
    assert torch.equal(out, _tiled_attention_ref(q, keys, valid, sink, d ** -0.5))
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    compact = _tiled_attention_ref(q, torch.gather(keys, 1, order.unsqueeze(-1).expand_as(keys)),
                                   torch.gather(valid, 1, order), sink, d ** -0.5)
    assert not torch.equal(out, compact)                             # the tilings do differ here
    assert_rows_close(out, compact, "compact tiling")                # ... by BF16 rounding only


def _window_key_from_bytes(payload_row, scale_row, group=32):
    """One window-cache row by the format's definition: E4M3 value times 2^(code - 127), rounded to BF16."""
    exp = scale_row.double().repeat_interleave(group) - 127
    return bf16_64(payload_row.double() * torch.pow(2.0, exp))


def _compressed_key_from_bytes(payload_row, scale_row, group=16):
    """One compressed-cache row: E2M1 nibbles (element 2i low) times the group's E4M3 scale, to BF16."""
    codes = torch.stack([payload_row & 0xF, payload_row >> 4], -1).reshape(-1).long()
    mag = torch.tensor(FP4_LEVELS, dtype=torch.float64)[codes & 7]
    vals = torch.where((codes & 8) != 0, -mag, mag)
    return bf16_64(vals * scale_row.double().repeat_interleave(group))


def test_sparse_attention_reads_each_key_from_the_caches_once_per_query_block(monkeypatch):
    """The leaf over cache rows (window FP8 and compressed FP4 bytes decoded in its pass, query blocks
    of one row) equals the per-row, per-head tiled formula on keys decoded here: three tiles and a
    short last one, invalid slots in place, compressed slots ahead of and behind window slots, a row
    with no valid key, keys whose groups span 2^-8..2^8."""
    from dsv41.ops import attention
    t, h, d, w, k = 6, 4, 64, 64, 70
    g = _g(73)
    win_fmt, cmp_fmt = kv_cache.FORMATS[kv_cache.WINDOW], kv_cache.FORMATS[kv_cache.COMPRESSED]
    spread = lambda n: 2.0 ** torch.randint(-8, 9, (n, d // 16), generator=g).repeat_interleave(16, 1)
    window = win_fmt.encode(torch.randn(90, d, generator=g) * spread(90))
    compressed = cmp_fmt.encode(torch.randn(120, d, generator=g) * spread(120))
    q = _bf(t, h, d, seed=74, std=3.0)
    sink = torch.randn(h, generator=_g(75))
    cmp_first = torch.rand(t, w + k, generator=g) < 0.5                 # a permuted list: sources interleave
    rows = torch.where(cmp_first, torch.randint(0, 120, (t, w + k), generator=g),
                       torch.randint(0, 90, (t, w + k), generator=g))
    rows = torch.where(torch.rand(t, w + k, generator=g) < 0.2, -1, rows)
    rows[2] = -1                                                         # no valid key: exactly 0
    rows[4, 100:] = -1                                                   # trailing invalid tiles of one row
    keys = torch.zeros(t, w + k, d, dtype=torch.float64)
    for i in range(t):
        for j in range(w + k):
            r = int(rows[i, j])
            if r >= 0:
                keys[i, j] = (_compressed_key_from_bytes(compressed[0][r], compressed[1][r].float()) if cmp_first[i, j]
                              else _window_key_from_bytes(window[0][r].float(), window[1][r]))
    want = _tiled_attention_ref(q, keys.float(), rows >= 0, sink, d ** -0.5)
    assert (want[2] == 0).all() and (want[0] != 0).any()
    monkeypatch.setattr(attention, "ROW_BLOCK_BYTES", 1)
    got = attention.sparse_attention_cached(q, window, compressed, rows, cmp_first, sink, d ** -0.5)
    assert torch.equal(got, want)
    monkeypatch.setattr(attention, "ROW_BLOCK_BYTES", 1 << 30)
    assert torch.equal(attention.sparse_attention_cached(q, window, compressed, rows, cmp_first, sink, d ** -0.5), want)


def test_slot_list_moves_compressed_slots_behind_a_short_window():
    # official prefill lists min(prompt, window) window slots; decode lists the whole window
    w, k, d = 6, 3, 2
    win = torch.arange(2 * w * d, dtype=torch.float32).reshape(2, w, d) + 1
    cmp = -torch.arange(2 * k * d, dtype=torch.float32).reshape(2, k, d) - 1
    wv = torch.tensor([[True, True, False, False, False, False], [True] * 6])
    cv = torch.tensor([[True, True, False], [True, False, False]])
    keys, valid = slot_list(win * wv.unsqueeze(-1), wv, cmp, cv, torch.tensor([4, 6]))
    assert valid.tolist() == [[True, True, False, False, True, True, False, False, False],
                              [True] * 7 + [False, False]]
    assert torch.equal(keys[0, 4:7], cmp[0])
    assert torch.equal(keys[1], torch.cat([win[1], cmp[1]]))
    with pytest.raises(ValueError, match="win_width"):
        slot_list(win, torch.ones(2, w, dtype=torch.bool), cmp, cv, torch.tensor([4, 6]))
