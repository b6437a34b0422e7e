"""The LM head: each TP rank's vocabulary shard of the logits, then the full row and its greedy token."""
from __future__ import annotations

import torch

from dsv41.kernels.cost import F32_BYTES, I64, Cost, meta, reads
from dsv41.kernels.record import NodeKind, at_rows
from dsv41.model.head import Head
from dsv41.ops.lm_head import select_rows


def shard(st, node, hidden, step):
    return st.model.head.logits(hidden, step.md.logit_row_indices)


def shard_cost(ctx, node, hidden, step):
    b, d = step.md.logit_row_indices.shape[0], hidden.shape[1]
    vocab = ctx.cfg.vocab_size // ctx.topo.tp
    return Cost(meta(b, vocab), weights=reads(Head.HEAD), act_read=b * d * F32_BYTES,
                flops={"dense": 2 * b * d * vocab})


def shard_pypto(st, node, hidden, step):
    x = select_rows(hidden, step.md.logit_row_indices)
    return "lm_head.shard", {"x": x, "w": st.weights[Head.HEAD]}, {}, {"out": "fp32"}, lambda o: o["y"].float()


def argmax(st, node, *shards):
    """The group's tokens, made here; the logits stay on this card until asked for."""
    logits = torch.cat(shards, -1)
    st.logits[node.attrs["dp_group"]] = (node.attrs.get("step"), logits)
    return st.model.head.sample(logits)


def argmax_cost(ctx, node, *shards):
    b = shards[0].shape[0]
    vocab = sum(s.shape[1] for s in shards)
    remote = (len(shards) - 1) * b * shards[0].shape[1] * F32_BYTES
    # the ids leave the card; the logits stay on it (CardState.logits) until asked for
    return Cost(meta(b, dtype=I64), link=remote, flops={"vector": b * vocab})


RECORDS = (
    NodeKind("lm_head.shard", shard, shard_cost, latency="matmul", pypto=shard_pypto,
             device_time=at_rows(lambda node, args: args[1].md.num_requests)),
    NodeKind("lm_head.argmax", argmax, argmax_cost),
)
