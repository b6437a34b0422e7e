"""A per-operator ``cpu`` profile measured on this machine, and the plan with it against measured steps.

    python bench/cpu_profile.py --checkpoint /tmp/flash-L4-E8 --out cpu-profile.json
    python bench/cpu_profile.py --checkpoint /tmp/flash-L4-E8 --check cpu-profile.json \
        --shapes 1:16384:1 8:16384:1 1:16384:6

A shape is ``batch:context:rows``; ``rows`` 0 is a prefill step of ``batch`` prompts of ``context``
tokens (no history). Otherwise ``batch`` requests started at ``context`` tokens of drawn history
(``Engine.prefill(..., context=N)`` after a one-token prompt), then ``--steps`` decode steps of
``rows`` rows per request (the last token and ``rows - 1`` drafts, all rejected, so every step starts
at the same position; with drafts the step also runs DSpark's nodes, as the plan plans a verify
step), traced, on the ``sync`` executor at TP1. For each node kind the step's node spans are summed
(median over the steps) and matched with what the plan of the same step (``plan.step.run_plan``)
gives those nodes: node count, bytes, FLOPs, decoded weight values. ``--out`` writes them as the
operator points of a profile file based on ``cpu`` (``--device-profile FILE`` loads it;
``dsv41.plan.operators`` fits each kind), with the host's time a step outside the node spans (the
step's time less its node spans, median) as ``host_step_us``; the per-kernel launch, graph
replay and token sync are inside the spans or that host time, so they are 0. ``--check`` measures
the shapes and prints the measured step against the plan's with that profile file.

Times are this process's CPU time by default (``--clock cpu``: each step's node spans scaled by
the step's CPU time over its wall time; on a machine whose cores other jobs share, the wall clock
measures them too), or the wall clock (``--clock wall``).

The default profile shapes (1:4096:1 4:4096:1 2:8192:3 1:8192:1) differ from the validation shapes
above in batch, context and rows, so the check is out of sample.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections import defaultdict

import torch

from dsv41.checkpoint.reader import open_checkpoint
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import Topology
from dsv41.plan.step import run_plan
from dsv41.telemetry.session import TraceSession

DEFAULT_SHAPES = ("1:4096:1", "4:4096:1", "2:8192:3", "1:8192:1")


def shape(text: str) -> tuple[int, int, int]:
    try:
        batch, context, rows = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be batch:context:rows, got {text!r}") from None
    if batch < 1 or context < 1 or not 0 <= rows <= 6:
        raise argparse.ArgumentTypeError(f"batch >= 1, context >= 1, rows in [0, 6] (0: a prefill); got {text!r}")
    return batch, context, rows


def measure(engine, batch: int, context: int, rows: int, steps: int, clock: str = "cpu") -> dict:
    """Medians over the decode steps: the step's µs, its node spans' and the rest (host), and node kind
    -> summed node-span µs; on the wall clock or this process's CPU time (``clock``)."""
    vocab = engine.cfg.vocab_size
    engine.dspark = bool(engine.cfg.dspark and rows > 1)
    if rows == 0:
        return _prefills(engine, batch, context, steps, clock)
    out = engine.prefill([[1] for _ in range(batch)], context=context)
    rids, last = out.request_ids, out.last
    session = TraceSession(engine)
    walls, cpus = [], []
    try:
        for _ in range(steps):
            drafts = [[(t + 1 + j) % vocab for j in range(rows - 1)] for t in last] if rows > 1 else None
            t0, c0 = time.perf_counter(), time.process_time()
            out = engine.decode(last, rids, drafts)
            walls.append((time.perf_counter() - t0) * 1e6)
            cpus.append((time.process_time() - c0) * 1e6)
            last = out.last
        records = session.collect()
    finally:
        session.close()
        for r in rids:
            engine.release(r)
    return _medians(records, "decode", walls, cpus, clock)


def _prefills(engine, batch: int, length: int, steps: int, clock: str) -> dict:
    """``steps`` prefills of ``batch`` prompts of ``length`` tokens, each released after its step."""
    session = TraceSession(engine)
    walls, cpus = [], []
    try:
        for i in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            out = engine.prefill([[(i + j) % engine.cfg.vocab_size] * length for j in range(batch)])
            walls.append((time.perf_counter() - t0) * 1e6)
            cpus.append((time.process_time() - c0) * 1e6)
            for r in out.request_ids:
                engine.release(r)
        records = session.collect()
    finally:
        session.close()
    return _medians(records, "prefill", walls, cpus, clock)


def _medians(records, phase: str, walls: list, cpus: list, clock: str) -> dict:
    by_step: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        a = r["attributes"]
        if a.get("dsv41.span") == "node" and a["dsv41.phase"] == phase:
            by_step[a["dsv41.step"]][a["dsv41.kernel"]] += (r["end_ns"] - r["start_ns"]) / 1e3
    # on CPU time (``cpu``): each step's spans scaled by its CPU time over its wall time, what the
    # step costs this process's one thread whatever else the shared cores run
    scale = [c / w for c, w in zip(cpus, walls)] if clock == "cpu" else [1.0] * len(walls)
    steps_ = [{k: v * f for k, v in by_step[s].items()} for s, f in zip(sorted(by_step), scale)]
    kinds = {k for s in steps_ for k in s}
    spans = {k: statistics.median(s.get(k, 0.0) for s in steps_) for k in sorted(kinds)}
    nodes = [sum(s.values()) for s in steps_]
    totals = cpus if clock == "cpu" else walls
    return {"wall_us": statistics.median(totals), "nodes_us": statistics.median(nodes),
            "host_us": statistics.median(w - n for w, n in zip(totals, nodes)), "kinds_us": spans}


def planned(cfg, capacity, batch: int, context: int, rows: int, device: str = "cpu") -> tuple[dict, dict]:
    """(the plan's report of the step, node kind -> {calls, bytes, flops, values})."""
    cap = dataclasses.replace(capacity, decode_rows_per_request=max(rows, 1), prefill_max_tokens=batch * context,
                              max_batch_per_dp=max(batch, capacity.max_batch_per_dp))
    if rows == 0:       # a prefill of batch prompts of context tokens
        report, step = run_plan(cfg, Topology(1, 1, 1), batch, context, "prefill", device=device, capacity=cap)
    else:
        report, step = run_plan(cfg, Topology(1, 1, 1), batch, context + 2, "decode", device=device, capacity=cap)
    feats: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(("calls", "bytes", "flops", "values"), 0.0))
    for key, c in step.costs.items():
        f = feats[step.plan.graph.nodes[key].kernel]
        f["calls"] += 1
        f["bytes"] += c.bytes_read + c.bytes_written
        f["flops"] += sum(c.flops.values())
        f["values"] += sum(c.decoded.values())
    return report, dict(feats)


def load_line() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a written checkpoint (python -m dsv41.checkpoint.write)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", metavar="FILE.json", help="measure the profile shapes and write the profile file")
    what.add_argument("--check", metavar="FILE.json", help="measure the shapes and compare the plan with this profile")
    p.add_argument("--shapes", type=shape, nargs="+", default=None, metavar="B:N:R")
    p.add_argument("--steps", type=int, default=3, help="decode steps measured per shape (the median is used)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="time steps by this process's CPU time (default: steadier when other jobs share the "
                        "cores) or by the wall clock")
    a = p.parse_args(argv)
    shapes = a.shapes or [shape(s) for s in DEFAULT_SHAPES]
    torch.set_num_threads(1)
    ckpt = open_checkpoint(a.checkpoint)
    cfg = ckpt.cfg
    top = max(b for b, _, _ in shapes)
    ctx = max(n for _, n, _ in shapes) + 2 + a.steps * 6 + 8
    engine = GraphEngine(cfg, Topology(1, 1, 1), EngineConfig(seed=0, executor="sync", max_batch=top, max_context=ctx),
                         checkpoint=ckpt)
    points, hosts, rows_out = defaultdict(list), [], []
    try:
        for batch, context, rows in shapes:
            load = load_line()
            m = measure(engine, batch, context, rows, a.steps, a.clock)
            label = (f"{cfg.name}, batch {batch}, context {context}, {rows} row(s) per request" if rows else
                     f"{cfg.name}, prefill of {batch} prompts of {context} tokens")
            if a.out:
                _, feats = planned(cfg, ckpt.capacity, batch, context, rows)
                hosts.append(m["host_us"])
                src = (f"bench/cpu_profile.py --checkpoint {a.checkpoint}: node spans of {a.steps} decode steps "
                       f"(median, {a.clock} clock), sync executor, TP1, {load}")
                for kind, us in m["kinds_us"].items():
                    if us > 0 and kind in feats:
                        points[kind].append({**feats[kind], "us": us, "shape": label, "source": src})
                print(f"{label}: step {m['wall_us'] / 1e3:.1f} ms, node spans {m['nodes_us'] / 1e3:.1f} ms "
                      f"({load})", flush=True)
            else:
                report, _ = planned(cfg, ckpt.capacity, batch, context, rows, a.check)
                pred = report["predicted_step_us"]
                rows_out.append({"batch": batch, "context": context, "rows": rows, "measured_ms": m["wall_us"] / 1e3,
                                 "predicted_ms": pred / 1e3, "ratio": pred / m["wall_us"], "load": load,
                                 "node_spans_ms": m["nodes_us"] / 1e3})
                print(f"{label}: measured {m['wall_us'] / 1e3:.1f} ms, predicted {pred / 1e3:.1f} ms "
                      f"({pred / m['wall_us'] - 1:+.1%}); {load}", flush=True)
    finally:
        engine.close()
    if a.out:
        host = statistics.median(hosts)
        how = "included in the measured node spans (bench/cpu_profile.py)"
        prof = {"base": "cpu", "name": "cpu-measured",
                "description": f"this machine's operators measured on {cfg.name} by bench/cpu_profile.py",
                "launch_us": 0.0, "graph_launch_us": 0.0, "token_sync_us": 0.0, "host_step_us": host,
                "sources": {"launch_us": how, "graph_launch_us": how, "token_sync_us": "within host_step_us",
                            "host_step_us": "bench/cpu_profile.py: a decode step's wall time less its node spans "
                                            f"(the runtime's own work a step), median over the shapes: "
                                            + ", ".join(f"{h / 1e3:.1f} ms" for h in hosts)},
                "operators": dict(points)}
        with open(a.out, "w") as f:
            json.dump(prof, f, indent=1)
        print(f"wrote {a.out}: {len(points)} node kinds measured, host {host / 1e3:.1f} ms a step")
    else:
        print(json.dumps(rows_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
