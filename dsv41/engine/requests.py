"""The request table of one DP group: its sequences, its blocks, and one step's inputs.

``plan`` checks every input before it changes anything, then reserves the step's pages (logged,
so ``abort`` gives them back) and lowers the step's metadata; the sequences themselves change only
at ``commit``, which publishes the rows the step kept: all of them in a plain step, the accepted
prefix in a verify step (whose pages past it go back to the pools). Token histories are appended
to, never copied.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from dsv41.config import ModelConfig
from dsv41.engine.blocks import BlockManager, Reservation
from dsv41.engine.sequence import GREEDY, Sequence
from dsv41.ops import metadata as md_ops
from dsv41.ops.engram import default_token_map, hash_ids
from dsv41.ops.sampling import RequestGenerator, RowDraw, SamplingParams


@dataclass
class StepInputs:
    rids: list[int]
    input_ids: torch.Tensor                 # i64 [T]
    md: md_ops.ForwardMetadata
    hash_ids: dict[int, torch.Tensor]       # engram layer -> i64 [T, ids]
    phase: str
    fed: list[list[int]]                    # per request, the rows it feeds (drafts last)
    proposed: list[int]                     # per request, how many of its last rows are drafts to verify
    logit_rows: torch.Tensor                # i32 [R] the rows whose token is made: each request's last
    #                                         row, and every row of a draft block (the row before each draft)
    draws: list[RowDraw] | None = None      # per logit row, for the head; None: every row greedy argmax
    draft_probs: list | None = None         # per request, its drafts' distribution [k, vocab] or None
    reservation: Reservation = field(default_factory=Reservation, repr=False)
    new: dict = field(default_factory=dict, repr=False)    # rid -> Sequence started by this step

    @property
    def verifies(self) -> bool:
        return any(self.proposed)

    @property
    def first_rows(self) -> list[int]:
        """Per request, its first logit row: each request has its drafts' rows and one more."""
        return list(itertools.accumulate([0] + [k + 1 for k in self.proposed]))[:-1]


@dataclass
class Started:
    """Requests admitted at a context without a step (``RequestTable.start_at``); commit like a step."""
    rids: list[int]
    requests: dict[int, Sequence]
    reservation: Reservation


class RequestTable:
    """Sequences and block pools of one DP group (one paged-cache owner)."""

    def __init__(self, cfg: ModelConfig, max_batch: int, max_context: int, token_map: torch.Tensor | None = None,
                 cache_tokens: int | None = None, prefix_caching: bool = False):
        if not 1 <= max_batch <= cfg.max_batch_per_dp:
            raise ValueError(f"max_batch: must be in [1, {cfg.max_batch_per_dp}], got {max_batch}")
        if not 1 <= max_context <= cfg.max_position_embeddings:
            raise ValueError(f"max_context: must be in [1, {cfg.max_position_embeddings}], got {max_context}")
        self.cfg, self.max_batch, self.max_context = cfg, max_batch, max_context
        if cache_tokens is not None and not 1 <= cache_tokens <= max_batch * max_context:
            raise ValueError(f"cache_tokens: must be in [1, {max_batch * max_context}], got {cache_tokens}")
        self.cache_tokens = cache_tokens
        self.blocks = BlockManager(cfg, max_batch, max_context, cache_tokens, prefix_caching)
        self.requests: dict[int, Sequence] = {}
        self.next_rid = 0
        self.token_map = default_token_map(cfg) if token_map is None else token_map

    @property
    def pools(self):
        return self.blocks.pools

    # ---- planning --------------------------------------------------------------------------
    def check(self, batch: list[tuple[int | None, list[int]]], phase: str, sampling=None, drafts=None,
              draft_probs=None, cached=None):
        """Every input of a step checked, nothing changed: returns (sampling, drafts) one per pair."""
        cfg = self.cfg
        if not batch:
            raise ValueError("batch: must contain at least one request")
        sampling = [None] * len(batch) if sampling is None else list(sampling)
        if len(sampling) != len(batch):
            raise ValueError(f"sampling: expected one entry per request ({len(batch)}), found {len(sampling)}")
        drafts = [[] for _ in batch] if drafts is None else [list(d or []) for d in drafts]
        if len(drafts) != len(batch):
            raise ValueError(f"drafts: expected one list per request ({len(batch)}), found {len(drafts)}")
        if draft_probs is not None:
            if len(draft_probs) != len(batch):
                raise ValueError(f"draft_probs: expected one entry per request ({len(batch)}), found {len(draft_probs)}")
            for d, q in zip(drafts, draft_probs):
                if q is not None and (not isinstance(q, torch.Tensor) or tuple(q.shape) != (len(d), cfg.vocab_size)
                                      or not q.is_floating_point()):
                    raise ValueError(f"draft_probs: each must be a float tensor [drafts, {cfg.vocab_size}], got "
                                     f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        cached = [None] * len(batch) if cached is None else list(cached)
        if len(cached) != len(batch):
            raise ValueError(f"cached: expected one entry per request ({len(batch)}), found {len(cached)}")
        starting, seen = 0, set()
        for (rid, toks), d, c in zip(batch, drafts, cached):
            if c and (rid is not None or self.blocks.cache is None):
                raise ValueError("cached: only a request this step starts reuses a cached prefix (prefix caching on)")
            if not toks:
                raise ValueError("token_ids: every request in a step needs at least one token")
            bad = [t for t in list(toks) + d if not (isinstance(t, int) and 0 <= t < cfg.vocab_size)]
            if bad:
                raise ValueError(f"token_ids: must be ints in [0, {cfg.vocab_size - 1}], got {bad[0]!r}")
            if d and (rid is None or len(toks) != 1):     # a prefill step may carry decode rows and their drafts
                raise ValueError("drafts: only a running request's decode row (one new token) verifies drafts")
            if len(d) > cfg.decode_rows_per_request - 1:
                raise ValueError(f"drafts: at most {cfg.decode_rows_per_request - 1} per request "
                                 f"(decode_rows_per_request {cfg.decode_rows_per_request}), got {len(d)}")
            if rid is None:
                starting += 1
                kv = len(c or [])
            elif rid not in self.requests:
                raise ValueError(f"request_ids: unknown or released request {rid}")
            elif rid in seen:
                raise ValueError(f"request_ids: request {rid} appears twice in one step")
            else:
                seen.add(rid)
                kv = self.requests[rid].kv_len
            if kv + len(toks) + len(d) > self.max_context:
                raise ValueError(f"token_ids: request {rid} would reach {kv + len(toks) + len(d)} tokens, "
                                 f"max_context is {self.max_context}")
        if len(self.requests) + starting > self.max_batch:
            raise ValueError(f"batch: at most {self.max_batch} active requests (capacity contract)")
        rows = sum(len(t) + len(d) for (_, t), d in zip(batch, drafts))
        limit = cfg.prefill_max_tokens if phase == "prefill" else cfg.decode_max_tokens
        if rows > limit:
            raise ValueError(f"batch: {rows} token rows exceed the {phase} capacity {limit} per DP group")
        return sampling, drafts, cached

    def plan(self, batch: list[tuple[int | None, list[int]]], phase: str,
             sampling: list[SamplingParams | None] | None = None, drafts: list[list[int]] | None = None,
             draft_probs: list | None = None, cached: list[list[int] | None] | None = None) -> StepInputs:
        """batch: (request id, new tokens) pairs; rid None starts a new request at position 0, or
        after the tokens ``cached`` gives it (a prefix whose pages the prefix cache holds: the
        request shares them and feeds only its new tokens). sampling: per pair, the settings of a
        request it starts (None: greedy; ignored for running requests, which keep their own).
        drafts: per pair, proposed tokens to verify after its new tokens (decode only). Reserves
        the step's pages: ``commit`` or ``abort`` the result."""
        sampling, drafts, cached = self.check(batch, phase, sampling, drafts, draft_probs, cached)
        res = Reservation()
        new: dict[int, Sequence] = {}
        seqs = []
        try:
            next_rid = self.next_rid
            starts = {}
            # cached pages first: the other requests' pages may not evict what the new ones reuse
            for i, ((rid, toks), params, c) in enumerate(zip(batch, sampling, cached)):
                if rid is not None:
                    continue
                params = params or GREEDY
                seed = RequestGenerator(params.seed).seed if not params.greedy else 0
                seq = starts[i] = Sequence(next_rid, list(c or []), sampling=params, seed=seed,
                                           prompt_len=len(c or []) + len(toks))
                if c:
                    hit = self.blocks.cache.lookup(c, len(c))
                    if hit.length != len(c):
                        raise ValueError(f"cached: {len(c)} tokens asked, {hit.length} of them cached")
                    self.blocks.attach(seq, hit, res)
                self.blocks.take_state(seq, res)
                new[next_rid] = seq
                next_rid += 1
            for i, ((rid, toks), d) in enumerate(zip(batch, drafts)):
                seq = starts[i] if rid is None else self.requests[rid]
                self.blocks.reserve(seq, len(toks) + len(d), res)
                seqs.append(seq)
        except BaseException:
            res.undo(self.pools)
            raise
        fed = [list(t) + d for (_, t), d in zip(batch, drafts)]
        proposed = [len(d) for d in drafts]
        step = self._inputs(seqs, fed, proposed, phase, res, new)
        step.draft_probs = draft_probs
        return step

    def _inputs(self, seqs: list[Sequence], fed, proposed, phase, res, new) -> StepInputs:
        cfg = self.cfg
        lens = [len(f) for f in fed]
        qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32)
        kv = torch.tensor([s.kv_len for s in seqs], dtype=torch.int32)
        md = md_ops.lower(cfg, qsl, kv, self._window_table(seqs), self._compressed_tables(seqs),
                          {s: torch.tensor([[q.state_block] for q in seqs], dtype=torch.int32)
                           for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 2})
        hashes = {layer: [] for layer in cfg.engram_layer_ids}
        keep = cfg.engram_max_ngram_size - 1       # the n-gram reaches this many tokens back
        for seq, f in zip(seqs, fed):
            base = max(0, seq.kv_len - keep)
            window = seq.tokens[base:] + f
            for layer in cfg.engram_layer_ids:
                hashes[layer].append(hash_ids(cfg, layer, window, range(seq.kv_len - base, len(window)),
                                              self.token_map))
        ends = qsl[1:].tolist()
        logit_rows = torch.tensor([r for end, k in zip(ends, proposed) for r in range(end - 1 - k, end)],
                                  dtype=torch.int32)
        draws = [d for seq, f, k in zip(seqs, fed, proposed) for d in seq.row_draws(f, k + 1)]
        ids = torch.tensor([t for f in fed for t in f], dtype=torch.int64)
        return StepInputs([s.rid for s in seqs], ids, md, {k: torch.cat(v) for k, v in hashes.items()}, phase,
                          fed, proposed, logit_rows, None if all(d.plain for d in draws) else draws,
                          reservation=res, new=new)

    def start_at(self, histories: list[list[int]]) -> Started:
        """Plan new requests that have already read these token histories: the pages a prefill of each
        history would leave allocated (its stale window pages released after each of its steps of at
        most ``prefill_max_tokens``), no model step. The caller fills the caches
        (``engine.context.fill_caches``) and commits."""
        if not histories:
            raise ValueError("context: at least one request to start")
        if len(self.requests) + len(histories) > self.max_batch:
            raise ValueError(f"batch: at most {self.max_batch} active requests (capacity contract)")
        for n in map(len, histories):
            if not 1 <= n < self.max_context:
                raise ValueError(f"context: must be in [1, {self.max_context - 1}] tokens (max_context "
                                 f"{self.max_context} leaves a row for the next token), got {n}")
        res, started = Reservation(), {}
        try:
            for i, history in enumerate(histories):
                n = len(history)
                seq = started[self.next_rid + i] = Sequence(self.next_rid + i, list(history), prompt_len=n,
                                                            from_context=True)
                self.blocks.take_state(seq, res)
                for done in range(0, n, self.cfg.prefill_max_tokens):   # in the largest steps the scheduler allows
                    step = min(self.cfg.prefill_max_tokens, n - done)
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
    def commit(self, step: StepInputs | Started, emitted: list[int] | None = None):
        """Make a planned step the host state. emitted: per request, the tokens the step made
        (None: one each, every row kept); a verify step keeps the rows up to its last accepted
        draft, and gives back the pages it reserved past them."""
        if isinstance(step, Started):
            self.requests.update(step.requests)
            self.next_rid = max([self.next_rid] + [r + 1 for r in step.rids])
            return
        self.requests.update(step.new)
        emitted = [1] * len(step.rids) if emitted is None else emitted
        for rid, fed, k, n in zip(step.rids, step.fed, step.proposed, emitted):
            seq = self.requests[rid]
            seq.publish(fed, len(fed) - k + n - 1, n)
            if n - 1 < k:
                self.blocks.trim(seq, step.reservation)
            self.blocks.register(seq)
            self.blocks.release_stale(seq)
        self.next_rid = max([self.next_rid] + [r + 1 for r in step.rids])

    def abort(self, step: StepInputs | Started):
        """Give back what a planned step reserved; its requests stay as they were."""
        step.reservation.undo(self.pools)

    def release(self, rid: int):
        """Free a finished request's blocks."""
        if rid not in self.requests:
            raise ValueError(f"request_ids: unknown or released request {rid}")
        self.blocks.free(self.requests.pop(rid))
