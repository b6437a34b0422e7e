"""Per-card State: weight shards (checkpoint formats, see ``shards``) and the model's blocks over them,
the DP group's paged caches (a replica per TP rank), RoPE tables, the logits its head nodes made.

Weights and caches are never graph values; kernels get their card's State from the runtime, which
finds it in the registry under the submission's engine id (``cluster/registry.py``). A State names
its build and how many steps it has committed (generation), so a submission can tell the State it
expects from a stale or rebuilt one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from dsv41.checkpoint.shards import CardWeights, DrawnCheckpoint, read_cards
from dsv41.config import ModelConfig, Topology
from dsv41.engine.blocks import BlockManager
from dsv41.model.caches import empty_caches
from dsv41.model.options import Options
from dsv41.model.transformer import Transformer
from dsv41.ops.rope import COMPRESSED, PLAIN, precompute_rope_tables
from dsv41.model.staged import StagedTensors


@dataclass
class CardState:
    cfg: ModelConfig
    topo: Topology
    card: int
    weights: CardWeights          # checkpoint formats, decoded per use
    caches: StagedTensors
    rope_tables: dict
    options: Options
    build: str = ""
    generation: int = 0                      # steps committed into these caches
    capacity: tuple = (1, 1, None, None)     # (max_batch, max_context, cache_tokens, step_rows) the caches are sized for
    # DP group -> (step, FP32 logits) its head node made on this card: they stay here until asked for
    logits: dict = field(default_factory=dict)
    draft_logits: dict = field(default_factory=dict)   # DP group -> (step, FP32 [B, block, vocab]) its DSpark head drew from

    @property
    def tp_rank(self) -> int:
        return self.topo.tp_rank(self.card)

    @cached_property
    def model(self) -> Transformer:
        """The blocks over this card's weight shards (the kernels call their stage methods)."""
        return Transformer(self.cfg, self.weights)


def build_states(cfg: ModelConfig, topo: Topology, seed: int, cards, max_batch: int, max_context: int,
                 options: Options = Options(), source=None, build: str = "",
                 generation: int = 0, cache_tokens: int | None = None,
                 step_rows: int | None = None) -> dict[int, CardState]:
    """States of the given cards, each reading its own weight slices from ``source`` (a checkpoint
    reader, or by default one deterministic draw from ``seed``); cache_tokens and step_rows: the
    request table's (its pools' sizes, ``BlockManager``)."""
    if cfg.vocab_size % topo.tp:
        raise ValueError(f"Topology.tp={topo.tp}: must divide vocab_size={cfg.vocab_size} (LM-head shards)")
    source = DrawnCheckpoint(cfg, seed) if source is None else source
    # a DSpark block's rows run up to dspark_block_size positions past the context
    tables = {p: precompute_rope_tables(cfg, max_context + (cfg.dspark_block_size if p == PLAIN else 0), p)
              for p in (PLAIN, COMPRESSED)}
    weights = read_cards(source, topo, cards)
    capacity = (max_batch, max_context, cache_tokens, step_rows)
    return {c: CardState(cfg, topo, c, weights[c], _empty(cfg, *capacity),
                         tables, options, build, generation, capacity) for c in cards}


def renew(st: CardState, build: str, generation: int):
    """Keep the weights, start over with empty caches as a new build (a DP-group peer of a lost card)."""
    st.caches = _empty(st.cfg, *st.capacity)
    st.logits = {}
    st.draft_logits = {}
    st.build, st.generation = build, generation


def _empty(cfg: ModelConfig, max_batch: int, max_context: int, cache_tokens: int | None,
           step_rows: int | None) -> StagedTensors:
    return StagedTensors(empty_caches(cfg, BlockManager(cfg, max_batch, max_context, cache_tokens,
                                                        step_rows=step_rows)))
