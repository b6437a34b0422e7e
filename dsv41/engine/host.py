"""The host state of an engine's requests, in one owner: per DP group its ``RequestTable``
(sequences, block pools, prefix cache), and which group each request runs in (``routing``).

The scheduler asks it what fits and where a new request goes (``needs``/``fits``,
``cached_prefixes``, ``place``), a step is planned here into each group's device inputs (``plan``:
``Scheduled``), the engine runs those (``Engine.execute``: ``StepInputs`` in, tokens out) and the
verdict is committed here (``commit``), or the step's reservations given back (``abort``). As in
nano-vllm and vLLM v1, the block manager and the sequences live on the scheduler's side; the engine
holds the caches its pools index, so an engine and its host state are made together, one for one
(``Engine.host``). Recovery replays a lost group from its table here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig
from dsv41.capacity import Capacity
from dsv41.engine.layout import Part, StepLayout
from dsv41.engine.prefix_cache import Hit, chain_start, span_hashes
from dsv41.engine.requests import Planned, RequestTable, Started, StepInputs
from dsv41.engine.routing import Router, Split
from dsv41.engine.sequence import Sequence


@dataclass
class Scheduled:
    """One step planned over the DP groups: its parts in batch order, where each went (``split``),
    and per group the planned step whose ``StepInputs`` are all its cards receive."""
    parts: list[Part]
    layout: StepLayout
    split: Split
    groups: dict[int, Planned]

    @property
    def inputs(self) -> dict[int, StepInputs]:
        return {g: p.inputs for g, p in self.groups.items()}

    @property
    def started(self) -> int:
        """Requests the step starts."""
        return sum(len(p.new) for p in self.groups.values())

    def spans(self) -> list[tuple[int, range]]:
        """Per request in batch order: its group and its logit rows among that group's."""
        return [(g, self.groups[g].layout.logit_span(i)) for g, i in self.split.placed]


class HostState:
    """The requests an engine holds, by DP group and id."""

    def __init__(self, cfg: ModelConfig, capacity: Capacity, dp: int, max_batch: int, max_context: int,
                 token_map: torch.Tensor | None = None, cache_tokens: int | None = None,
                 prefix_caching: bool = False):
        """max_batch, max_context, cache_tokens: per DP group, as its cards' caches are sized."""
        self.tables = [RequestTable(cfg, max_batch, max_context, token_map, cache_tokens, prefix_caching, g, capacity)
                       for g in range(dp)]
        self.router = Router(dp)

    # ---- what is held --------------------------------------------------------------------------
    @property
    def active(self) -> list[int]:
        return sorted(rid for t in self.tables for rid in t.requests)

    @property
    def dp(self) -> int:
        """The DP groups."""
        return len(self.tables)

    @property
    def max_batch(self) -> int:
        return sum(t.max_batch for t in self.tables)

    @property
    def max_context(self) -> int:
        return self.tables[0].max_context

    @property
    def prefix_caching(self) -> bool:
        """Whether the DP groups keep a prefix cache (``prefix_cache.py``)."""
        return self.tables[0].blocks.cache is not None

    def sequence(self, rid: int) -> Sequence:
        for table in self.tables:
            if rid in table.requests:
                return table.requests[rid]
        raise ValueError(f"request_ids: unknown or released request {rid}")

    def group_of(self, rid: int) -> int:
        """The DP group a live request runs in."""
        return self.sequence(rid).group

    def place(self, cached: list[int], placed: list[int]) -> tuple[int, int]:
        """(the DP group for a new request, the least loaded group: where it goes if the first has no
        room this step), given per group the prompt tokens it would start after there
        (``cached_prefixes``, or spans a request of that group is computing) and the new requests placed
        there before it in this step (``Router.choose``; the step's parts then carry the group)."""
        loads = [n + k for n, k in zip(self._loads(), placed)]
        return self.router.choose(loads, cached, min(t.max_batch for t in self.tables)), self.router.least(loads)

    def blocks_in_use(self) -> tuple[int, int]:
        """(cache blocks held by live requests, blocks in all pools), over every DP group."""
        used = [t.blocks_in_use() for t in self.tables]
        return sum(u for u, _ in used), sum(t for _, t in used)

    def _loads(self) -> list[int]:
        return [len(t.requests) for t in self.tables]

    # ---- what fits -------------------------------------------------------------------------------
    def needs(self, rid: int | None, n_new: int, drawn: int = 0, hit: Hit | None = None, group: int = 0) -> dict:
        """Blocks per pool a request (None: a new one, holding ``drawn`` tokens of drawn history
        first, or starting after ``hit``, a cached prefix of DP group ``group``) takes to feed n_new
        more rows (``BlockManager.needs``)."""
        if rid is None:
            if hit is not None and hit.length:
                return self.tables[group].blocks.needs(None, n_new, hit)
            blocks = self.tables[0].blocks          # every group's pools have the same sizes
            return blocks.needs_started(drawn, n_new) if drawn else blocks.needs(None, n_new)
        return self.tables[self.group_of(rid)].blocks.needs(self.sequence(rid), n_new)

    def fits(self, group: int, needs: list[dict]) -> bool:
        """Whether a DP group's free blocks hold these needs together."""
        return self.tables[group].blocks.fits(needs)

    def cached_prefixes(self, tokens: list[int], prompt_len: int, min_feed: int = 1,
                        salt_root: bytes = b"") -> list[Hit]:
        """Per DP group, the longest prefix of tokens (a request's, whose prompt has prompt_len tokens,
        under its cache salt's root) its prefix cache holds, leaving at least min_feed tokens to feed
        (empty with prefix caching off). Each group caches what its own pools hold; the tokens are
        hashed once for all of them."""
        caches = [t.blocks.cache for t in self.tables]
        if caches[0] is None:
            return [Hit() for _ in caches]
        hashes = span_hashes(tokens, caches[0].span, chain_start(caches[0].cfg, prompt_len, salt_root))
        return [c.lookup(tokens, len(tokens) - min_feed, hashes) for c in caches]

    # ---- a step ----------------------------------------------------------------------------------
    def plan(self, parts: list[Part], phase: str) -> Scheduled:
        """The step over the DP groups: a starting part goes to its ``group`` (the scheduler's
        ``place``) or else to the least loaded group, a running one stays in its own; each group's
        table checks and reserves its share. Nothing is reserved if any group refuses."""
        if not parts:
            raise ValueError("batch: must contain at least one request, got an empty batch")
        self._check_new([p.id for p in parts if p.start])
        split = self.router.split(parts, self._loads(), self.group_of)
        groups: dict[int, Planned] = {}
        try:
            for g, share in split.shares.items():
                groups[g] = self.tables[g].plan([parts[i] for i in share], phase)
        except BaseException:
            self.abort(Scheduled(parts, StepLayout.of(parts), split, groups))
            raise
        return Scheduled(parts, StepLayout.of(parts), split, groups)

    def commit(self, step: Scheduled, tokens: dict[int, list[list[int]]], drafted: dict[int, list] | None = None):
        """The verdict of a step that ran: per group the tokens each request made (its kept rows) and,
        from a step that drafted DSpark blocks, each request's block."""
        for g, planned in step.groups.items():
            self.tables[g].commit(planned, tokens[g])
        for g, blocks in (drafted or {}).items():
            for rid, block in zip(step.groups[g].rids, blocks):
                self.tables[g].requests[rid].drafted = block

    def abort(self, step: Scheduled):
        """Give back what a step reserved; its requests stay as they were."""
        for g, planned in step.groups.items():
            self.tables[g].abort(planned)

    def start_at(self, rids: list[int], histories: dict[int, list[int]],
                 groups: dict[int, int] | None = None) -> dict[int, Started]:
        """Requests placed as a prefill places them (in ``groups``: request id -> DP group, the
        scheduler's ``place``; else the least loaded group), planned as having read these histories
        (no step): per group, what to fill into its cards' caches, then ``commit_started`` or
        ``abort_started``."""
        self._check_new(rids)
        split = self.router.split([Part(rid, [], start=True, group=(groups or {}).get(rid)) for rid in rids],
                                  self._loads(), self.group_of)
        started: dict[int, Started] = {}
        try:
            for g, share in split.shares.items():
                mine = [rids[i] for i in share]
                started[g] = self.tables[g].start_at(mine, [histories[r] for r in mine])
        except BaseException:
            self.abort_started(started)
            raise
        return started

    def commit_started(self, started: dict[int, Started]):
        for g, s in started.items():
            self.tables[g].commit(s)

    def abort_started(self, started: dict[int, Started]):
        for g, s in started.items():
            self.tables[g].abort(s)

    def settle(self, rid: int, state: Sequence):
        """Give a live request the sampling state ``state`` holds: after a chunk of its prompt or of
        its recompute, whose token is not kept (``Sequence.settle``)."""
        self.sequence(rid).settle(state)

    def release(self, rid: int):
        """Free a finished request's blocks."""
        self.tables[self.group_of(rid)].release(rid)

    def _check_new(self, rids: list[int]):
        """Requests to start run nowhere yet (a group's table checks only its own)."""
        for rid in rids:
            if any(rid in t.requests for t in self.tables):
                raise ValueError(f"request_ids: request {rid} is running already")
