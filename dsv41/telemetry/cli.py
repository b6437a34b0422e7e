"""The telemetry half of ``python -m dsv41.run``: --trace, --report, --plan, --context, --device-profile.

``--batch`` counts requests in total here as in a run; ``--plan`` spreads them evenly over the DP
groups (``--batch 64 --dp 2``: 32 requests x 6 rows = 192 decode rows per group, the seed's
capacity contract).
"""
from __future__ import annotations

import json
from contextlib import nullcontext

from dsv41.cli.args import ALL, DIST, FILE_NAME, GRAPH_OR_PLAN, PLAN, traces_writable
from dsv41.telemetry.export import TRACES, write_traces
from dsv41.telemetry.profiles import PROFILES
from dsv41.telemetry.session import DEFAULT_PROFILE, TraceSession
from dsv41.telemetry.spans import otlp_configured

GB = 1e9


def add_arguments(p):
    g = p.add_argument_group("telemetry")
    g.add_argument("--trace", metavar="NAME", default=None,
                   help="write traces/NAME.otlp.jsonl and traces/NAME.perfetto.json (NAME: a plain file name). "
                        "Spans also go live to a collector when OTEL_EXPORTER_OTLP_ENDPOINT is set")
    g.add_argument("--report", action="store_true",
                   help="distributed: write Dask's performance report to traces/NAME.dask-report.html")
    g.add_argument("--plan", action="store_true",
                   help="build the step's graph at full scale on meta tensors and report HBM and roofline latency; "
                        "--batch requests are spread evenly over the DP groups")
    g.add_argument("--context", type=int, default=None, help="--plan: tokens per request (default: the config's max)")
    g.add_argument("--device-profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help="--plan or traced runs: roofline device for simulated times (default: %(default)s)")


def tracing_on(a) -> bool:
    """Spans are recorded for --trace, and whenever the OTEL_* variables name a collector."""
    return bool(a.trace) or otlp_configured()


APPLIES = {
    "--trace": (GRAPH_OR_PLAN, None),
    "--report": (DIST, None),
    "--plan": (ALL, None),
    "--context": (frozenset({PLAN}), None),
    "--device-profile": (GRAPH_OR_PLAN, ("--trace (or OTEL_EXPORTER_OTLP_ENDPOINT)",
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
    from dsv41.telemetry.plan import rows_per_request
    if a.context is None:
        return None
    low, top = rows_per_request(cfg, a.batch // a.dp, a.graph), cfg.max_position_embeddings
    if not low <= a.context <= top:
        return f"must be in [{low}, {top}] tokens per request on --config {cfg.name}, got {a.context}"


CHECKS = [("--trace", _trace), ("--report", _report), ("--context", _context)]


# ---- plan mode -----------------------------------------------------------------------------------

def plan_command(args, cfg, topo, say) -> int:
    say(f"dsv41 plan {args.graph}: config={cfg.name} tp={topo.tp} dp={topo.dp} ep={topo.ep} wiring={args.wiring}")
    report = plan_report(args, cfg, topo, say)
    if args.json:
        print(json.dumps({"graph": args.graph, "config": cfg.name,
                          "topology": {"tp": topo.tp, "dp": topo.dp, "ep": topo.ep}, "plan": report}))
    return 0


def plan_report(args, cfg, topo, say) -> dict:
    from dsv41.telemetry.plan import run_plan
    context = cfg.max_position_embeddings if args.context is None else args.context
    report, records, resource = run_plan(cfg, topo, args.batch // topo.dp, context, args.graph, args.wiring,
                                         args.device_profile)
    report["traces"] = write_traces(args.trace or f"plan-{cfg.name}", records, resource)
    requests = report["requests_per_dp_group"]
    say(f"  {requests} requests x {report['rows_per_dp_group'] // requests} rows per DP group at context {context}: "
        f"nodes={report['nodes']} submissions={report['submissions']}")
    say(f"  {'card':>4} {'weights GB':>11} {'caches GB':>10} {'transient GB':>13} {'total GB':>9}")
    for c in report["cards"]:
        say(f"  {c['card']:>4} {c['weights_bytes'] / GB:>11.2f} {c['cache_bytes'] / GB:>10.2f} "
            f"{c['transient_peak_bytes'] / GB:>13.3f} {c['total_bytes'] / GB:>9.2f}")
    kinds = report["cards"][0]["by_kind"]
    say("  card 0 by kind (GB): " + ", ".join(f"{k} {v / GB:.3f}" for k, v in kinds.items()))
    say(f"  cache per request: {report['cache_per_request_bytes'] / GB:.3f} GB "
        f"(BF16 rows: {report['cache_per_request_bf16_bytes'] / GB:.3f} GB)")
    say(f"  {report['device_profile']}: predicted step {report['predicted_step_us'] / 1e3:.2f} ms, "
        f"memory-bound floor {report['floor_us'] / 1e3:.2f} ms")
    say(f"  simulated timeline: {report['traces']['perfetto']}")
    return report


# ---- traced runs ---------------------------------------------------------------------------------

class Tracing:
    """What a traced run holds open: the span session and, with --report, Dask's performance report."""

    def __init__(self, args, engine):
        self.name = args.trace or "run"
        self.keep = bool(args.trace)
        self.session = TraceSession(engine, args.device_profile, self.keep) if tracing_on(args) else None
        self.report_path = str(TRACES / f"{self.name}.dask-report.html") if args.report else None
        self.report = nullcontext()
        if self.report_path:
            from distributed import performance_report
            TRACES.mkdir(exist_ok=True)
            self.report = performance_report(filename=self.report_path)
        self.report.__enter__()

    def finish(self, result: dict, say):
        self.report.__exit__(None, None, None)
        self.report = None
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
        if self.report is not None:
            self.report.__exit__(None, None, None)
            self.report = None
        if self.session is not None:
            self.session.close()
            self.session = None


def start(args, engine):
    return Tracing(args, engine) if (tracing_on(args) or args.report) else None
