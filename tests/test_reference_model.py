"""Model-level behaviour of the monolithic reference on TINY (window 16, Top-K 8, 3x4 candidate blocks).

One TINY model is shared by the module; every test releases what it starts, so the pools are whole
between tests.
"""
import copy

import pytest
import torch

from dsv41.config import TINY
from dsv41.engine.reference import ReferenceEngine
from dsv41.model.moe import MoE
from dsv41.ops.lm_head import greedy
from _spec_ref import assert_rows_close


def _tokens(n, seed):
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return ReferenceEngine(TINY, seed=0)


@pytest.fixture(autouse=True)
def _clean(model):
    assert model.active == [], "a previous test left requests active"
    yield
    for rid in model.active:
        model.release(rid)


def _pools(model):
    p = model.host.tables[0].pools
    return sorted(p.window), {r: sorted(v) for r, v in p.compressed.items()}, sorted(p.state)


def _snapshot(model):
    caches = {k: tuple(t.clone() for t in v) for k, v in model.caches.committed.items()}
    t = model.host.tables[0]
    return caches, copy.deepcopy(t.requests), copy.deepcopy(t.pools), model.starts, list(model.last_request_ids)


def _assert_unchanged(model, snap):
    caches, requests, pools, started, last = snap
    assert model.caches.pending == 0
    assert set(model.caches.committed) == set(caches)
    for name, ts in caches.items():
        now = model.caches.committed[name]
        for a, b in zip(now, ts):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    t = model.host.tables[0]
    assert t.requests == requests and t.pools == pools and model.starts == started
    assert model.last_request_ids == last


# ---- prefill + teacher-forced decode == longer prefill ------------------------------------------------

@pytest.mark.parametrize("n,k", [(11, 3), (67, 3)], ids=["short", "long"])
def test_prefill_then_decode_equals_longer_prefill(model, n, k):
    toks = _tokens(n + k, seed=n)
    model.prefill([toks[:n]])
    rid = model.last_request_ids[0]
    for i in range(k):
        logits = model.decode([toks[n + i]], [rid]).logits
    model.release(rid)
    ref = model.prefill([toks]).logits
    model.release(model.last_request_ids[0])
    assert_rows_close(logits, ref, "last-row logits")


def test_batched_prefill_and_decode_equal_single_longer_prefills(model):
    a, b = _tokens(19, seed=100), _tokens(40, seed=101)
    model.prefill([a[:17], b[:37]])
    rids = list(model.last_request_ids)
    model.decode([a[17], b[37]], rids)
    logits = model.decode([a[18], b[38]], rids).logits
    for r in rids:
        model.release(r)
    for row, toks in enumerate((a, b[:39])):
        ref = model.prefill([toks]).logits
        model.release(model.last_request_ids[0])
        assert_rows_close(logits[row:row + 1], ref, f"request {row}")


# ---- continuous batching -------------------------------------------------------------------------------

def test_request_joining_mid_decode_gets_its_solo_tokens(model):
    a, b = _tokens(30, seed=7), _tokens(21, seed=8)
    solo_a = model.generate([a], 6)[0]
    solo_b = model.generate([b], 4)[0]
    la = model.prefill([a]).logits
    ra = model.last_request_ids[0]
    got_a = [int(greedy(la)[0])]
    for _ in range(2):
        got_a.append(int(greedy(model.decode([got_a[-1]], [ra]).logits)[0]))
    lb = model.prefill([b]).logits                                  # joins while a is active
    rb = model.last_request_ids[0]
    assert rb != ra and model.active == [ra, rb]
    got_b = [int(greedy(lb)[0])]
    for _ in range(3):
        logits = model.decode([got_a[-1], got_b[-1]]).logits        # default: every active request, admission order
        nxt = greedy(logits).tolist()
        got_a.append(nxt[0])
        got_b.append(nxt[1])
    assert got_a == solo_a
    assert got_b == solo_b


def test_release_returns_blocks_to_the_pools(model):
    before = _pools(model)
    blocks = model.host.tables[0].blocks
    sizes = (blocks.window_blocks, blocks.compressed_blocks, blocks.state_blocks)
    assert len(before[0]) == sizes[0] and {r: len(v) for r, v in before[1].items()} == sizes[1]
    assert len(before[2]) == sizes[2]
    model.prefill([_tokens(40, 1), _tokens(9, 2)])
    rids = list(model.last_request_ids)
    model.decode([1, 2], rids)
    during = _pools(model)
    assert len(during[0]) < len(before[0]) and len(during[2]) == len(before[2]) - 2
    for r in rids:
        model.release(r)
    assert _pools(model) == before
    assert model.active == []
    with pytest.raises(ValueError, match="request_ids"):
        model.release(rids[0])


def test_window_pages_behind_the_window_are_recycled(model):
    free0 = len(model.host.tables[0].pools.window)
    model.prefill([_tokens(80, 3)])                          # 80 tokens = 5 pages of 16; window 16
    rid = model.last_request_ids[0]
    held = model.host.tables[0].requests[rid].window_pages
    assert len(held) <= 2 and max(held) == 4                 # only the pages the next window needs
    assert len(model.host.tables[0].pools.window) == free0 - len(held)
    model.release(rid)


# ---- determinism -----------------------------------------------------------------------------------

def test_generate_again_on_the_same_model_gives_the_same_tokens(model):
    prompts = [_tokens(20, 50), _tokens(13, 51)]
    out = model.generate(prompts, 4)
    assert model.active == []
    assert model.generate(prompts, 4) == out                    # released blocks leave nothing behind


def test_generate_4x48_is_deterministic_across_instances(model):
    prompts = [_tokens(48, 20 + i) for i in range(4)]
    out = model.generate(prompts, 8)          # 8 steps: on past the prompts' three full 16-token pages
    assert len(out) == 4 and all(len(o) == 8 for o in out)
    assert all(0 <= t < TINY.vocab_size for o in out for t in o)
    assert model.active == []
    other = ReferenceEngine(TINY, seed=0)
    assert other.generate(prompts, 8) == out


def test_different_seed_differs(model):
    p = [_tokens(12, 30)]
    l0 = model.prefill(p).logits
    model.release(model.last_request_ids[0])
    l1 = ReferenceEngine(TINY, seed=1).prefill(p).logits
    assert not torch.equal(l0, l1)
    assert (l0 - l1).abs().max() > 1e-3


# ---- bad input: ValueError naming the field, nothing changed ----------------------------------------------

BAD = [
    ("prefill", ([[5, TINY.vocab_size]],), "token_ids"),
    ("prefill", ([[5, -1]],), "token_ids"),
    ("prefill", ([[5, 1.5]],), "token_ids"),
    ("prefill", ([[]],), "token_ids"),
    ("prefill", ([[1]] * 8,), "batch"),                       # 1 active + 8 new > max_batch 8
    ("prefill", ([list(range(300)), list(range(300))],), "batch"),   # 600 rows > prefill capacity 512
    ("prefill", ([[1] * 1025],), "token_ids"),               # beyond max_context 1024
    ("decode", ([TINY.vocab_size],), "token_ids"),
    ("decode", ([1, 2],), "token_ids"),                      # one active request, two tokens
    ("decode", ([1], [999]), "request_ids"),
    ("decode", ([1, 2], ["ACTIVE", "ACTIVE"]), "request_ids"),
]


@pytest.mark.parametrize("method,args,field", BAD, ids=[f"{m}-{f}-{i}" for i, (m, _, f) in enumerate(BAD)])
def test_bad_input_raises_and_changes_nothing(model, method, args, field):
    model.prefill([_tokens(20, 40)])
    rid = model.last_request_ids[0]
    model.decode([3], [rid])
    args = tuple([rid if a == "ACTIVE" else a for a in arg] if isinstance(arg, list) and "ACTIVE" in arg else arg
                 for arg in args)
    snap = _snapshot(model)
    with pytest.raises(ValueError) as e:
        getattr(model, method)(*args)
    assert field in str(e.value), str(e.value)
    _assert_unchanged(model, snap)


def test_failure_inside_the_forward_discards_staged_writes(model, monkeypatch):
    model.prefill([_tokens(20, 41)])
    rid = model.last_request_ids[0]
    snap = _snapshot(model)
    real = MoE.forward

    def failing(moe, x):
        if moe.layer == 30:
            raise RuntimeError("injected")
        return real(moe, x)

    monkeypatch.setattr(MoE, "forward", failing)
    with pytest.raises(RuntimeError, match="injected"):
        model.decode([3], [rid])
    _assert_unchanged(model, snap)
    monkeypatch.setattr(MoE, "forward", real)
    ok = model.decode([3], [rid]).logits                             # the request still works afterwards
    assert torch.isfinite(ok).all()
