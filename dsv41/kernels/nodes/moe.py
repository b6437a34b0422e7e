"""MoE: the router, the dispatch to EP cards, the routed and shared experts, the combine."""
from __future__ import annotations

import math

import torch

from dsv41.kernels.cost import BF16_BYTES, F32_BYTES, I64, Cost, meta, nbytes, reads
from dsv41.kernels.record import NodeKind
from dsv41.kernels.ties import tie_mismatch_rows
from dsv41.kernels.verdict import Verdict, compare
from dsv41.model.dspark import block_prefix
from dsv41.ops import moe
from dsv41.ops.moe import combine


def _experts(cfg, layer: int) -> tuple[str, int, int]:
    """(the layer's FFN weight prefix, its routed experts, experts per token): a DSpark stage
    routes to its own."""
    prefix = block_prefix(cfg, layer) + "ffn."
    dspark = layer >= cfg.num_hidden_layers
    return (prefix, cfg.routed_experts_of(prefix),
            cfg.dspark_n_activated_experts if dspark else cfg.num_experts_per_tok)


def gate(st, node, normed):
    x = normed[node.attrs["rows"]]
    indices, weights = st.model.block(node.layer).moe.gate(x)
    return x, indices, weights


def gate_cost(ctx, node, normed):
    cfg, m, d = ctx.cfg, len(node.attrs["rows"]), normed.shape[1]
    f, n, k = _experts(cfg, node.layer)
    return Cost((meta(m, d), meta(m, k, dtype=I64), meta(m, k)), weights=reads(f + "gate.weight", f + "gate.bias"),
                act_read=m * d * F32_BYTES, flops={"dense": 2 * m * d * n, "vector": 8 * m * n})


def gate_pypto(st, node, normed):
    x = normed[node.attrs["rows"]]
    f, _, k = _experts(st.cfg, node.layer)
    return "moe.gate", {"x": x, "w": st.weights[f + "gate.weight"]}, {}, {}, \
        lambda o: (x, *moe.pick_experts(o["scores"].float(), st.weights[f + "gate.bias"],
                                         k, st.cfg.routed_scaling_factor))


def gate_compare(st, node, actual, golden) -> Verdict:
    """The expert choice up to swaps among equal biased scores (selected scores may tie); the
    routing weights where no tie was swapped."""
    x, idx, w = golden
    v = compare(actual[0], x)
    f = _experts(st.cfg, node.layer)[0]
    biased = moe.router_scores(x, st.weights[f + "gate.weight"]) + st.weights[f + "gate.bias"].float()
    bad = tie_mismatch_rows(actual[1], idx, biased)
    if bad:
        v.merge(Verdict(False, False, why=f"rows {bad[:4]} choose other experts beyond ties"), "[1]")
    same = (actual[1] == idx).all(1)
    v.merge(compare(actual[2][same], w[same]), "[2]")
    v.exact &= torch.equal(actual[1], idx)
    return v


def dispatch(st, node, gate_out):
    """Per destination EP card: (token row, slot, expert id) triples in (t, k) order + their inputs."""
    x, indices, weights = gate_out
    per_card = _experts(st.cfg, node.layer)[1] // st.topo.ep
    out = {}
    for dst in st.topo.cards:
        t, k = torch.nonzero((indices // per_card) == dst, as_tuple=True)
        out[dst] = (t, indices[t, k], x[t], weights[t, k])
    return out


def _dispatch_counts(indices: torch.Tensor, per_card: int, ep: int) -> list[int]:
    if indices.device.type != "meta":
        return torch.bincount((indices // per_card).flatten(), minlength=ep).tolist()
    base, extra = divmod(indices.numel(), ep)
    return [base + (dst < extra) for dst in range(ep)]


def dispatch_cost(ctx, node, gate_out):
    x, indices, _ = gate_out
    d, per_card = x.shape[1], _experts(ctx.cfg, node.layer)[1] // ctx.topo.ep
    counts = _dispatch_counts(indices, per_card, ctx.topo.ep)
    out = {dst: (meta(n, dtype=I64), meta(n, dtype=I64), meta(n, d), meta(n)) for dst, n in enumerate(counts)}
    return Cost(out, act_read=sum(counts) * d * F32_BYTES + nbytes(indices))


def experts(st, node, *dispatches):
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
    hit, counts = torch.unique_consecutive(eids[order], return_counts=True)
    y = st.model.block(node.layer).moe.grouped(x[order], w[order], hit.tolist(), counts.tolist())
    for run, r, part in zip(runs.tolist(), rows[order].split(run_counts.tolist()), y.split(run_counts.tolist())):
        e, i = divmod(run, len(sources))
        out[sources[i]][e] = (r, part)
    return out


def _experts_read(eids: list[torch.Tensor], pairs: int, first: int, local: int, k: int, e: int) -> dict[int, float]:
    """Local expert id -> fraction of its weights read: the experts hit, or the expectation. Each token
    picks k distinct experts of E, so an expert is missed by a token with probability 1 - k/E, and
    the card's pairs come from pairs * E / (k * local) tokens under uniform routing."""
    if not pairs:
        return {}
    if eids[0].device.type != "meta":
        return dict.fromkeys(torch.unique(torch.cat(eids)).tolist(), 1.0)
    return dict.fromkeys(range(first, first + local), 1 - (1 - k / e) ** (pairs * e / (k * local)))


def experts_cost(ctx, node, *dispatches):
    cfg, card = ctx.cfg, ctx.card
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    f, n_experts, top_k = _experts(cfg, node.layer)
    local = n_experts // ctx.topo.ep
    out, pairs, received, eids = {}, 0, 0, []
    for src, disp in zip(node.attrs["sources"], dispatches):
        rows, ids, x, _ = disp[card]
        n = rows.shape[0]
        out[src] = {card: (meta(n, dtype=I64), meta(n, d))} if n else {}
        pairs += n
        eids.append(ids)
        if src != card:
            received += n * (d * BF16_BYTES + 8)
    read = _experts_read(eids, pairs, card * local, local, top_k, n_experts)
    weights = {f"{f}experts.{e}.{w}": frac for e, frac in read.items() for w in ("w1", "w2", "w3")}
    per_pair = d * F32_BYTES + 8 + 8 + 4   # row, token index, expert id, routing weight
    return Cost(out, weights=weights, link=received, act_read=pairs * per_pair,
                flops={"mx": 2 * pairs * 3 * d * inter, "vector": 8 * pairs * inter})


def experts_rows(st, node, args):
    """The rows per DP group that give this step's routed pairs on the card (see ``experts_parts``)."""
    cfg, tp, ep = st.cfg, st.topo.tp, st.topo.ep
    pairs = sum(len(d[dst][0]) for d in args for dst in d)
    return max(1, math.ceil(pairs / ((ep // tp) * cfg.num_experts_per_tok)))


def experts_parts(cfg, rows, tp, ep):
    """One grouped GEMM over the card's experts at the mean routed rows per expert (every card of the
    EP world, ``ep // tp`` DP groups, routes its rows), padded to 16; FP4 experts simulated as W8A8 (INT8)."""
    routed = rows * (ep // tp) * cfg.num_experts_per_tok
    per_expert = -(-max(1, -(-routed // cfg.n_routed_experts)) // 16) * 16
    return [("moe.experts", dict(G=cfg.n_routed_experts // ep, T=per_expert, D=cfg.hidden_size,
                                 I=cfg.moe_intermediate_size))]


def shared(st, node, gate_out):
    return st.model.block(node.layer).moe.shared(gate_out[0])


def shared_cost(ctx, node, gate_out):
    cfg, (m, d) = ctx.cfg, gate_out[0].shape
    f = _experts(cfg, node.layer)[0] + "shared_experts."
    return Cost(meta(m, d), weights=reads(f + "w1", f + "w2", f + "w3"), act_read=m * d * F32_BYTES,
                flops={"mx": 2 * m * 3 * d * cfg.moe_intermediate_size, "vector": 8 * m * cfg.moe_intermediate_size})


def moe_combine(st, node, gate_out, shared_out, *expert_outs):
    routed = {}
    for per_src in expert_outs:
        routed.update(per_src.get(st.card, {}))
    return combine(routed, shared_out)


def combine_cost(ctx, node, gate_out, shared_out, *expert_outs):
    m, d = shared_out.shape
    mine = [per_src.get(ctx.card, {}) for per_src in expert_outs]
    rows = [sum(y.shape[0] for _, y in groups.values()) for groups in mine]
    remote = sum(n for e, n in zip(ctx.topo.cards, rows) if e != ctx.card)
    return Cost(meta(m, d), link=remote * (d * BF16_BYTES + 4), act_read=nbytes(shared_out) + nbytes(mine),
                flops={"vector": (sum(rows) + m) * d})


RECORDS = (
    NodeKind("moe.gate", gate, gate_cost, launches=(2, "router GEMM, grouped top-k"), comm="none",
             latency="matmul", pypto=gate_pypto, compare=gate_compare,
             pypto_parts=lambda cfg, rows, tp, ep: [("moe.gate", dict(T=rows, D=cfg.hidden_size,
                                                                      E=cfg.n_routed_experts))],
             sim_rows=lambda st, node, args: len(node.attrs["rows"])),
    NodeKind("moe.dispatch", dispatch, dispatch_cost, launches=(2, "dispatch layout, quant of the rows sent"),
             comm="none", no_pypto_parts="no pypto kernel for the dispatch layout"),
    NodeKind("moe.experts", experts, experts_cost,
             launches=(4, "dispatch receive, grouped GEMM w1/w3, SiLU-and-mul + quant, grouped GEMM w2"),
             comm="all_to_all", routed=True, latency="matmul", pypto_parts=experts_parts, sim_rows=experts_rows,
             no_pypto="FP4 experts simulated as W8A8 (INT8)"),
    NodeKind("moe.shared", shared, shared_cost, launches=(5, "quant + GEMM w1/w3, SiLU-and-mul, quant + GEMM w2"),
             comm="none", latency="matmul", no_pypto="MX linears simulated as BF16",
             pypto_parts=lambda cfg, rows, tp, ep: [("moe.shared", dict(
                 G=1, T=rows, D=cfg.hidden_size, I=cfg.moe_intermediate_size * cfg.n_shared_experts))],
             sim_rows=lambda st, node, args: args[0][0].shape[0]),
    NodeKind("moe.combine", moe_combine, combine_cost, launches=(2, "combine, weighted sum with the shared expert"),
             comm="all_to_all", no_pypto_parts="no pypto kernel for the combine"),
)
