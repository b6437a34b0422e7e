"""Tracing one GraphEngine: the recorder in this process or on every dask worker, a span per step.

Each step is one trace: a root span on the engine, its submissions as children (recorded where they
run) and their nodes as grandchildren. Under ``distributed`` every worker keeps its own recorder and
ledger; ``collect`` gathers their finished spans with ``client.run``.
"""
from __future__ import annotations

from contextlib import contextmanager

from dsv41.cluster import registry
from dsv41.plan.hbm import annotate
from dsv41.plan.roofline import profile
from dsv41.telemetry.spans import SpanRecorder
from dsv41.telemetry.tracer import NodeTracer

DEFAULT_PROFILE = "a5"


def resource_attributes(cfg, topo, executor: str, device: str) -> dict:
    return {"service.name": "dsv41", "dsv41.config": cfg.name,
            "dsv41.topology": f"tp{topo.tp}-dp{topo.dp}-ep{topo.ep}", "dsv41.tp": topo.tp, "dsv41.dp": topo.dp,
            "dsv41.ep": topo.ep, "dsv41.executor": executor, "dsv41.device_profile": device}


class TraceSession:
    """keep: hold every span for ``collect`` (files); spans also go live to an OTLP collector when the
    OTEL_* variables name one (``spans.otlp_configured``), in this process and on every worker."""

    def __init__(self, engine, device: str = DEFAULT_PROFILE, keep: bool = True):
        self.engine, self.device, self.keep = engine, profile(device), keep
        self.resource = resource_attributes(engine.cfg, engine.topo, engine.executor, device)
        self.recorder = SpanRecorder(self.resource, keep)
        self.records: list[dict] = []
        if engine.runner is None:
            registry.owned(engine.id).hooks.tracer = NodeTracer(self.recorder, self.device)
        else:
            engine.runner.run_on_cards(_install, engine.id, self.resource, device, keep)
        engine.trace = self

    @contextmanager
    def step(self, plan):
        step, phase = next(iter(plan.submissions.values())).step, plan.graph.phase
        span = self.recorder.start(f"{phase} step {step}", attrs={
            "dsv41.span": "step", "dsv41.phase": phase, "dsv41.step": step,
            "dsv41.nodes": len(plan.graph.nodes), "dsv41.submissions": len(plan.submissions)})
        annotate(plan, self.recorder.ids(span))
        error = None
        try:
            yield
        except BaseException as e:
            error = repr(e)
            raise
        finally:
            self.recorder.end(span, error=error)

    def attach(self, cards):
        """A tracer on the workers that now serve these cards (after a recovery replaced them)."""
        if self.engine.runner is not None:
            self.engine.runner.run_on_cards(_install, self.engine.id, self.resource, self.device.name, self.keep,
                                            cards=cards)

    def collect(self) -> list[dict]:
        """Every span recorded so far (here and on the workers), by start time."""
        self.records += self.recorder.drain()
        if self.engine.runner is not None:
            for recs in self.engine.runner.run_on_cards(_drain, self.engine.id).values():
                self.records += recs
        self.records.sort(key=lambda r: (r["start_ns"], r["end_ns"]))
        return self.records

    def hbm(self) -> list[dict]:
        """Per card: weights, caches, transient peak and total peak bytes seen so far."""
        if self.engine.runner is None:
            rows = _ledger_rows(self.engine.id)
        else:
            rows = [r for rs in self.engine.runner.run_on_cards(_ledger_rows, self.engine.id).values() for r in rs]
        return sorted(rows, key=lambda r: r["card"])

    def close(self):
        """Stop tracing and flush what is queued for a collector."""
        if self.engine.runner is None:
            _uninstall(self.engine.id)
        else:
            self.engine.runner.run_on_cards(_uninstall, self.engine.id)
        self.recorder.shutdown()
        self.engine.trace = None


def _ledger_row(card: int, led) -> dict:
    return {"card": card, "weights_bytes": led.weights, "cache_bytes": led.caches,
            "transient_peak_bytes": led.peak_transient, "peak_bytes": led.peak_bytes}


def _install(engine: str, resource: dict, device: str, keep: bool):
    registry.owned(engine).hooks.tracer = NodeTracer(SpanRecorder(resource, keep), profile(device))


def _tracer(engine: str):
    """The engine's tracer here, if any (a worker that replaced a lost one starts without spans)."""
    entry = registry.find(engine)
    return None if entry is None else entry.hooks.tracer


def _drain(engine: str) -> list[dict]:
    tracer = _tracer(engine)
    return [] if tracer is None else tracer.recorder.drain()


def _ledger_rows(engine: str) -> list[dict]:
    tracer = _tracer(engine)
    return [] if tracer is None else [_ledger_row(c, led) for c, led in tracer.ledgers.items()]


def _uninstall(engine: str):
    entry = registry.find(engine)
    if entry is not None and entry.hooks.tracer is not None:
        entry.hooks.tracer.recorder.shutdown()
        entry.hooks.tracer = None
