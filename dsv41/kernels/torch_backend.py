"""The Torch backend: one function per kernel name, ``fn(state, node, *inputs) -> value``.

Every kernel is a stage method of the card's model blocks (``state.model``, ``dsv41.model``) over the
card's weight shards, so a graph run and the reference engine share one definition of the arithmetic.
Inputs arrive in ``node.inputs`` order.
"""
from __future__ import annotations

import torch

from dsv41.config import slab
from dsv41.kernels.registry import registrar
from dsv41.model.hyper import HyperSite
from dsv41.ops.moe import combine
from dsv41.ops.norm import rms_norm
from dsv41.ops.o_proj import reduce_partials
from dsv41.ops.rope import materialize_rope_rows

KERNELS = {}
kernel = registrar(KERNELS)


def _block(st, node):
    return st.model.blocks[node.layer]


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
    return st.model.embed.shard(step.input_ids)


@kernel("hc.pack")
def hc_pack(st, node, rows):
    return st.model.embed.pack(rows)


@kernel("engram.lookup")
def engram_lookup(st, node, step):
    """This card's table slab's share of a DP group's looked-up rows (-0.0 outside the slab)."""
    return _block(st, node).engram.lookup_share(step.hash_ids[node.layer])


@kernel("engram")
def engram(st, node, x, step, *shares):
    rows = node.attrs["rows"]
    return _block(st, node).engram.apply(x, [s[rows] for s in shares])


@kernel("hc.mixes")
def hc_mixes(st, node, x):
    return _block(st, node).sites[node.attrs["site"]].mixes(x)


@kernel("hc.pre")
def hc_pre(st, node, x, *mixes):
    pre = HyperSite.initial_pre(x.shape[0], st.cfg.hc_mult) if node.attrs["initial"] else mixes[0][0]
    return HyperSite.pre(x, pre)


@kernel("hc.post")
def hc_post(st, node, sub, x, mixes):
    _, post, comb = mixes
    return HyperSite.post(sub, x, post, comb)


@kernel("hc.head")
def hc_head(st, node, x, mixes):
    return HyperSite.head(x, mixes[0])


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
    return _block(st, node).attn.q_proj(x, *rope, heads=st.cfg.num_attention_heads // st.topo.tp)


@kernel("attn.kv_proj")
def attn_kv_proj(st, node, x, rope):
    return _block(st, node).attn.kv_proj(x, *rope)


@kernel("attn.compress")
def attn_compress(st, node, x, step):
    return _block(st, node).attn.compress(st.caches, step.md, x)


@kernel("attn.publish")
def attn_publish(st, node, value, *rest):
    """Stage the cache writes; the version token names what was published."""
    attn = _block(st, node).attn
    if node.attrs["cache"] == "window":
        (step,) = rest
        attn.publish_window(st.caches, step.md, value)
    else:
        rope, step = rest
        attn.publish_compressed(st.caches, step.md, value, rope)
    return node.attrs["publishes"]


@kernel("attn.index")
def attn_index(st, node, q, x, rope, step, _published, *candidates):
    qr, _ = q
    cand = candidates[0][1] if candidates else None
    a, b = node.attrs["rows"]
    return _block(st, node).attn.index_chunk(st.caches, step.md, qr, x, rope, slice(a, b), cand, st.options)


@kernel("attn.topk")
def attn_topk(st, node, *chunks):
    return _block(st, node).attn.select(list(chunks))


def _leaf(st, node, q, step, _window, *sources):
    topk = sources[1][0] if sources else None
    return _block(st, node).attn.attend(st.caches, step.md, q[1], topk)


for _kind in ("swa", "c2a_full", "c2a_reuse", "c1a_full", "c1a_reindex", "c1a_reuse"):
    KERNELS[f"attn.leaf.{_kind}"] = _leaf


@kernel("attn.o_proj")
def attn_o_proj(st, node, attended, rope):
    return _block(st, node).attn.o_proj(attended, *rope)


# ---- MoE ------------------------------------------------------------------------------------------------

@kernel("moe.gate")
def moe_gate(st, node, normed):
    x = normed[node.attrs["rows"]]
    indices, weights = _block(st, node).moe.gate(x)
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
    sources = node.attrs["sources"]
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
    y = _block(st, node).moe.grouped(x[order], w[order], experts.tolist(), counts.tolist())
    for run, r, part in zip(runs.tolist(), rows[order].split(run_counts.tolist()), y.split(run_counts.tolist())):
        e, i = divmod(run, len(sources))
        out[sources[i]][e] = (r, part)
    return out


@kernel("moe.shared")
def moe_shared(st, node, gate):
    return _block(st, node).moe.shared(gate[0])


@kernel("moe.combine")
def moe_combine(st, node, gate, shared, *experts):
    routed = {}
    for per_src in experts:
        routed.update(per_src.get(st.card, {}))
    return combine(routed, shared)


# ---- head and commit ---------------------------------------------------------------------------------------

@kernel("lm_head.shard")
def lm_head_shard(st, node, hidden, step):
    return st.model.head.logits(hidden, step.md.logit_row_indices)


@kernel("lm_head.argmax")
def lm_head_argmax(st, node, *shards):
    """The group's tokens, made here; the logits stay on this card until asked for."""
    logits = torch.cat(shards, -1)
    st.logits[node.attrs["dp_group"]] = (node.attrs.get("step"), logits)
    return st.model.head.sample(logits)


@kernel("cache.commit")
def cache_commit(st, node, *_done):
    st.caches.commit(node.attrs.get("step"))
    st.generation += 1                       # one more committed step (an abort of this step undoes it)
    return True
