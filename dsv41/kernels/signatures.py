"""Kernel signatures: the value spec, bytes and FLOPs of a node, from its inputs' shapes.

``SIGNATURES[kernel](ctx, node, *inputs) -> Cost``; ctx has ``cfg``, ``topo``, ``card`` and
``tp_rank`` (a CardState works). Inputs may be real or ``meta`` tensors; ``Cost.out`` is a meta value
with the shapes and dtypes the Torch backend returns, so the full FLASH graph can be walked (and its
HBM planned) without allocating it. Step literals are real host metadata in both cases.

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

from dsv41.config import slab
from dsv41.ops import kv_cache
from dsv41.kernels.registry import registrar
from dsv41.ops.compressor import Compressed
from dsv41.ops.engram import table_slab
from dsv41.engine.requests import StepInputs

F32, I64 = torch.float32, torch.int64
BF16_BYTES, F32_BYTES = 2, 4
SIGNATURES = {}


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


signature = registrar(SIGNATURES)


def _w(*keys) -> dict:
    return dict.fromkeys(keys, 1.0)


def _attn(node) -> str:
    return f"layers.{node.layer}.attn."


def _row(kind: str, width: int) -> int:
    return kv_cache.FORMATS[kind].row_bytes(width)


def _count(t: torch.Tensor) -> int:
    return int((t >= 0).sum())


# ---- boundary ------------------------------------------------------------------------------------

@signature("rope.rows")
def rope_rows(ctx, node, step):
    t, half = step.md.num_tokens, ctx.cfg.qk_rope_head_dim // 2
    return Cost((meta(t, half), meta(t, half)), act_read=0)


@signature("embed")
def embed(ctx, node, step):
    """A vocabulary shard's share of every row of the group: only the ids in the shard read a row."""
    cfg, t = ctx.cfg, step.md.num_tokens
    rows = ctx.topo.vocab_rows(cfg, ctx.card)
    ids = step.input_ids.long().clamp(0, cfg.vocab_size - 1)
    mine = int(((ids >= rows.start) & (ids < rows.stop)).sum())
    return Cost(meta(t, cfg.hidden_size), gathered=mine * cfg.hidden_size * BF16_BYTES, act_read=0)


@signature("hc.pack")
def hc_pack(ctx, node, rows):
    t, d = rows.shape
    return Cost(meta(t, ctx.cfg.hc_mult, d), flops={"vector": t * ctx.cfg.hc_mult * d})


def _table_owner(cfg, topo, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """The EP card holding each Engram table row (contiguous slabs, ``engram.table_slab``)."""
    return ids.long() // max(1, table_slab(cfg, layer, topo.ep, 0)[1])


@signature("engram.lookup")
def engram_lookup(ctx, node, step):
    """This card's slab's share of a group's lookups: rows (FP8 payload + E8M0 scales) read only for
    the ids in the slab."""
    cfg, ids = ctx.cfg, step.hash_ids[node.layer]
    row = cfg.engram_head_dim + cfg.engram_head_dim // cfg.mx_group
    mine = int((_table_owner(cfg, ctx.topo, node.layer, ids) == ctx.card).sum())
    return Cost(meta(*ids.shape, cfg.engram_head_dim), gathered=mine * row, act_read=0)


@signature("engram")
def engram(ctx, node, x, step, *shares):
    """The shares of the card's rows added (received from the cards owning them), then the update."""
    cfg, (t, hc, d) = ctx.cfg, x.shape
    e = f"layers.{node.layer}.engram."
    ids = step.hash_ids[node.layer][node.attrs["rows"]]
    remote = int((_table_owner(cfg, ctx.topo, node.layer, ids) != ctx.card).sum())
    looked_up = t * cfg.engram_ids_per_token * cfg.engram_head_dim
    return Cost(meta(t, hc, d), weights=_w(e + "wkv", e + "q_weight", e + "k_weight"),
                link=remote * cfg.engram_head_dim * BF16_BYTES,
                act_read=nbytes(x) + len(shares) * looked_up * F32_BYTES,
                flops={"mx": 2 * t * cfg.engram_lookup_dim * (hc + 1) * d,
                       "vector": 12 * t * hc * d + len(shares) * looked_up})


# ---- mHC and norms -------------------------------------------------------------------------------

@signature("hc.mixes")
def hc_mixes(ctx, node, x):
    cfg, (t, hc, d) = ctx.cfg, x.shape
    p = f"layers.{node.layer}.hc_{node.attrs['site']}_"
    sinkhorn = 4 * cfg.hc_sinkhorn_iters * t * hc * hc
    return Cost((meta(t, hc), meta(t, hc), meta(t, hc, hc)), weights=_w(p + "fn", p + "scale", p + "base"),
                flops={"dense": 2 * t * hc * d * cfg.mix_hc, "vector": 3 * t * hc * d + sinkhorn})


@signature("hc.pre", "hc.head")
def hc_pre(ctx, node, x, *mixes):
    t, hc, d = x.shape
    return Cost(meta(t, d), flops={"vector": 2 * t * hc * d})


@signature("hc.post")
def hc_post(ctx, node, sub, x, mixes):
    t, hc, d = x.shape
    return Cost(meta(t, hc, d), flops={"vector": 2 * t * hc * hc * d + 3 * t * hc * d})


@signature("norm.rms", "norm.final")
def norm(ctx, node, x):
    return Cost(meta(*x.shape), weights=_w(node.attrs["weight"]), flops={"vector": 4 * x.numel()})


# ---- TP transports -------------------------------------------------------------------------------

@signature("tp.all_gather")
def all_gather(ctx, node, *slabs):
    rows = sum(s.shape[0] for s in slabs)
    own = slabs[ctx.tp_rank].shape[0]
    return Cost(meta(rows, slabs[0].shape[1]), link=(rows - own) * slabs[0].shape[1] * BF16_BYTES)


@signature("tp.reduce_scatter")
def reduce_scatter(ctx, node, *partials):
    t, d = partials[0].shape
    width = slab(t, ctx.topo.tp, ctx.tp_rank)[1]
    ring = (ctx.topo.tp - 1) * -(-t // ctx.topo.tp) * d
    return Cost(meta(width, d), link=ring * F32_BYTES, flops={"vector": len(partials) * t * d})


@signature("tp.all_reduce")
def all_reduce(ctx, node, *parts):
    tp = ctx.topo.tp
    if "owners" in node.attrs:
        rows, d = node.attrs["rows"], parts[0].shape[1]
        own = len(node.attrs["owners"][ctx.tp_rank])
        return Cost(meta(rows, d), link=(rows - own) * d * BF16_BYTES, flops={"vector": len(parts) * rows * d})
    t, d = parts[0].shape
    ring = (tp - 1) * -(-t // tp) * d
    return Cost(meta(t, d), link=ring * (F32_BYTES + BF16_BYTES), flops={"vector": len(parts) * t * d})


# ---- attention -----------------------------------------------------------------------------------

@signature("attn.q_proj")
def q_proj(ctx, node, x, rope):
    cfg, t, d = ctx.cfg, x.shape[0], x.shape[1]
    heads, r, hd = cfg.num_attention_heads // ctx.topo.tp, cfg.q_lora_rank, cfg.head_dim
    p = _attn(node)
    return Cost((meta(t, r), meta(t, heads, hd)), weights=_w(p + "wq_a", p + "q_norm.weight", p + "wq_b"),
                flops={"mx": 2 * t * (d * r + r * heads * hd), "vector": 6 * t * (r + heads * hd)})


@signature("attn.kv_proj")
def kv_proj(ctx, node, x, rope):
    cfg, t, d = ctx.cfg, x.shape[0], x.shape[1]
    p = _attn(node)
    return Cost(meta(t, cfg.head_dim), weights=_w(p + "wkv", p + "kv_norm.weight"),
                flops={"mx": 2 * t * d * cfg.head_dim, "vector": 6 * t * cfg.head_dim})


def _ring_writes(cfg, md, source: int) -> int:
    """Ring rows compress_ratio2 writes: each request's last min(capacity, chunk) valid rows."""
    t = md.num_tokens
    if not t:
        return 0
    pos, req = md.position_ids.long(), md.token_to_req_indices.long()
    valid = (pos >= 0) & (md.state_block_tables[source][req, 0] >= 0)
    end = md.query_start_loc.long()[1:][req]
    return int((valid & (torch.arange(t) >= end - cfg.state_capacity)).sum())


@signature("attn.compress")
def compress(ctx, node, x, step):
    cfg, spec = ctx.cfg, ctx.cfg.layers[node.layer]
    t, d, hd = x.shape[0], x.shape[1], cfg.head_dim
    p = _attn(node) + "compressor."
    names = [p + "wkv.weight", p + "norm.weight"] + ([p + "wgate.weight"] if spec.ratio == 2 else [])
    n = _ring_writes(cfg, step.md, node.layer) if spec.ratio == 2 else 0
    out = Compressed(meta(t, hd), meta(t, dtype=torch.bool), meta(n, dtype=I64), meta(n, 2 * hd))
    ring = t * 2 * hd * F32_BYTES if spec.ratio == 2 else 0
    return Cost(out, weights=_w(*names), cache_read=ring,
                flops={"dense": 2 * t * d * hd * (2 if spec.ratio == 2 else 1), "vector": 8 * t * hd})


@signature("attn.publish")
def publish(ctx, node, value, *rest):
    cfg, md = ctx.cfg, rest[-1].md
    if node.attrs["cache"] == "window":
        return Cost(node.attrs["publishes"], cache_written=_count(md.window_slots) * _row(kv_cache.WINDOW, cfg.head_dim))
    rows = _count(md.compressed_slots[node.layer])
    written = rows * (_row(kv_cache.COMPRESSED, cfg.head_dim) + _row(kv_cache.INDEX, cfg.index_head_dim))
    written += nbytes(value.ring_rows)
    p, t = _attn(node) + "indexer.", value.latent.shape[0]
    return Cost(node.attrs["publishes"], weights=_w(p + "wk.weight", p + "k_norm.weight"), cache_written=written,
                flops={"dense": 2 * t * cfg.head_dim * cfg.index_head_dim, "vector": 16 * t * cfg.head_dim})


def _visible_per_request(md, source: int, a: int, b: int) -> int:
    """Index keys rows [a, b) read: each request's largest causal compressed length, once."""
    if b <= a:
        return 0
    req = md.token_to_req_indices[a:b].long()
    lens = md.compressed_lens[source][a:b].long()
    best = torch.zeros(int(req.max()) + 1, dtype=torch.long).scatter_reduce(0, req, lens, "amax")
    return int(best.sum())


@signature("attn.index")
def index(ctx, node, q, x, rope, step, _published, *candidates):
    cfg, spec, md = ctx.cfg, ctx.cfg.layers[node.layer], step.md
    a, b = node.attrs["rows"]
    n, t = b - a, md.num_tokens
    width = int(md.compressed_lens[spec.kv_source].max()) if t else 0
    mask = meta(n, width, dtype=torch.bool) if node.layer == cfg.candidate_source_layer_id else None
    nh, ih, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size, cfg.q_lora_rank
    p = _attn(node) + "indexer."
    keys = _visible_per_request(md, spec.kv_source, a, b) * _row(kv_cache.INDEX, ih)
    share = n / t if t else 0.0
    return Cost((meta(n, cfg.index_topk, dtype=I64), mask), weights=_w(p + "wq_b", p + "weights_proj.weight"),
                cache_read=keys, act_read=int(share * nbytes((q[0], x, candidates))),
                flops={"mx": 2 * n * r * nh * ih, "dense": 2 * n * d * nh + 2 * n * width * nh * ih,
                       "vector": 4 * n * width * nh})


@signature("attn.topk")
def topk(ctx, node, *chunks):
    k = ctx.cfg.index_topk
    t = sum(c[0].shape[0] for c in chunks)
    masks = [c[1] for c in chunks]
    mask = meta(t, masks[0].shape[1], dtype=torch.bool) if masks and masks[0] is not None else None
    return Cost((meta(t, k, dtype=I64), mask))


def leaf(ctx, node, q, step, _window, *sources):
    """Window rows once each; a query's Top-K compressed rows (all K slots on meta inputs)."""
    t, heads, hd = q[1].shape
    window = step.md.window_indices
    distinct = int(torch.unique(window[window >= 0]).numel()) if t else 0
    read = distinct * _row(kv_cache.WINDOW, hd)
    keys = window.shape[1]
    if sources:
        top = sources[1][0]
        rows = top.numel() if top.device.type == "meta" else _count(top)
        read += rows * _row(kv_cache.COMPRESSED, hd)
        keys += top.shape[1]
    return Cost(meta(t, heads, hd), weights=_w(_attn(node) + "attn_sink"), cache_read=read,
                act_read=nbytes(q[1]), flops={"dense": 4 * t * heads * hd * keys, "vector": 6 * t * heads * keys})


for _kind in ("swa", "c2a_full", "c2a_reuse", "c1a_full", "c1a_reindex", "c1a_reuse"):
    SIGNATURES[f"attn.leaf.{_kind}"] = leaf


@signature("attn.o_proj")
def o_proj(ctx, node, attended, rope):
    cfg, (t, heads, hd) = ctx.cfg, attended.shape
    groups, d = cfg.o_groups // ctx.topo.tp, cfg.hidden_size
    p = _attn(node)
    return Cost(meta(t, d), weights=_w(p + "wo_a", p + "wo_b"),
                flops={"dense": 2 * t * heads * hd * cfg.o_lora_rank, "mx": 2 * t * groups * cfg.o_lora_rank * d,
                       "vector": 6 * t * heads * hd})


# ---- MoE -----------------------------------------------------------------------------------------

@signature("moe.gate")
def gate(ctx, node, normed):
    cfg, m, d = ctx.cfg, len(node.attrs["rows"]), normed.shape[1]
    k, f = cfg.num_experts_per_tok, f"layers.{node.layer}.ffn."
    return Cost((meta(m, d), meta(m, k, dtype=I64), meta(m, k)), weights=_w(f + "gate.weight", f + "gate.bias"),
                act_read=m * d * F32_BYTES, flops={"dense": 2 * m * d * cfg.n_routed_experts,
                                                     "vector": 8 * m * cfg.n_routed_experts})


def _dispatch_counts(indices: torch.Tensor, per_card: int, ep: int) -> list[int]:
    if indices.device.type != "meta":
        return torch.bincount((indices // per_card).flatten(), minlength=ep).tolist()
    base, extra = divmod(indices.numel(), ep)
    return [base + (dst < extra) for dst in range(ep)]


@signature("moe.dispatch")
def dispatch(ctx, node, gate_out):
    x, indices, _ = gate_out
    d, per_card = x.shape[1], ctx.cfg.n_routed_experts // ctx.topo.ep
    counts = _dispatch_counts(indices, per_card, ctx.topo.ep)
    out = {dst: (meta(n, dtype=I64), meta(n, dtype=I64), meta(n, d), meta(n)) for dst, n in enumerate(counts)}
    return Cost(out, act_read=sum(counts) * d * F32_BYTES + nbytes(indices))


def _experts_read(eids: list[torch.Tensor], pairs: int, first: int, local: int) -> dict[int, float]:
    """Local expert id -> fraction of its weights read: the experts hit, or the expectation."""
    if not pairs:
        return {}
    if eids[0].device.type != "meta":
        return dict.fromkeys(torch.unique(torch.cat(eids)).tolist(), 1.0)
    return dict.fromkeys(range(first, first + local), 1 - (1 - 1 / local) ** pairs)


@signature("moe.experts")
def experts(ctx, node, *dispatches):
    cfg, card = ctx.cfg, ctx.card
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    local = cfg.n_routed_experts // ctx.topo.ep
    out, pairs, received, eids = {}, 0, 0, []
    for src, disp in zip(node.attrs["sources"], dispatches):
        rows, ids, x, _ = disp[card]
        n = rows.shape[0]
        out[src] = {card: (meta(n, dtype=I64), meta(n, d))} if n else {}
        pairs += n
        eids.append(ids)
        if src != card:
            received += n * (d * BF16_BYTES + 8)
    read = _experts_read(eids, pairs, card * local, local)
    weights = {f"layers.{node.layer}.ffn.experts.{e}.{w}": frac for e, frac in read.items() for w in ("w1", "w2", "w3")}
    per_pair = d * F32_BYTES + 8 + 8 + 4   # row, token index, expert id, routing weight
    return Cost(out, weights=weights, link=received, act_read=pairs * per_pair,
                flops={"mx": 2 * pairs * 3 * d * inter, "vector": 8 * pairs * inter})


@signature("moe.shared")
def shared(ctx, node, gate_out):
    cfg, (m, d) = ctx.cfg, gate_out[0].shape
    f = f"layers.{node.layer}.ffn.shared_experts."
    return Cost(meta(m, d), weights=_w(f + "w1", f + "w2", f + "w3"), act_read=m * d * F32_BYTES,
                flops={"mx": 2 * m * 3 * d * cfg.moe_intermediate_size, "vector": 8 * m * cfg.moe_intermediate_size})


@signature("moe.combine")
def combine(ctx, node, gate_out, shared_out, *expert_outs):
    m, d = shared_out.shape
    mine = [per_src.get(ctx.card, {}) for per_src in expert_outs]
    rows = [sum(y.shape[0] for _, y in groups.values()) for groups in mine]
    remote = sum(n for e, n in zip(ctx.topo.cards, rows) if e != ctx.card)
    return Cost(meta(m, d), link=remote * (d * BF16_BYTES + 4), act_read=nbytes(shared_out) + nbytes(mine),
                flops={"vector": (sum(rows) + m) * d})


# ---- head and commit -----------------------------------------------------------------------------

@signature("lm_head.shard")
def lm_head_shard(ctx, node, hidden, step):
    b, d = step.md.logit_row_indices.shape[0], hidden.shape[1]
    vocab = ctx.cfg.vocab_size // ctx.topo.tp
    return Cost(meta(b, vocab), weights=_w("head.weight"), act_read=b * d * F32_BYTES,
                flops={"dense": 2 * b * d * vocab})


@signature("lm_head.argmax")
def lm_head_argmax(ctx, node, *shards):
    b = shards[0].shape[0]
    vocab = sum(s.shape[1] for s in shards)
    remote = (len(shards) - 1) * b * shards[0].shape[1] * F32_BYTES
    # the ids leave the card; the logits stay on it (CardState.logits) until asked for
    return Cost(meta(b, dtype=I64), link=remote, flops={"vector": b * vocab})


@signature("cache.commit")
def cache_commit(ctx, node, *_done):
    return Cost(True, act_read=0)
