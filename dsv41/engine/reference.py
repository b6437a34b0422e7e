"""The reference engine: the blocks composed in one process (``model.Transformer``) over one DP
group's paged caches; the token is the head's draw from the logits it just made. Its requests'
host state is its ``host`` (``engine.host``)."""
from __future__ import annotations

from dsv41.checkpoint.shards import DrawnCheckpoint, read_card
from dsv41.config import ModelConfig, Topology
from dsv41.capacity import Capacity, capacity_of
from dsv41.engine.context import fill_caches
from dsv41.engine.host import HostState
from dsv41.engine.protocol import Engine, Ran, StepCounter
from dsv41.engine.requests import StepInputs
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
        self.host = HostState(cfg, self.capacity, 1, max_batch or self.capacity.max_batch_per_dp,
                              max_context or min(cfg.max_position_embeddings, 1024),
                              None if checkpoint is None else checkpoint.token_map, cache_tokens, prefix_caching)
        self.caches = StagedTensors(empty_caches(cfg, self.host.tables[0].blocks))
        self.rope_tables = {p: precompute_rope_tables(cfg, self.max_context, p) for p in (PLAIN, COMPRESSED)}
        self.last_request_ids: list[int] = []
        self.last_stats: dict = {}
        self._steps = StepCounter()

    def host_weights(self):
        return self.weights

    def execute(self, inputs: dict[int, StepInputs], phase: str) -> Ran:
        (step,) = inputs.values()          # one DP group
        try:
            taps = {} if self.taps else None
            logits = ensure_finite(self.model.forward(self.caches, self.rope_tables, step, self.options, taps),
                                   None, LOGITS)
            made = Head.tokens(logits, step)     # made before anything commits, as on a card
        except NonFiniteError as e:
            self.caches.abort()
            raise e.at(self._steps.latest + 1, phase, site_tensors(self.cfg, e.layer, e.site)) from None
        except BaseException:
            self.caches.abort()
            raise
        self.caches.commit(keep_rows=made.keep_rows)
        qsl = step.layout.starts
        per_request = None if taps is None else [{L: taps[L][a:b] for L in self.taps} for a, b in zip(qsl, qsl[1:])]
        return Ran({0: made.tokens}, lambda: {0: logits}, {0: made.logprobs},
                   taps=None if per_request is None else {0: per_request})

    def fill(self, fills: dict[int, list]):
        fill_caches(self.cfg, self.seed, [self.caches], fills[0])
