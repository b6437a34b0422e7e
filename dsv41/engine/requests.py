"""Host-side request state: requests, paged block allocation, and one step's inputs.

A step is planned on copies (``plan``): token validation, capacity checks, page allocation,
metadata lowering and Engram hashing all happen before any tensor of the model is touched, and
``commit`` makes the plan the new host state. A failed step therefore leaves nothing changed.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from dsv41.config import ModelConfig
from dsv41.ops import metadata as md_ops
from dsv41.ops.engram import default_token_map, hash_ids
from dsv41.ops.sampling import RequestGenerator, RowDraw, SamplingParams

GREEDY = SamplingParams()


@dataclass
class Request:
    rid: int
    tokens: list[int]                       # every token fed so far (history for Engram hashing)
    kv_len: int = 0
    window_pages: dict[int, int] = field(default_factory=dict)      # logical page -> physical block
    compressed_pages: dict[int, list[int]] = field(default_factory=dict)  # ratio -> physical blocks
    state_block: int = -1
    sampling: SamplingParams = GREEDY
    seed: int = 0                           # the request's generator: draw n is seeded by (seed, n)
    drawn: int = 0                          # draws made so far (temperature > 0 rows draw once a step)
    prompt_len: int = 0                     # tokens of the first step (the rest were generated)

    def row_draw(self) -> RowDraw:
        """This step's draw: its index, and the history the penalties read (only when one is set)."""
        p = self.sampling
        out = tuple(self.tokens[self.prompt_len:]) if p.frequency_penalty or p.presence_penalty \
            or p.repetition_penalty != 1.0 else ()
        prompt = tuple(self.tokens[:self.prompt_len]) if p.repetition_penalty != 1.0 else ()
        return RowDraw(p, self.seed, self.drawn, out, prompt)


@dataclass
class Pools:
    window: list[int]
    compressed: dict[int, list[int]]        # ratio -> free blocks
    state: list[int]


@dataclass
class StepInputs:
    rids: list[int]
    input_ids: torch.Tensor                 # i64 [T]
    md: md_ops.ForwardMetadata
    hash_ids: dict[int, torch.Tensor]       # engram layer -> i64 [T, ids]
    phase: str
    requests: dict[int, Request]            # host state after commit
    pools: Pools
    draws: list[RowDraw] | None = None      # per request, for the head; None: every row greedy argmax


@dataclass
class Started:
    """Requests admitted at a context without a step (``RequestTable.start_at``); commit like a step."""
    rids: list[int]
    requests: dict[int, Request]            # host state after commit
    pools: Pools


def window_pages(cfg: ModelConfig, max_context: int) -> int:
    """Window pages one request can hold at once. Before a step it holds the pages from its earliest
    window position on; a step of n new tokens adds pages up to its last, so at most
    ceil((n + window - 1) / block) + 1, with n <= prefill_max_tokens, and never more than its whole
    context's. A drawn 1M-token history (``start_at``) keeps 34 FLASH pages a layer, not 8,193."""
    bs = cfg.block_size
    return min(math.ceil(max_context / bs), math.ceil((cfg.prefill_max_tokens + cfg.sliding_window - 1) / bs)) + 1


class RequestTable:
    """Requests and block pools of one DP group (one paged-cache owner)."""

    def __init__(self, cfg: ModelConfig, max_batch: int, max_context: int, token_map: torch.Tensor | None = None):
        if not 1 <= max_batch <= cfg.max_batch_per_dp:
            raise ValueError(f"max_batch: must be in [1, {cfg.max_batch_per_dp}], got {max_batch}")
        if not 1 <= max_context <= cfg.max_position_embeddings:
            raise ValueError(f"max_context: must be in [1, {cfg.max_position_embeddings}], got {max_context}")
        self.cfg, self.max_batch, self.max_context = cfg, max_batch, max_context
        bs = cfg.block_size
        self.window_blocks = max_batch * window_pages(cfg, max_context)
        self.compressed_blocks = {r: max_batch * math.ceil(max_context // r / bs + 1)
                                  for r in sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids})}
        self.state_blocks = max_batch
        self.pools = Pools(list(range(self.window_blocks)),
                           {r: list(range(n)) for r, n in self.compressed_blocks.items()},
                           list(range(self.state_blocks)))
        self.requests: dict[int, Request] = {}
        self.next_rid = 0
        self.token_map = default_token_map(cfg) if token_map is None else token_map

    # ---- planning --------------------------------------------------------------------------
    def plan(self, batch: list[tuple[int | None, list[int]]], phase: str,
             sampling: list[SamplingParams | None] | None = None) -> StepInputs:
        """batch: (request id, new tokens) pairs; rid None starts a new request at position 0.
        sampling: per pair, the settings of a request it starts (None: greedy; ignored for running
        requests, which keep their own)."""
        cfg = self.cfg
        if not batch:
            raise ValueError("batch: must contain at least one request")
        sampling = [None] * len(batch) if sampling is None else list(sampling)
        if len(sampling) != len(batch):
            raise ValueError(f"sampling: expected one entry per request ({len(batch)}), found {len(sampling)}")
        requests = copy.deepcopy(self.requests)
        pools = copy.deepcopy(self.pools)
        next_rid = self.next_rid
        rids = []
        for (rid, toks), params in zip(batch, sampling):
            if not toks:
                raise ValueError("token_ids: every request in a step needs at least one token")
            bad = [t for t in toks if not (isinstance(t, int) and 0 <= t < cfg.vocab_size)]
            if bad:
                raise ValueError(f"token_ids: must be ints in [0, {cfg.vocab_size - 1}], got {bad[0]!r}")
            if rid is None:
                if len(requests) >= self.max_batch:
                    raise ValueError(f"batch: at most {self.max_batch} active requests (capacity contract)")
                if not pools.state:
                    raise ValueError("batch: no free compressor state block")
                rid, next_rid = next_rid, next_rid + 1
                params = params or GREEDY
                seed = RequestGenerator(params.seed).seed if not params.greedy else 0
                requests[rid] = Request(rid, [], state_block=pools.state.pop(0), sampling=params, seed=seed,
                                        prompt_len=len(toks))
            elif rid not in requests:
                raise ValueError(f"request_ids: unknown or released request {rid}")
            if rid in rids:
                raise ValueError(f"request_ids: request {rid} appears twice in one step")
            req = requests[rid]
            if req.kv_len + len(toks) > self.max_context:
                raise ValueError(f"token_ids: request {rid} would reach {req.kv_len + len(toks)} tokens, "
                                 f"max_context is {self.max_context}")
            rids.append(rid)
        rows = sum(len(t) for _, t in batch)
        limit = cfg.prefill_max_tokens if phase == "prefill" else cfg.decode_max_tokens
        if rows > limit:
            raise ValueError(f"batch: {rows} token rows exceed the {phase} capacity {limit} per DP group")
        for rid, (_, toks) in zip(rids, batch):
            self._allocate(requests[rid], len(toks), pools)

        lens = [len(t) for _, t in batch]
        qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32)
        kv = torch.tensor([requests[r].kv_len for r in rids], dtype=torch.int32)
        md = md_ops.lower(cfg, qsl, kv, self._window_table(requests, rids), self._compressed_tables(requests, rids),
                          {s: torch.tensor([[requests[r].state_block] for r in rids], dtype=torch.int32)
                           for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 2})
        hashes = {layer: [] for layer in cfg.engram_layer_ids}
        for rid, (_, toks) in zip(rids, batch):
            req = requests[rid]
            start = len(req.tokens)
            req.tokens.extend(toks)
            for layer in cfg.engram_layer_ids:
                hashes[layer].append(hash_ids(cfg, layer, req.tokens, range(start, len(req.tokens)), self.token_map))
            req.kv_len += len(toks)
            self._release_stale_window(req, pools)
        draws = [requests[r].row_draw() for r in rids]
        for r in rids:
            requests[r].drawn += not requests[r].sampling.greedy
        ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.int64)
        return StepInputs(rids, ids, md, {k: torch.cat(v) for k, v in hashes.items()}, phase, requests, pools,
                          None if all(d.plain for d in draws) else draws)

    def start_at(self, histories: list[list[int]]) -> Started:
        """Plan new requests that have already read these token histories: the pages a prefill of each
        history would leave allocated (its stale window pages released after each of its steps of at
        most ``prefill_max_tokens``), no model step. The caller fills the caches
        (``engine.context.fill_caches``) and commits."""
        if not histories:
            raise ValueError("context: at least one request to start")
        requests, pools = copy.deepcopy(self.requests), copy.deepcopy(self.pools)
        if len(requests) + len(histories) > self.max_batch:
            raise ValueError(f"batch: at most {self.max_batch} active requests (capacity contract)")
        rids = []
        for history in histories:
            n = len(history)
            if not 1 <= n < self.max_context:
                raise ValueError(f"context: must be in [1, {self.max_context - 1}] tokens (max_context "
                                 f"{self.max_context} leaves a row for the next token), got {n}")
            rid = self.next_rid + len(rids)
            req = requests[rid] = Request(rid, list(history), state_block=pools.state.pop(0), prompt_len=n)
            for done in range(0, n, self.cfg.prefill_max_tokens):   # in the largest steps the scheduler allows
                step = min(self.cfg.prefill_max_tokens, n - done)
                self._allocate(req, step, pools)
                req.kv_len += step
                self._release_stale_window(req, pools)
            rids.append(rid)
        return Started(rids, requests, pools)

    def _allocate(self, req: Request, n_new: int, pools: Pools):
        bs, w = self.cfg.block_size, self.cfg.sliding_window
        first = max(0, req.kv_len - w + 1) // bs
        last = (req.kv_len + n_new - 1) // bs
        for page in range(first, last + 1):
            if page not in req.window_pages:
                if not pools.window:
                    raise ValueError("batch: window cache pool exhausted")
                req.window_pages[page] = pools.window.pop(0)
        for r, free in pools.compressed.items():
            pages = req.compressed_pages.setdefault(r, [])
            need = math.ceil((req.kv_len + n_new) // r / bs)
            while len(pages) < need:
                if not free:
                    raise ValueError(f"batch: ratio-{r} compressed cache pool exhausted")
                pages.append(free.pop(0))

    def _release_stale_window(self, req: Request, pools: Pools):
        """Pages wholly before the next step's earliest window position go back to the pool."""
        keep_from = max(0, req.kv_len - self.cfg.sliding_window + 1) // self.cfg.block_size
        for page in [p for p in req.window_pages if p < keep_from]:
            pools.window.append(req.window_pages.pop(page))

    def _window_table(self, requests, rids) -> torch.Tensor:
        width = max([max(requests[r].window_pages, default=-1) + 1 for r in rids] + [1])
        table = torch.full((len(rids), width), -1, dtype=torch.int32)
        for i, r in enumerate(rids):
            for page, blk in requests[r].window_pages.items():
                table[i, page] = blk
        return table

    def _compressed_tables(self, requests, rids) -> dict[int, torch.Tensor]:
        tables = {}
        for r_ in self.pools.compressed:
            width = max([len(requests[r].compressed_pages.get(r_, [])) for r in rids] + [1])
            t = torch.full((len(rids), width), -1, dtype=torch.int32)
            for i, r in enumerate(rids):
                pages = requests[r].compressed_pages.get(r_, [])
                t[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            tables[r_] = t
        return {s: tables[self.cfg.compress_ratios[s]] for s in self.cfg.kv_source_layer_ids}

    def blocks_in_use(self) -> tuple[int, int]:
        """(cache blocks held by requests, blocks in all pools): window, compressed and state."""
        total = self.window_blocks + sum(self.compressed_blocks.values()) + self.state_blocks
        free = len(self.pools.window) + sum(map(len, self.pools.compressed.values())) + len(self.pools.state)
        return total - free, total

    # ---- state transitions -----------------------------------------------------------------
    def commit(self, step: StepInputs):
        self.requests, self.pools = step.requests, step.pools
        self.next_rid = max([self.next_rid] + [r + 1 for r in step.rids])

    def release(self, rid: int):
        """Free a finished request's blocks."""
        if rid not in self.requests:
            raise ValueError(f"request_ids: unknown or released request {rid}")
        req = self.requests.pop(rid)
        self.pools.window.extend(req.window_pages.values())
        for r, pages in req.compressed_pages.items():
            self.pools.compressed[r].extend(pages)
        self.pools.state.append(req.state_block)
