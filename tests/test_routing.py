"""DP routing (``engine/routing.py``): where new requests go, and a step split by group and put back."""
from __future__ import annotations

import random

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
