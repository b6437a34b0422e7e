"""Tracing one GraphEngine: the recorder in this process or on every dask worker, a span per step.

Each step is one trace: a root span on the engine, its submissions as children (recorded where they
run) and their nodes as grandchildren; a speculative step's root also has a ``verify`` and a ``draft``
child spanning its target and its DSpark nodes (``part_spans``, made on collect). Under ``distributed`` every worker keeps its own recorder and
ledger; ``collect`` gathers their finished spans with ``client.run``. What the cards noted during a
step becomes spans before the next step starts (outside every span) and on collect, hbm and close.
"""
from __future__ import annotations

from contextlib import contextmanager
from time import perf_counter_ns

from dsv41.cluster import registry
from dsv41.cluster.observers import StepObserver
from dsv41.graph.build import DRAFT, TARGET
from dsv41.plan.hbm import annotate
from dsv41.plan.roofline import profile
from dsv41.telemetry.buffer import new_id, unix_ns
from dsv41.telemetry.spans import SpanRecorder
from dsv41.telemetry.tracer import NodeTracer

DEFAULT_PROFILE = "a5"
VERIFY = "verify"           # the target model's forward of a speculative step: it verifies the drafts


def resource_attributes(cfg, topo, executor: str, device: str) -> dict:
    return {"service.name": "dsv41", "dsv41.config": cfg.name,
            "dsv41.topology": f"tp{topo.tp}-dp{topo.dp}-ep{topo.ep}", "dsv41.tp": topo.tp, "dsv41.dp": topo.dp,
            "dsv41.ep": topo.ep, "dsv41.executor": executor, "dsv41.device_profile": device}


class TraceSession(StepObserver):
    """keep: hold every span for ``collect`` (files); spans also go live to an OTLP collector when the
    OTEL_* variables name one (``spans.otlp_configured``), in this process and on every worker."""

    def __init__(self, engine, device: str = DEFAULT_PROFILE, keep: bool = True):
        self.engine, self.device, self.keep = engine, profile(device), keep
        self.resource = resource_attributes(engine.cfg, engine.topo, engine.settings.executor, device)
        self.recorder = SpanRecorder(self.resource, keep)
        self.records: list[dict] = []
        if engine.runner is None:
            registry.owned(engine.id).hooks.tracer = NodeTracer(self.recorder, self.device)
        else:
            engine.runner.run_on_cards(_install, engine.id, self.resource, device, keep)
        engine.observe(self)

    @contextmanager
    def step(self, plan):
        self.encode(on_error="ignore")    # a worker lost since takes its notes with it; recovery follows
        step, phase = next(iter(plan.submissions.values())).step, plan.graph.phase
        span = self.recorder.start(f"{phase} step {step}", start_ns=unix_ns(perf_counter_ns()), attrs={
            "dsv41.span": "step", "dsv41.phase": phase, "dsv41.step": step,
            "dsv41.nodes": len(plan.graph.nodes), "dsv41.submissions": len(plan.submissions),
            **speculative_attributes(plan.graph, self.engine.cfg)})
        annotate(plan, self.recorder.ids(span))
        error = None
        try:
            yield
        except BaseException as e:
            error = repr(e)
            raise
        finally:
            self.recorder.end(span, end_ns=unix_ns(perf_counter_ns()), error=error)

    def attach(self, cards):
        """A tracer on the workers that now serve these cards (after a recovery replaced them)."""
        if self.engine.runner is not None:
            self.engine.runner.run_on_cards(_install, self.engine.id, self.resource, self.device.name, self.keep,
                                            cards=cards)

    def encode(self, on_error: str = "raise"):
        """Spans of what every card noted so far (on their workers under ``distributed``)."""
        if self.engine.runner is None:
            _encode(self.engine.id)
        else:
            self.engine.runner.run_on_cards(_encode, self.engine.id, on_error=on_error)

    def collect(self) -> list[dict]:
        """Every span recorded so far (here and on the workers), by start time."""
        self.encode()
        new = self.recorder.drain()
        if self.engine.runner is not None:
            for recs in self.engine.runner.run_on_cards(_drain, self.engine.id).values():
                new += recs
        self.records += new + part_spans(new)
        self.records.sort(key=lambda r: (r["start_ns"], r["end_ns"]))
        return self.records

    def hbm(self) -> list[dict]:
        """Per card: weights, caches, transient peak and total peak bytes seen so far."""
        self.encode()
        if self.engine.runner is None:
            rows = _ledger_rows(self.engine.id)
        else:
            rows = [r for rs in self.engine.runner.run_on_cards(_ledger_rows, self.engine.id).values() for r in rs]
        return sorted(rows, key=lambda r: r["card"])

    def close(self) -> int:
        """Stop tracing and flush what is queued for a collector; the number of spans it did not get
        (here and on every worker)."""
        if self.engine.runner is None:
            lost = _uninstall(self.engine.id)     # its tracer records with self.recorder: shut down once
        else:
            lost = sum(self.engine.runner.run_on_cards(_uninstall, self.engine.id).values())
        lost += self.recorder.shutdown()
        self.engine.unobserve(self)
        return lost


def speculative_attributes(graph, cfg) -> dict:
    """A step's speculative work: the drafts its target forward verifies, the draft rows it runs
    (DSpark's blocks, drafted in the same graph)."""
    def step_of(node):
        return graph.literals[node.inputs[-1]][0]
    verified = sum(sum(step_of(n).proposed) for n in graph.nodes.values() if n.kernel == "lm_head.argmax")
    drafted = sum(len(step_of(n).rids) * cfg.dspark_block_size for n in graph.nodes.values()
                  if n.kernel == "dspark.head")
    return {"dsv41.verify.drafts": verified, "dsv41.draft.rows": drafted}


def part_spans(records: list[dict]) -> list[dict]:
    """Per speculative step (one that verifies drafts or drafts a block) a child span of its step
    span per part: ``verify`` over its target nodes' spans, ``draft`` over its draft nodes' (first
    start to last end on any card), each with the node count and their summed device time. A whole
    trace's spans come in one collect (its step's cards are encoded before the next step)."""
    steps = {r["trace_id"]: r for r in records if r["attributes"].get("dsv41.span") == "step"
             and (r["attributes"].get("dsv41.verify.drafts") or r["attributes"].get("dsv41.draft.rows"))}
    spans: dict[tuple, list[dict]] = {}
    for r in records:
        a = r["attributes"]
        if a.get("dsv41.span") == "node" and r["trace_id"] in steps:
            spans.setdefault((r["trace_id"], VERIFY if a["dsv41.part"] == TARGET else DRAFT), []).append(r)
    out = []
    for (trace, part), nodes in sorted(spans.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        step = steps[trace]
        count = "dsv41.verify.drafts" if part == VERIFY else "dsv41.draft.rows"
        out.append({"name": f"{part} (step {step['attributes']['dsv41.step']})", "trace_id": trace,
                    "span_id": new_id(64), "parent_id": step["span_id"],
                    "start_ns": min(n["start_ns"] for n in nodes), "end_ns": max(n["end_ns"] for n in nodes),
                    "attributes": {"dsv41.span": part, "dsv41.step": step["attributes"]["dsv41.step"],
                                   "dsv41.nodes": len(nodes), count: step["attributes"][count],
                                   "dsv41.device.sim_us": sum(n["attributes"]["dsv41.device.sim_us"] for n in nodes)},
                    "error": None})
    return out


def _ledger_row(card: int, led) -> dict:
    return {"card": card, "weights_bytes": led.weights, "cache_bytes": led.caches,
            "transient_peak_bytes": led.peak_transient, "peak_bytes": led.peak_bytes}


def _install(engine: str, resource: dict, device: str, keep: bool):
    registry.owned(engine).hooks.tracer = NodeTracer(SpanRecorder(resource, keep), profile(device))


def _tracer(engine: str):
    """The engine's tracer here, if any (a worker that replaced a lost one starts without spans)."""
    entry = registry.find(engine)
    return None if entry is None else entry.hooks.tracer


def _encode(engine: str):
    tracer = _tracer(engine)
    if tracer is not None:
        tracer.encode()


def _drain(engine: str) -> list[dict]:
    tracer = _tracer(engine)
    return [] if tracer is None else tracer.recorder.drain()


def _ledger_rows(engine: str) -> list[dict]:
    tracer = _tracer(engine)
    return [] if tracer is None else [_ledger_row(c, led) for c, led in tracer.ledgers.items()]


def _uninstall(engine: str) -> int:
    """The spans its recorder could not deliver to a collector."""
    entry = registry.find(engine)
    if entry is None or entry.hooks.tracer is None:
        return 0
    entry.hooks.tracer.encode()         # the last step's spans still go live
    lost = entry.hooks.tracer.recorder.shutdown()
    entry.hooks.tracer = None
    return lost
