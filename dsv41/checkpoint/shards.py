"""A card's weight shard: the slices it reads from a weight source, held in checkpoint formats.

A weight source serves named checkpoint tensors, or slices of them, in their checkpoint dtypes:

    cfg: ModelConfig
    names() -> list[str]
    get(name, index=()) -> tensor[index]

``DrawnCheckpoint`` is the random-weights source (one deterministic draw); the checkpoint reader
serves folders. ``read_card`` asks a source for exactly the slices one card holds (scales sliced
with their payloads) and keeps them as they came: FP8 E4M3 + E8M0, packed MXFP4 + E8M0, BF16, FP32.
``CardWeights`` decodes a runtime weight on each use (a lookup table only the rows looked up, a matrix
each value in a register inside its product: ``matrix``), so nothing larger than the checkpoint bytes stays resident; the decoded values are those of
``weights.decode_checkpoint`` bit for bit.

Sharding (head-parallel attention, expert-parallel MoE, vocab-parallel embed and head, EP-split
Engram tables), as ``dsv41.plan.sizing`` sizes it:

| tensors                                   | a card holds                                   |
| routed experts                            | its EP rank's n_routed/EP experts              |
| wq_b rows, attn_sink, wo_a groups         | its TP rank's heads / groups                   |
| wo_b columns                              | its TP rank's groups' input columns            |
| embed.weight and head.weight rows         | its TP rank's vocabulary shard                 |
| Engram tables (payload + scale rows)      | its EP slab of the rows (``ops.engram.table_slab``) |
| DSpark stages ``mtp.S.*``                 | as the backbone blocks' (own expert count); Markov tables whole |
| everything else                           | the whole tensor                               |

A sharded lookup table is a ``RowLookup`` that knows its first row; the graph looks up every card's
share (-0.0 outside it) and sums the shares across the cards (``ops.embed.shard_rows``).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from dsv41.checkpoint.errors import CheckpointError
from dsv41.config import ModelConfig, Topology
from dsv41.ops.engram import table_slab
from dsv41.ops.packed import PackedMatrix
from dsv41.weights import checkpoint_specs, decode_tensor, draw_checkpoint, runtime_key


class DrawnCheckpoint:
    """Weight source of deterministic random weights (``weights.draw_checkpoint``), drawn as asked:
    only the tensor last asked for is held, so readers that go through ``names()`` in order (as
    ``read_cards`` does) never hold the whole draw; asking for an earlier tensor draws again."""
    token_map = None          # random weights have no tokenizer: the identity Engram map

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        self._order = {name: i for i, name in enumerate(checkpoint_specs(cfg))}
        self._draw, self._at = None, None      # the draw in progress and its (name, tensor) last drawn

    def names(self) -> list[str]:
        return list(self._order)

    def get(self, name: str, index: tuple = ()) -> torch.Tensor:
        if name not in self._order:
            raise CheckpointError(f"drawn checkpoint: no tensor {name!r}")
        if self._at is None or self._order[self._at[0]] > self._order[name]:
            self._draw = draw_checkpoint(self.cfg, self.seed)
        while self._at is None or self._at[0] != name:
            self._at = None              # let the previous tensor go before the next is drawn
            self._at = next(self._draw)
        return self._at[1][index]


def _rows(a: int, b: int) -> tuple:
    return (slice(a, b),)


def card_index(cfg: ModelConfig, topo: Topology, card: int, name: str) -> tuple | None:
    """The index of checkpoint tensor ``name`` that ``card`` holds: () for all of it, None for none.

    Scale tensors follow their payloads: 32x32 block scales take rows / columns divided by the
    block (shard boundaries are whole blocks: head_dim and o_lora_rank are multiples of 32)."""
    g = cfg.mx_group
    base, _, part = name.rpartition(".")
    div = g if part == "scale" else 1
    if ".ffn.experts." in name:
        per = cfg.routed_experts_of(name) // topo.ep
        return () if int(name.split(".ffn.experts.")[1].split(".")[0]) // per == card else None
    r, tp = topo.tp_rank(card), topo.tp
    hl, gl = cfg.num_attention_heads // tp, cfg.o_groups // tp
    if base.endswith(".attn.wq_b"):
        n = hl * cfg.head_dim
        return _rows(r * n // div, (r + 1) * n // div)
    if name.endswith(".attn.attn_sink"):
        return _rows(r * hl, (r + 1) * hl)
    if base.endswith(".attn.wo_a"):
        n = gl * cfg.o_lora_rank
        return _rows(r * n // div, (r + 1) * n // div)
    if base.endswith(".attn.wo_b"):
        n = gl * cfg.o_lora_rank
        return (slice(None), slice(r * n // div, (r + 1) * n // div))
    if name in ("head.weight", "embed.weight"):
        rows = topo.vocab_rows(cfg, card)
        return _rows(rows.start, rows.stop)
    if ".engram.embed." in name:
        first, count = table_slab(cfg, int(name.split(".")[1]), topo.ep, card)
        return _rows(first, first + count)
    return ()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """t in storage of its own: a view of a larger tensor would keep the whole parent alive (a
    checkpoint's mapped slice is already one: its storage is the slice's pages of the file)."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage counted once)."""
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


class RowLookup:
    """A card's rows [first, first + len) of a lookup table (embed, Engram) in its checkpoint format:
    indexing (by row of the shard) decodes only the rows asked for, the same values as those rows of
    the whole decoded table."""

    def __init__(self, cfg: ModelConfig, key: str, payload: torch.Tensor, scale: torch.Tensor | None,
                 first: int = 0):
        self.cfg, self.key, self.payload, self.scale, self.first = cfg, key, payload, scale, first

    @property
    def shape(self) -> torch.Size:
        return self.payload.shape

    def __getitem__(self, idx) -> torch.Tensor:
        flat = torch.as_tensor(idx).reshape(-1)
        rows = decode_tensor(self.cfg, self.key, self.payload[flat],
                             None if self.scale is None else self.scale[flat])
        return rows.reshape(*torch.as_tensor(idx).shape, self.payload.shape[1])


def _is_lookup(key: str) -> bool:
    return key.endswith(("embed.weight", ".engram.embed"))    # embed, DSpark's Markov embedding, Engram


class CardWeights(Mapping):
    """Runtime key -> decoded weight, decoded from the held checkpoint-format tensors on each use."""

    def __init__(self, cfg: ModelConfig, held: dict[str, torch.Tensor], firsts: dict[str, int] | None = None):
        """firsts: runtime key of a lookup table -> the first table row this card holds."""
        self.cfg = cfg
        self.held = held
        self.firsts = firsts or {}
        self.keys_ = [k for k in (runtime_key(n, held) for n in held) if k is not None]
        self._known = set(self.keys_)
        self._scaled = {k for k in self.keys_ if k + ".scale" in held}
        self._matrices: dict[str, PackedMatrix] = {}

    def __getitem__(self, key: str) -> torch.Tensor | RowLookup:
        if _is_lookup(key):
            scale = self.held[key + ".scale"] if key in self._scaled else None
            return RowLookup(self.cfg, key, self.held[key + ".weight"] if scale is not None else self.held[key], scale,
                             self.firsts.get(key, 0))
        if key in self._scaled:
            return decode_tensor(self.cfg, key, self.held[key + ".weight"], self.held[key + ".scale"])
        return decode_tensor(self.cfg, key, self.held[key])

    def matrix(self, key: str) -> PackedMatrix:
        """A weight matrix a block multiplies by, as held (FP8, FP4, BF16 or FP32): its product decodes
        each value as it multiplies (``ops.packed``), to the values ``__getitem__`` decodes it to whole.
        Made once per key (the format check reads the payload once)."""
        m = self._matrices.get(key)
        if m is None:
            if key in self._scaled:
                t = self.held[key + ".weight"]
                m = PackedMatrix("fp4" if t.dtype == torch.int8 else "fp8", t, self.held[key + ".scale"])
            else:
                t = self.held[key]
                m = PackedMatrix("bf16" if t.dtype == torch.bfloat16 else "f32", t)
            self._matrices[key] = m
        return m

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def __contains__(self, key) -> bool:
        return key in self._known

    def nbytes(self) -> int:
        """Resident bytes: the held tensors' storages."""
        return resident_bytes(self.held.values())


def read_cards(source, topo: Topology, cards) -> dict[int, CardWeights]:
    """The cards' shards, read from ``source`` in one pass over its tensors. Cards holding the same
    slice (replicated tensors, DP replicas of a TP rank's slice) share one copy: in one process the
    weights of a topology cost what one replica of it costs, while each card's ``nbytes`` still
    counts everything it holds."""
    held, firsts = {c: {} for c in cards}, {c: {} for c in cards}
    for name in source.names():
        read = {}
        for card in cards:
            index = card_index(source.cfg, topo, card, name)
            if index is None:
                continue
            key = repr(index)
            if key not in read:
                read[key] = _owned(source.get(name, index))
            held[card][name] = read[key]
            if name == "embed.weight" or ".engram.embed." in name:
                firsts[card][name if name == "embed.weight" else name.rpartition(".")[0]] = index[0].start
    return {c: CardWeights(source.cfg, held[c], firsts[c]) for c in cards}


def read_card(source, topo: Topology, card: int) -> CardWeights:
    """The card's shard, read slice by slice from ``source``."""
    return read_cards(source, topo, [card])[card]


def card_bytes(st) -> dict:
    """A card's resident bytes, measured from the tensors its State holds."""
    caches = [t for ts in st.caches.committed.values() for t in ts]
    return {"card": st.card, "weights_bytes": st.weights.nbytes(), "cache_bytes": resident_bytes(caches)}


def return_freed_memory():
    """Hand a freed weight draw back to the OS: glibc keeps freed heap pages, so a process's RSS
    would stay at the whole model's size although it holds one card's shard."""
    import ctypes
    import ctypes.util
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
