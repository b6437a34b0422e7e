"""Which DP group serves each request of a ``GraphEngine``.

A request is numbered once, engine-wide, and lives in one DP group's request table under that
table's own local id. A new request goes to the group holding the fewest requests (the lowest group
on a tie), counting the requests placed before it in the same batch; a running one stays where it
is. A step's batch is split into one batch per group, and what the groups return is put back in
the batch's order.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Split:
    """One batch cut into per-group batches. placed: per request of the batch, (group, index within
    that group's batch); batches: group -> [(local id or None for a new request, tokens)], groups in
    ascending order; sampling, drafts, draft_probs: group -> that group's entries, in its batch order; cached: group -> the prefix each new request reuses (or None)."""
    rids: list[int | None]
    placed: list[tuple[int, int]]
    batches: dict[int, list]
    sampling: dict[int, list]
    drafts: dict[int, list]
    draft_probs: dict[int, list]
    cached: dict[int, list]

    def gather(self, per_group: dict[int, list]) -> list:
        """Per-group results (each in its group's batch order) in the batch's order."""
        return [per_group[g][i] for g, i in self.placed]


class Router:
    def __init__(self, dp: int):
        self.dp = dp
        self.where: dict[int, tuple[int, int]] = {}   # global request id -> (DP group, local id)
        self.next_rid = 0

    def place(self, loads: list[int], count: int) -> list[int]:
        """Groups for count new requests, given how many requests each group holds now."""
        load = list(loads)
        groups = []
        for _ in range(count):
            grp = min(range(self.dp), key=lambda g: (load[g], g))
            load[grp] += 1
            groups.append(grp)
        return groups

    def locate(self, rid: int) -> tuple[int, int]:
        if rid not in self.where:
            raise ValueError(f"request_ids: unknown or released request {rid}")
        return self.where[rid]

    def split(self, batch: list[tuple[int | None, list[int]]], loads: list[int], sampling=None, drafts=None,
              draft_probs=None, cached=None) -> Split:
        """batch: (global id, or None for a new request; tokens) pairs; sampling, drafts, draft_probs,
        cached: one entry per pair (None: plain settings, no proposals, drafts without a
        distribution, no cached prefix)."""
        sampling = [None] * len(batch) if sampling is None else list(sampling)
        if len(sampling) != len(batch):
            raise ValueError(f"sampling: expected one entry per request ({len(batch)}), found {len(sampling)}")
        drafts = [[] for _ in batch] if drafts is None else list(drafts)
        if len(drafts) != len(batch):
            raise ValueError(f"drafts: expected one list per request ({len(batch)}), found {len(drafts)}")
        draft_probs = [None] * len(batch) if draft_probs is None else list(draft_probs)
        if len(draft_probs) != len(batch):
            raise ValueError(f"draft_probs: expected one entry per request ({len(batch)}), found {len(draft_probs)}")
        cached = [None] * len(batch) if cached is None else list(cached)
        if len(cached) != len(batch):
            raise ValueError(f"cached: expected one entry per request ({len(batch)}), found {len(cached)}")
        new = iter(self.place(loads, sum(rid is None for rid, _ in batch)))
        out = Split([rid for rid, _ in batch], [], *({g: [] for g in range(self.dp)} for _ in range(5)))
        for (rid, toks), sp, d, q, c in zip(batch, sampling, drafts, draft_probs, cached):
            grp, local = (next(new), None) if rid is None else self.locate(rid)
            out.placed.append((grp, len(out.batches[grp])))
            out.batches[grp].append((local, toks))
            out.sampling[grp].append(sp)
            out.drafts[grp].append(d)
            out.draft_probs[grp].append(q)
            out.cached[grp].append(c)
        for g in [g for g, b in out.batches.items() if not b]:     # groups this batch does not use
            del out.batches[g], out.sampling[g], out.drafts[g], out.draft_probs[g], out.cached[g]
        return out

    def admit(self, split: Split, local_ids: dict[int, list[int]]) -> list[int]:
        """The batch's global ids once its groups took it: each new request numbered in batch order and
        recorded at the local id its group gave it (local_ids: group -> local ids, in its batch order)."""
        ids = []
        for rid, (grp, idx) in zip(split.rids, split.placed):
            if rid is None:
                rid, self.next_rid = self.next_rid, self.next_rid + 1
                self.where[rid] = (grp, local_ids[grp][idx])
            ids.append(rid)
        return ids

    def release(self, rid: int) -> tuple[int, int]:
        grp_local = self.locate(rid)
        del self.where[rid]
        return grp_local

    def renumber(self, group: int, renamed: dict[int, int]):
        """A group's requests got new local ids (old -> new), e.g. in fresh tables after a recovery."""
        for rid, (g, local) in self.where.items():
            if g == group:
                self.where[rid] = (g, renamed[local])
