"""DP routing (``engine/routing.py``): where new requests go, and a step split by group and put back."""
from __future__ import annotations

import random

import pytest

from dsv41.engine.routing import Router
from dsv41.engine.layout import Part


def test_new_requests_fill_the_least_loaded_group_lowest_first():
    r = Router(3)
    assert r.place([2, 0, 1], 4) == [1, 1, 2, 0]      # loads 2,1,1 -> 2,2,1 -> 2,2,2 -> group 0 on the tie
    assert r.place([0, 0, 0], 5) == [0, 1, 2, 0, 1]


def test_split_and_gather_keep_step_order_and_running_requests_stay_put():
    rng = random.Random(0)
    r = Router(4)
    where = {rid: rid % 4 for rid in range(6)}           # running request id -> its group
    for _ in range(20):
        running = rng.sample(sorted(where), rng.randint(0, len(where)))
        parts = [Part(rid, [rid, rng.randint(0, 99)]) for rid in running] + \
            [Part(100 + k, [-1], start=True) for k in range(rng.randint(0, 3))]
        rng.shuffle(parts)
        if not parts:
            continue
        split = r.split(parts, [2, 2, 1, 1], where.__getitem__)
        assert list(split.shares) == sorted(split.shares)            # groups in ascending order
        for i, (part, (g, j)) in enumerate(zip(parts, split.placed)):
            assert split.shares[g][j] == i
            if not part.start:
                assert g == where[part.id]
        assert split.gather({g: [parts[i].tokens for i in s] for g, s in split.shares.items()}) == \
            [p.tokens for p in parts]
        assert [g for p, (g, _) in zip(parts, split.placed) if p.start] == \
            r.place([2, 2, 1, 1], sum(p.start for p in parts))


def test_a_new_request_goes_where_its_prefix_is_unless_that_group_is_too_loaded():
    r = Router(3)
    # no prefix anywhere, or the same everywhere: the least loaded group, as place puts it
    assert r.choose([2, 0, 1], [0, 0, 0], 8) == 1 == r.place([2, 0, 1], 1)[0]
    assert r.choose([1, 1, 1], [64, 64, 64], 8) == 0
    # the longest prefix wins, the least loaded of the groups holding it on a tie
    assert r.choose([0, 1, 2], [0, 32, 64], 8) == 2
    assert r.choose([0, 3, 2], [0, 64, 64], 8) == 2
    # the bound: at most max(1, max_batch // 4) requests more than the least loaded group (8: 2)
    assert r.choose([0, 2, 0], [0, 64, 0], 8) == 1
    assert r.choose([0, 3, 0], [0, 64, 0], 8) == 0
    assert r.choose([0, 1, 0], [0, 64, 0], 2) == 1 and r.choose([1, 2, 1], [0, 64, 0], 2) == 0   # 2: full
    # a shorter prefix in the least loaded group: the longer one still wins within the bound
    assert r.choose([0, 1, 2], [32, 64, 0], 8) == 1


def test_a_placed_start_goes_to_its_group_and_the_others_after_it():
    r = Router(2)
    parts = [Part(1, [0], start=True, group=1), Part(2, [0], start=True), Part(3, [0], start=True, group=1),
             Part(4, [0], start=True)]
    split = r.split(parts, [0, 0], lambda rid: 0)
    assert [g for g, _ in split.placed] == [1, 0, 1, 0]      # the unplaced ones fill group 0 (loads 0, 2)
    with pytest.raises(ValueError, match=r"^group: must be in \[0, 1\] \(the DP groups\), got 2$"):
        r.split([Part(5, [0], start=True, group=2)], [0, 0], lambda rid: 0)
