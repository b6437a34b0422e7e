"""The Torch backend: one function per kernel name, ``fn(state, node, *inputs) -> value``.

Every kernel calls the ``ops`` goldens (or the reference's stage helpers), so a graph run and the
monolithic reference share their arithmetic. Inputs arrive in ``node.inputs`` order.
"""
from __future__ import annotations

import torch

from dsv41.config import slab
from dsv41.kernels.registry import registrar
from dsv41.ops import mhc, reference as ref
from dsv41.ops.embed import embed_shard, pack_lanes, shard_rows
from dsv41.ops.engram import engram_apply, sum_shares
from dsv41.ops.lm_head import greedy, logits_shard, select_rows
from dsv41.ops.moe import combine, experts_grouped
from dsv41.ops.norm import rms_norm
from dsv41.ops.o_proj import o_proj_partial, reduce_partials
from dsv41.ops.projections import kv_proj, q_proj
from dsv41.ops.rope import materialize_rope_rows

KERNELS = {}
kernel = registrar(KERNELS)


def _spec(st, node):
    return st.cfg.layers[node.layer]


@kernel("rope.rows")
def rope_rows(st, node, step):
    md = step.md
    pos = md.position_ids if node.attrs["vector"] == "token" else md.compressed_rope_position_ids[node.attrs["vector"]]
    cos_t, sin_t = st.rope_tables[node.attrs["profile"]]
    cos = torch.empty(pos.shape[0], cos_t.shape[1])
    sin = torch.empty_like(cos)
    materialize_rope_rows(cos_t, sin_t, pos, pos.shape[0], cos, sin)
    return cos, sin


@kernel("embed")
def embed(st, node, step):
    """This card's vocabulary shard's share of every row of the DP group (-0.0 outside the shard)."""
    table = st.weights["embed.weight"]
    return embed_shard(step.input_ids, table, table.first, st.cfg.vocab_size)


@kernel("hc.pack")
def hc_pack(st, node, rows):
    return pack_lanes(rows, st.cfg.hc_mult)


@kernel("engram.lookup")
def engram_lookup(st, node, step):
    """This card's table slab's share of a DP group's looked-up rows (-0.0 outside the slab)."""
    table = st.weights[f"layers.{node.layer}.engram.embed"]
    return shard_rows(step.hash_ids[node.layer], table, table.first)


@kernel("engram")
def engram(st, node, x, step, *shares):
    rows, e, w = node.attrs["rows"], f"layers.{node.layer}.engram.", st.weights
    looked_up = sum_shares([s[rows] for s in shares])
    return engram_apply(x, looked_up, w[e + "wkv"], w[e + "q_weight"], w[e + "k_weight"], st.cfg.rms_norm_eps)


@kernel("hc.mixes")
def hc_mixes(st, node, x):
    return ref.mixes(st.cfg, st.weights, node.layer, node.attrs["site"], x)


@kernel("hc.pre")
def hc_pre(st, node, x, *mixes):
    pre = mhc.initial_pre(x.shape[0], st.cfg.hc_mult) if node.attrs["initial"] else mixes[0][0]
    return mhc.hc_pre(x, pre)


@kernel("hc.post")
def hc_post(st, node, sub, x, mixes):
    _, post, comb = mixes
    return mhc.hc_post(sub, x, post, comb)


@kernel("hc.head")
def hc_head(st, node, x, mixes):
    return mhc.hc_head(x, mixes[0])


@kernel("norm.rms", "norm.final")
def norm(st, node, x):
    return rms_norm(x, st.weights[node.attrs["weight"]], st.cfg.rms_norm_eps)


# ---- TP transports ---------------------------------------------------------------------------------

@kernel("tp.all_gather")
def all_gather(st, node, *slabs):
    """Rank-ordered concatenation of every rank's active slab rows."""
    return torch.cat(slabs, 0)


@kernel("tp.reduce_scatter")
def reduce_scatter(st, node, *partials):
    """FP32 sum in rank order, one BF16 rounding, keep this rank's slab."""
    first, count = slab(partials[0].shape[0], st.topo.tp, st.tp_rank)
    return reduce_partials(list(partials))[first:first + count]


@kernel("tp.all_reduce")
def all_reduce(st, node, *parts):
    """Attention: sum FP32 partials in rank order, round once. MoE: rows are owner-disjoint
    BF16 values scattered into zeros and summed, which is exact."""
    if "owners" not in node.attrs:
        return reduce_partials(list(parts))
    full = torch.zeros(node.attrs["rows"], parts[0].shape[1])
    for rows, part in zip(node.attrs["owners"], parts):
        full[rows] += part
    return full


# ---- attention --------------------------------------------------------------------------------------

@kernel("attn.q_proj")
def attn_q_proj(st, node, x, rope):
    p, cfg = f"layers.{node.layer}.attn.", st.cfg
    heads = cfg.num_attention_heads // st.topo.tp
    return q_proj(x, st.weights[p + "wq_a"], st.weights[p + "q_norm.weight"], st.weights[p + "wq_b"], *rope,
                  cfg.rms_norm_eps, heads, cfg.head_dim)


@kernel("attn.kv_proj")
def attn_kv_proj(st, node, x, rope):
    p = f"layers.{node.layer}.attn."
    return kv_proj(x, st.weights[p + "wkv"], st.weights[p + "kv_norm.weight"], *rope, st.cfg.rms_norm_eps)


@kernel("attn.compress")
def attn_compress(st, node, x, step):
    return ref.compress(st.cfg, st.weights, _spec(st, node), st.caches, step.md, x)


@kernel("attn.publish")
def attn_publish(st, node, value, *rest):
    """Stage the cache writes; the version token names what was published."""
    if node.attrs["cache"] == "window":
        (step,) = rest
        ref.publish(st.caches, f"window.{node.layer}", step.md.window_slots, value)
    else:
        rope, step = rest
        ref.publish_compressed(st.cfg, st.weights, _spec(st, node), st.caches, step.md, value, rope)
    return node.attrs["publishes"]


@kernel("attn.index")
def attn_index(st, node, q, x, rope, step, _published, *candidates):
    qr, _ = q
    cand = candidates[0][1] if candidates else None
    a, b = node.attrs["rows"]
    return ref.index_chunk(st.cfg, st.weights, _spec(st, node), st.caches, step.md, qr, x, rope, slice(a, b),
                           cand, st.options)


@kernel("attn.topk")
def attn_topk(st, node, *chunks):
    top = torch.cat([c[0] for c in chunks]) if chunks else torch.zeros(0, st.cfg.index_topk, dtype=torch.long)
    masks = [c[1] for c in chunks]
    return top, (torch.cat(masks) if masks and masks[0] is not None else None)


def _leaf(st, node, q, step, _window, *sources):
    topk = sources[1][0] if sources else None
    return ref.attend(st.cfg, st.weights, _spec(st, node), st.caches, step.md, q[1], topk)


for _kind in ("swa", "c2a_full", "c2a_reuse", "c1a_full", "c1a_reindex", "c1a_reuse"):
    KERNELS[f"attn.leaf.{_kind}"] = _leaf


@kernel("attn.o_proj")
def attn_o_proj(st, node, attended, rope):
    p = f"layers.{node.layer}.attn."
    return o_proj_partial(attended, *rope, st.weights[p + "wo_a"], st.weights[p + "wo_b"])


# ---- MoE ------------------------------------------------------------------------------------------------

@kernel("moe.gate")
def moe_gate(st, node, normed):
    x = normed[node.attrs["rows"]]
    indices, weights = ref.gate(st.cfg, st.weights, node.layer, x)
    return x, indices, weights


@kernel("moe.dispatch")
def moe_dispatch(st, node, gate):
    """Per destination EP card: (token row, slot, expert id) triples in (t, k) order + their inputs."""
    x, indices, weights = gate
    per_card = st.cfg.n_routed_experts // st.topo.ep
    out = {}
    for dst in st.topo.cards:
        t, k = torch.nonzero((indices // per_card) == dst, as_tuple=True)
        out[dst] = (t, indices[t, k], x[t], weights[t, k])
    return out


@kernel("moe.experts")
def moe_experts(st, node, *dispatches):
    """This EP rank's experts on the rows every source sent: source -> expert -> (rows, BF16 out)."""
    p, cfg, sources = f"layers.{node.layer}.ffn.experts.", st.cfg, node.attrs["sources"]
    parts = [d[st.card] for d in dispatches]
    src = torch.cat([torch.full_like(rows, i) for i, (rows, *_) in enumerate(parts)])
    rows, eids, x, w = (torch.cat(col) for col in zip(*parts))
    out = {s: {} for s in sources}
    if not eids.numel():
        return out
    # rows sorted by (expert, source), stably: one group per expert, a run per source inside it
    run_key = eids * len(sources) + src
    order = torch.argsort(run_key, stable=True)
    runs, run_counts = torch.unique_consecutive(run_key[order], return_counts=True)
    experts, counts = torch.unique_consecutive(eids[order], return_counts=True)
    y = experts_grouped(x[order], w[order], experts.tolist(), counts.tolist(),
                        lambda e, name: st.weights[f"{p}{e}.{name}"], cfg.swiglu_limit)
    for run, r, part in zip(runs.tolist(), rows[order].split(run_counts.tolist()), y.split(run_counts.tolist())):
        e, i = divmod(run, len(sources))
        out[sources[i]][e] = (r, part)
    return out


@kernel("moe.shared")
def moe_shared(st, node, gate):
    return ref.shared_expert(st.cfg, st.weights, node.layer, gate[0])


@kernel("moe.combine")
def moe_combine(st, node, gate, shared, *experts):
    routed = {}
    for per_src in experts:
        routed.update(per_src.get(st.card, {}))
    return combine(routed, shared)


# ---- head and commit ---------------------------------------------------------------------------------------

@kernel("lm_head.shard")
def lm_head_shard(st, node, hidden, step):
    return logits_shard(select_rows(hidden, step.md.logit_row_indices), st.weights["head.weight"])


@kernel("lm_head.argmax")
def lm_head_argmax(st, node, *shards):
    logits = torch.cat(shards, -1)
    return logits, greedy(logits)


@kernel("cache.commit")
def cache_commit(st, node, *_done):
    st.caches.commit(node.attrs.get("step"))
    st.generation += 1                       # one more committed step (an abort of this step undoes it)
    return True
