"""The LM head: each TP rank's vocabulary shard of the logits, then the full row and its token, drawn
with each request's sampling settings (greedy by default)."""
from __future__ import annotations

import torch

from dsv41.kernels.cost import F32_BYTES, I64, Cost, meta, reads
from dsv41.kernels.record import NodeKind
from dsv41.model.finite import LOGITS, ensure_finite
from dsv41.model.head import Head
from dsv41.ops.lm_head import select_rows


def shard(st, node, hidden, step):
    return st.model.head.logits(hidden, step.logit_rows)


def shard_cost(ctx, node, hidden, step):
    b, d = step.logit_rows.shape[0], hidden.shape[1]
    vocab = ctx.cfg.vocab_size // ctx.topo.tp
    return Cost(meta(b, vocab), weights=reads(Head.HEAD), act_read=b * d * F32_BYTES,
                flops={"dense": 2 * b * d * vocab})


def shard_pypto(st, node, hidden, step):
    x = select_rows(hidden, step.logit_rows)
    return "lm_head.shard", {"x": x, "w": st.weights[Head.HEAD]}, {}, {"out": "fp32"}, lambda o: o["y"].float()


def argmax(st, node, *inputs):
    """The group's tokens (``ops.verify.Accepted``: per request the tokens made, a verify step's
    accepted drafts and the model's token after them, and the rows to publish), made here from the
    full rows, finite ones only; the rows' logits stay on this card until asked for. (The name is
    kept from the greedy-only head: traces and records know the node by it.)"""
    *shards, step = inputs
    logits = ensure_finite(torch.cat(shards, -1), None, LOGITS)
    accepted = st.model.head.tokens(logits, step)
    st.logits[node.attrs["dp_group"]] = (node.attrs.get("step"), logits)
    return accepted


def argmax_cost(ctx, node, *inputs):
    *shards, _ = inputs
    b = shards[0].shape[0]
    vocab = sum(s.shape[1] for s in shards)
    remote = (len(shards) - 1) * b * shards[0].shape[1] * F32_BYTES
    # the ids leave the card; the logits stay on it (CardState.logits) until asked for
    return Cost(meta(b, dtype=I64), link=remote, flops={"vector": b * vocab})


RECORDS = (
    NodeKind("lm_head.shard", shard, shard_cost, launches=(2, "quant + GEMM"), comm="none", latency="matmul",
             pypto=shard_pypto,
             pypto_parts=lambda cfg, rows, tp, ep: [("lm_head.shard", dict(M=rows, K=cfg.hidden_size,
                                                                           N=cfg.vocab_size // tp))],
             sim_rows=lambda st, node, args: args[1].logit_rows.shape[0]),
    NodeKind("lm_head.argmax", argmax, argmax_cost, launches=(2, "gather of the vocabulary shards, argmax"),
             comm="none", no_pypto_parts="no pypto kernel for the sampling over the gathered shards"),
)
