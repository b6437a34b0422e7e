"""Per node kernel: the pypto cost model's simulated µs next to the roofline estimate, same node.

    python bench/pypto_vs_roofline.py --config tiny                 # TP1, 8 requests x 6 decode rows
    python bench/pypto_vs_roofline.py --config flash                # TP4/DP2/EP8, 192 decode rows per DP group
    python bench/pypto_vs_roofline.py --config flash --rows 32      # 32 requests x 1 row
    python bench/pypto_vs_roofline.py --config flash --json --step  # one object per line, plus the step

Both come from one decode graph built with the plan machinery (meta tensors, nothing allocated):
the roofline from the node's signature on --device-profile (default a2: pypto 0.2.0's SIM models an
Ascend 910B), the pypto time from the node kind's record for the node's actual row count (cached
in ~/.cache/dsv41/pypto). ``--step`` adds every node of the step: per card, the summed simulated µs
of the nodes that have a pypto form against the summed roofline of the same nodes, busiest card
first (the card's device time if it ran its pypto submissions back to back). Each row names the
chip pypto simulated (``arch``: a2 only in pypto 0.2.0, docs/pypto.md).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from dsv41.cluster.plan import make_plan
from dsv41.config import PRESETS, Topology
from dsv41.capacity import capacity_of
from dsv41.graph.build import REPLICATED, build
from dsv41.kernels.cost import nbytes
from dsv41.kernels.device_time import node_sim_us
from dsv41.kernels.kinds import KINDS
from dsv41.kernels.pypto.env import SIM_ARCH
from dsv41.plan.step import CardContext, step_inputs
from dsv41.plan.roofline import node_us, profile
from dsv41.plan.sizing import card_weights, node_cost

NODES = ["rope/compressed/token@c0", "L3/attn/norm@c0", "L3/attn/pre@c0", "L3/attn/q_proj@c0",
         "L3/attn/kv_proj@c0", "L0/attn/leaf.swa@c0", "L2/attn/leaf.c2a_full@c0", "L3/attn/leaf.c2a_reuse@c0",
         "L20/attn/leaf.c1a_full@c0", "L21/attn/leaf.c1a_reuse@c0", "L24/attn/leaf.c1a_reindex@c0", "L3/attn/o_proj@c0",
         "L3/attn/post@c0", "L3/moe/gate@c0", "L3/moe/experts@c0", "L3/moe/shared@c0", "final/hc.head@c0",
         "final/norm@c0", "final/lm_head.shard@c0"]


def split_rows(rows: int, max_requests: int, per_request: int) -> tuple[int, int]:
    """(requests, rows per request) for ``rows`` decode rows per DP group: whole requests of
    ``per_request`` rows when they fit the batch, else ``rows`` requests of one row each."""
    if rows % per_request == 0 and rows // per_request <= max_requests:
        return rows // per_request, per_request
    if rows <= max_requests:
        return rows, 1
    raise ValueError(f"--rows: must be a multiple of {per_request} up to {max_requests * per_request}, "
                     f"or at most {max_requests}; got {rows}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=("tiny", "flash"))
    p.add_argument("--device-profile", default="a2")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--rows", type=int, default=None, help="decode rows per DP group (default: the batch)")
    p.add_argument("--json", action="store_true", help="one JSON object per node kind, one per line")
    p.add_argument("--step", action="store_true", help="also every node of the step, summed per card")
    a = p.parse_args()
    cfg = PRESETS[a.config]
    topo = Topology(4, 2, 8) if a.config == "flash" else Topology(1, 1, 1)
    capacity = capacity_of(cfg)
    requests, per_request = split_rows(a.rows or capacity.decode_max_tokens, capacity.max_batch_per_dp,
                                       capacity.decode_rows_per_request)
    context = a.context or (1 << 20 if a.config == "flash" else 256)
    steps = {g: step_inputs(cfg, requests, per_request, context, "decode") for g in range(topo.dp)}
    graph = build(cfg, topo, steps, REPLICATED, "decode")
    make_plan(graph, topo)
    dev = profile(a.device_profile)
    ctx = {c: CardContext(cfg, topo, c) for c in topo.cards}
    held = {c: card_weights(cfg, topo, c) for c in topo.cards}
    values = {k: v for k, (v, _) in graph.literals.items()}
    rows, cards = [], defaultdict(lambda: {"sim_us": 0.0, "roofline_us": 0.0, "nodes": 0, "without_pypto": 0})
    for key in graph.topo_order():
        node = graph.nodes[key]
        args = [values[i] for i in node.inputs]
        sig = KINDS[node.kernel].cost(ctx[node.card], node, *args)
        values[key] = sig.out
        if key not in NODES and not a.step:
            continue
        roof = node_us(node_cost(held[node.card], sig, args, nbytes(sig.out)), dev)
        sim = node_sim_us(ctx[node.card], node, args)
        if key in NODES:
            rows.append({"node": key, "kernel": node.kernel, "rows": requests * per_request, "arch": SIM_ARCH,
                         "sim_us": None if sim is None else round(sim, 2), "roofline_us": round(roof, 2),
                         "ratio": None if sim is None or roof <= 0 else round(sim / roof, 1)})
        if a.step:
            c = cards[node.card]
            c["nodes"] += 1
            if sim is None:
                c["without_pypto"] += 1
            else:
                c["sim_us"] += sim
                c["roofline_us"] += roof
    step = [{"card": c, "sim_us": round(v["sim_us"], 1), "roofline_us": round(v["roofline_us"], 1),
             "nodes": v["nodes"], "without_pypto": v["without_pypto"]}
            for c, v in sorted(cards.items(), key=lambda kv: -kv[1]["sim_us"])]
    head = {"config": cfg.name, "topology": [topo.tp, topo.dp, topo.ep], "rows_per_dp_group": requests * per_request,
            "device_profile": dev.name}
    if a.json:
        for r in rows:
            print(json.dumps(r))
        if step:
            print(json.dumps({"step_busiest_card": step[0], **head}))
        return
    print(json.dumps({**head, "nodes": rows, **({"step_cards": step} if step else {})}, indent=1))


if __name__ == "__main__":
    main()
