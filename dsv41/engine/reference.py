"""The reference engine: the blocks composed in one process (``model.Transformer``), paged caches,
continuous batching; the token is the head's draw from the logits it just made."""
from __future__ import annotations

from dsv41.checkpoint.shards import DrawnCheckpoint, read_card
from dsv41.config import ModelConfig, Topology
from dsv41.engine.capacity import Capacity, capacity_of
from dsv41.engine.context import draw_history, fill_caches
from dsv41.engine.layout import Part
from dsv41.engine.protocol import Engine, StepCounter, StepOutput
from dsv41.engine.requests import RequestTable
from dsv41.model.caches import empty_caches
from dsv41.model.finite import LOGITS, NonFiniteError, ensure_finite
from dsv41.model.head import Head
from dsv41.model.options import Options
from dsv41.model.transformer import Transformer
from dsv41.ops.rope import COMPRESSED, PLAIN, precompute_rope_tables
from dsv41.model.staged import StagedTensors
from dsv41.weights import site_tensors


class ReferenceEngine(Engine):
    """Deterministic random (or loaded) weights in one process."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, max_batch: int | None = None,
                 max_context: int | None = None, checkpoint=None, options: Options = Options(),
                 cache_tokens: int | None = None, prefix_caching: bool = False, capacity: Capacity | None = None):
        """checkpoint: an opened checkpoint (``dsv41.checkpoint.reader``) holding cfg; None draws from seed.
        capacity: the limits of its step and table (default: the checkpoint's or the model's)."""
        self.cfg = cfg
        self.capacity = capacity or capacity_of(cfg, checkpoint)
        self.options = options
        self.seed = seed
        if checkpoint is not None and checkpoint.cfg != cfg:
            raise ValueError(f"checkpoint: holds config {checkpoint.cfg.name!r}, not {cfg.name!r}")
        # held in checkpoint formats and decoded per use, as a card holds them: decoded whole, FLASH's
        # FP64 matrices would be 8x the checkpoint bytes
        source = DrawnCheckpoint(cfg, seed) if checkpoint is None else checkpoint
        self.weights = read_card(source, Topology(1, 1, 1), 0)
        self.model = Transformer(cfg, self.weights)
        self.table = RequestTable(cfg, max_batch or self.capacity.max_batch_per_dp,
                                  max_context or min(cfg.max_position_embeddings, 1024),
                                  None if checkpoint is None else checkpoint.token_map, cache_tokens, prefix_caching,
                                  capacity=self.capacity)
        self.caches = StagedTensors(empty_caches(cfg, self.table.blocks))
        capacity = self.table.max_context
        self.rope_tables = {p: precompute_rope_tables(cfg, capacity, p) for p in (PLAIN, COMPRESSED)}
        self.last_request_ids: list[int] = []
        self.last_stats: dict = {}
        self._steps = StepCounter()

    @property
    def active(self) -> list[int]:
        return sorted(self.table.requests)

    @property
    def max_batch(self) -> int:
        return self.table.max_batch

    @property
    def tables(self) -> list:
        return [self.table]

    @property
    def max_context(self) -> int:
        return self.table.max_context

    def host_weights(self):
        return self.weights

    def sequence(self, rid: int):
        return self.table.requests[rid]

    def run(self, parts: list[Part], phase: str) -> StepOutput:
        planned = self.table.plan(parts, phase)
        step = planned.inputs
        try:
            taps = {} if self.taps else None
            logits = ensure_finite(self.model.forward(self.caches, self.rope_tables, step, self.options, taps),
                                   None, LOGITS)
            made = Head.tokens(logits, step)     # made before anything commits, as on a card
        except NonFiniteError as e:
            self._abort(planned)
            raise e.at(self._steps.latest + 1, phase, site_tensors(self.cfg, e.layer, e.site)) from None
        except BaseException:
            self._abort(planned)
            raise
        self.caches.commit(keep_rows=made.keep_rows)
        self.table.commit(planned, made.tokens)
        self.starts += len(planned.new)
        self.last_request_ids = step.rids
        qsl = step.layout.starts
        per_request = None if taps is None else [{L: taps[L][a:b] for L in self.taps} for a, b in zip(qsl, qsl[1:])]
        return StepOutput(step.layout, made.tokens, self._steps.guard(self._steps.next(), lambda: logits),
                          made.logprobs, per_request)

    def _abort(self, step):
        self.caches.abort()
        self.table.abort(step)

    def start_at_context(self, rids: list[int], context: int) -> list[int]:
        keys = range(self.starts, self.starts + len(rids))
        started = self.table.start_at(rids, [draw_history(self.cfg, self.seed, k, context) for k in keys])
        try:
            fill_caches(self.cfg, self.seed, [self.caches], [(k, started.requests[r]) for k, r in zip(keys, rids)])
        except BaseException:
            self.table.abort(started)
            raise
        self.table.commit(started)
        self.starts += len(rids)
        return started.rids

    def release(self, rid: int):
        self.table.release(rid)

    def blocks_in_use(self) -> tuple[int, int]:
        return self.table.blocks_in_use()
