"""Tracing one GraphEngine: the recorder in this process or on every dask worker, a span per step.

Each step is one trace: a root span on the engine, its submissions as children (recorded where they
run) and their nodes as grandchildren. Under ``distributed`` every worker keeps its own recorder and
ledger; ``collect`` gathers their finished spans with ``client.run``.
"""
from __future__ import annotations

from contextlib import contextmanager

from dsv41.cluster.runtime import Hooks
from dsv41.telemetry.hbm import annotate
from dsv41.telemetry.roofline import profile
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
        self.engine, self.device = engine, profile(device)
        self.resource = resource_attributes(engine.cfg, engine.topo, engine.executor, device)
        self.recorder = SpanRecorder(self.resource, keep)
        self.records: list[dict] = []
        if engine.runner is None:
            Hooks.tracer = NodeTracer(self.recorder, self.device)
        else:
            engine.runner.run_on_workers(_install, self.resource, device, keep)
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

    def collect(self) -> list[dict]:
        """Every span recorded so far (here and on the workers), by start time."""
        self.records += self.recorder.drain()
        if self.engine.runner is not None:
            for recs in self.engine.runner.run_on_workers(_drain).values():
                self.records += recs
        self.records.sort(key=lambda r: (r["start_ns"], r["end_ns"]))
        return self.records

    def hbm(self) -> list[dict]:
        """Per card: weights, caches, transient peak and total peak bytes seen so far."""
        if self.engine.runner is None:
            rows = [_ledger_row(c, led) for c, led in Hooks.tracer.ledgers.items()]
        else:
            rows = [r for rs in self.engine.runner.run_on_workers(_ledger_rows).values() for r in rs]
        return sorted(rows, key=lambda r: r["card"])

    def close(self):
        """Stop tracing and flush what is queued for a collector."""
        if self.engine.runner is None:
            Hooks.tracer = None
        else:
            self.engine.runner.run_on_workers(_uninstall)
        self.recorder.shutdown()
        self.engine.trace = None


def _ledger_row(card: int, led) -> dict:
    return {"card": card, "weights_bytes": led.weights, "cache_bytes": led.caches,
            "transient_peak_bytes": led.peak_transient, "peak_bytes": led.peak_bytes}


def _install(resource: dict, device: str, keep: bool):
    Hooks.tracer = NodeTracer(SpanRecorder(resource, keep), profile(device))


def _drain() -> list[dict]:
    return Hooks.tracer.recorder.drain()


def _ledger_rows() -> list[dict]:
    return [_ledger_row(c, led) for c, led in Hooks.tracer.ledgers.items()]


def _uninstall():
    Hooks.tracer.recorder.shutdown()
    Hooks.tracer = None
