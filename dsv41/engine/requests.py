"""The request table of one DP group: its sequences, its blocks, and one step's inputs.

``plan`` checks every input before it changes anything, then reserves the step's pages (logged,
so ``abort`` gives them back) and lowers the step's metadata: a ``Planned`` step, whose device
inputs (``StepInputs``) are all the cards receive, while its parts, reservation and new sequences
stay on the host. The sequences themselves change only
at ``commit``, which publishes the rows the step kept: all of them in a plain step, the accepted
prefix in a verify step (whose pages past it go back to the pools). Token histories are appended
to, never copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig
from dsv41.engine.blocks import BlockManager, Reservation
from dsv41.capacity import Capacity, capacity_of
from dsv41.engine.layout import Part, StepLayout
from dsv41.engine.prefix_cache import chain_start
from dsv41.engine.sequence import GREEDY, Sequence
from dsv41.ops import metadata as md_ops
from dsv41.ops.engram import default_token_map, hash_ids
from dsv41.ops.sampling import RequestGenerator, RowDraw


@dataclass
class StepInputs:
    """What a card of the group uses: the rows, their metadata and Engram ids, the layout its head
    verifies with and each logit row's draw. Nothing of the host's bookkeeping (``Planned``)."""
    layout: StepLayout                      # per request: rows, drafts and their distributions
    input_ids: torch.Tensor                 # i64 [T]
    md: md_ops.ForwardMetadata
    hash_ids: dict[int, torch.Tensor]       # engram layer -> i64 [T, ids]
    phase: str
    logit_rows: torch.Tensor                # i32 [R] the layout's logit rows
    draws: list[RowDraw] | None = None      # per logit row, for the head; None: every row greedy argmax

    @property
    def rids(self) -> list[int]:
        return self.layout.ids

    @property
    def proposed(self) -> list[int]:
        return self.layout.proposed

    @property
    def draft_probs(self) -> list | None:
        return self.layout.draft_probs

    @property
    def verifies(self) -> bool:
        return self.layout.verifies


@dataclass
class Planned:
    """A step planned in one DP group: its device inputs, and what stays on the host (its parts,
    the pages it reserved, the sequences it starts) until ``commit`` or ``abort``."""
    inputs: StepInputs
    parts: list[Part]
    reservation: Reservation
    new: dict[int, Sequence]                # request id -> Sequence started by this step

    @property
    def layout(self) -> StepLayout:
        return self.inputs.layout

    @property
    def rids(self) -> list[int]:
        return self.inputs.layout.ids


@dataclass
class Started:
    """Requests admitted at a context without a step (``RequestTable.start_at``); commit like a step."""
    rids: list[int]
    requests: dict[int, Sequence]
    reservation: Reservation


class RequestTable:
    """Sequences and block pools of one DP group (one paged-cache owner), by request id."""

    def __init__(self, cfg: ModelConfig, max_batch: int, max_context: int, token_map: torch.Tensor | None = None,
                 cache_tokens: int | None = None, prefix_caching: bool = False, group: int = 0,
                 capacity: Capacity | None = None):
        """capacity: the deployment's limits per DP group (default: the model's, ``capacity_of``)."""
        self.capacity = capacity = capacity or capacity_of(cfg)
        if not 1 <= max_batch <= capacity.max_batch_per_dp:
            raise ValueError(f"max_batch: must be in [1, {capacity.max_batch_per_dp}] (max_batch_per_dp), "
                             f"got {max_batch}")
        if not 1 <= max_context <= cfg.max_position_embeddings:
            raise ValueError(f"max_context: must be in [1, {cfg.max_position_embeddings}], got {max_context}")
        self.cfg, self.max_batch, self.max_context, self.group = cfg, max_batch, max_context, group
        if cache_tokens is not None and not 1 <= cache_tokens <= max_batch * max_context:
            raise ValueError(f"cache_tokens: must be in [1, {max_batch * max_context}], got {cache_tokens}")
        self.cache_tokens = cache_tokens
        self.blocks = BlockManager(cfg, max_batch, max_context, cache_tokens, prefix_caching,
                                   capacity.prefill_max_tokens)
        self.requests: dict[int, Sequence] = {}
        self.token_map = default_token_map(cfg) if token_map is None else token_map

    @property
    def pools(self):
        return self.blocks.pools

    # ---- planning --------------------------------------------------------------------------
    def check(self, parts: list[Part], layout: StepLayout, phase: str):
        """Every input of a step checked, nothing changed."""
        cfg = self.cfg
        if not parts:
            raise ValueError("batch: must contain at least one request")
        for part in parts:
            q, d = part.probs, part.drafts
            if q is not None and (not isinstance(q, torch.Tensor) or tuple(q.shape) != (len(d), cfg.vocab_size)
                                  or not q.is_floating_point()):
                raise ValueError(f"draft_probs: each must be a float tensor [drafts, {cfg.vocab_size}], got "
                                 f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        starting, seen = 0, set()
        for part in parts:
            rid, toks, d = part.id, part.tokens, part.drafts
            if part.cached and (not part.start or self.blocks.cache is None):
                raise ValueError("cached: only a request this step starts reuses a cached prefix (prefix caching on)")
            if part.prompt_len is not None and (not part.start or not isinstance(part.prompt_len, int)
                                                or part.prompt_len < 1):
                raise ValueError(f"prompt_len: only a request this step starts gives one, an int >= 1, "
                                 f"got {part.prompt_len!r}")
            if not toks:
                raise ValueError("token_ids: every request in a step needs at least one token")
            bad = [t for t in list(toks) + d if not (isinstance(t, int) and 0 <= t < cfg.vocab_size)]
            if bad:
                raise ValueError(f"token_ids: must be ints in [0, {cfg.vocab_size - 1}], got {bad[0]!r}")
            if d and (part.start or len(toks) != 1):     # a prefill step may carry decode rows and their drafts
                raise ValueError("drafts: only a running request's decode row (one new token) verifies drafts")
            if len(d) > self.capacity.max_drafts:
                raise ValueError(f"drafts: at most {self.capacity.max_drafts} per request "
                                 f"(decode_rows_per_request {self.capacity.decode_rows_per_request}), got {len(d)}")
            if rid in seen:
                raise ValueError(f"request_ids: request {rid} appears twice in one step")
            seen.add(rid)
            if part.start:
                if rid in self.requests:
                    raise ValueError(f"request_ids: request {rid} is running already")
                starting += 1
                kv = len(part.cached or [])
            elif rid not in self.requests:
                raise ValueError(f"request_ids: unknown or released request {rid}")
            else:
                kv = self.requests[rid].kv_len
            if kv + len(toks) + len(d) > self.max_context:
                raise ValueError(f"token_ids: request {rid} would reach {kv + len(toks) + len(d)} tokens, "
                                 f"max_context is {self.max_context}")
        if len(self.requests) + starting > self.max_batch:
            raise ValueError(f"batch: at most {self.max_batch} active requests (capacity contract)")
        limit = self.capacity.step_limit(phase)
        if layout.total > limit:
            raise ValueError(f"batch: {layout.total} token rows exceed the {phase} capacity {limit} per DP group")

    def plan(self, parts: list[Part], phase: str) -> Planned:
        """The step's inputs: a part that starts a request makes its sequence (with the part's
        settings; a running request keeps its own), every part's drafts are verified after its
        tokens. Reserves the step's pages: ``commit`` or ``abort`` the result."""
        layout = StepLayout.of(parts)
        self.check(parts, layout, phase)
        res = Reservation()
        new: dict[int, Sequence] = {}
        seqs = []
        try:
            # cached pages first: the other requests' pages may not evict what the new ones reuse
            for part in parts:
                if not part.start:
                    continue
                params, c = part.sampling or GREEDY, part.cached or []
                seed = RequestGenerator(params.seed).seed if not params.greedy else 0
                prompt = len(c) + len(part.tokens) if part.prompt_len is None else part.prompt_len
                seq = Sequence(part.id, list(c), sampling=params, seed=seed, prompt_len=prompt, group=self.group,
                               cache_root=part.cache_root)
                if c:
                    hit = self.blocks.cache.lookup(c, len(c), root=chain_start(self.cfg, prompt, part.cache_root))
                    if hit.length != len(c):
                        raise ValueError(f"cached: {len(c)} tokens asked, {hit.length} of them cached")
                    self.blocks.attach(seq, hit, res)
                self.blocks.take_state(seq, res)
                new[part.id] = seq
            for part in parts:
                seq = new[part.id] if part.start else self.requests[part.id]
                self.blocks.reserve(seq, len(part.tokens) + len(part.drafts), res)
                seqs.append(seq)
        except BaseException:
            res.undo(self.pools)
            raise
        return Planned(self._inputs(seqs, parts, layout, phase), parts, res, new)

    def _inputs(self, seqs: list[Sequence], parts: list[Part], layout: StepLayout, phase: str) -> StepInputs:
        cfg = self.cfg
        fed = [p.tokens + p.drafts for p in parts]
        qsl = torch.tensor(layout.starts, dtype=torch.int32)
        kv = torch.tensor([s.kv_len for s in seqs], dtype=torch.int32)
        md = md_ops.lower(cfg, qsl, kv, self._window_table(seqs), self._compressed_tables(seqs),
                          {s: torch.tensor([[q.state_block] for q in seqs], dtype=torch.int32)
                           for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 2},
                          torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32))
        hashes = {layer: [] for layer in cfg.engram_layer_ids}
        keep = cfg.engram_max_ngram_size - 1       # the n-gram reaches this many tokens back
        for seq, f in zip(seqs, fed):
            base = max(0, seq.kv_len - keep)
            window = seq.tokens[base:] + f
            for layer in cfg.engram_layer_ids:
                hashes[layer].append(hash_ids(cfg, layer, window, range(seq.kv_len - base, len(window)),
                                              self.token_map))
        draws = [d for seq, f, k in zip(seqs, fed, layout.proposed) for d in seq.row_draws(f, k + 1)]
        ids = torch.tensor([t for f in fed for t in f], dtype=torch.int64)
        return StepInputs(layout, ids, md, {k: torch.cat(v) for k, v in hashes.items()}, phase,
                          torch.tensor(layout.logit_rows, dtype=torch.int32),
                          None if all(d.plain for d in draws) else draws)

    def start_at(self, rids: list[int], histories: list[list[int]]) -> Started:
        """Plan new requests that have already read these token histories: the pages a prefill of each
        history would leave allocated (its stale window pages released after each of its steps of at
        most ``prefill_max_tokens``), no model step. The caller fills the caches
        (``engine.context.fill_caches``) and commits."""
        if not histories:
            raise ValueError("context: at least one request to start")
        if len(self.requests) + len(histories) > self.max_batch:
            raise ValueError(f"batch: at most {self.max_batch} active requests (capacity contract)")
        for rid in rids:
            if rid in self.requests:
                raise ValueError(f"request_ids: request {rid} is running already")
        for n in map(len, histories):
            if not 1 <= n < self.max_context:
                raise ValueError(f"context: must be in [1, {self.max_context - 1}] tokens (max_context "
                                 f"{self.max_context} leaves a row for the next token), got {n}")
        res, started = Reservation(), {}
        try:
            for rid, history in zip(rids, histories):
                n = len(history)
                seq = started[rid] = Sequence(rid, list(history), prompt_len=n, group=self.group, from_context=True)
                self.blocks.take_state(seq, res)
                top = self.capacity.prefill_max_tokens      # in the largest steps the scheduler allows
                for done in range(0, n, top):
                    step = min(top, n - done)
                    self.blocks.reserve(seq, step, res)
                    seq.kv_len += step
                    self.blocks.release_stale(seq)
        except BaseException:
            res.undo(self.pools)
            raise
        return Started(list(started), started, res)

    def _window_table(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max([max(s.window_pages, default=-1) + 1 for s in seqs] + [1])
        table = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            for page, blk in s.window_pages.items():
                table[i, page] = blk
        return table

    def _compressed_tables(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        tables = {}
        for r_ in self.pools.compressed:
            width = max([len(s.compressed_pages.get(r_, [])) for s in seqs] + [1])
            t = torch.full((len(seqs), width), -1, dtype=torch.int32)
            for i, s in enumerate(seqs):
                pages = s.compressed_pages.get(r_, [])
                t[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            tables[r_] = t
        return {s: tables[self.cfg.compress_ratios[s]] for s in self.cfg.kv_source_layer_ids}

    def blocks_in_use(self) -> tuple[int, int]:
        """(cache blocks held by requests, blocks in all pools): window, compressed and state."""
        return self.blocks.in_use()

    # ---- state transitions -----------------------------------------------------------------
    def commit(self, step: Planned | Started, emitted: list[list[int]] | None = None):
        """Make a planned step the host state. emitted: per request, the tokens the step made
        (None: one each, every row kept); a verify step keeps the rows up to its last accepted
        draft, and gives back the pages it reserved past them."""
        if isinstance(step, Started):
            self.requests.update(step.requests)
            return
        self.requests.update(step.new)
        layout = step.layout
        made = [[0]] * len(layout) if emitted is None else emitted
        for part, k, n, m in zip(step.parts, layout.proposed, layout.kept(made), made):
            seq = self.requests[part.id]
            seq.publish(part.tokens + part.drafts, n, len(m))
            if len(m) - 1 < k:
                self.blocks.trim(seq, step.reservation)
            self.blocks.register(seq)
            self.blocks.release_stale(seq)

    def abort(self, step: Planned | Started):
        """Give back what a planned step reserved; its requests stay as they were."""
        step.reservation.undo(self.pools)

    def release(self, rid: int):
        """Free a finished request's blocks."""
        if rid not in self.requests:
            raise ValueError(f"request_ids: unknown or released request {rid}")
        self.blocks.free(self.requests.pop(rid))
