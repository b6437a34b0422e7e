"""Per node kernel: the pypto cost model's simulated µs next to the roofline estimate, same node.

    python bench/pypto_vs_roofline.py --config tiny            # TP1, 8 requests x 6 decode rows
    python bench/pypto_vs_roofline.py --config flash           # TP4/DP2/EP8, 192 decode rows per DP group

Both come from one decode graph built with the plan machinery (meta tensors, nothing allocated):
the roofline from the node's signature on --device-profile, the pypto time from
the node kind's record for the node's actual row count (cached in ~/.cache/dsv41/pypto; a cold
FLASH moe.experts simulation takes minutes).
"""
from __future__ import annotations

import argparse
import json

from dsv41.cluster.plan import make_plan
from dsv41.config import PRESETS, Topology
from dsv41.graph.build import REPLICATED, build
from dsv41.kernels.cost import nbytes
from dsv41.kernels.device_time import node_sim_us
from dsv41.kernels.kinds import KINDS
from dsv41.plan.step import CardContext, step_inputs
from dsv41.plan.roofline import node_us, profile
from dsv41.plan.sizing import card_weights, node_cost

NODES = ["rope/compressed/token@c0", "L3/attn/norm@c0", "L3/attn/pre@c0", "L3/attn/q_proj@c0",
         "L3/attn/kv_proj@c0", "L3/attn/leaf.c2a_reuse@c0", "L3/attn/o_proj@c0", "L3/attn/post@c0",
         "L3/moe/gate@c0", "L3/moe/experts@c0", "L3/moe/shared@c0", "final/hc.head@c0", "final/norm@c0",
         "final/lm_head.shard@c0"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=("tiny", "flash"))
    p.add_argument("--device-profile", default="a5")
    p.add_argument("--context", type=int, default=None)
    a = p.parse_args()
    cfg = PRESETS[a.config]
    topo = Topology(4, 2, 8) if a.config == "flash" else Topology(1, 1, 1)
    requests = cfg.max_batch_per_dp
    context = a.context or (1 << 20 if a.config == "flash" else 256)
    steps = {g: step_inputs(cfg, topo.tp, requests, cfg.decode_rows_per_request, context, "decode")
             for g in range(topo.dp)}
    graph = build(cfg, topo, steps, REPLICATED, "decode")
    make_plan(graph, topo)
    dev = profile(a.device_profile)
    ctx = {c: CardContext(cfg, topo, c) for c in topo.cards}
    held = {c: card_weights(cfg, topo, c) for c in topo.cards}
    values = {k: v for k, (v, _) in graph.literals.items()}
    rows = []
    for key in graph.topo_order():
        node = graph.nodes[key]
        args = [values[i] for i in node.inputs]
        sig = KINDS[node.kernel].cost(ctx[node.card], node, *args)
        values[key] = sig.out
        if key in NODES:
            cost = node_cost(held[node.card], sig, args, nbytes(sig.out))
            rows.append({"node": key, "kernel": node.kernel, "roofline_us": round(node_us(cost, dev), 2),
                         "pypto_sim_us": node_sim_us(ctx[node.card], node, args)})
    print(json.dumps({"config": cfg.name, "topology": [topo.tp, topo.dp, topo.ep], "rows_per_dp_group":
                      requests * cfg.decode_rows_per_request, "device_profile": dev.name, "nodes": rows}, indent=1))


if __name__ == "__main__":
    main()
