"""A planned step (``dsv41.plan.step``) drawn as spans, as if it had just run: one span per
submission and per node at the plan's simulated times, so the Perfetto view of a plan and of a traced
run read the same way."""
from __future__ import annotations

import time

from dsv41.plan.simulate import PlanPricer, SimulatedEngine
from dsv41.telemetry.session import resource_attributes
from dsv41.telemetry.spans import SpanRecorder
from dsv41.telemetry.buffer import node_attributes


def record_planned(planned, cfg, topo) -> tuple[list[dict], dict]:
    """(span records, resource attributes). Nodes on the critical path carry ``dsv41.critical_path``
    (search for it in Perfetto); each node carries its latency parts (``dsv41.latency.*``)."""
    plan, lat = planned.plan, planned.latency
    recorder = SpanRecorder(resource_attributes(cfg, topo, "plan", planned.device.name))
    times, critical = lat.times, set(lat.path)
    base, phase = time.time_ns(), plan.graph.phase

    def ns(us: float) -> int:
        return base + int(us * 1e3)

    step = recorder.start(f"{phase} step (simulated)", start_ns=base, attrs={
        "dsv41.span": "step", "dsv41.phase": phase, "dsv41.step": 1, "dsv41.simulated": True,
        "dsv41.nodes": len(plan.graph.nodes), "dsv41.submissions": len(plan.submissions)})
    for sub in plan.submissions.values():
        start, end = min(times[n.key][0] for n in sub.nodes), max(times[n.key][1] for n in sub.nodes)
        span = recorder.start(sub.key, step, ns(start), {
            "dsv41.span": "submission", "dsv41.submission": sub.key, "dsv41.node": sub.nodes[0].key,
            "dsv41.kernel": sub.nodes[0].kernel, "dsv41.card": sub.card, "dsv41.phase": phase, "dsv41.step": 1,
            "dsv41.nodes": len(sub.nodes), "dsv41.simulated": True})
        for n in sub.nodes:
            p = lat.parts[n.key]
            attrs = node_attributes(n, sub, planned.costs[n.key], planned.device, *planned.live_at[n.key], p.total)
            attrs.update({"dsv41.device.source": "latency", "dsv41.critical_path": n.key in critical,
                          "dsv41.latency.launch_us": p.launch, "dsv41.latency.collectives_us": p.collectives,
                          "dsv41.latency.body_us": p.body, "dsv41.latency.bound": p.bound})
            recorder.end(recorder.start(n.key, span, ns(times[n.key][0]), attrs), end_ns=ns(times[n.key][1]))
        recorder.end(span, end_ns=ns(end))
    recorder.end(step, end_ns=ns(lat.step_us))
    return recorder.drain(), recorder.resource


def record_simulated(engine: SimulatedEngine, price: PlanPricer, resource: dict) -> list[dict]:
    """The simulated run as the spans a traced run writes: one step span per step at its simulated
    time (phase, requests, rows) and under it one span per node kind, each as long as its share of the
    step on the critical path of the planned step nearest in rows (``PlanPricer``), with that plan's
    HBM of card 0 (``dsv41.hbm.live_bytes``: weights and caches, ``peak_bytes``: with its transient
    peak). Times start at the recording's wall clock."""
    recorder = SpanRecorder(resource)
    base = time.time_ns()
    for n, st in enumerate(engine.steps, 1):
        kind = "decode" if st.phase == "decode" else "prefill"
        report = price.nearest(kind, sum(st.rows))
        start = base + int(st.start_us * 1e3)
        span = recorder.start(f"{st.phase} step (simulated)", start_ns=start, attrs={
            "dsv41.span": "step", "dsv41.phase": st.phase, "dsv41.step": n, "dsv41.simulated": True,
            "dsv41.requests": len(st.ids), "dsv41.rows": sum(st.rows)})
        path = report["critical_path_us_by_kernel"]
        total, t = sum(path.values()) or 1.0, start
        card = report["cards"][0]
        for kernel, us in path.items():
            dur = int(us / total * st.us * 1e3)
            recorder.end(recorder.start(kernel, span, t, {
                "dsv41.span": "node", "dsv41.kernel": kernel, "dsv41.card": card["card"], "dsv41.phase": st.phase,
                "dsv41.step": n, "dsv41.simulated": True, "dsv41.device.sim_us": us / total * st.us,
                "dsv41.device.source": "simulated", "dsv41.device.profile": price.device,
                "dsv41.hbm.live_bytes": card["weights_bytes"] + card["cache_bytes"],
                "dsv41.hbm.peak_bytes": card["total_bytes"]}), end_ns=t + dur)
            t += dur
        recorder.end(span, end_ns=start + int(st.us * 1e3))
    return recorder.drain()
