"""Plan mode of ``python -m dsv41.run --plan``: its flags and their rows of the command line's rules
(``dsv41.cli.args``), then HBM per card, the predicted step and where it goes.

``--batch`` counts requests in total here as in a run; the plan spreads them evenly over the DP
groups (``--batch 64 --dp 2``: 32 requests x 6 rows = 192 decode rows per group, the seed's
capacity contract).
"""
from __future__ import annotations

import dataclasses
import json
import time

from dsv41.cli.args import on
from dsv41.cli.modes import ALL, GRAPH_OR_PLAN, PLAN
from dsv41.cli.trace import tracing_on
from dsv41.engine.blocks import BlockManager
from dsv41.plan.calibration import calibrated
from dsv41.plan.explain import calibration_lines, explain_lines, operator_lines, sensitivity
from dsv41.plan.latency import DISPATCH, PARTS, SCHEMES
from dsv41.plan.profiles import PROFILES
from dsv41.plan.roofline import profile
from dsv41.plan.step import rows_per_request, run_plan
from dsv41.telemetry.export import write_traces
from dsv41.telemetry.session import DEFAULT_PROFILE, resource_attributes
from dsv41.telemetry.simulated import record_planned


def add_arguments(g):
    g.add_argument("--plan", action="store_true",
                   help="build the step's graph at full scale on meta tensors and report HBM and predicted latency; "
                        "--batch requests are spread evenly over the DP groups")
    g.add_argument("--context", type=int, default=None, metavar="N",
                   help="--plan: tokens per request (default: the config's max); a run: start every request at N "
                        "tokens of drawn history (caches filled as a prefill would leave them, from the seed; "
                        "docs/flash-shapes.md), then prefill its prompt and decode")
    g.add_argument("--device-profile", default=DEFAULT_PROFILE, metavar="NAME|FILE",
                   help=f"--plan or traced runs: the device whose cited constants time the plan and traced nodes: "
                        f"a built-in profile {sorted(PROFILES)} (dsv41/plan/profiles.py) or your own .json/.toml "
                        f"profile file (docs/plan-validation.md; default: %(default)s)")
    g.add_argument("--explain", action="store_true",
                   help="--plan: the predicted step with each fixed cost halved and doubled (which assumption the "
                        "answer rests on)")
    g.add_argument("--acceptance", type=float, default=0.0, metavar="A",
                   help="--plan, decode: the chance each draft row is accepted (the tokens a request makes per "
                        "step: 1 + A + ... + A^drafts; default 0: one token per request per step)")
    g.add_argument("--dispatch", choices=DISPATCH, default="graph",
                   help="--plan: graph (one captured graph replay per step, default) or eager (one host issue per kernel)")
    g.add_argument("--simulate", action="store_true",
                   help="--plan: a serving run on a simulated clock: the engine's own scheduler over an executor "
                        "that computes nothing, each step priced by the plan (docs/plan.md); prints what vLLM's "
                        "bench serve prints")
    g.add_argument("--num-prompts", type=int, default=1000, metavar="N", help="--simulate: requests (default 1000)")
    g.add_argument("--random-input-len", type=int, default=1024, metavar="N",
                   help="--simulate: prompt tokens after the shared prefix (default 1024)")
    g.add_argument("--random-output-len", type=int, default=128, metavar="N",
                   help="--simulate: tokens each request makes (EOS ignored; default 128)")
    g.add_argument("--random-prefix-len", type=int, default=0, metavar="N",
                   help="--simulate: tokens of a prefix every prompt shares (default 0)")
    g.add_argument("--request-rate", type=float, default=float("inf"), metavar="R",
                   help="--simulate: requests per second, Poisson arrivals (default inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="--simulate: requests in flight at most (default: no limit)")
    g.add_argument("--scheme", choices=SCHEMES, default="all_to_all",
                   help="--plan: how the stack hands a layer's data between cards: all_to_all (attention rows "
                        "gathered and scattered, MoE rows dispatched and combined: DP attention with DeepEP; default) "
                        "or all_reduce (TP attention, the experts' partial sums all-reduced: one DP group)")


APPLIES = {
    "--plan": (ALL, None),
    "--context": (ALL, ("does not go with --temperature > 0: drawn-history requests are greedy",
                        lambda a: a.plan or not a.context or not a.temperature)),
    "--dispatch": (frozenset({PLAN}), None),
    "--scheme": (frozenset({PLAN}), ("needs --dp 1 with all_reduce (the experts' sums are all-reduced over the "
                                     "one TP group)", lambda a: a.scheme != "all_reduce" or a.dp == 1)),
    "--acceptance": (frozenset({PLAN}), ("needs --graph decode (a prefill verifies no drafts)",
                                         lambda a: a.graph == "decode")),
    "--explain": (frozenset({PLAN}), None),
    "--simulate": (frozenset({PLAN}), ("needs --graph decode (a serving run decodes)", lambda a: a.graph == "decode")),
    **{f: (frozenset({PLAN}), ("needs --simulate", lambda a: a.simulate))
       for f in ("--num-prompts", "--random-input-len", "--random-output-len", "--random-prefix-len", "--request-rate",
                 "--max-concurrency")},
    # a run's step budget, cache and prefix cache; with --plan --simulate the simulated engine's
    "--max-num-batched-tokens": (ALL, ("needs --simulate with --plan", lambda a: not a.plan or a.simulate)),
    "--enable-prefix-caching": (ALL, ("needs --simulate with --plan", lambda a: not a.plan or a.simulate)),
    "--no-enable-prefix-caching": (ALL, ("needs --simulate with --plan", lambda a: not a.plan or a.simulate)),
    "--device-profile": (GRAPH_OR_PLAN, ("needs --trace (or OTEL_EXPORTER_OTLP_ENDPOINT)",
                                         lambda a: a.plan or tracing_on(a))),
}


def _context(a, cfg):
    if a.context is None:
        return None
    if not a.plan:
        new = a.new_tokens if a.graph == "decode" else 0
        top = cfg.max_position_embeddings - a.prompt_len - new - 1
        if not 1 <= a.context <= top:
            return (f"must be in [1, {top}] tokens of drawn history with --prompt-len {a.prompt_len} and "
                    f"{new} new tokens {on(a, cfg)} (context limit {cfg.max_position_embeddings}), got {a.context}")
        return None
    low, top = rows_per_request(a.capacity, a.batch // a.dp, a.graph), cfg.max_position_embeddings
    if not low <= a.context <= top:
        return f"must be in [{low}, {top}] tokens per request {on(a, cfg)}, got {a.context}"


def _device_profile(a, cfg):
    """A built-in name or a profile file, loaded and validated field by field before any work."""
    try:
        profile(a.device_profile)
    except ValueError as e:
        return str(e).removeprefix("--device-profile").lstrip(": ")


def _acceptance(a, cfg):
    if not 0.0 <= a.acceptance <= 1.0:
        return f"must be in [0, 1] (a probability per draft), got {a.acceptance:g}"


CHECKS = [("--context", _context), ("--device-profile", _device_profile), ("--acceptance", _acceptance)]


# ---- the plan ------------------------------------------------------------------------------------

GB = 1e9


def plan_command(args, cfg, topo, say) -> int:
    say(f"dsv41 plan {args.graph}: config={cfg.name} tp={topo.tp} dp={topo.dp} ep={topo.ep} wiring={args.wiring}")
    if args.simulate:
        result = simulate_command(args, cfg, topo, say)
        if args.json:
            print(json.dumps(result))
        return 0
    report = plan_report(args, cfg, topo, say)
    if args.json:
        print(json.dumps({"graph": args.graph, "config": cfg.name,
                          "topology": {"tp": topo.tp, "dp": topo.dp, "ep": topo.ep}, "plan": report}))
    return 0


def _parts(breakdown: dict) -> str:
    return ", ".join(f"{k} {breakdown[k] / 1e3:.2f}" for k in PARTS)


def _per_step(report) -> str:
    if not report["acceptance"]:
        return "one token per request per step"
    return (f"{report['tokens_per_request_step']:.2f} tokens per request per step at acceptance "
            f"{report['acceptance']:g} per draft")


def plan_report(args, cfg, topo, say) -> dict:
    context = cfg.max_position_embeddings if args.context is None else args.context
    capacity = args.capacity
    if args.draft_tokens is not None and args.graph == "decode":    # rows per request: 1 + drafts
        capacity = dataclasses.replace(capacity, decode_rows_per_request=1 + args.draft_tokens)
    report, planned = run_plan(cfg, topo, args.batch // topo.dp, context, args.graph, args.wiring,
                               args.device_profile, args.dispatch, args.acceptance, args.scheme, capacity)
    if args.trace:     # files only when asked, as in every other mode
        report["traces"] = write_traces(args.trace, *record_planned(planned, cfg, topo))
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
    if args.max_total_tokens is not None:
        per_group = -(-args.max_total_tokens // topo.dp)
        per = capacity.max_batch_per_dp
        held = BlockManager(cfg, per, context, per_group, step_rows=capacity.prefill_max_tokens).holds(context) * topo.dp
        report["max_total_tokens"], report["requests_held"] = args.max_total_tokens, held
        say(f"  cache budget {args.max_total_tokens} tokens ({per_group} per DP group): holds {held} requests of "
            f"{context} tokens at once ({per} per DP group at most)")
    say(f"  {report['device_profile']} ({report['dispatch']} dispatch, {report['scheme']}): predicted step "
        f"{report['predicted_step_us'] / 1e3:.2f} ms; {report['tokens_per_s_per_request']:.1f} tokens/s per request, "
        f"{report['tokens_per_s']:.0f} tokens/s in total ({_per_step(report)})")
    say(f"  roofline {report['roofline_step_us'] / 1e3:.2f} ms, memory-bound floor {report['floor_us'] / 1e3:.2f} ms")
    # fitted on accelerator decode steps; a CPU profile is measured on this machine
    if args.graph == "decode" and not planned.device.shared_cores:
        report["calibrated"] = calibrated(report, cfg.num_hidden_layers)
        for line in calibration_lines(report["calibrated"], detail=args.explain):
            say(line)
    say(f"  critical path (ms): {_parts(report['breakdown_us'])}")
    if args.explain:
        for line in operator_lines(report["operators"], report["critical_path_us_by_kernel"]):
            say(line)
        rows = sensitivity(planned)
        for line in explain_lines(rows, report["predicted_step_us"]):
            say(line)
        report["sensitivity"] = [dataclasses.asdict(r) for r in rows]
    for c in report["cards"]:
        say(f"  card {c['card']} (ms): {_parts(c['breakdown_us'])}")
    if args.trace:
        say(f"  simulated timeline: {report['traces']['perfetto']}")
    return report


def simulate_command(args, cfg, topo, say) -> dict:
    """A bench-serve workload through the engine's scheduler on the simulated clock (``plan.simulate``)."""
    from dsv41.cli.args import cache_tokens
    from dsv41.plan.simulate import PlaceholderDrafter, PlanPricer, SimulatedEngine, Workload, report_lines, simulate
    work = Workload(args.num_prompts, args.random_input_len, args.random_output_len, args.request_rate,
                    args.max_concurrency, args.random_prefix_len, args.seed)
    work.check()
    drafts = args.draft_tokens if args.draft_tokens is not None else (
        args.capacity.decode_rows_per_request - 1 if args.acceptance else 0)
    budget = args.max_num_batched_tokens or args.capacity.prefill_max_tokens
    context = args.context or min(cfg.max_position_embeddings,
                                  args.random_prefix_len + args.random_input_len + args.random_output_len // 2)
    price = PlanPricer(cfg, topo, args.device_profile, context, drafts, budget, args.capacity.max_batch_per_dp,
                       args.dispatch, args.scheme)
    engine = SimulatedEngine(cfg, args.capacity, price, topo.dp, cache_tokens=cache_tokens(args),
                             prefix_caching=args.enable_prefix_caching, acceptance=args.acceptance, seed=args.seed)
    t0 = time.perf_counter()
    metrics, _ = simulate(engine, work, PlaceholderDrafter(drafts) if drafts else None, budget)
    seconds = time.perf_counter() - t0
    for line in report_lines(metrics):
        say(line)
    traces = None
    if args.trace:      # files only when asked, as in every other mode
        from dsv41.telemetry.simulated import record_simulated
        resource = resource_attributes(cfg, topo, "simulated", args.device_profile)
        traces = write_traces(args.trace, record_simulated(engine, price, resource), resource)
        say(f"  simulated run: {traces['perfetto']}")
    say(f"  {len(engine.steps)} steps simulated in {seconds:.1f} s ({len(price.anchors)} planned steps priced them; "
        f"profile {args.device_profile}, {drafts} drafts at acceptance {args.acceptance:g})")
    return {**metrics, "steps": len(engine.steps), "device_profile": args.device_profile, "drafts": drafts,
            "acceptance": args.acceptance, "planned_steps": len(price.anchors), "simulated_in_s": seconds,
            **({"traces": traces} if traces else {})}
