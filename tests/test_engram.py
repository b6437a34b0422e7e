"""Engram (spec 01 §6 with the corrections and hashing of 04 §1 7b, §2.7, §3)."""
import math

import numpy as np
import pytest
import sympy
import torch

from dsv41.config import FLASH, TINY
from dsv41.ops.engram import (default_token_map, engram, engram_primes, engram_table_rows, hash_ids,
                              multipliers)
from _spec_ref import bf16_64, bf16_ulp_close, is_bf16, mx_linear_64


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_flash_primes_and_table_rows():
    primes = engram_primes(FLASH)
    # the 48 smallest primes above 15,999,999, layer 1 first, then layer 14
    want, n = [], 15_999_999
    for _ in range(48):
        n = sympy.nextprime(n)
        want.append(n)
    assert primes[1] == want[:24] and primes[14] == want[24:]
    assert sum(primes[1]) == 384006168 and sum(primes[14]) == 384016682
    assert (engram_table_rows(FLASH, 1), engram_table_rows(FLASH, 14)) == (384006168, 384016682)
    assert FLASH.engram_ids_per_token == 24 and FLASH.engram_lookup_dim == 6144


def test_multipliers_are_official_rng_odd_values():
    for layer in (1, 14):
        bound = max(1, (2 ** 63 - 1) // 99092 // 2)
        raw = np.random.default_rng(10007 * layer).integers(0, bound, 4, dtype=np.int64)
        assert multipliers(FLASH, layer) == [2 * int(v) + 1 for v in raw]
        assert all(m % 2 == 1 for m in multipliers(FLASH, layer))


def _wrap64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _hash_ref(cfg, layer, history, positions, token_map):
    """Spec 04 §3 with Python integers and explicit int64 wrap-around."""
    primes = engram_primes(cfg)[layer]
    offsets = [sum(primes[:i]) for i in range(len(primes))]
    mult = multipliers(cfg, layer)
    pad = int(token_map[cfg.engram_pad_token_id])
    comp = [int(token_map[t]) for t in history]
    heads, n_max = cfg.engram_n_heads, cfg.engram_max_ngram_size
    rows = []
    for p in positions:
        toks = []
        dead = False
        for s in range(n_max):
            dead = dead or p - s < 0
            toks.append(pad if dead else comp[p - s])
        row = []
        h = _wrap64(toks[0] * mult[0])
        for s in range(1, n_max):
            h = _wrap64(h ^ _wrap64(toks[s] * mult[s]))
            for head in range(heads):
                col = (s - 1) * heads + head
                row.append(h % primes[col] + offsets[col])
        rows.append(row)
    return rows


@pytest.mark.parametrize("cfg", [TINY, FLASH], ids=["tiny", "flash"])
def test_hash_ids_vs_independent_and_in_range(cfg):
    g = _g(0)
    history = torch.randint(0, cfg.vocab_size, (12,), generator=g).tolist()
    tmap = default_token_map(cfg)
    for layer in cfg.engram_layer_ids:
        ids = hash_ids(cfg, layer, history, range(0, 12), tmap)
        assert ids.shape == (12, cfg.engram_ids_per_token) and ids.dtype == torch.int64
        assert ids.tolist() == _hash_ref(cfg, layer, history, range(12), tmap)
        primes = engram_primes(cfg)[layer]
        offs = np.concatenate([[0], np.cumsum(primes[:-1])])
        lo = torch.tensor(offs)
        hi = lo + torch.tensor(primes)
        assert ((ids >= lo) & (ids < hi)).all()
        assert int(ids.max()) < engram_table_rows(cfg, layer)
        # a continuation computed from the history equals the rows of the full computation
        assert torch.equal(hash_ids(cfg, layer, history, range(7, 12), tmap), ids[7:])


def test_hash_pad_uses_compressed_pad_id():
    cfg = TINY
    tmap = torch.randperm(cfg.vocab_size, generator=_g(1)) % cfg.engram_compressed_vocab_size
    hist = [5, 9, 300]
    got = hash_ids(cfg, 1, hist, range(3), tmap)
    assert got.tolist() == _hash_ref(cfg, 1, hist, range(3), tmap)
    # position 0's lookback tokens are all the pad: token_map[2], not 2
    h2 = hash_ids(cfg, 1, [hist[0]], range(1), tmap)
    assert torch.equal(h2, got[:1])


def _engram_setup(t=5, seed=2):
    cfg = TINY
    hc, d, hd = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
    n_ids = cfg.engram_ids_per_token
    g = _g(seed)
    table = bf16_64(torch.randn(200, hd, generator=g)).float()
    ids = torch.randint(0, 200, (t, n_ids), generator=g)
    wkv = torch.randn((hc + 1) * d, n_ids * hd, generator=g) * (n_ids * hd) ** -0.5
    qw = bf16_64(torch.randn(hc, d, generator=g) * 0.05 + 1).float()
    kw = bf16_64(torch.randn(hc, d, generator=g) * 0.05 + 1).float()
    x = bf16_64(torch.randn(t, hc, d, generator=g)).float()
    return x, ids, table, wkv, qw, kw


def test_engram_vs_formula():
    x, ids, table, wkv, qw, kw = _engram_setup()
    t, hc, d = x.shape
    out = engram(x, ids, table, wkv, qw, kw, 1e-20)
    assert out.shape == x.shape and is_bf16(out)
    lookup = table[ids].reshape(t, -1).double()
    kv = bf16_64(mx_linear_64(lookup, wkv))
    key, value = kv[:, : hc * d].reshape(t, hc, d), kv[:, hc * d:]
    want = torch.zeros(t, hc, d, dtype=torch.float64)
    for i in range(t):
        for c in range(hc):
            xc, kc = x[i, c].double(), key[i, c]
            w = qw[c].double() * kw[c].double()
            dot = float((xc * w * kc).sum()) / math.sqrt(float((xc * xc).mean()) + 1e-20) \
                / math.sqrt(float((kc * kc).mean()) + 1e-20) / math.sqrt(d)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            want[i, c] = xc + gate * value[i]
    want = bf16_64(want)
    # same rounding points; the FP32 gate and sum may flip the final BF16 rounding by one ulp where
    # the exact value sits on a boundary (rare: at most 1% of elements)
    bf16_ulp_close(out, want, ulps=1.0)
    assert (out.double() != want).float().mean() <= 0.01
    assert (out.double() != x.double()).any()


def test_engram_gate_uses_copysign_at_positive_zero():
    cfg = TINY
    hc, d, hd, n_ids = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim, cfg.engram_ids_per_token
    table = torch.ones(4, hd)
    ids = torch.zeros(1, n_ids, dtype=torch.long)
    wkv = torch.zeros((hc + 1) * d, n_ids * hd)
    wkv[hc * d:, 0] = 1.0                      # key = 0 exactly; value = 1.0 on every channel
    qw = kw = torch.ones(hc, d)
    # x just below the BF16 midpoint 1 + 2^-8 after adding 0.5; the gate sigmoid(+1e-3) pushes it over
    x = torch.full((1, hc, d), 0.5 + 2 ** -8 - 1e-4)
    out = engram(x, ids, table, wkv, qw, kw, 1e-20)
    g_copysign = 1 / (1 + math.exp(-1e-3))
    want = bf16_64(x.double() + g_copysign)
    assert torch.equal(out.double(), want)
    assert not torch.equal(want, bf16_64(x.double() + 0.5))   # sign(0) = 0 would give sigmoid(0) = 0.5
    assert out[0, 0, 0].item() == 1.0 + 2 ** -7
