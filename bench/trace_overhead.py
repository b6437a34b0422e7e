"""Cost of tracing a decode step, measured in one run.

    python bench/trace_overhead.py                  # TINY, TP2/DP1/EP2, sync executor
    python bench/trace_overhead.py --config small --steps 6
    python bench/trace_overhead.py --otlp           # spans live over OTLP/HTTP to a local receiver, no file

Decode steps alternate tracing off and on over one engine (so both see the same context lengths
and machine load) and the medians are compared, of wall time and of the process's CPU time (the steadier figure when
other work shares the machine). A traced step only notes its events; turning them
into spans (signatures, HBM ledger, span records, the live export's hand-off) happens after it, in
``session.collect()`` here (in a run: before the next step starts), and is reported apart as
``encode_ms_per_step``. Tracing off leaves only two ``is None`` checks per
node and per submission on the hot path; their cost is timed separately and reported as a share of
an untraced step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import timeit
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.cluster.registry import Hooks
from dsv41.config import PRESETS, Topology
from dsv41.plan.roofline import profile
from dsv41.telemetry.session import TraceSession
from dsv41.telemetry.tracer import NodeTracer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--executor", default="sync", choices=("sync", "threads"))
    p.add_argument("--steps", type=int, default=8, help="decode steps per setting")
    p.add_argument("--otlp", action="store_true",
                   help="traced steps export live to a local OTLP/HTTP receiver instead of keeping spans for files")
    a = p.parse_args()
    if a.otlp:
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = _discarding_receiver() + "/v1/traces"
    cfg, topo = PRESETS[a.config], Topology(a.tp, a.dp, a.tp * a.dp)
    prompt = 8
    engine = GraphEngine(cfg, topo, EngineConfig(seed=0, executor=a.executor, max_batch=2 * a.dp,
                                                 max_context=prompt + 2 * a.steps + 2))
    logits = engine.prefill(torch.randint(0, cfg.vocab_size, (2 * a.dp, prompt)).tolist()).logits
    rids = list(engine.last_request_ids)
    ms = {"off": [], "on": [], "encode": []}
    cpu = {"off": [], "on": []}     # process CPU time: steadier than wall time on a shared machine
    for i in range(2 * a.steps):
        mode = "on" if i % 2 else "off"
        session = TraceSession(engine, keep=not a.otlp) if mode == "on" else None
        t0, c0 = time.perf_counter(), time.process_time()
        logits = engine.decode(torch.argmax(logits, -1).tolist(), rids).logits
        ms[mode].append((time.perf_counter() - t0) * 1e3)
        cpu[mode].append((time.process_time() - c0) * 1e3)
        if session is not None:
            t0 = time.perf_counter()
            session.collect()
            ms["encode"].append((time.perf_counter() - t0) * 1e3)
            session.close()
    nodes, subs = engine.last_stats["nodes"], engine.last_stats["submissions"]
    check_ns = timeit.timeit("hooks.tracer is not None", globals={"hooks": Hooks()}, number=200_000) / 200_000 * 1e9
    off_path_us = (2 * nodes + 2 * subs) * check_ns / 1e3
    off, on = statistics.median(ms["off"]), statistics.median(ms["on"])
    cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    print(json.dumps({
        "config": cfg.name, "topology": f"tp{topo.tp}-dp{topo.dp}-ep{topo.ep}", "executor": a.executor,
        "tracing": "live OTLP/HTTP" if a.otlp else "kept for files",
        "nodes": nodes, "submissions": subs, "steps_each": a.steps,
        "step_ms_tracing_off": round(off, 2), "step_ms_tracing_on": round(on, 2), "on_over_off": round(on / off, 3),
        "tracing_us_per_node": round((on - off) * 1e3 / nodes, 1),
        "step_cpu_ms_tracing_off": round(cpu_off, 2), "step_cpu_ms_tracing_on": round(cpu_on, 2),
        "cpu_on_over_off": round(cpu_on / cpu_off, 3),
        "tracing_cpu_us_per_node": round((cpu_on - cpu_off) * 1e3 / nodes, 1),
        "encode_ms_per_step": round(statistics.median(ms["encode"]), 2),
        "hot_path_us_per_node": round(hot_path_us(engine, nodes / subs), 2),
        "off_path_checks_us_per_step": round(off_path_us, 2),
        "off_path_share_of_step": f"{off_path_us / (off * 1e3):.2e}",
    }, indent=1))


def hot_path_us(engine, nodes_per_sub: float) -> float:
    """What the tracer adds around a kernel call during a step, alone: begin, a no-op kernel per node
    of the last step's card 0, end (submissions of the step's mean size), against the bare calls; the
    best of 7 repeats, so other load on the machine weighs least."""
    class _Quiet:
        def observe_hbm(self, read): pass

    tracer, st = NodeTracer(_Quiet(), profile("a5")), engine.states()[0]
    nodes = [n for n in engine.last_graph.nodes.values() if n.card == 0]
    per_sub = max(1, round(nodes_per_sub))
    subs = [(SimpleNamespace(key=ns[0].key, phase="decode", step=0, card=0, trace=None, nodes=ns), ns)
            for ns in (nodes[i:i + per_sub] for i in range(0, len(nodes), per_sub))]
    tracer.ledger(st)

    def noop(st, node, *args):
        return None

    def traced():
        for sub, ns in subs:
            tracer.begin_submission(sub, st)
            for n in ns:
                tracer.run(st, n, noop, ())
            tracer.end_submission(sub)
        tracer.events.clear()

    def bare():
        for _, ns in subs:
            for n in ns:
                noop(st, n)

    best = [min(timeit.repeat(f, number=20, repeat=7)) for f in (traced, bare)]
    return (best[0] - best[1]) / 20 / len(nodes) * 1e6


class _Discard(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_):
        pass


def _discarding_receiver() -> str:
    """An OTLP/HTTP endpoint on 127.0.0.1 that accepts and drops everything (a collector's cheapest case)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


if __name__ == "__main__":
    main()
