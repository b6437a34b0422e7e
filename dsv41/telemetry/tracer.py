"""An engine's ``hooks.tracer`` (see ``cluster/registry.py``): a span per submission, a child span per node, an HBM ledger per card.

A node span covers the kernel call alone; its bytes, FLOPs and roofline time come from the kernel's
signature, evaluated on the node's real inputs after the call.
"""
from __future__ import annotations

import threading
import time

from dsv41.kernels.cost import nbytes
from dsv41.kernels.kinds import KINDS
from dsv41.plan.hbm import CardLedger, SubmissionTrace
from dsv41.plan.roofline import node_us
from dsv41.plan.sizing import caches_by_kind, card_weights, node_cost, weights_by_kind

_UNTRACKED = SubmissionTrace({}, frozenset(), None)
_SUMMED = ("dsv41.bytes_read", "dsv41.bytes_written", "dsv41.flops", "dsv41.device.sim_us")


def node_attributes(node, sub, cost, device, live: int, peak: int, sim_us: float | None = None) -> dict:
    """sim_us: the pypto cost model's time when the backend gives one, else the roofline estimate."""
    return {
        "dsv41.span": "node", "dsv41.node": node.key, "dsv41.kernel": node.kernel,
        "dsv41.layer": -1 if node.layer is None else node.layer, "dsv41.card": node.card,
        "dsv41.phase": sub.phase, "dsv41.step": sub.step, "dsv41.submission": sub.key,
        "dsv41.bytes_read": cost.bytes_read, "dsv41.bytes_written": cost.bytes_written,
        "dsv41.output_bytes": cost.output_bytes, "dsv41.link_bytes": cost.link, "dsv41.flops": cost.total_flops,
        "dsv41.hbm.live_bytes": live, "dsv41.hbm.peak_bytes": peak,
        "dsv41.device.sim_us": node_us(cost, device) if sim_us is None else sim_us,
        "dsv41.device.source": "roofline" if sim_us is None else "pypto",
        "dsv41.device.profile": device.name,
    }


class _Open:
    """The submission a thread is running, and its totals so far."""

    def __init__(self, sub, span):
        self.sub, self.span, self.error, self.ran = sub, span, None, 0
        self.info = sub.trace or _UNTRACKED
        self.totals = dict.fromkeys(_SUMMED, 0)     # over the submission's nodes


class NodeTracer:
    def __init__(self, recorder, device):
        self.recorder, self.device = recorder, device
        self.ledgers: dict[int, CardLedger] = {}
        self.weights: dict[int, dict] = {}          # card -> runtime weight key -> bytes held
        self._current = threading.local()
        recorder.observe_hbm(self.hbm_bytes)

    def hbm_bytes(self) -> dict[int, tuple[int, int]]:
        """Card -> (live, peak) bytes now (read without the lock: a gauge tolerates a node's lag)."""
        return {c: (led.live_bytes, led.peak_bytes) for c, led in list(self.ledgers.items())}

    def ledger(self, st) -> CardLedger:
        card = st.card
        if card not in self.ledgers:
            self.weights[card] = card_weights(st.cfg, st.topo, card)
            weights = sum(weights_by_kind(st.cfg, st.topo, card).values())
            self.ledgers.setdefault(card, CardLedger(weights, sum(caches_by_kind(st.caches.committed).values())))
        return self.ledgers[card]

    def begin_submission(self, sub, st):
        info = sub.trace or _UNTRACKED
        span = self.recorder.start(sub.key, parent=info.parent, attrs={
            "dsv41.span": "submission", "dsv41.submission": sub.key, "dsv41.node": sub.nodes[0].key,
            "dsv41.kernel": sub.nodes[0].kernel, "dsv41.card": sub.card, "dsv41.phase": sub.phase,
            "dsv41.step": sub.step, "dsv41.nodes": len(sub.nodes)})
        led = self.ledger(st)
        with led.lock:
            led.begin(sub.step)
        self._current.open = _Open(sub, span)

    def run(self, st, node, kernel_fn, args, sim_us: float | None = None):
        cur = self._current.open
        t0 = time.time_ns()
        try:
            value = kernel_fn(st, node, *args)
        except Exception as e:
            cur.error = f"{node.key}: {e}"
            failed = {"dsv41.span": "failed", "dsv41.node": node.key, "dsv41.kernel": node.kernel, "dsv41.card": node.card}
            self.recorder.end(self.recorder.start(node.key, cur.span, t0, failed), error=str(e))
            raise
        t1 = time.time_ns()
        cur.ran += 1
        led = self.ledger(st)
        cost = node_cost(self.weights[node.card], KINDS[node.kernel].cost(st, node, *args), args, nbytes(value))
        with led.lock:
            led.produce(node.key, cost.output_bytes, cur.info.uses.get(node.key, 0), node.key in cur.info.remote)
            for i in node.inputs:
                led.consume(i)
            live, peak = led.live_bytes, led.peak_bytes
        attrs = node_attributes(node, cur.sub, cost, self.device, live, peak, sim_us)
        for k in cur.totals:
            cur.totals[k] += attrs[k]
        self.recorder.end(self.recorder.start(node.key, cur.span, t0, attrs), end_ns=t1)
        return value

    def end_submission(self, sub):
        cur = self._current.open
        led = self.ledgers[sub.card]
        with led.lock:
            for k in cur.info.remote:
                led.sent(k)
            live, peak = led.live_bytes, led.peak_bytes
        attrs = {**cur.totals, "dsv41.hbm.live_bytes": live, "dsv41.hbm.peak_bytes": peak}
        if cur.error is None and cur.ran < len(sub.nodes):
            cur.error = f"stopped after {cur.ran} of {len(sub.nodes)} nodes"
        self.recorder.end(cur.span, attrs=attrs, error=cur.error)
        self._current.open = None
