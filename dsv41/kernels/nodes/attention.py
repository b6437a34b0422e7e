"""Attention: projections, the compressor and its cache publication, the indexer and its Top-K, the
leaf of each attention mode, the output projection."""
from __future__ import annotations

import torch

from dsv41.kernels.cost import F32_BYTES, I64, Cost, meta, nbytes, reads, row_bytes, valid
from dsv41.kernels.record import NodeKind
from dsv41.model.attention import Attention
from dsv41.ops import kv_cache
from dsv41.ops.compressor import Compressed

LEAF_MODES = ("swa", "c2a_full", "c2a_reuse", "c1a_full", "c1a_reindex", "c1a_reuse")   # LayerSpec.kind
MX_AS_BF16 = "MX linears simulated as BF16"   # pypto 0.2.0 has no FP8 matmul


def _attn(st, node) -> Attention:
    return st.model.blocks[node.layer].attn


def _prefix(node) -> str:
    """The attention block's weight-name prefix (``Attention.key``)."""
    return Attention.key(node.layer, "")


def attn_q_proj(st, node, x, rope):
    return _attn(st, node).q_proj(x, *rope, heads=st.cfg.num_attention_heads // st.topo.tp)


def q_proj_cost(ctx, node, x, rope):
    cfg, t, d = ctx.cfg, x.shape[0], x.shape[1]
    heads, r, hd = cfg.num_attention_heads // ctx.topo.tp, cfg.q_lora_rank, cfg.head_dim
    p = _prefix(node)
    return Cost((meta(t, r), meta(t, heads, hd)), weights=reads(p + "wq_a", p + "q_norm.weight", p + "wq_b"),
                flops={"mx": 2 * t * (d * r + r * heads * hd), "vector": 6 * t * (r + heads * hd)})


def attn_kv_proj(st, node, x, rope):
    return _attn(st, node).kv_proj(x, *rope)


def kv_proj_cost(ctx, node, x, rope):
    cfg, t, d = ctx.cfg, x.shape[0], x.shape[1]
    p = _prefix(node)
    return Cost(meta(t, cfg.head_dim), weights=reads(p + "wkv", p + "kv_norm.weight"),
                flops={"mx": 2 * t * d * cfg.head_dim, "vector": 6 * t * cfg.head_dim})


def compress(st, node, x, step):
    return _attn(st, node).compress(st.caches, step.md, x)


def _ring_writes(cfg, md, source: int) -> int:
    """Ring rows compress_ratio2 writes: each request's last min(capacity, chunk) valid rows."""
    t = md.num_tokens
    if not t:
        return 0
    pos, req = md.position_ids.long(), md.token_to_req_indices.long()
    ok = (pos >= 0) & (md.state_block_tables[source][req, 0] >= 0)
    end = md.query_start_loc.long()[1:][req]
    return int((ok & (torch.arange(t) >= end - cfg.state_capacity)).sum())


def compress_cost(ctx, node, x, step):
    cfg, spec = ctx.cfg, ctx.cfg.layers[node.layer]
    t, d, hd = x.shape[0], x.shape[1], cfg.head_dim
    p = _prefix(node) + "compressor."
    names = [p + "wkv.weight", p + "norm.weight"] + ([p + "wgate.weight"] if spec.ratio == 2 else [])
    n = _ring_writes(cfg, step.md, node.layer) if spec.ratio == 2 else 0
    out = Compressed(meta(t, hd), meta(t, dtype=torch.bool), meta(n, dtype=I64), meta(n, 2 * hd), meta(n, dtype=I64))
    ring = t * 2 * hd * F32_BYTES if spec.ratio == 2 else 0
    return Cost(out, weights=reads(*names), cache_read=ring,
                flops={"dense": 2 * t * d * hd * (2 if spec.ratio == 2 else 1), "vector": 8 * t * hd})


def publish(st, node, value, *rest):
    """Stage the cache writes; the version token names what was published."""
    attn = _attn(st, node)
    if node.attrs["cache"] == "window":
        (step,) = rest
        attn.publish_window(st.caches, step.md, value)
    else:
        rope, step = rest
        attn.publish_compressed(st.caches, step.md, value, rope)
    return node.attrs["publishes"]


def publish_cost(ctx, node, value, *rest):
    cfg, md = ctx.cfg, rest[-1].md
    if node.attrs["cache"] == "window":
        return Cost(node.attrs["publishes"],
                    cache_written=valid(md.window_slots) * row_bytes(kv_cache.WINDOW, cfg.head_dim))
    rows = valid(md.compressed_slots[node.layer])
    written = rows * (row_bytes(kv_cache.COMPRESSED, cfg.head_dim) + row_bytes(kv_cache.INDEX, cfg.index_head_dim))
    written += nbytes(value.ring_rows)
    p, t = _prefix(node) + "indexer.", value.latent.shape[0]
    return Cost(node.attrs["publishes"], weights=reads(p + "wk.weight", p + "k_norm.weight"), cache_written=written,
                flops={"dense": 2 * t * cfg.head_dim * cfg.index_head_dim, "vector": 16 * t * cfg.head_dim})


def index(st, node, q, x, rope, step, _published, *candidates):
    qr, _ = q
    cand = candidates[0][1] if candidates else None
    a, b = node.attrs["rows"]
    return _attn(st, node).index_chunk(st.caches, step.md, qr, x, rope, slice(a, b), cand, st.options)


def _visible_per_request(md, source: int, a: int, b: int) -> int:
    """Index keys rows [a, b) read: each request's largest causal compressed length, once."""
    if b <= a:
        return 0
    req = md.token_to_req_indices[a:b].long()
    lens = md.compressed_lens[source][a:b].long()
    best = torch.zeros(int(req.max()) + 1, dtype=torch.long).scatter_reduce(0, req, lens, "amax")
    return int(best.sum())


def index_cost(ctx, node, q, x, rope, step, _published, *candidates):
    cfg, spec, md = ctx.cfg, ctx.cfg.layers[node.layer], step.md
    a, b = node.attrs["rows"]
    n, t = b - a, md.num_tokens
    width = int(md.compressed_lens[spec.kv_source].max()) if t else 0
    mask = meta(n, width, dtype=torch.bool) if node.layer == cfg.candidate_source_layer_id else None
    nh, ih, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size, cfg.q_lora_rank
    p = _prefix(node) + "indexer."
    keys = _visible_per_request(md, spec.kv_source, a, b) * row_bytes(kv_cache.INDEX, ih)
    share = n / t if t else 0.0
    return Cost((meta(n, cfg.index_topk, dtype=I64), mask), weights=reads(p + "wq_b", p + "weights_proj.weight"),
                cache_read=keys, act_read=int(share * nbytes((q[0], x, candidates))),
                flops={"mx": 2 * n * r * nh * ih, "dense": 2 * n * d * nh + 2 * n * width * nh * ih,
                       "vector": 4 * n * width * nh})


def topk(st, node, *chunks):
    return _attn(st, node).select(list(chunks))


def topk_cost(ctx, node, *chunks):
    k = ctx.cfg.index_topk
    t = sum(c[0].shape[0] for c in chunks)
    masks = [c[1] for c in chunks]
    mask = meta(t, masks[0].shape[1], dtype=torch.bool) if masks and masks[0] is not None else None
    return Cost((meta(t, k, dtype=I64), mask))


def leaf(st, node, q, step, _window, *sources):
    topk_ids = sources[1][0] if sources else None
    return _attn(st, node).attend(st.caches, step.md, q[1], topk_ids)


def leaf_cost(ctx, node, q, step, _window, *sources):
    """Window rows once each; a query's Top-K compressed rows (all K slots on meta inputs)."""
    t, heads, hd = q[1].shape
    window = step.md.window_indices
    distinct = int(torch.unique(window[window >= 0]).numel()) if t else 0
    read = distinct * row_bytes(kv_cache.WINDOW, hd)
    keys = window.shape[1]
    if sources:
        top = sources[1][0]
        rows = top.numel() if top.device.type == "meta" else valid(top)
        read += rows * row_bytes(kv_cache.COMPRESSED, hd)
        keys += top.shape[1]
    return Cost(meta(t, heads, hd), weights=reads(_prefix(node) + "attn_sink"), cache_read=read,
                act_read=nbytes(q[1]), flops={"dense": 4 * t * heads * hd * keys, "vector": 6 * t * heads * keys})


def leaf_parts(window_only: bool):
    """One attention leaf over all its keys per token (the window, plus the index Top-K unless the
    layer is sliding-window only): scores, softmax and PV each one pypto call, every local head."""
    def parts(cfg, rows, tp, ep):
        return leaf_tiles(cfg, rows, tp, cfg.sliding_window + (0 if window_only else cfg.index_topk))
    return parts


def leaf_tiles(cfg, rows: int, tp: int, keys: int):
    """Scores, softmax and PV of ``rows`` queries over ``keys`` keys, every local head."""
    h = cfg.num_attention_heads // tp
    tile = dict(T=rows, H=h, K=keys, d=cfg.head_dim)
    return [("attn.qk_tile", tile), ("attn.softmax_tile", dict(R=rows * h, K=keys)), ("attn.pv_tile", tile)]


def o_proj(st, node, attended, rope):
    return _attn(st, node).o_proj(attended, *rope)


def o_proj_cost(ctx, node, attended, rope):
    cfg, (t, heads, hd) = ctx.cfg, attended.shape
    groups, d = cfg.o_groups // ctx.topo.tp, cfg.hidden_size
    p = _prefix(node)
    return Cost(meta(t, d), weights=reads(p + "wo_a", p + "wo_b"),
                flops={"dense": 2 * t * heads * hd * cfg.o_lora_rank, "mx": 2 * t * groups * cfg.o_lora_rank * d,
                       "vector": 6 * t * heads * hd})


def _first_rows(st, node, args):
    return args[0].shape[0]


def _rope(cfg, rows, tp) -> dict:
    return dict(T=rows, H=cfg.num_attention_heads // tp, dim=cfg.head_dim, half=cfg.qk_rope_head_dim // 2)


def q_proj_parts(cfg, rows, tp, ep):
    d, r, h = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads // tp
    return [("attn.q_proj", dict(M=rows, K=d, N=r)), ("norm.rms", dict(T=rows, D=r)),
            ("attn.q_proj", dict(M=rows, K=r, N=h * cfg.head_dim)), ("rope.apply", _rope(cfg, rows, tp))]


def kv_proj_parts(cfg, rows, tp, ep):
    hd = cfg.head_dim
    return [("attn.kv_proj", dict(M=rows, K=cfg.hidden_size, N=hd)), ("norm.rms", dict(T=rows, D=hd)),
            ("rope.apply", dict(_rope(cfg, rows, tp), H=1))]


def o_proj_parts(cfg, rows, tp, ep):
    groups = cfg.o_groups // tp
    return ([("rope.apply", dict(_rope(cfg, rows, tp), inverse=1))]
            + [("attn.o_proj", dict(M=rows, K=cfg.o_group_in, N=cfg.o_lora_rank))] * groups
            + [("attn.o_proj", dict(M=rows, K=groups * cfg.o_lora_rank, N=cfg.hidden_size))])


RECORDS = (
    NodeKind("attn.q_proj", attn_q_proj, q_proj_cost, launches=(5, "quant + GEMM wq_a, q_norm, quant + GEMM wq_b"),
             comm="none", latency="matmul", pypto_parts=q_proj_parts, sim_rows=_first_rows, no_pypto=MX_AS_BF16),
    NodeKind("attn.kv_proj", attn_kv_proj, kv_proj_cost, launches=(4, "quant + GEMM wkv, kv_norm, RoPE"),
             comm="none", latency="matmul", pypto_parts=kv_proj_parts, sim_rows=_first_rows, no_pypto=MX_AS_BF16),
    NodeKind("attn.compress", compress, compress_cost, launches=(3, "GEMM, norm, pooled write"), comm="none",
             latency="matmul", no_pypto_parts="no pypto kernel for the compressor"),
    NodeKind("attn.publish", publish, publish_cost, launches=(2, "cache write (KV rows), indexer key write"),
             comm="none", effects=True, no_pypto_parts="cache writes: no pypto kernel for them"),
    NodeKind("attn.index", index, index_cost,
             launches=(5, "quant + GEMM wq_b, weights_proj GEMM, RoPE, MQA logits"), comm="none",
             latency="matmul", no_pypto_parts="no pypto kernel for the indexer"),
    NodeKind("attn.topk", topk, topk_cost, launches=(1, "top-k"), comm="none",
             no_pypto_parts="no pypto kernel for the top-k"),
    *(NodeKind(f"attn.leaf.{mode}", leaf, leaf_cost, launches=(2, "sparse decode metadata, sparse attention"),
               comm="none", latency="gather", pypto_parts=leaf_parts(mode == "swa"),
               sim_rows=lambda st, node, args: args[1].md.num_tokens,
               no_pypto="per-tile kernels (qk, softmax, pv)") for mode in LEAF_MODES),
    NodeKind("attn.o_proj", o_proj, o_proj_cost, launches=(4, "quant + GEMM wo_a, quant + GEMM wo_b"),
             comm="none", latency="matmul", pypto_parts=o_proj_parts, sim_rows=_first_rows, no_pypto=MX_AS_BF16),
)
