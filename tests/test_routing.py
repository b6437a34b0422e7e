"""DP routing (``cluster/routing.py``): where new requests go, and a batch split by group and put back."""
from __future__ import annotations

import random

import pytest

from dsv41.cluster.routing import Router


def test_new_requests_fill_the_least_loaded_group_lowest_first():
    r = Router(3)
    assert r.place([2, 0, 1], 4) == [1, 1, 2, 0]      # loads 2,1,1 -> 2,2,1 -> 2,2,2 -> group 0 on the tie
    assert r.place([0, 0, 0], 5) == [0, 1, 2, 0, 1]


def test_split_and_gather_keep_batch_order_and_running_requests_stay_put():
    rng = random.Random(0)
    r = Router(4)
    loads = [0, 0, 0, 0]
    first = r.split([(None, [i]) for i in range(6)], loads)
    ids = r.admit(first, {g: [10 * g + i for i in range(len(b))] for g, b in first.batches.items()})
    assert ids == list(range(6)) and r.next_rid == 6
    assert [r.where[i][0] for i in ids] == [0, 1, 2, 3, 0, 1]
    for _ in range(20):
        running = rng.sample(ids, rng.randint(0, len(ids)))
        batch = [(rid, [rid, rng.randint(0, 99)]) for rid in running] + [(None, [-1])] * rng.randint(0, 3)
        rng.shuffle(batch)
        if not batch:
            continue
        drafts = [[k] * k for k in range(len(batch))]
        probs = [f"q{k}" if k % 2 else None for k in range(len(batch))]
        split = r.split(batch, [2, 2, 1, 1], drafts=drafts, draft_probs=probs)
        assert list(split.batches) == sorted(split.batches)            # groups in ascending order
        for (rid, toks), (g, i) in zip(batch, split.placed):
            local, got = split.batches[g][i]
            assert got == toks
            assert (g, local) == (r.where[rid] if rid is not None else (g, None))
        assert split.gather({g: [t for _, t in b] for g, b in split.batches.items()}) == [t for _, t in batch]
        assert split.gather(split.drafts) == drafts
        assert split.gather(split.draft_probs) == probs
        assert split.gather(split.sampling) == [None] * len(batch)
        assert [g for (rid, _), (g, _) in zip(batch, split.placed) if rid is None] == \
            r.place([2, 2, 1, 1], sum(rid is None for rid, _ in batch))


def test_unknown_ids_and_mismatched_lists_are_refused():
    r = Router(2)
    with pytest.raises(ValueError, match="request_ids: unknown or released request 7"):
        r.split([(7, [1])], [0, 0])
    with pytest.raises(ValueError, match=r"sampling: expected one entry per request \(1\), found 2"):
        r.split([(None, [1])], [0, 0], sampling=[None, None])
    with pytest.raises(ValueError, match=r"drafts: expected one list per request \(1\), found 0"):
        r.split([(None, [1])], [0, 0], drafts=[])
    with pytest.raises(ValueError, match=r"draft_probs: expected one entry per request \(1\), found 2"):
        r.split([(None, [1])], [0, 0], draft_probs=[None, None])
    split = r.split([(None, [1]), (None, [2])], [0, 0])
    a, b = r.admit(split, {0: [5], 1: [3]})
    assert r.release(a) == (0, 5) and r.where == {b: (1, 3)}
    r.renumber(1, {3: 0})
    assert r.where == {b: (1, 0)}
    with pytest.raises(ValueError, match=f"request_ids: unknown or released request {a}"):
        r.release(a)
