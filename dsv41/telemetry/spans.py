"""The only module that imports OpenTelemetry: the SDK records spans, the API is the interface.

Spans leave as plain records (dicts of ints and strings) so they can cross processes (dask workers)
and feed the exporters without the SDK on the reading side.
"""
from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

SCOPE = "dsv41.telemetry"


class SpanRecorder:
    def __init__(self, resource: dict):
        self.resource = dict(resource)
        self._exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create(self.resource))
        provider.add_span_processor(SimpleSpanProcessor(self._exporter))
        self._tracer = provider.get_tracer(SCOPE)

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

    def drain(self) -> list[dict]:
        """Finished spans as records, oldest first; the recorder forgets them."""
        spans = self._exporter.get_finished_spans()
        self._exporter.clear()
        return [{"name": s.name, "trace_id": s.context.trace_id, "span_id": s.context.span_id,
                 "parent_id": s.parent.span_id if s.parent is not None else None,
                 "start_ns": s.start_time, "end_ns": s.end_time, "attributes": dict(s.attributes),
                 "error": s.status.description if s.status.status_code == StatusCode.ERROR else None}
                for s in spans]
