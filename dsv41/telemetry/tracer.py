"""An engine's ``hooks.tracer`` (see ``cluster/registry.py``): a span per submission, a child span per node, an HBM ledger per card.

A node span covers the kernel call alone; its bytes, FLOPs and roofline time come from the kernel's
signature, evaluated on the node's real inputs. While a step runs the tracer only notes events in
its card's list (``telemetry.buffer``); ``encode`` turns them into spans, after the step.
"""
from __future__ import annotations

import threading
from time import perf_counter_ns

from dsv41.plan.hbm import CardLedger, SubmissionTrace
from dsv41.plan.sizing import caches_by_kind, card_weights, weights_by_kind
from dsv41.telemetry.buffer import BEGIN, END, FAILED, NODE, Open, encode_card

_UNTRACKED = SubmissionTrace({}, frozenset(), None)


class NodeTracer:
    def __init__(self, recorder, device):
        self.recorder, self.device = recorder, device
        self.ledgers: dict[int, CardLedger] = {}
        self.weights: dict[int, dict] = {}          # card -> runtime weight key -> bytes held
        self.events: dict[int, list] = {}           # card -> events not yet encoded, in the order they happened
        self._current = threading.local()
        recorder.observe_hbm(self.hbm_bytes)

    def hbm_bytes(self) -> dict[int, tuple[int, int]]:
        """Card -> (live, peak) bytes as of the last encoded step (read without a lock: a gauge tolerates lag)."""
        return {c: (led.live_bytes, led.peak_bytes) for c, led in list(self.ledgers.items())}

    def ledger(self, st) -> CardLedger:
        card = st.card
        if card not in self.ledgers:
            self.weights[card] = card_weights(st.cfg, st.topo, card)
            weights = sum(weights_by_kind(st.cfg, st.topo, card).values())
            self.ledgers.setdefault(card, CardLedger(weights, sum(caches_by_kind(st.caches.committed).values())))
        return self.ledgers[card]

    # ---- the hot path: a tuple per event, nothing else --------------------------------------------

    def begin_submission(self, sub, st):
        if sub.card not in self.ledgers:
            self.ledger(st)     # sized once per card, from the caches as the run found them
        events = self.events.get(sub.card)
        if events is None:
            events = self.events.setdefault(sub.card, [])
        cur = self._current.open = Open(sub, sub.trace or _UNTRACKED, events)
        events.append((BEGIN, cur, perf_counter_ns()))

    def run(self, st, node, kernel_fn, args, sim_us: float | None = None):
        cur = self._current.open
        t0 = perf_counter_ns()
        try:
            value = kernel_fn(st, node, *args)
        except Exception as e:
            t1 = perf_counter_ns()
            cur.error = f"{node.key}: {e}"
            cur.events.append((FAILED, cur, node, t0, t1, str(e)))
            raise
        t1 = perf_counter_ns()     # the stamps bracket the kernel alone; the note below falls outside
        cur.ran += 1
        cur.events.append((NODE, cur, node, st, args, value, t0, t1, sim_us))
        return value

    def end_submission(self, sub):
        cur = self._current.open
        cur.events.append((END, cur, perf_counter_ns()))
        self._current.open = None

    # ---- off the hot path ----------------------------------------------------------------------------

    def encode(self) -> None:
        """Spans of every event noted so far, to the recorder; call it while no submission runs."""
        events, self.events = self.events, {}
        for card, evs in events.items():
            self.recorder.add(encode_card(evs, self.ledgers[card], self.weights[card], self.device))
