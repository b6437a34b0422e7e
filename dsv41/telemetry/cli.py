"""The telemetry half of ``python -m dsv41.run``: --trace, --report, and the plan's options (--plan,
--context, --device-profile, --dispatch; plan mode itself is ``dsv41.plan.cli``), with their rows of
the command line's rules (``dsv41.cli.args``)."""
from __future__ import annotations

from dsv41.cli.args import ALL, DIST, FILE_NAME, GRAPH_OR_PLAN, PLAN, on, traces_writable
from dsv41.telemetry.export import TRACES, write_traces
from dsv41.plan.latency import DISPATCH
from dsv41.plan.profiles import PROFILES
from dsv41.telemetry.session import DEFAULT_PROFILE, TraceSession
from dsv41.telemetry.spans import otlp_configured


def add_arguments(p):
    g = p.add_argument_group("telemetry")
    g.add_argument("--trace", metavar="NAME", default=None,
                   help="write traces/NAME.otlp.jsonl and traces/NAME.perfetto.json (NAME: a plain file name). "
                        "Spans also go live to a collector when OTEL_EXPORTER_OTLP_ENDPOINT is set")
    g.add_argument("--report", action="store_true",
                   help="distributed: write Dask's performance report to traces/NAME.dask-report.html")
    g.add_argument("--plan", action="store_true",
                   help="build the step's graph at full scale on meta tensors and report HBM and predicted latency; "
                        "--batch requests are spread evenly over the DP groups")
    g.add_argument("--context", type=int, default=None, help="--plan: tokens per request (default: the config's max)")
    g.add_argument("--device-profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help="--plan or traced runs: the device whose cited constants time the plan and traced nodes "
                        "(dsv41/plan/profiles.py; default: %(default)s)")
    g.add_argument("--dispatch", choices=DISPATCH, default="graph",
                   help="--plan: graph (one captured graph replay per step, default) or eager (one host issue per kernel)")


def tracing_on(a) -> bool:
    """Spans are recorded for --trace, and whenever the OTEL_* variables name a collector."""
    return bool(a.trace) or otlp_configured()


APPLIES = {
    "--trace": (GRAPH_OR_PLAN, None),
    "--report": (DIST, None),
    "--plan": (ALL, None),
    "--context": (frozenset({PLAN}), None),
    "--dispatch": (frozenset({PLAN}), None),
    "--device-profile": (GRAPH_OR_PLAN, ("needs --trace (or OTEL_EXPORTER_OTLP_ENDPOINT)",
                                         lambda a: a.plan or tracing_on(a))),
}


def _trace(a, cfg):
    if a.trace is not None and not FILE_NAME.fullmatch(a.trace):
        return (f"must be a plain file name (letters, digits, '.', '_', '-'; written as traces/NAME.*), "
                f"got {a.trace!r}")
    return traces_writable() if (a.trace or a.plan) else None


def _report(a, cfg):
    return traces_writable() if a.report else None


def _context(a, cfg):
    from dsv41.plan.step import rows_per_request
    if a.context is None:
        return None
    low, top = rows_per_request(cfg, a.batch // a.dp, a.graph), cfg.max_position_embeddings
    if not low <= a.context <= top:
        return f"must be in [{low}, {top}] tokens per request {on(a, cfg)}, got {a.context}"


CHECKS = [("--trace", _trace), ("--report", _report), ("--context", _context)]


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
