"""The telemetry half of ``python -m dsv41.run``: --trace, --report, and the plan's options (--plan,
--context, --device-profile, --dispatch; plan mode itself is ``dsv41.plan.cli``)."""
from __future__ import annotations

from contextlib import nullcontext

from dsv41.telemetry.export import TRACES, write_traces
from dsv41.plan.latency import DISPATCH
from dsv41.plan.profiles import PROFILES
from dsv41.telemetry.session import DEFAULT_PROFILE, TraceSession


def add_arguments(p):
    g = p.add_argument_group("telemetry")
    g.add_argument("--trace", metavar="NAME", default=None,
                   help="write traces/NAME.otlp.jsonl and traces/NAME.perfetto.json")
    g.add_argument("--report", action="store_true",
                   help="distributed: write Dask's performance report to traces/NAME.dask-report.html")
    g.add_argument("--plan", action="store_true",
                   help="build the step's graph at full scale on meta tensors and report HBM and predicted latency")
    g.add_argument("--context", type=int, default=None, help="--plan: tokens per request (default: the config's max)")
    g.add_argument("--device-profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help="device whose cited constants time the plan and traced nodes (dsv41/plan/profiles.py)")
    g.add_argument("--dispatch", choices=DISPATCH, default=None,
                   help="--plan: graph (one captured graph replay per step, default) or eager (one host issue per kernel)")


def check_arguments(p, a):
    if a.plan:
        return
    if a.report and a.executor != "distributed":
        p.error("--report needs --executor distributed")
    if a.trace and a.executor == "reference":
        p.error("--trace needs a graph executor (sync, threads or distributed)")
    for name in ("context", "dispatch"):
        if getattr(a, name) is not None:
            p.error(f"--{name} is a --plan option")


# ---- traced runs ---------------------------------------------------------------------------------

class Tracing:
    """What a traced run holds open: the span session and, with --report, Dask's performance report."""

    def __init__(self, args, engine):
        self.name = args.trace or "run"
        self.session = TraceSession(engine, args.device_profile) if args.trace else None
        self.report_path = str(TRACES / f"{self.name}.dask-report.html") if args.report else None
        self.report = nullcontext()
        if self.report_path:
            from distributed import performance_report
            TRACES.mkdir(exist_ok=True)
            self.report = performance_report(filename=self.report_path)
        self.report.__enter__()

    def finish(self, result: dict, say):
        self.report.__exit__(None, None, None)
        files = {}
        if self.session is not None:
            files = write_traces(self.name, self.session.collect(), self.session.resource)
            result["hbm"] = self.session.hbm()
            self.session.close()
        if self.report_path:
            files["dask_report"] = self.report_path
        result["traces"] = files
        for kind, path in files.items():
            say(f"  {kind}: {path}")


def start(args, engine):
    return Tracing(args, engine) if (args.trace or args.report) else None
