"""``--trace`` and ``--report`` of ``python -m dsv41.run``: their flags, their rows of the command
line's rules (``dsv41.cli.args``) and what a traced run holds open while it works."""
from __future__ import annotations

from dsv41.cli.args import FILE_NAME, traces_writable
from dsv41.cli.modes import DIST, GRAPH_OR_PLAN
from dsv41.telemetry.export import TRACES, write_traces
from dsv41.telemetry.session import TraceSession
from dsv41.telemetry.spans import otlp_configured


def add_arguments(g):
    g.add_argument("--trace", metavar="NAME", default=None,
                   help="write traces/NAME.otlp.jsonl and traces/NAME.perfetto.json (NAME: a plain file name). "
                        "Spans also go live to a collector when OTEL_EXPORTER_OTLP_ENDPOINT is set")
    g.add_argument("--report", action="store_true",
                   help="distributed: write Dask's performance report to traces/NAME.dask-report.html")


def tracing_on(a) -> bool:
    """Spans are recorded for --trace, and whenever the OTEL_* variables name a collector."""
    return bool(a.trace) or otlp_configured()


APPLIES = {
    "--trace": (GRAPH_OR_PLAN, None),
    "--report": (DIST, None),
}


def _trace(a, cfg):
    if a.trace is not None and not FILE_NAME.fullmatch(a.trace):
        return (f"must be a plain file name (letters, digits, '.', '_', '-'; written as traces/NAME.*), "
                f"got {a.trace!r}")
    return traces_writable() if (a.trace or a.plan) else None


def _report(a, cfg):
    return traces_writable() if a.report else None


CHECKS = [("--trace", _trace), ("--report", _report)]


# ---- traced runs ---------------------------------------------------------------------------------

class Tracing:
    """What a traced run holds open: the span session and, with --report, Dask's performance report."""

    def __init__(self, args, engine):
        self.name = args.trace or "run"
        self.keep = bool(args.trace)
        self.session = TraceSession(engine, args.device_profile, self.keep) if tracing_on(args) else None
        self.report_path = str(TRACES / f"{self.name}.dask-report.html") if args.report else None
        self.report = None
        if self.report_path:
            from distributed import performance_report
            TRACES.mkdir(exist_ok=True)
            self.report = performance_report(filename=self.report_path)
            self.report.__enter__()

    def finish(self, result: dict, say):
        self._end_report()     # the report ends with the steps, before the spans are gathered
        files = {}
        if self.session is not None:
            if self.keep:
                files = write_traces(self.name, self.session.collect(), self.session.resource)
            result["hbm"] = self.session.hbm()
        self.close()
        if self.report_path:
            files["dask_report"] = self.report_path
        result["traces"] = files
        for kind, path in files.items():
            say(f"  {kind}: {path}")

    def close(self):
        """Stop tracing, also when the run failed (idempotent)."""
        self._end_report()
        if self.session is not None:
            self.session.close()
            self.session = None

    def _end_report(self):
        if self.report is not None:
            self.report.__exit__(None, None, None)
            self.report = None


def start(args, engine):
    return Tracing(args, engine) if (tracing_on(args) or args.report) else None
