"""``--trace`` and ``--report`` of ``python -m dsv41.run``: their flags, their rows of the command
line's rules (``dsv41.cli.args``) and what a traced run holds open while it works."""
from __future__ import annotations

import sys

from dsv41.cli.args import FILE_NAME, PROG, outputs_writable
from dsv41.cli.modes import DIST, GRAPH_OR_PLAN
from dsv41.outputs import write_output
from dsv41.telemetry.export import TRACES, write_traces
from dsv41.telemetry.session import TraceSession
from dsv41.telemetry.spans import collector, otlp_configured


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
    if not a.trace:
        return None
    return outputs_writable([f"{a.trace}.otlp.jsonl", f"{a.trace}.perfetto.json"])


def _report(a, cfg):
    return outputs_writable([report_file(a)]) if a.report else None


def report_file(a) -> str:
    """--report's file under traces/."""
    return f"{a.trace or 'run'}.dask-report.html"


CHECKS = [("--trace", _trace), ("--report", _report)]
REPORT_BUFFER = "memory://dsv41/dask-report.html"


# ---- traced runs ---------------------------------------------------------------------------------

class Tracing:
    """What a traced run holds open: the span session and, with --report, Dask's performance report."""

    def __init__(self, args, engine):
        self.name = args.trace
        self.keep = bool(args.trace)
        self.session = TraceSession(engine, args.device_profile, self.keep) if tracing_on(args) else None
        self.report_path = str(TRACES / report_file(args)) if args.report else None
        self.report = None
        if self.report_path:
            from distributed import performance_report
            TRACES.mkdir(exist_ok=True)
            # Dask writes the report with a plain open(), which follows a link: it goes to fsspec's
            # in-memory store and from there to traces/ through open_output
            self.report = performance_report(filename=REPORT_BUFFER)
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
        """Stop tracing, also when the run failed (idempotent); one warning line when the collector did
        not get every span."""
        self._end_report()
        if self.session is not None:
            lost = self.session.close()
            self.session = None
            if lost:
                print(f"{PROG}: warning: {lost} span(s) not delivered to the OTLP collector at {collector()} "
                      f"(down or not answering; each exporter gave up after its first failed export)",
                      file=sys.stderr)

    def _end_report(self):
        if self.report is not None:
            import fsspec
            self.report.__exit__(None, None, None)
            self.report = None
            memory = fsspec.filesystem("memory")
            html = memory.cat_file(REPORT_BUFFER)
            memory.rm_file(REPORT_BUFFER)
            write_output(self.report_path, html)


def start(args, engine):
    return Tracing(args, engine) if (tracing_on(args) or args.report) else None
