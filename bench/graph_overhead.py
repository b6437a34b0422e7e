"""Scheduler overhead of the graph executors against the monolithic reference, measured in one run.

    python bench/graph_overhead.py --config tiny
    python bench/graph_overhead.py --config small --no-distributed

Reports (median decode-step wall time over --steps steps after a prefill):
- graph/reference for the same step (TP1/DP1/EP1, sync and threads);
- nodes, submissions and dask tasks per decode step for a multi-card layout, with and without
  submissions, and each executor's overhead per extra dask task (node granularity vs submissions;
  distributed node granularity is timed on one step);
- distributed step time over threaded for the same layout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.config import PRESETS, Topology
from dsv41.ops.reference import ReferenceModel


def decode_ms(engine, prompts, steps: int) -> tuple[float, dict]:
    logits = engine.prefill(prompts)
    rids = list(engine.last_request_ids)
    times = []
    for _ in range(steps):
        toks = torch.argmax(logits, -1).tolist()
        t0 = time.perf_counter()
        logits = engine.decode(toks, rids)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), dict(getattr(engine, "last_stats", {}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--no-distributed", action="store_true")
    a = p.parse_args()
    cfg = PRESETS[a.config]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    ctx = a.prompt_len + a.steps + 2
    out = {"config": cfg.name, "batch": a.batch, "prompt_len": a.prompt_len}

    ref_ms, _ = decode_ms(ReferenceModel(cfg, max_batch=a.batch, max_context=ctx), prompts, a.steps)
    out["reference_ms"] = ref_ms
    one = Topology(1, 1, 1)
    for ex in ("sync", "threads"):
        ms, stats = decode_ms(GraphEngine(cfg, one, executor=ex, max_batch=a.batch, max_context=ctx), prompts, a.steps)
        out[f"graph_{ex}_tp1_ms"] = ms
        out[f"graph_{ex}_tp1_over_reference"] = ms / ref_ms

    topo = Topology(a.tp, a.dp, a.tp * a.dp)
    layout = {}
    executors = ("sync", "threads") + (() if a.no_distributed else ("distributed",))
    for ex in executors:
        per = {}
        for gran in ("submission", "node"):
            eng = GraphEngine(cfg, topo, executor=ex, granularity=gran, max_batch=a.batch, max_context=ctx)
            try:
                per[gran] = decode_ms(eng, prompts, a.steps if gran == "submission" or ex != "distributed" else 1)
            finally:
                eng.close()
        (sub_ms, sub), (node_ms, node) = per["submission"], per["node"]
        layout.update(nodes=sub["nodes"], dask_tasks_submission=sub["dask_tasks"], dask_tasks_node=node["dask_tasks"],
                      tasks_over_nodes=sub["dask_tasks"] / sub["nodes"])
        layout[ex] = {"submission_ms": sub_ms, "node_ms": node_ms,
                      "overhead_us_per_task": (node_ms - sub_ms) * 1e3 / (node["dask_tasks"] - sub["dask_tasks"])}
    if "distributed" in layout:
        layout["distributed_over_threads"] = layout["distributed"]["submission_ms"] / layout["threads"]["submission_ms"]
    out[f"tp{topo.tp}dp{topo.dp}ep{topo.ep}"] = layout
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
