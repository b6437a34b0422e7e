"""The only module that imports OpenTelemetry: the SDK records spans, its exporters send them.

- Live: with ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (and the
  other standard ``OTEL_*`` variables: headers, timeout, compression, ``OTEL_BSP_*``,
  ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SDK_DISABLED``), spans go to that collector
  over OTLP/HTTP through a BatchSpanProcessor, and each card's HBM live/peak bytes as gauges. The
  exporter runs in a child process (``python -m dsv41.telemetry.spans``) fed batches of span records:
  its protobuf encoding would otherwise hold the step's GIL.
- Kept: finished spans also leave as plain records (dicts of ints and strings) so they can cross
  processes (dask workers) and feed the file exporters; ``otlp_json_lines`` encodes them with the
  OTLP exporter's own protobuf encoder.
"""
from __future__ import annotations

import base64
import json
import math
import os
import pickle
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Callable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

SCOPE = "dsv41.telemetry"
LIVE_QUEUE = 1 << 16   # spans; the SDK's 2048 drops spans of one TINY step (~3,400 nodes) before export
LIVE_BATCH = 512       # span records per hand-off to the exporter process
EXPORT_TIMEOUT_S = 2.0  # per export request (retries included) unless OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT says
CHILD_EXIT_S = 10.0    # the exporter's last flush; past it the exporter is killed and its spans counted lost
HEX_IDS = ("traceId", "spanId", "parentSpanId")


def _on(variable: str, default: str = "") -> str:
    return os.environ.get(variable, default).strip().lower()


def otlp_configured(signal: str = "traces") -> bool:
    """Whether the standard OTEL_* variables ask for OTLP export of this signal (traces | metrics)."""
    if _on("OTEL_SDK_DISABLED") == "true" or _on(f"OTEL_{signal.upper()}_EXPORTER", "otlp") == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))


OTLP_PROTOCOL = "http/protobuf"     # the only exporter this project ships (opentelemetry-exporter-otlp-proto-http)


def _settings_problem() -> str | None:
    """A timeout that is not a number > 0, or a protocol other than OTLP over HTTP: the SDK would
    fail on the first, and silently use HTTP against a gRPC collector on the second."""
    for signal in ("", "TRACES_", "METRICS_"):
        name = f"OTEL_EXPORTER_OTLP_{signal}TIMEOUT"
        value = os.environ.get(name)
        if value is not None:
            try:
                ok = math.isfinite(float(value)) and float(value) > 0
            except ValueError:
                ok = False
            if not ok:
                return f"{name}: expected a number > 0, got {value!r}"
        name = f"OTEL_EXPORTER_OTLP_{signal}PROTOCOL"
        value = os.environ.get(name)
        if value is not None and value.strip().lower() != OTLP_PROTOCOL:
            return f"{name}: only {OTLP_PROTOCOL} is exported (OTLP over HTTP), got {value!r}"
    return None


def endpoint_problem() -> str | None:
    """What is wrong with the OTEL_* variables (None when export is off, or every endpoint set is an
    http(s) URL with a host and a port in range and the timeouts and protocols are usable)."""
    from urllib.parse import urlsplit
    if not (otlp_configured() or otlp_configured("metrics")):
        return None
    problem = _settings_problem()
    if problem:
        return problem
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        value = os.environ.get(name)
        if not value:
            continue
        try:
            url = urlsplit(value.strip())
            ok = url.scheme in ("http", "https") and bool(url.hostname)
            url.port        # raises on a port that is not a number in [0, 65535]
        except ValueError:
            ok = False
        if not ok:
            return (f"{name}: expected the collector's OTLP/HTTP URL, e.g. http://localhost:4318, "
                    f"got {value!r}")
    return None


def export_timeout(signal: str) -> float | None:
    """The exporter's timeout: ours unless the OTEL_* variables set one (None: the SDK reads them)."""
    if os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT") or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT"):
        return None
    return EXPORT_TIMEOUT_S


def collector() -> str:
    """The traces collector's address, as the user gave it."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


def otel_resource(attrs: dict) -> Resource:
    """The run's attributes over the SDK's (OTEL_RESOURCE_ATTRIBUTES); OTEL_SERVICE_NAME renames the service."""
    if os.environ.get("OTEL_SERVICE_NAME"):
        attrs = {**attrs, "service.name": os.environ["OTEL_SERVICE_NAME"]}
    return Resource.create(attrs)


class _Kept(SpanProcessor):
    """Finished spans, appended as they end: half the cost per span of the SDK's in-memory exporter
    behind a SimpleSpanProcessor (which wraps every span in a context attach and a lock)."""

    def __init__(self):
        self.spans: list[ReadableSpan] = []
        self.records: list[dict] = []     # spans that never were SDK spans (``SpanRecorder.add``)

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def _record(s: ReadableSpan) -> dict:
    return {"name": s.name, "trace_id": s.context.trace_id, "span_id": s.context.span_id,
            "parent_id": s.parent.span_id if s.parent is not None else None,
            "start_ns": s.start_time, "end_ns": s.end_time, "attributes": dict(s.attributes),
            "error": s.status.description if s.status.status_code == StatusCode.ERROR else None}


class _LiveExport(SpanProcessor):
    """Span records, in batches, to the exporter process; the SDK's BatchSpanProcessor and OTLP/HTTP
    exporter do the rest there."""

    def __init__(self, resource: dict):
        repo = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "dsv41.telemetry.spans"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        self._batch: list[dict] = []
        self._lock = threading.Lock()     # the threads executor ends spans from several threads
        self.sent = 0                     # span records handed to the exporter process
        self.lost = 0                     # not delivered: known at shutdown, or once the exporter is gone
        self._send(resource)
        if self._proc.stdout.read(1) != b"1":   # ready: its imports (a second) stay out of the steps
            self._stop()                         # it could not start; its error is on stderr

    def _stop(self) -> None:
        """Live export ends (the exporter died, failed to start or hung); the run goes on without it."""
        self._proc.kill()
        self._proc.wait()
        self._proc = None
        self.lost = self.sent + len(self._batch)
        self._batch = []

    def _send(self, obj) -> None:
        pickle.dump(obj, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self._proc.stdin.flush()

    def on_end(self, span: ReadableSpan) -> None:
        if self._proc is None:
            self.lost += 1
            return
        with self._lock:
            self._batch.append(_record(span))
            if len(self._batch) >= LIVE_BATCH:
                try:
                    self._send(self._batch)
                    self.sent += len(self._batch)
                    self._batch = []
                except OSError:
                    self._stop()

    def add(self, records: list[dict]) -> None:
        """Span records built off the hot path (``SpanRecorder.add``), in batches of LIVE_BATCH."""
        if self._proc is None:
            return
        with self._lock:
            self._batch += records
            while len(self._batch) >= LIVE_BATCH and self._proc is not None:
                batch, self._batch = self._batch[:LIVE_BATCH], self._batch[LIVE_BATCH:]
                try:
                    self._send(batch)
                except OSError:
                    self._stop()

    def shutdown(self) -> None:
        """The last batch, then the exporter's own count of the spans it could not deliver."""
        if self._proc is None:
            return
        with self._lock:
            last = pickle.dumps(self._batch, protocol=pickle.HIGHEST_PROTOCOL)
            try:
                out, _ = self._proc.communicate(last, timeout=CHILD_EXIT_S)
            except subprocess.TimeoutExpired:
                self._stop()
                return
            self._proc = None
            self.lost = int(out) if out.strip().isdigit() else self.sent + len(self._batch)  # it died: all
            self._batch = []


class _GiveUp(SpanExporter):
    """The OTLP exporter until its first failed export (it retries within its timeout first): then the
    collector counts as down and later batches are dropped at once, so a dead or silent collector
    costs one timeout, not one per batch. Counts the spans delivered."""

    def __init__(self, exporter: SpanExporter):
        self.exporter, self.delivered, self.down = exporter, 0, False

    def export(self, spans) -> SpanExportResult:
        if self.down:
            return SpanExportResult.FAILURE
        result = self.exporter.export(spans)
        if result == SpanExportResult.SUCCESS:
            self.delivered += len(spans)
        else:
            self.down = True
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()


def _export_forever(stream) -> None:
    """The exporter process: span records from ``stream`` into a BatchSpanProcessor(OTLPSpanExporter);
    at the end, the number of spans not delivered on stdout (the parent warns once for the run)."""
    import logging
    import signal

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    # a Ctrl-C or SIGTERM to the run's process group is the run's to handle: it closes our stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)   # a line per retry; the count says it all
    resource = otel_resource(pickle.load(stream))
    scope = InstrumentationScope(SCOPE)
    queue = None if "OTEL_BSP_MAX_QUEUE_SIZE" in os.environ else LIVE_QUEUE
    exporter = _GiveUp(OTLPSpanExporter(timeout=export_timeout("traces")))
    processor = BatchSpanProcessor(exporter, max_queue_size=queue)
    sys.stdout.buffer.write(b"1")
    sys.stdout.buffer.flush()
    received = 0
    while True:
        try:
            batch = pickle.load(stream)
        except EOFError:
            break
        received += len(batch)
        for r in batch:
            processor.on_end(_readable(r, resource, scope))
    processor.shutdown()
    sys.stdout.buffer.write(str(received - exporter.delivered).encode())
    sys.stdout.buffer.flush()


class SpanRecorder:
    """keep: hold finished spans for ``drain`` (files); spans also go live over OTLP/HTTP when the OTEL_*
    variables name a collector (``otlp_configured``)."""

    def __init__(self, resource: dict, keep: bool = True):
        self.resource = dict(resource)
        self._resource = otel_resource(self.resource)
        self._provider = TracerProvider(resource=self._resource)
        self._kept = _Kept() if keep else None
        if keep:
            self._provider.add_span_processor(self._kept)
        self._live = _LiveExport(self.resource) if otlp_configured() else None
        if self._live is not None:
            self._provider.add_span_processor(self._live)
        self._tracer = self._provider.get_tracer(SCOPE)
        self._meters = None
        self._closed = False

    def start(self, name: str, parent=None, start_ns: int | None = None, attrs: dict | None = None):
        """A live span; parent is a span, a (trace id, span id) pair from another process, or None."""
        if parent is None:
            ctx = Context()
        elif isinstance(parent, tuple):
            remote = SpanContext(parent[0], parent[1], is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
            ctx = trace.set_span_in_context(NonRecordingSpan(remote))
        else:
            ctx = trace.set_span_in_context(parent)
        return self._tracer.start_span(name, context=ctx, start_time=start_ns, attributes=attrs)

    @staticmethod
    def end(span, end_ns: int | None = None, attrs: dict | None = None, error: str | None = None):
        if attrs:
            span.set_attributes(attrs)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    @staticmethod
    def ids(span) -> tuple[int, int]:
        ctx = span.get_span_context()
        return ctx.trace_id, ctx.span_id

    def add(self, records: list[dict]) -> None:
        """Spans recorded without the SDK, as records (``telemetry.buffer``): kept and sent live like its spans."""
        if self._kept is not None:
            self._kept.records += records
        if self._live is not None:
            self._live.add(records)

    def drain(self) -> list[dict]:
        """Finished spans as records; the recorder forgets them."""
        if self._kept is None:
            return []
        spans, self._kept.spans = self._kept.spans, []    # called between steps: nothing ends meanwhile
        records, self._kept.records = self._kept.records, []
        return [_record(s) for s in spans] + records

    def observe_hbm(self, read: Callable[[], dict[int, tuple[int, int]]]) -> None:
        """Export ``read()`` (card -> (live, peak) bytes) as two gauges when OTLP metrics are configured;
        observed at each export (``OTEL_METRIC_EXPORT_INTERVAL``) and at shutdown, never per node."""
        if self._meters is not None or not otlp_configured("metrics"):
            return
        import logging

        from opentelemetry.exporter.otlp.proto.http import metric_exporter
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        # a line per retry at a dead collector; the readings are gauges, the next one replaces a lost one
        logging.getLogger(metric_exporter.__name__).setLevel(logging.CRITICAL)
        from opentelemetry.metrics import Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        def gauge(i: int):
            return lambda _options: [Observation(v[i], {"dsv41.card": c}) for c, v in sorted(read().items())]

        self._meters = MeterProvider(resource=self._resource,
                                     metric_readers=[PeriodicExportingMetricReader(
                                         OTLPMetricExporter(timeout=export_timeout("metrics")))])
        meter = self._meters.get_meter(SCOPE)
        meter.create_observable_gauge("dsv41.hbm.live_bytes", [gauge(0)], unit="By",
                                      description="card HBM in use: weights + caches + live transient values")
        meter.create_observable_gauge("dsv41.hbm.peak_bytes", [gauge(1)], unit="By",
                                      description="card HBM peak so far in the run")

    def shutdown(self) -> int:
        """Flush what is still queued for the collector (spans, then a last metrics reading); the number
        of spans the collector did not get. Once: later calls return 0."""
        if self._closed:
            return 0
        self._closed = True
        self._provider.shutdown()
        if self._meters is not None:
            self._meters.shutdown()
        return 0 if self._live is None else self._live.lost


def otlp_json_lines(records: list[dict], resource: dict) -> list[str]:
    """OTLP JSON, one ``ExportTraceServiceRequest`` per trace: the OTLP exporter's protobuf encoder,
    then protobuf's JSON mapping with the two changes the OTLP/JSON spec makes to it (trace and
    span ids in hex, not base64; enums as integers)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    res, scope = otel_resource(resource), InstrumentationScope(SCOPE)
    by_trace = defaultdict(list)
    for r in records:
        by_trace[r["trace_id"]].append(_readable(r, res, scope))
    lines = []
    for spans in by_trace.values():
        doc = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    for k in HEX_IDS:
                        if k in s:
                            s[k] = base64.b64decode(s[k]).hex()
        lines.append(json.dumps(doc, separators=(",", ":")))
    return lines


def _readable(r: dict, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    flags = TraceFlags(TraceFlags.SAMPLED)
    parent = None if r["parent_id"] is None else SpanContext(r["trace_id"], r["parent_id"], False, flags)
    status = Status(StatusCode.ERROR, r["error"]) if r["error"] is not None else Status(StatusCode.UNSET)
    return ReadableSpan(name=r["name"], context=SpanContext(r["trace_id"], r["span_id"], False, flags),
                        parent=parent, resource=resource, attributes=r["attributes"], kind=SpanKind.INTERNAL,
                        status=status, start_time=r["start_ns"], end_time=r["end_ns"],
                        instrumentation_scope=scope)


if __name__ == "__main__":   # the exporter process of _LiveExport
    _export_forever(sys.stdin.buffer)
