"""Traces where OpenTelemetry users send them: live over OTLP/HTTP to a collector named by the
standard OTEL_* variables, and the .otlp.jsonl file in the OTLP JSON encoding; files only under
./traces/ of the working directory."""
import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from dsv41.cli import run
from dsv41.cluster import registry

REPO = Path(__file__).resolve().parents[1]
RUN = ["--executor", "sync", "--tp", "2", "--dp", "1", "--batch", "1", "--prompt-len", "4", "--new-tokens", "2"]
PREFILL = ["--executor", "sync", "--tp", "2", "--dp", "1", "--batch", "1", "--prompt-len", "4", "--graph", "prefill"]


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP receiver on 127.0.0.1: decodes every request body by its signal path."""

    def __init__(self):
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            self.server.traces.append(ExportTraceServiceRequest.FromString(body))
        elif self.path == "/v1/metrics":
            self.server.metrics.append(ExportMetricsServiceRequest.FromString(body))
        self.send_response(200 if self.path in ("/v1/traces", "/v1/metrics") else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_):
        pass


@pytest.fixture
def collector():
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _attrs(kvs) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}


def _file_requests(path) -> list[ExportTraceServiceRequest]:
    """Each line through protobuf's JSON parser, after undoing OTLP/JSON's one change to the mapping
    that matters for parsing: ids in hex rather than base64."""
    out = []
    for line in open(path):
        doc = json.loads(line)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    for k in ("traceId", "spanId", "parentSpanId"):
                        if k in s:
                            assert len(s[k]) == (32 if k == "traceId" else 16)
                            s[k] = base64.b64encode(bytes.fromhex(s[k])).decode()
        out.append(json_format.ParseDict(doc, ExportTraceServiceRequest()))
    return out


def _spans(requests) -> dict:
    return {(s.trace_id, s.span_id): s for r in requests for rs in r.resource_spans
            for ss in rs.scope_spans for s in ss.spans}


@pytest.mark.timeout(300)
def test_spans_go_live_to_the_collector_and_to_the_file(collector, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "dsv41-test")
    assert run.main(RUN + ["--trace", "live", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(registry.find(e).hooks.tracer is None for e in registry.engines())

    from_file = _spans(_file_requests(tmp_path / out["traces"]["otlp"]))
    live = _spans(collector.traces)
    assert len(from_file) > 3000 and set(live) == set(from_file)     # every span, none dropped
    for key, span in live.items():
        assert len(span.trace_id) == 16 and len(span.span_id) == 8
        assert span.name == from_file[key].name and span.start_time_unix_nano == from_file[key].start_time_unix_nano
        assert _attrs(span.attributes) == _attrs(from_file[key].attributes)
    kinds = {_attrs(s.attributes)["dsv41.span"] for s in live.values()}
    assert kinds == {"step", "submission", "node"}
    node = next(s for s in live.values() if s.name == "L20/attn/index#0@c0")
    a = _attrs(node.attributes)
    assert a["dsv41.kernel"] == "attn.index" and a["dsv41.layer"] == 20 and a["dsv41.card"] == 0
    assert a["dsv41.flops"] > 0 and a["dsv41.hbm.live_bytes"] > 0
    resource = _attrs(collector.traces[0].resource_spans[0].resource.attributes)
    assert resource["service.name"] == "dsv41-test" and resource["dsv41.topology"] == "tp2-dp1-ep2"

    gauges = {}
    for r in collector.metrics:
        for rm in r.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.gauge.data_points:
                        gauges[(m.name, _attrs(p.attributes)["dsv41.card"])] = p.as_int
    for h in out["hbm"]:
        assert gauges[("dsv41.hbm.peak_bytes", h["card"])] == h["peak_bytes"]
        assert h["weights_bytes"] + h["cache_bytes"] <= gauges[("dsv41.hbm.live_bytes", h["card"])] <= h["peak_bytes"]


@pytest.mark.timeout(300)
def test_the_collector_alone_turns_tracing_on(collector, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.endpoint + "/v1/traces")
    assert run.main(PREFILL + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spans = _spans(collector.traces)
    assert len(spans) == 1 + out["submissions"] + out["nodes"]     # the step, its submissions, their nodes
    assert not collector.metrics      # metrics go only where a metrics endpoint is named
    assert list(tmp_path.iterdir()) == []                  # no --trace: no files


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_files_stay_under_traces(tmp_path):
    """--trace, --backend pypto-sim and --show-graph in a fresh working directory: every file the
    run leaves is under ./traces/, and none lands in the checkout."""
    work = tmp_path / "work"
    work.mkdir()
    checkout_before = _listing(REPO / "traces") if (REPO / "traces").exists() else set()
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "dsv41.run", *RUN, "--trace", "t", "--backend", "pypto-sim",
                        "--show-graph", "g.dot", "--json"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=850, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pypto_kernels"] and out["graph_file"] == "traces/g.dot"
    made = _listing(work)
    assert {"traces/t.otlp.jsonl", "traces/t.perfetto.json", "traces/g.dot"} <= made
    assert any(m.startswith("traces/pypto-run/") for m in made)
    assert [m for m in made if not m.startswith("traces/")] == []
    assert (tmp_path / "cache" / "dsv41" / "pypto" / "sim_times.json").exists()
    assert (_listing(REPO / "traces") if (REPO / "traces").exists() else set()) == checkout_before


def test_trace_and_graph_files_stay_under_traces(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert run.main(PREFILL + ["--trace", "t", "--show-graph", "g.dot", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["graph_file"] == "traces/g.dot" and open(tmp_path / "traces/g.dot").read().startswith("digraph")
    assert _listing(tmp_path) == {"traces/t.otlp.jsonl", "traces/t.perfetto.json", "traces/g.dot"}


@pytest.mark.timeout(120)
def test_a_dead_exporter_never_stops_the_run(monkeypatch):
    from dsv41.telemetry import spans
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    recorder = spans.SpanRecorder({"service.name": "dsv41"}, keep=True)
    live = next(p for p in recorder._provider._active_span_processor._span_processors
                if isinstance(p, spans._LiveExport))
    live._proc.kill()
    for _ in range(3 * spans.LIVE_BATCH):
        recorder.end(recorder.start("node"))
    assert live._proc is None and len(recorder.drain()) == 3 * spans.LIVE_BATCH
    recorder.shutdown()
