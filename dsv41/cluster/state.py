"""Per-card State: weight shards (checkpoint formats, see ``shards``), the DP group's paged caches
(a replica per TP rank), RoPE tables.

Weights and caches are never graph values; kernels find their card's State in ``STATES``. In one
process every card's State lives here; under dask.distributed each worker process holds only its
own card's (installed by ``CardStatePlugin``).
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv41.cluster.shards import CardWeights, DrawnCheckpoint, read_card
from dsv41.config import ModelConfig, Topology
from dsv41.ops.reference import Options, empty_caches
from dsv41.ops.rope import COMPRESSED, PLAIN, precompute_rope_tables
from dsv41.ops.staged import StagedTensors
from dsv41.serving import RequestTable

STATES: dict[int, "CardState"] = {}


@dataclass
class CardState:
    cfg: ModelConfig
    topo: Topology
    card: int
    weights: CardWeights          # checkpoint formats, decoded per use
    caches: StagedTensors
    rope_tables: dict
    options: Options

    @property
    def tp_rank(self) -> int:
        return self.topo.tp_rank(self.card)


def build_states(cfg: ModelConfig, topo: Topology, seed: int, cards, max_batch: int, max_context: int,
                 options: Options = Options(), source=None) -> dict[int, CardState]:
    """States of the given cards, each reading its own weight slices from ``source`` (a checkpoint
    reader, or by default one deterministic draw from ``seed``)."""
    if cfg.vocab_size % topo.tp:
        raise ValueError(f"Topology.tp={topo.tp}: must divide vocab_size={cfg.vocab_size} (LM-head shards)")
    source = DrawnCheckpoint(cfg, seed) if source is None else source
    table = RequestTable(cfg, max_batch, max_context)
    tables = {p: precompute_rope_tables(cfg, max_context, p) for p in (PLAIN, COMPRESSED)}
    return {c: CardState(cfg, topo, c, read_card(source, topo, c), StagedTensors(empty_caches(cfg, table)),
                         tables, options) for c in cards}
