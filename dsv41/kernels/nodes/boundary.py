"""The step's edges: RoPE rows, the embedding and Engram lookups at its start, the cache commit at its end."""
from __future__ import annotations

import torch

from dsv41.kernels.cost import BF16_BYTES, F32_BYTES, Cost, meta, nbytes, reads
from dsv41.kernels.record import NodeKind
from dsv41.model.embedding import Engram
from dsv41.ops.engram import table_slab
from dsv41.ops.rope import materialize_rope_rows


def _positions(node, md):
    return md.position_ids if node.attrs["vector"] == "token" else md.compressed_rope_position_ids[node.attrs["vector"]]


def rope_rows(st, node, step):
    pos = _positions(node, step.md)
    cos_t, sin_t = st.rope_tables[node.attrs["profile"]]
    cos = torch.empty(pos.shape[0], cos_t.shape[1])
    sin = torch.empty_like(cos)
    materialize_rope_rows(cos_t, sin_t, pos, pos.shape[0], cos, sin)
    return cos, sin


def rope_rows_cost(ctx, node, step):
    t, half = step.md.num_tokens, ctx.cfg.qk_rope_head_dim // 2
    return Cost((meta(t, half), meta(t, half)), act_read=0)


def rope_rows_pypto(st, node, step):
    pos = _positions(node, step.md)
    cos_t, sin_t = st.rope_tables[node.attrs["profile"]]
    return "rope.rows", {"cos_table": cos_t, "sin_table": sin_t, "pos": pos.reshape(-1, 1)}, {}, {}, \
        lambda o: (o["cos"].float(), o["sin"].float())


def embed(st, node, step):
    """This card's vocabulary shard's share of every row of the DP group (-0.0 outside the shard)."""
    return st.model.embed.shard(step.input_ids)


def embed_cost(ctx, node, step):
    """A vocabulary shard's share of every row of the group: only the ids in the shard read a row."""
    cfg, t = ctx.cfg, step.md.num_tokens
    rows = ctx.topo.vocab_rows(cfg, ctx.card)
    ids = step.input_ids.long().clamp(0, cfg.vocab_size - 1)
    mine = int(((ids >= rows.start) & (ids < rows.stop)).sum())
    return Cost(meta(t, cfg.hidden_size), gathered=mine * cfg.hidden_size * BF16_BYTES, act_read=0)


def hc_pack(st, node, rows):
    return st.model.embed.pack(rows)


def hc_pack_cost(ctx, node, rows):
    t, d = rows.shape
    return Cost(meta(t, ctx.cfg.hc_mult, d), flops={"vector": t * ctx.cfg.hc_mult * d})


def engram_lookup(st, node, step):
    """This card's table slab's share of a DP group's looked-up rows (-0.0 outside the slab)."""
    return st.model.blocks[node.layer].engram.lookup_share(step.hash_ids[node.layer])


def _table_owner(cfg, topo, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """The EP card holding each Engram table row (contiguous slabs, ``engram.table_slab``)."""
    return ids.long() // max(1, table_slab(cfg, layer, topo.ep, 0)[1])


def engram_lookup_cost(ctx, node, step):
    """This card's slab's share of a group's lookups: rows (FP8 payload + E8M0 scales) read only for
    the ids in the slab."""
    cfg, ids = ctx.cfg, step.hash_ids[node.layer]
    row = cfg.engram_head_dim + cfg.engram_head_dim // cfg.mx_group
    mine = int((_table_owner(cfg, ctx.topo, node.layer, ids) == ctx.card).sum())
    return Cost(meta(*ids.shape, cfg.engram_head_dim), gathered=mine * row, act_read=0)


def engram(st, node, x, step, *shares):
    rows = node.attrs["rows"]
    return st.model.blocks[node.layer].engram.apply(x, [s[rows] for s in shares])


def engram_cost(ctx, node, x, step, *shares):
    """The shares of the card's rows added (received from the cards owning them), then the update."""
    cfg, (t, hc, d) = ctx.cfg, x.shape
    e = Engram.key(node.layer, "")
    ids = step.hash_ids[node.layer][node.attrs["rows"]]
    remote = int((_table_owner(cfg, ctx.topo, node.layer, ids) != ctx.card).sum())
    looked_up = t * cfg.engram_ids_per_token * cfg.engram_head_dim
    return Cost(meta(t, hc, d), weights=reads(e + "wkv", e + "q_weight", e + "k_weight"),
                link=remote * cfg.engram_head_dim * BF16_BYTES,
                act_read=nbytes(x) + len(shares) * looked_up * F32_BYTES,
                flops={"mx": 2 * t * cfg.engram_lookup_dim * (hc + 1) * d,
                       "vector": 12 * t * hc * d + len(shares) * looked_up})


def cache_commit(st, node, *done):
    """Publish the step's writes: on a card of a group with work, only the rows its head kept."""
    keep = done[0].keep_rows if node.attrs.get("accepts") else None
    st.caches.commit(node.attrs.get("step"), keep)
    st.generation += 1                       # one more committed step (an abort of this step undoes it)
    return True


def cache_commit_cost(ctx, node, *_done):
    return Cost(True, act_read=0)


RECORDS = (
    NodeKind("rope.rows", rope_rows, rope_rows_cost, launches=(1, "cos/sin row gather"), comm="none",
             pypto=rope_rows_pypto,
             pypto_parts=lambda cfg, rows, tp, ep: [("rope.rows", dict(T=rows, C=cfg.max_position_embeddings,
                                                                       half=cfg.qk_rope_head_dim // 2))],
             sim_rows=lambda st, node, args: args[0].md.num_tokens),
    NodeKind("embed", embed, embed_cost, launches=(1, "row gather"), comm="none", latency="gather",
             no_pypto_parts="no pypto kernel for the vocabulary row gather"),
    NodeKind("hc.pack", hc_pack, hc_pack_cost, launches=(1, "copy into the residual streams"), comm="none",
             no_pypto_parts="a copy: no pypto kernel for it"),
    NodeKind("engram.lookup", engram_lookup, engram_lookup_cost, launches=(2, "hash, row gather"), comm="none",
             no_pypto_parts="no pypto kernel for the n-gram hash and table gather"),
    NodeKind("engram", engram, engram_cost, launches=(3, "quant + GEMM of the gated projection, gate"),
             comm="none", latency="gather", no_pypto_parts="no pypto kernel for the Engram gated projection"),
    NodeKind("cache.commit", cache_commit, cache_commit_cost, launches=(1, "metadata update"), comm="none",
             effects=True, no_pypto_parts="a metadata update: no pypto kernel for it"),
)
