"""A planned step (``dsv41.plan.step``) drawn as spans, as if it had just run: one span per
submission and per node at the plan's simulated times, so the Perfetto view of a plan and of a traced
run read the same way."""
from __future__ import annotations

import time

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
