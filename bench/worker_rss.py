"""Process RSS of each distributed worker against the bytes its card's State holds.

    python bench/worker_rss.py                      # SMALL, TP2/DP1, after a prefill and a decode step
    python bench/worker_rss.py --config tiny --tp 2 --dp 2

Each worker holds one card's weight shard in checkpoint formats plus its caches; the rest of its
RSS is the Python/Torch runtime and the step's transient tensors. Prints one JSON object: per card
the worker's RSS, the State's weights_bytes + cache_bytes, and RSS / (weights + caches); the
runtime's own RSS is shown by idle workers with the project imported (``idle_worker_rss``) for scale.
"""
from __future__ import annotations

import argparse
import json
import os

import psutil
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import PRESETS, Topology


def _rss() -> dict:
    return {"pid": os.getpid(), "rss": psutil.Process().memory_info().rss}


def _idle_worker_rss(n: int) -> list[int]:
    """RSS of the workers of a LocalCluster like the engine's, with the project imported, no State."""
    from distributed import Client, LocalCluster
    with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=40) as cluster, Client(cluster) as client:
        client.run(lambda: __import__("dsv41.cluster.engine"))
        return sorted(r["rss"] for r in client.run(_rss).values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="small", choices=sorted(PRESETS))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    args = p.parse_args()
    cfg = PRESETS[args.config]
    topo = Topology(args.tp, args.dp, args.tp * args.dp).check(cfg)
    engine = GraphEngine(cfg, topo, EngineConfig(executor="distributed", max_batch=args.batch,
                                                 max_context=args.prompt_len + 2))
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.batch)]
        logits = engine.prefill(prompts).logits
        engine.decode(torch.argmax(logits, -1).tolist(), list(engine.last_request_ids))
        rss = engine.runner.run_on_cards(_rss)
        card_of = {addr: card for card, addr in engine.runner.address_of.items()}
    finally:
        engine.close()
    idle = _idle_worker_rss(topo.ep)
    by_card = {c["card"]: c for c in engine.cards}
    rows = []
    for card, r in sorted((card_of[addr], r) for addr, r in rss.items()):
        held = by_card[card]["weights_bytes"] + by_card[card]["cache_bytes"]
        rows.append({"card": card, "pid": r["pid"], "rss_bytes": r["rss"], **by_card[card],
                     "rss_over_held": round(r["rss"] / held, 3),
                     "above_idle_over_held": round((r["rss"] - max(idle)) / held, 3)})
    print(json.dumps({"config": cfg.name, "topology": {"tp": topo.tp, "dp": topo.dp, "ep": topo.ep},
                      "idle_worker_rss": idle, "workers": rows}, indent=1))


if __name__ == "__main__":
    main()
