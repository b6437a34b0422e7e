"""Per-card State: weight shards, the DP group's paged caches (a replica per TP rank), RoPE tables.

Weights and caches are never graph values; kernels get their card's State from the runtime, which
finds it in the registry under the submission's engine id (``cluster/registry.py``). A State names
its owner (engine id), its build and how many steps it has committed (generation), so a submission
can tell the State it expects from a stale or rebuilt one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig, Topology
from dsv41.ops.reference import Options, empty_caches
from dsv41.ops.rope import COMPRESSED, PLAIN, precompute_rope_tables
from dsv41.ops.staged import StagedTensors
from dsv41.serving import RequestTable
from dsv41.weights import decode_checkpoint, init_checkpoint

@dataclass
class CardState:
    cfg: ModelConfig
    topo: Topology
    card: int
    weights: dict[str, torch.Tensor]
    caches: StagedTensors
    rope_tables: dict
    options: Options
    engine: str = ""
    build: str = ""
    generation: int = 0                      # steps committed into these caches
    capacity: tuple[int, int] = (1, 1)       # (max_batch, max_context) the caches are sized for

    @property
    def tp_rank(self) -> int:
        return self.topo.tp_rank(self.card)


def shard_weights(cfg: ModelConfig, topo: Topology, card: int, w: dict) -> dict[str, torch.Tensor]:
    """Head-parallel attention shards (wq_b rows, sinks, wo_a groups, wo_b columns), this EP rank's
    experts, this TP rank's vocab shard of the head; everything else replicated (views, no copies)."""
    r, tp = topo.tp_rank(card), topo.tp
    hl, gl = cfg.num_attention_heads // tp, cfg.o_groups // tp
    experts = range(card * cfg.n_routed_experts // topo.ep, (card + 1) * cfg.n_routed_experts // topo.ep)
    vocab = cfg.vocab_size // tp
    out = {}
    for name, t in w.items():
        if ".ffn.experts." in name:
            if int(name.split(".ffn.experts.")[1].split(".")[0]) in experts:
                out[name] = t
        elif name.endswith(".attn.wq_b"):
            out[name] = t[r * hl * cfg.head_dim:(r + 1) * hl * cfg.head_dim]
        elif name.endswith(".attn.attn_sink"):
            out[name] = t[r * hl:(r + 1) * hl]
        elif name.endswith(".attn.wo_a"):
            out[name] = t[r * gl:(r + 1) * gl]
        elif name.endswith(".attn.wo_b"):
            out[name] = t[:, r * gl * cfg.o_lora_rank:(r + 1) * gl * cfg.o_lora_rank]
        elif name == "head.weight":
            out[name] = t[r * vocab:(r + 1) * vocab]
        else:
            out[name] = t
    return out


def build_states(cfg: ModelConfig, topo: Topology, seed: int, cards, max_batch: int, max_context: int,
                 options: Options = Options(), engine: str = "", build: str = "",
                 generation: int = 0) -> dict[int, CardState]:
    """States of the given cards from one deterministic draw of the weights, owned by ``engine``."""
    if cfg.vocab_size % topo.tp:
        raise ValueError(f"Topology.tp={topo.tp}: must divide vocab_size={cfg.vocab_size} (LM-head shards)")
    full = decode_checkpoint(cfg, init_checkpoint(cfg, seed))
    tables = {p: precompute_rope_tables(cfg, max_context, p) for p in (PLAIN, COMPRESSED)}
    return {c: CardState(cfg, topo, c, shard_weights(cfg, topo, c, full), _empty(cfg, max_batch, max_context),
                         tables, options, engine, build, generation, (max_batch, max_context)) for c in cards}


def renew(st: CardState, build: str, generation: int):
    """Keep the weights, start over with empty caches as a new build (a DP-group peer of a lost card)."""
    st.caches = _empty(st.cfg, *st.capacity)
    st.build, st.generation = build, generation


def _empty(cfg: ModelConfig, max_batch: int, max_context: int) -> StagedTensors:
    return StagedTensors(empty_caches(cfg, RequestTable(cfg, max_batch, max_context)))
