"""Scheduler overhead of the graph executors against the monolithic reference, measured in one run.

    python bench/graph_overhead.py --config tiny
    python bench/graph_overhead.py --config small --no-distributed

Reports (median decode-step wall time over --steps steps after a prefill):
- graph/reference for the same step (TP1/DP1/EP1, sync and threads);
- nodes, submissions and dask tasks per decode step for a multi-card layout, with and without
  submissions, and each executor's overhead per extra dask task (node granularity vs submissions;
  distributed node granularity is timed on one step);
- distributed step time over threaded for the same layout, and scheduler messages per distributed
  decode step (counted by the scheduler's own handlers: client requests and stream messages);
- the multi-card sync step over the reference step (same math split over the cards);
- host time building, validating and planning a repeated decode shape (reused graph) over the step,
  and a FLASH decode graph (TP4/DP2/EP8, 32 requests per group) built, validated and planned.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import statistics
import time

import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.cluster.plan import make_plan
from dsv41.config import FLASH, PRESETS, Topology
from dsv41.graph.build import build, head_key
from dsv41.engine.reference import ReferenceEngine
from dsv41.plan.step import step_inputs


def decode_ms(engine, prompts, steps: int) -> tuple[float, dict]:
    """Median decode step; stats of the last step, the median host_ms of steps that reused their graph
    and the scheduler messages of the last step."""
    logits = engine.prefill(prompts).logits
    rids = list(engine.last_request_ids)
    times, host, messages = [], [], []
    runner = getattr(engine, "runner", None)
    if runner is not None:
        runner.client.run_on_scheduler(_count_messages)
    for _ in range(steps):
        toks = torch.argmax(logits, -1).tolist()
        before = runner.client.run_on_scheduler(_messages) if runner is not None else None
        t0 = time.perf_counter()
        logits = engine.decode(toks, rids).logits
        times.append((time.perf_counter() - t0) * 1e3)
        if runner is not None:   # minus the one request that read the counters
            after = runner.client.run_on_scheduler(_messages)
            after["run_function"] -= 1
            messages.append({op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)})
        if getattr(engine, "last_stats", {}).get("graph_reused"):
            host.append(engine.last_stats["host_ms"])
    stats = dict(getattr(engine, "last_stats", {}))
    stats.update(host_ms=statistics.median(host) if host else None,
                 scheduler_messages=messages[-1] if messages else None)
    return statistics.median(times), stats


def _count_messages(dask_scheduler):
    """Count, by op, every request and every client stream message the scheduler handles (wrapping its
    own handler tables; worker heartbeats and worker stream messages are left out)."""
    if getattr(dask_scheduler, "dsv41_ops", None) is not None:
        return
    ops = dask_scheduler.dsv41_ops = {}

    def counted(op, fn, stream):
        def count(kwargs):
            if not stream or "client" in kwargs:
                ops[op] = ops.get(op, 0) + 1

        @functools.wraps(fn)   # distributed reads the handler's signature
        def handler(*args, **kwargs):
            count(kwargs)
            return fn(*args, **kwargs)

        @functools.wraps(fn)   # and awaits coroutine handlers only if they look like one
        async def async_handler(*args, **kwargs):
            count(kwargs)
            return await fn(*args, **kwargs)
        return async_handler if inspect.iscoroutinefunction(fn) else handler
    for op in list(dask_scheduler.handlers):
        if op != "heartbeat_worker":
            dask_scheduler.handlers[op] = counted(op, dask_scheduler.handlers[op], False)
    for op in list(dask_scheduler.stream_handlers):
        dask_scheduler.stream_handlers[op] = counted(op, dask_scheduler.stream_handlers[op], True)


def _messages(dask_scheduler) -> dict:
    return dict(dask_scheduler.dsv41_ops)


def flash_plan_s() -> float:
    """FLASH decode graph, TP4/DP2/EP8, 32 one-row requests per group at 1024 tokens: build+validate+plan."""
    topo = Topology(4, 2, 8)
    steps = {g: step_inputs(FLASH, 32, 1, 1024, "decode") for g in range(topo.dp)}
    t0 = time.perf_counter()
    make_plan(build(FLASH, topo, steps, phase="decode"), topo, outputs=[head_key(g) for g in steps])
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="decode steps; the first builds the decode graph")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--no-distributed", action="store_true")
    a = p.parse_args()
    cfg = PRESETS[a.config]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    ctx = a.prompt_len + a.steps + 2
    out = {"config": cfg.name, "batch": a.batch, "prompt_len": a.prompt_len}

    ref_ms, _ = decode_ms(ReferenceEngine(cfg, max_batch=a.batch, max_context=ctx), prompts, a.steps)
    out["reference_ms"] = ref_ms
    one = Topology(1, 1, 1)
    for ex in ("sync", "threads"):
        ms, stats = decode_ms(GraphEngine(cfg, one, EngineConfig(executor=ex, max_batch=a.batch, max_context=ctx)),
                              prompts, a.steps)
        out[f"graph_{ex}_tp1_ms"] = ms
        out[f"graph_{ex}_tp1_over_reference"] = ms / ref_ms

    topo = Topology(a.tp, a.dp, a.tp * a.dp)
    layout = {}
    executors = ("sync", "threads") + (() if a.no_distributed else ("distributed",))
    for ex in executors:
        per = {}
        for gran in ("submission", "node"):
            eng = GraphEngine(cfg, topo, EngineConfig(executor=ex, granularity=gran, max_batch=a.batch,
                                                      max_context=ctx))
            try:
                per[gran] = decode_ms(eng, prompts, a.steps if gran == "submission" or ex != "distributed" else 1)
            finally:
                eng.close()
        (sub_ms, sub), (node_ms, node) = per["submission"], per["node"]
        layout.update(nodes=sub["nodes"], dask_tasks_submission=sub["dask_tasks"], dask_tasks_node=node["dask_tasks"],
                      tasks_over_nodes=sub["dask_tasks"] / sub["nodes"])
        layout[ex] = {"submission_ms": sub_ms, "node_ms": node_ms,
                      "overhead_us_per_task": (node_ms - sub_ms) * 1e3 / (node["dask_tasks"] - sub["dask_tasks"]),
                      "host_ms_repeated_shape": sub["host_ms"],
                      "host_over_step": None if sub["host_ms"] is None else sub["host_ms"] / sub_ms}
        if sub["scheduler_messages"] is not None:
            layout[ex]["scheduler_messages_last_step"] = sub["scheduler_messages"]
    layout["sync_over_reference"] = layout["sync"]["submission_ms"] / ref_ms
    if "distributed" in layout:
        layout["distributed_over_threads"] = layout["distributed"]["submission_ms"] / layout["threads"]["submission_ms"]
    out[f"tp{topo.tp}dp{topo.dp}ep{topo.ep}"] = layout
    out["flash_tp4dp2ep8_decode_plan_s"] = flash_plan_s()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
