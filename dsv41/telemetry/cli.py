"""The telemetry half of ``python -m dsv41.run``: --trace, --report, --plan, --context, --device-profile.

``--plan --batch N`` means N requests per DP group (the seed's capacity contract: 32 requests x 6
rows = 192 decode rows per group), unlike a run's --batch, which counts prompts over all groups.
"""
from __future__ import annotations

import json
from contextlib import nullcontext

from dsv41.telemetry.export import TRACES, write_traces
from dsv41.plan.profiles import PROFILES
from dsv41.telemetry.session import DEFAULT_PROFILE, TraceSession

GB = 1e9


def add_arguments(p):
    g = p.add_argument_group("telemetry")
    g.add_argument("--trace", metavar="NAME", default=None,
                   help="write traces/NAME.otlp.jsonl and traces/NAME.perfetto.json")
    g.add_argument("--report", action="store_true",
                   help="distributed: write Dask's performance report to traces/NAME.dask-report.html")
    g.add_argument("--plan", action="store_true",
                   help="build the step's graph at full scale on meta tensors and report HBM and roofline latency")
    g.add_argument("--context", type=int, default=None, help="--plan: tokens per request (default: the config's max)")
    g.add_argument("--device-profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help="roofline device for simulated times")


def check_arguments(p, a):
    if a.plan:
        return
    if a.report and a.executor != "distributed":
        p.error("--report needs --executor distributed")
    if a.trace and a.executor == "reference":
        p.error("--trace needs a graph executor (sync, threads or distributed)")
    if a.context is not None:
        p.error("--context is a --plan option")


# ---- plan mode -----------------------------------------------------------------------------------

def plan_command(args, cfg, topo, say) -> int:
    say(f"dsv41 plan {args.graph}: config={cfg.name} tp={topo.tp} dp={topo.dp} ep={topo.ep} wiring={args.wiring}")
    report = plan_report(args, cfg, topo, say)
    if args.json:
        print(json.dumps({"graph": args.graph, "config": cfg.name,
                          "topology": {"tp": topo.tp, "dp": topo.dp, "ep": topo.ep}, "plan": report}))
    return 0


def plan_report(args, cfg, topo, say) -> dict:
    from dsv41.plan.step import run_plan
    context = args.context or cfg.max_position_embeddings
    report, records, resource = run_plan(cfg, topo, args.batch, context, args.graph, args.wiring,
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
