"""Bytes of values, of a card's weight shards (checkpoint formats) and of its caches.

Weights are sized as a device would hold them, and as a card's State holds them
(``dsv41.checkpoint.shards``): the checkpoint's own formats (FP8 payload + E8M0 block scales, packed
FP4 experts + scales, BF16 dense, FP32 mHC/bias/sinks). Sharding policy per card:

| tensors                                        | held by a card                                  |
| routed experts                                 | the EP rank's n_routed/EP experts               |
| Engram embedding tables (payload + scales)     | 1/EP of the rows (the seed's deployment)        |
| wq_b rows, wo_a groups, wo_b columns, sinks    | 1/TP (head-parallel attention, as state.py)     |
| head and embed (vocab rows)                    | 1/TP (vocab-parallel, like DeepSeek's inference |
|                                                | ParallelEmbedding / ColumnParallelLinear head)  |
| DSpark stages (mtp.S.*)                        | as the backbone blocks (experts: the stages'    |
|                                                | own count / EP); Markov tables replicated       |
| everything else                                | replicated                                      |

The graph serves the two sharded lookups by summing every shard's share (-0.0 outside it): the TP
transport for embed, a card-order sum over the EP world for Engram. Here a table's bytes are divided
by EP; the cards hold whole rows in ceil(rows/EP) slabs, a few rows' difference on the last card.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from dsv41.kernels.cost import nbytes
from dsv41.ops import kv_cache
from dsv41.weights import checkpoint_specs, runtime_key

WEIGHT_KINDS = ("routed_experts", "engram_tables", "fp8_linears", "dense", "embed_head", "dspark")
CACHE_KINDS = ("window", "compressed", "index", "ring")
_TP_SPLIT = (".attn.wq_b", ".attn.wo_a", ".attn.wo_b", ".attn.attn_sink")


def state_key(name: str, specs: dict) -> str:
    """The runtime weight key a checkpoint tensor feeds: quantized payload and scale fold into one."""
    key = runtime_key(name, specs)
    return name[: -len(".scale")] if key is None else key


def _kind(name: str, key: str) -> str:
    if name.startswith("mtp."):      # the drafter's stages, apart: the backbone's figures stay the seed's
        return "dspark"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".engram.embed." in name:
        return "engram_tables"
    if name in ("embed.weight", "head.weight"):
        return "embed_head"
    return "fp8_linears" if key != name else "dense"


def _held(name: str, nbytes_: int, cfg, topo, card: int) -> int:
    """Bytes of one checkpoint tensor this card holds under the sharding policy."""
    if ".ffn.experts." in name:
        per = cfg.routed_experts_of(name) // topo.ep
        return nbytes_ if int(name.split(".ffn.experts.")[1].split(".")[0]) // per == card else 0
    if ".engram.embed." in name:
        return nbytes_ // topo.ep
    if name.startswith(("embed.", "head.")) or any(s in name for s in _TP_SPLIT):
        return nbytes_ // topo.tp
    return nbytes_


@lru_cache(maxsize=4)
def _specs(cfg) -> dict:
    return checkpoint_specs(cfg)


# payload dtype -> (format a use decodes from, values per stored byte); E8M0 scales join their payload
_DECODED = {torch.float8_e4m3fn: ("fp8", 1), torch.int8: ("fp4", 2), torch.bfloat16: ("bf16", 0.5),
            torch.float32: ("f32", 0.25)}


# read a row at a time (as the Engram tables), never decoded whole: the embedding, DSpark's Markov embedding
_LOOKED_UP = ("embed.weight", "markov_head.embed.weight")


@lru_cache(maxsize=64)
def _card_table(cfg, topo, card: int) -> tuple[dict[str, int], dict[str, int], dict[str, tuple[str, int]]]:
    specs = _specs(cfg)
    by_key: dict[str, int] = defaultdict(int)
    by_kind = dict.fromkeys(WEIGHT_KINDS, 0)
    values: dict[str, tuple[str, int]] = {}
    for name, (shape, dtype) in specs.items():
        held = _held(name, math.prod(shape) * dtype.itemsize, cfg, topo, card)
        if held:
            key = state_key(name, specs)
            by_key[key] += held
            by_kind[_kind(name, key)] += held
            if dtype in _DECODED and not key.endswith(_LOOKED_UP) and _kind(name, key) != "engram_tables":
                fmt, per_byte = _DECODED[dtype]
                values[key] = (fmt, int(held * per_byte))
    return dict(by_key), by_kind, values


def checkpoint_bytes(cfg) -> int:
    """Bytes of every checkpoint tensor (the safetensors payloads of a test checkpoint)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in _specs(cfg).values())


def card_weights(cfg, topo, card: int) -> dict[str, int]:
    """Runtime weight key -> bytes this card holds (checkpoint formats, sharding policy above)."""
    return _card_table(cfg, topo, card)[0]


def weights_by_kind(cfg, topo, card: int) -> dict[str, int]:
    return dict(_card_table(cfg, topo, card)[1])


def card_values(cfg, topo, card: int) -> dict[str, tuple[str, int]]:
    """Runtime weight key -> (checkpoint format, values this card holds): what a use of it decodes on
    a part that decodes per use (in registers, next to the multiply: ``cpu.fused_product``)."""
    return _card_table(cfg, topo, card)[2]


def cache_kind(name: str) -> str:
    return name.split(".")[0]


def caches_by_kind(tensors: dict[str, tuple[torch.Tensor, ...]]) -> dict[str, int]:
    """Allocated cache bytes of a State's committed caches, by kind."""
    kinds = dict.fromkeys(CACHE_KINDS, 0)
    for name, ts in tensors.items():
        kinds[cache_kind(name)] += nbytes(ts)
    return kinds


def request_cache_bytes(cfg, context: int, bf16: bool = False) -> dict[str, int]:
    """Cache bytes one request holds at ``context`` tokens, by kind: the sliding window per layer
    (and per DSpark stage),
    ceil(context / ratio) compressed and index rows per KV source, and the ratio-2 compressor rings.
    ``bf16`` sizes the same rows as BF16 (the seed's comparison figure)."""
    hd, ih = cfg.head_dim, cfg.index_head_dim

    def row(kind, width):
        return 2 * width if bf16 else kv_cache.FORMATS[kind].row_bytes(width)

    kinds = dict.fromkeys(CACHE_KINDS, 0)
    # the backbone's layers and the DSpark stages (``model.caches``: a window each)
    layers = cfg.num_hidden_layers + cfg.n_mtp_layers
    kinds["window"] = layers * min(cfg.sliding_window, context) * row(kv_cache.WINDOW, hd)
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        rows = -(-context // r)
        kinds["compressed"] += rows * row(kv_cache.COMPRESSED, hd)
        kinds["index"] += rows * row(kv_cache.INDEX, ih)
        if r == 2:
            kinds["ring"] += cfg.state_capacity * 2 * hd * 4
    return kinds


@dataclass(frozen=True)
class NodeCost:
    bytes_read: int
    bytes_written: int
    flops: dict
    link: int
    output_bytes: int
    decoded: dict = field(default_factory=dict)   # checkpoint format -> weight values the node reads


    @property
    def total_flops(self) -> int:
        return int(sum(self.flops.values()))


def node_cost(weights_held: dict, cost, inputs, output_bytes: int, values_held: dict | None = None) -> NodeCost:
    """A signature's Cost in bytes on a card holding ``weights_held`` (``card_weights``): inputs (or the
    signature's own count), weights read, looked-up table rows and cache rows; output and cache rows
    written. With ``values_held`` (``card_values``), the weight values read by checkpoint format."""
    weights = sum(weights_held[k] * frac for k, frac in cost.weights.items())
    activations = nbytes(inputs) if cost.act_read is None else cost.act_read
    decoded: dict[str, int] = defaultdict(int)
    for k, frac in cost.weights.items():
        if values_held and k in values_held and frac > 0:
            fmt, n = values_held[k]
            decoded[fmt] += int(n * frac)
    return NodeCost(int(activations + weights + cost.gathered + cost.cache_read), output_bytes + cost.cache_written,
                    cost.flops, cost.link, output_bytes, dict(decoded))
