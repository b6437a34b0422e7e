"""Which DP group serves each request of a ``GraphEngine``.

A request keeps its one id (``engine.request``) in whichever group holds it; a running one stays
where it is. A new request goes to the group holding the fewest requests (the lowest group on a
tie), counting the requests placed before it in the same step, unless the scheduler placed it
(``Part.group``, chosen by ``choose``: cache-aware placement, as SGLang's cache-aware router). A
step is cut into one share per group, and what the groups return is put back in the step's order.
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

    def least(self, loads: list[int]) -> int:
        """The group holding the fewest requests, the lowest on a tie."""
        return min(range(self.dp), key=lambda g: (loads[g], g))

    def place(self, loads: list[int], count: int) -> list[int]:
        """Groups for count new requests, given how many requests each group holds now."""
        load = list(loads)
        groups = []
        for _ in range(count):
            grp = self.least(load)
            load[grp] += 1
            groups.append(grp)
        return groups

    def choose(self, loads: list[int], cached: list[int], max_batch: int) -> int:
        """The group for one new request, given per group the requests it holds and the prompt
        tokens the request would start after there (cached, or being computed by a request of that
        group). The group with the longest such prefix (the least loaded of those on a tie) unless
        it holds max_batch requests already or more than ``max(1, max_batch // 4)`` more than the
        least loaded group; then, and when no group has a longer prefix than the least loaded one
        (no prefix shared: always), the least loaded group."""
        least = self.least(loads)
        best = min(range(self.dp), key=lambda g: (-cached[g], loads[g], g))
        if cached[best] > cached[least] and loads[best] < max_batch and \
                loads[best] - loads[least] <= max(1, max_batch // 4):
            return best
        return least

    def split(self, parts: list[Part], loads: list[int], group_of: Callable[[int], int]) -> Split:
        """parts: a step's; a part that starts a request goes to its ``group`` (the scheduler's
        choice) or, without one, is placed (``place``, after the placed ones); the others stay in
        ``group_of(id)``."""
        load = list(loads)
        for part in parts:
            if part.start and part.group is not None:
                if not 0 <= part.group < self.dp:
                    raise ValueError(f"group: must be in [0, {self.dp - 1}] (the DP groups), got {part.group}")
                load[part.group] += 1
        new = iter(self.place(load, sum(p.start and p.group is None for p in parts)))
        out = Split([], {g: [] for g in range(self.dp)})
        for i, part in enumerate(parts):
            grp = (next(new) if part.group is None else part.group) if part.start else group_of(part.id)
            out.placed.append((grp, len(out.shares[grp])))
            out.shares[grp].append(i)
        for g in [g for g, s in out.shares.items() if not s]:     # groups this step does not use
            del out.shares[g]
        return out
