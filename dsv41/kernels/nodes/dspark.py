"""DSpark, the model's own drafter, as graph nodes of a DP group, after its head's verdict:

- ``dspark.tap``: the lane mean of the stream entering a target layer, on the card holding its rows;
- ``dspark.seed``: the card's rows' taps -> ``main_proj``/``main_norm`` -> each stage's window rows;
- ``dspark.publish``: the rows the verdict kept (a prefill's all), staged into the stages' window
  caches at the backbone's window slots (``cache.commit`` publishes them with the step; a rejected
  row never enters);
- ``dspark.embed`` / ``dspark.rope``: the next block's inputs ([bonus token, noise...] per request,
  RoPE at main position + 1 .. + block), the embedding's vocabulary share on each card;
- ``dspark.attn``: a stage's attention on the card's heads over the window (ring order) and the
  block's own rows, as an FP32 partial for the TP reduction;
- ``dspark.shard`` / ``dspark.head``: the shared LM head's vocabulary shard per card, then on the
  group's head card the full rows, the sequential Markov bias and draws, the confidence.

A stage's mixes, norms, MoE and reductions are the backbone's node kinds at the stage's layer id
(past the backbone), over the block's rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.kernels.cost import BF16_BYTES, F32_BYTES, I64, Cost, meta, nbytes, reads, row_bytes
from dsv41.kernels.nodes.attention import kv_proj_parts, leaf_tiles, o_proj_parts, q_proj_parts
from dsv41.kernels.record import NodeKind
from dsv41.model import caches as cache
from dsv41.model.dspark import DSpark, block_inputs, block_prefix, ring_order, seeded_sampler
from dsv41.model.finite import LOGITS, ensure_finite
from dsv41.model.head import Head
from dsv41.ops import kv_cache
from dsv41.ops.rope import PLAIN, gather_rope_rows
from dsv41.ops.sampling import SamplingParams

GREEDY = SamplingParams()


@dataclass(frozen=True)
class Drafts:
    """A DP group's next drafts, per request in its batch order."""
    tokens: torch.Tensor         # i64 [B, block]
    confidence: torch.Tensor     # FP32 [B, block]: the confidence head's score (a logit)
    probs: list | None           # per request its draft distributions [block, vocab] (sampling requests), or None


def _main_rows(step, verdict) -> torch.Tensor:
    """Each request's main token row: the last row the verdict kept."""
    return step.logit_rows.long()[verdict.last_rows]


def _main(step, verdict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's main position (its last kept row's) and its last token (what it feeds next)."""
    main = step.md.position_ids.long()[_main_rows(step, verdict)]
    return main, torch.tensor([t[-1] for t in verdict.tokens], dtype=torch.long)


def _block(cfg, step, verdict):
    """(ids, positions) of the group's next blocks."""
    main, last = _main(step, verdict)
    return block_inputs(cfg, last, main)


# ---- taps and seeding ------------------------------------------------------------------------------
def tap(st, node, x):
    return DSpark.tap(x)


def tap_cost(ctx, node, x):
    t, hc, d = x.shape
    return Cost(meta(t, d), act_read=nbytes(x), flops={"vector": t * hc * d})


def seed(st, node, rope, *taps):
    """[rows held, stages * head_dim]: the window rows of the card's rows (``attrs['rows']``)."""
    cos, sin = rope
    rows = node.attrs["rows"]
    out = st.model.dspark.seed_rows(torch.cat(taps, -1), cos[rows], sin[rows])
    return out.transpose(0, 1).reshape(len(rows), out.shape[0] * out.shape[2])


def seed_cost(ctx, node, rope, *taps):
    cfg, t, d = ctx.cfg, taps[0].shape[0], ctx.cfg.hidden_size
    n, hd, stages = len(taps) * d, cfg.head_dim, cfg.n_mtp_layers
    names = ["mtp.0.main_proj", "mtp.0.main_norm.weight"] + \
        [block_prefix(cfg, cfg.num_hidden_layers + s) + w for s in range(stages) for w in ("attn.wkv", "attn.kv_norm.weight")]
    return Cost(meta(t, stages * hd), weights=reads(*names),
                flops={"mx": 2 * t * (n * d + stages * d * hd), "vector": 4 * t * d + 6 * t * stages * hd})


def publish(st, node, rows, verdict, step):
    """Stage the kept rows' window rows into each stage's window cache (the backbone's slots)."""
    cfg = st.cfg
    slots = step.md.window_slots
    if verdict.keep_rows is not None:
        slots = torch.where(verdict.keep_rows, slots, torch.full_like(slots, -1))
    per_stage = rows.reshape(rows.shape[0], cfg.n_mtp_layers, cfg.head_dim)
    names = node.attrs["publishes"]
    for s, name in enumerate(names):
        cache.publish(st.caches, name, slots, per_stage[:, s])
    return names


def publish_cost(ctx, node, rows, verdict, step):
    cfg = ctx.cfg
    kept = int((step.md.window_slots >= 0).sum())
    return Cost(node.attrs["publishes"], cache_written=kept * cfg.n_mtp_layers * row_bytes(kv_cache.WINDOW, cfg.head_dim))


# ---- the next block's inputs -----------------------------------------------------------------------
def embed(st, node, verdict, step):
    """This card's vocabulary shard's share of the block rows (-0.0 outside the shard)."""
    return st.model.embed.shard(_block(st.cfg, step, verdict)[0])


def embed_cost(ctx, node, verdict, step):
    cfg, b = ctx.cfg, len(step.rids) * ctx.cfg.dspark_block_size
    return Cost(meta(b, cfg.hidden_size), gathered=b * cfg.hidden_size * BF16_BYTES // ctx.topo.tp, act_read=0)


def rope(st, node, verdict, step):
    return gather_rope_rows(*st.rope_tables[PLAIN], _block(st.cfg, step, verdict)[1])


def rope_cost(ctx, node, verdict, step):
    b, half = len(step.rids) * ctx.cfg.dspark_block_size, ctx.cfg.qk_rope_head_dim // 2
    return Cost((meta(b, half), meta(b, half)), act_read=0)


# ---- a stage's attention on the card's heads -------------------------------------------------------
def _rings(st, node, step, verdict) -> list[tuple[torch.Tensor, int]]:
    """Per request (its window ring [window, head_dim] in slot order, slots filled), read from the
    stage's window cache at the window of its main row."""
    w, md = st.cfg.sliding_window, step.md
    rows = _main_rows(step, verdict)
    out = []
    for r in rows.tolist():
        filled = int(md.window_lens[r])
        pos = int(md.position_ids[r]) - filled + 1 + torch.arange(w)
        pos = torch.where(torch.arange(w) < filled, pos, torch.full_like(pos, -1))
        order = ring_order(pos, w)
        slots = md.window_indices[r].long()[order]
        out.append((cache.read(st.caches, cache.window(node.layer), slots), filled))
    return out


def attn(st, node, x, rope_rows, verdict, step, _published):
    cos, sin = rope_rows
    stage = st.model.block(node.layer)
    return stage.attend_partial(x, _rings(st, node, step, verdict), cos, sin,
                                heads=st.cfg.num_attention_heads // st.topo.tp)


def attn_cost(ctx, node, x, rope_rows, verdict, step, _published):
    cfg, (t, d) = ctx.cfg, x.shape
    heads, r, hd = cfg.num_attention_heads // ctx.topo.tp, cfg.q_lora_rank, cfg.head_dim
    groups, k = cfg.o_groups // ctx.topo.tp, cfg.sliding_window + cfg.dspark_block_size
    p = block_prefix(cfg, node.layer) + "attn."
    b = len(step.rids)
    window = int(step.md.window_lens.long()[step.logit_rows.long()].sum()) if b else 0
    return Cost(meta(t, d), weights=reads(*(p + n for n in ("wq_a", "q_norm.weight", "wq_b", "wkv", "kv_norm.weight",
                                                                "attn_sink", "wo_a", "wo_b"))),
                cache_read=min(window, b * cfg.sliding_window) * row_bytes(kv_cache.WINDOW, hd), act_read=nbytes(x),
                flops={"mx": 2 * t * (d * r + r * heads * hd + d * hd + groups * cfg.o_lora_rank * d),
                       "dense": 4 * t * heads * hd * k + 2 * t * heads * hd * cfg.o_lora_rank,
                       "vector": 6 * t * (r + heads * hd + hd) + 6 * t * heads * k})


def attn_parts(cfg, rows, tp, ep):
    """A stage's attention at a step of ``rows`` tokens per DP group: its projections, one leaf over
    the window and the block's own rows, the output projection."""
    return (q_proj_parts(cfg, rows, tp, ep) + kv_proj_parts(cfg, rows, tp, ep)
            + leaf_tiles(cfg, rows, tp, cfg.sliding_window + cfg.dspark_block_size)
            + o_proj_parts(cfg, rows, tp, ep))


# ---- the heads -------------------------------------------------------------------------------------
def shard(st, node, hidden):
    return st.model.dspark.head_logits(hidden)


def shard_cost(ctx, node, hidden):
    cfg, (b, d) = ctx.cfg, hidden.shape
    vocab = cfg.vocab_size // ctx.topo.tp
    return Cost(meta(b, vocab), weights=reads(Head.HEAD, block_prefix(cfg, cfg.num_hidden_layers + cfg.n_mtp_layers - 1)
                                              + "norm.weight"),
                act_read=b * d * F32_BYTES, flops={"dense": 2 * b * d * vocab, "vector": 4 * b * d})


def shard_parts(cfg, rows, tp, ep):
    return [("norm.rms", dict(T=rows, D=cfg.hidden_size)),
            ("lm_head.shard", dict(M=rows, K=cfg.hidden_size, N=cfg.vocab_size // tp))]


def _samplers(step, main) -> list:
    """Per request (its settings, seed, its block's first position), from its first logit row's draw."""
    first = 0
    out = []
    for b, k in enumerate(step.proposed):
        d = step.draws[first] if step.draws is not None else None
        out.append((d.params, d.seed, int(main[b]) + 1) if d is not None else (GREEDY, 0, int(main[b]) + 1))
        first += k + 1
    return out


def head(st, node, *inputs):
    """The group's next drafts from the full LM-head rows (the vocabulary shards gathered), with
    the Markov bias drawn position by position as ``model.dspark`` does; the rows' draft logits
    stay on this card (``CardState.draft_logits``)."""
    *shards, hidden, verdict, step = inputs
    logits = ensure_finite(torch.cat(shards, -1), None, LOGITS)
    main, last = _main(step, verdict)
    dists: dict[int, list] = {}
    draft = st.model.dspark.markov(logits, hidden, last, seeded_sampler(_samplers(step, main), dists))
    st.draft_logits[node.attrs["dp_group"]] = (node.attrs.get("step"), draft.logits)
    probs = [torch.stack(dists[b]) if b in dists else None for b in range(last.numel())]
    return Drafts(draft.tokens, draft.confidence,
                  probs if any(p is not None for p in probs) else None)


def head_cost(ctx, node, *inputs):
    *shards, hidden, _verdict, step = inputs
    cfg, b, k = ctx.cfg, len(step.rids), ctx.cfg.dspark_block_size
    d, r, vocab = cfg.hidden_size, cfg.dspark_markov_rank, cfg.vocab_size
    p = block_prefix(cfg, cfg.num_hidden_layers + cfg.n_mtp_layers - 1)
    remote = (len(shards) - 1) * b * k * shards[0].shape[1] * F32_BYTES
    return Cost(Drafts(meta(b, k, dtype=I64), meta(b, k), None), link=remote,
                weights={p + "markov_head.head.weight": 1.0, p + "confidence_head.proj.weight": 1.0},
                gathered=b * k * r * BF16_BYTES,
                flops={"dense": 2 * b * k * (r * vocab + d + r), "vector": 4 * b * k * vocab})


def _draft_rows(st, node, args):
    return args[0].shape[0]


RECORDS = (
    NodeKind("dspark.tap", tap, tap_cost, launches=(1, "lane mean"), comm="none",
             no_pypto_parts="a lane mean of the stream: no pypto kernel for it"),
    NodeKind("dspark.seed", seed, seed_cost,
             launches=(15, "quant + GEMM main_proj, main_norm, per stage (3) quant + GEMM wkv, kv_norm, RoPE"),
             comm="none", latency="matmul",
             no_pypto_parts="no pypto kernel for the 3*dim -> dim main projection"),
    NodeKind("dspark.publish", publish, publish_cost, launches=(1, "cache write of the kept rows"), comm="none",
             effects=True, no_pypto_parts="cache writes: no pypto kernel for them"),
    NodeKind("dspark.embed", embed, embed_cost, launches=(1, "row gather"), comm="none", latency="gather",
             no_pypto_parts="no pypto kernel for the vocabulary row gather"),
    NodeKind("dspark.rope", rope, rope_cost, launches=(1, "cos/sin row gather"), comm="none",
             no_pypto_parts="a row gather of the block's positions: no pypto kernel for it"),
    NodeKind("dspark.attn", attn, attn_cost,
             launches=(15, "q_proj (5), kv_proj (4), sparse decode metadata + attention (2), o_proj (4)"),
             comm="none", latency="matmul", pypto_parts=attn_parts, sim_rows=_draft_rows,
             no_pypto="per-part kernels (projections, qk/softmax/pv tiles, o_proj)"),
    NodeKind("dspark.shard", shard, shard_cost, launches=(3, "RMSNorm, quant + GEMM"), comm="none",
             latency="matmul", pypto_parts=shard_parts, sim_rows=_draft_rows,
             no_pypto="per-part kernels (norm, LM-head shard)"),
    NodeKind("dspark.head", head, head_cost,
             launches=(3, "gather of the vocabulary shards, Markov bias + draw per position, confidence GEMV"),
             comm="none", no_pypto_parts="the Markov bias depends on the previous position's draw: host-side "
                                         "sequential sampling, no pypto kernel for it"),
)
