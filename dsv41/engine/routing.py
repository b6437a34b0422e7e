"""Which DP group serves each request of a ``GraphEngine``.

A request keeps its one id (``engine.request``) in whichever group holds it. A new request goes to
the group holding the fewest requests (the lowest group on a tie), counting the requests placed
before it in the same step; a running one stays where it is. A step is cut into one share per
group, and what the groups return is put back in the step's order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dsv41.engine.layout import Part


@dataclass
class Split:
    """One step cut into per-group shares. placed: per part of the step, (group, index within that
    group's share); shares: group -> indices of its parts in the step, groups in ascending order."""
    placed: list[tuple[int, int]]
    shares: dict[int, list[int]]

    def gather(self, per_group: dict[int, list]) -> list:
        """Per-group results (each in its group's order) in the step's order."""
        return [per_group[g][i] for g, i in self.placed]


class Router:
    def __init__(self, dp: int):
        self.dp = dp

    def place(self, loads: list[int], count: int) -> list[int]:
        """Groups for count new requests, given how many requests each group holds now."""
        load = list(loads)
        groups = []
        for _ in range(count):
            grp = min(range(self.dp), key=lambda g: (load[g], g))
            load[grp] += 1
            groups.append(grp)
        return groups

    def split(self, parts: list[Part], loads: list[int], group_of: Callable[[int], int]) -> Split:
        """parts: a step's; a part that starts a request is placed (``place``), the others stay in
        ``group_of(id)``."""
        new = iter(self.place(loads, sum(p.start for p in parts)))
        out = Split([], {g: [] for g in range(self.dp)})
        for i, part in enumerate(parts):
            grp = next(new) if part.start else group_of(part.id)
            out.placed.append((grp, len(out.shares[grp])))
            out.shares[grp].append(i)
        for g in [g for g, s in out.shares.items() if not s]:     # groups this step does not use
            del out.shares[g]
        return out
