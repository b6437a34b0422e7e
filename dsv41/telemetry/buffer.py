"""Node and submission events kept as plain tuples while a step runs, and turned into span records
after it.

Building an OpenTelemetry span and evaluating a node's signature (its bytes and FLOPs) each cost
more than many of the kernels they describe, so on the hot path a traced node only appends a tuple
to its card's list: ``perf_counter_ns`` stamps taken around the kernel, the node, its inputs and its
value. ``encode_card`` replays one card's list in the order it was recorded: the signature on the
kept inputs, the card's HBM ledger, the node's attributes, fresh span ids under the step span, and
one record per span in ``spans``' record format. The session encodes before the next step starts
and on collect, hbm and close, so a traced step keeps its nodes' inputs and values alive until then.
"""
from __future__ import annotations

import random
import time

from dsv41.graph.build import TARGET
from dsv41.kernels.cost import nbytes
from dsv41.kernels.kinds import KINDS
from dsv41.plan.roofline import node_us
from dsv41.plan.sizing import node_cost

BEGIN, NODE, FAILED, END = range(4)
_SUMMED = ("dsv41.bytes_read", "dsv41.bytes_written", "dsv41.flops", "dsv41.device.sim_us")   # node -> submission

# perf_counter_ns -> unix ns, read once per process: every span this process records shares one
# clock, so a child span never starts before its parent through a second reading's jitter.
_UNIX_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def unix_ns(perf_ns: int) -> int:
    return perf_ns + _UNIX_OFFSET_NS


def node_attributes(node, sub, cost, device, live: int, peak: int, sim_us: float | None = None) -> dict:
    """sim_us: the pypto cost model's time when the backend gives one, else the roofline estimate."""
    return {
        "dsv41.span": "node", "dsv41.node": node.key, "dsv41.kernel": node.kernel,
        "dsv41.part": node.attrs.get("part", TARGET),
        "dsv41.layer": -1 if node.layer is None else node.layer, "dsv41.card": node.card,
        "dsv41.phase": sub.phase, "dsv41.step": sub.step, "dsv41.submission": sub.key,
        "dsv41.bytes_read": cost.bytes_read, "dsv41.bytes_written": cost.bytes_written,
        "dsv41.output_bytes": cost.output_bytes, "dsv41.link_bytes": cost.link, "dsv41.flops": cost.total_flops,
        "dsv41.hbm.live_bytes": live, "dsv41.hbm.peak_bytes": peak,
        "dsv41.device.sim_us": node_us(cost, device) if sim_us is None else sim_us,
        "dsv41.device.source": "roofline" if sim_us is None else "pypto",
        "dsv41.device.profile": device.name,
    }


def new_id(bits: int) -> int:
    """A random nonzero id, as the SDK's RandomIdGenerator makes them (0 is the invalid id)."""
    while True:
        v = random.getrandbits(bits)
        if v:
            return v


class Open:
    """A submission as its card ran it: what the hot path notes about it, then its span's ids."""
    __slots__ = ("sub", "key", "phase", "step", "info", "events", "ran", "error", "trace_id", "span_id", "totals")

    def __init__(self, sub, info, events: list):
        # key, phase and step are read now: a reused plan's next step restamps its submissions
        self.sub, self.key, self.phase, self.step, self.info = sub, sub.key, sub.phase, sub.step, info
        self.events, self.ran, self.error = events, 0, None


def _span(name, trace_id, span_id, parent_id, start, end, attrs, error=None) -> dict:
    return {"name": name, "trace_id": trace_id, "span_id": span_id, "parent_id": parent_id,
            "start_ns": unix_ns(start), "end_ns": unix_ns(end), "attributes": attrs, "error": error}


def encode_card(events: list, led, weights_held: dict, device) -> list[dict]:
    """Span records of one card's events, with the card's ledger ``led`` advanced through them."""
    out, starts = [], {}
    for ev in events:
        kind, cur = ev[0], ev[1]
        if kind == BEGIN:
            parent = cur.info.parent
            cur.trace_id = parent[0] if parent is not None else new_id(128)
            cur.span_id, cur.totals = new_id(64), dict.fromkeys(_SUMMED, 0)
            starts[cur] = ev[2]
            led.begin(cur.step)
        elif kind == NODE:
            _, _, node, st, args, value, t0, t1, sim_us = ev
            cost = node_cost(weights_held, KINDS[node.kernel].cost(st, node, *args), args, nbytes(value))
            led.produce(node.key, cost.output_bytes, cur.info.uses.get(node.key, 0), node.key in cur.info.remote)
            for i in node.inputs:
                led.consume(i)
            attrs = node_attributes(node, cur, cost, device, led.live_bytes, led.peak_bytes, sim_us)
            for k in cur.totals:
                cur.totals[k] += attrs[k]
            out.append(_span(node.key, cur.trace_id, new_id(64), cur.span_id, t0, t1, attrs))
        elif kind == FAILED:
            _, _, node, t0, t1, error = ev
            attrs = {"dsv41.span": "failed", "dsv41.node": node.key, "dsv41.kernel": node.kernel,
                     "dsv41.card": node.card}
            out.append(_span(node.key, cur.trace_id, new_id(64), cur.span_id, t0, t1, attrs, error))
        else:
            sub = cur.sub
            for k in cur.info.remote:
                led.sent(k)
            attrs = {"dsv41.span": "submission", "dsv41.submission": cur.key, "dsv41.node": sub.nodes[0].key,
                     "dsv41.kernel": sub.nodes[0].kernel, "dsv41.card": sub.card, "dsv41.phase": cur.phase,
                     "dsv41.step": cur.step, "dsv41.nodes": len(sub.nodes),
                     **cur.totals, "dsv41.hbm.live_bytes": led.live_bytes, "dsv41.hbm.peak_bytes": led.peak_bytes}
            if cur.error is None and cur.ran < len(sub.nodes):
                cur.error = f"stopped after {cur.ran} of {len(sub.nodes)} nodes"
            out.append(_span(cur.key, cur.trace_id, cur.span_id, cur.info.parent and cur.info.parent[1],
                             starts.pop(cur), ev[2], attrs, cur.error))
    return out
