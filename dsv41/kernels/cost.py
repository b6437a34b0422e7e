"""What a node costs: its value spec, bytes and FLOPs, from its inputs' shapes (each record's ``cost``).

``NodeKind.cost(ctx, node, *inputs) -> Cost``; ctx has ``cfg``, ``topo``, ``card`` and ``tp_rank``
(a CardState works). Inputs may be real or ``meta`` tensors; ``Cost.out`` is a meta value with the
shapes and dtypes the Torch kernel returns, so the full FLASH graph can be walked (and its HBM
planned) without allocating it. Step literals are real host metadata in both cases.

Two sizes depend on data, not shapes: how many (row, expert) pairs the router sends to each EP card,
and how many distinct experts they hit. They are exact for real inputs; on meta inputs the pairs
are split evenly over the cards and the experts hit are the expectation under uniform routing.
Where a grouping depends on data (the experts' per-expert dict), the spec keeps the bytes and
shapes of the tensors under one group, not the keys.

A Cost names the weights a node reads (runtime keys; the card's shard of each is sized by
``dsv41.plan.sizing``) and counts everything else in bytes: looked-up table rows, cache rows in
their kv_cache formats (each row once per request that reads it: a request's query rows share its
window and index keys), and, by default, every input's bytes as the Torch backend holds them.
``link`` is what a card receives over the interconnect, with the device's element sizes (BF16
activations, FP32 TP partials). FLOPs count 2 per multiply-add, split into ``mx`` (FP8/FP4-weight
matmuls), ``dense`` (BF16/FP32 matmuls) and ``vector`` work.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from dsv41.ops import kv_cache
from dsv41.engine.requests import StepInputs

F32, I64 = torch.float32, torch.int64
BF16_BYTES, F32_BYTES = 2, 4


@dataclass
class Cost:
    out: object
    weights: dict = field(default_factory=dict)   # runtime weight key -> fraction of it read
    gathered: int = 0                # bytes of table rows looked up (embed, Engram)
    cache_read: int = 0
    cache_written: int = 0
    flops: dict = field(default_factory=dict)
    link: int = 0                    # bytes received from other cards
    act_read: int | None = None      # activation bytes read; None: every input's bytes


def nbytes(value) -> int:
    """Tensor bytes of a value (nested tuples, lists, dicts, dataclasses); host step metadata is 0."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, (type, StepInputs)):
        return sum(nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def meta(*shape, dtype=F32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def reads(*keys) -> dict:
    """Weights read whole."""
    return dict.fromkeys(keys, 1.0)


def row_bytes(kind: str, width: int) -> int:
    """One cache row's bytes in its kv_cache format."""
    return kv_cache.FORMATS[kind].row_bytes(width)


def valid(t: torch.Tensor) -> int:
    """How many slots or ids are set (-1 = none)."""
    return int((t >= 0).sum())
