"""Command line: ``python -m dsv41.run --graph decode|prefill``.

Runs a prefill of ``--batch`` random prompts of ``--prompt-len`` tokens (or, with ``--checkpoint``,
the ``--prompt`` texts), then (decode) greedy steps, on the chosen executor, and prints a readable
summary or one JSON object (``--json``). Every argument is checked before any work; ``dsv41.cli.args``
holds the rules.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from dsv41.checkpoint.errors import CheckpointError
from dsv41.cli import args as rules
from dsv41.cli import plan, sampling, speculative, trace
from dsv41.cli.interrupt import raise_terminated, stopped
from dsv41.cli.modes import max_context, topology
from dsv41.cli.progress import Progress, tolerant_streams
from dsv41.cli.prompts import prompts_for
from dsv41.cluster.connect import DEFAULT_TIMEOUT_S, ConnectError, Startup
from dsv41.config import PRESETS
from dsv41.engine.request import Request, requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.kernels.device_time import BACKENDS
from dsv41.model.finite import NonFiniteError
from dsv41.names import DEFAULT_EXECUTOR, EXECUTORS, REFERENCE
from dsv41.telemetry.export import TRACES

PROG = rules.PROG
EPILOG = """\
modes and the flags that go with them:
  every mode        --graph --config --checkpoint --batch --json --debug
                    --layers --experts --engram-rows (reduce --config's model)
  a run             --prompt-len --seed --new-tokens (--graph decode only) --context (drawn history first)
                    --prompt --prompt-file (with --checkpoint) --chat --allow-special-tokens (with a prompt)
                    --temperature; with it --top-p --top-k --min-p --sample-seed; --stop (with --checkpoint)
  graph executors   --tp --dp --ep --wiring --granularity --backend --show-graph --trace --device-profile
  sync, threads     --check; with it and a pypto --backend, --pypto-per-shape
  distributed       --address --connect-timeout --dashboard --hold (with --dashboard) --report
  --plan            --tp --dp --ep --wiring --context (tokens per request) --dispatch --trace --device-profile
--batch is the number of requests in total, everywhere: a run spreads them over the DP groups,
--plan spreads them evenly (so it must be a multiple of --dp). With --checkpoint its config.json is
the config (no --config); with --prompt/--prompt-file the batch is the prompts (no --batch,
--prompt-len or --seed). Files go under ./traces/ only.
"""


def add_model_arguments(p) -> None:
    """The flags that say which model runs where: shared with ``python -m dsv41.serve``."""
    p.add_argument("--config", choices=sorted(PRESETS), default="tiny")
    rules.add_reductions(p)
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="serve a checkpoint folder in the released layout (its config.json replaces --config)")
    p.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="with --checkpoint: skip hashing every tensor against the SHA-256 its index lists "
                        "(a start-up read of the whole folder: 0.4-0.5 GB/s on a 2-core machine, docs/checkpoints.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor", choices=EXECUTORS, default=DEFAULT_EXECUTOR,
                   help="threads (default) was the fastest in most measured runs; on a quiet machine try sync "
                        "(one submission at a time, same tokens); distributed runs one dask worker per card and "
                        "has the dashboard; reference is the monolithic model (README: Choosing an executor)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--ep", type=int, default=None, help="must equal tp*dp (the default)")
    p.add_argument("--granularity", choices=("submission", "node"), default="submission")
    p.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="pypto-sim: values from Torch, simulated device time per pypto-backed node")
    p.add_argument("--wiring", choices=("sharded", "replicated"), default="sharded")
    p.add_argument("--address", default=None, help="distributed: join this scheduler (e.g. tcp://host:8786), whose "
                   "workers are named 0..EP-1 with one thread each")
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="distributed: give up when the scheduler and every card's worker are not there "
                        "within this time (default: %(default)g s)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def add_budget_arguments(p):
    """The step's token budget and the cache's (run and serve)."""
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="rows one step feeds per DP group: prompt chunks fill what the decoding requests leave "
                        "(default and at most the model's prefill capacity); smaller trades time to first token "
                        "for inter-token latency")
    p.add_argument("--max-total-tokens", type=int, default=None, metavar="N",
                   help="tokens the cache pools hold in all, split over the DP groups (default: every request at "
                        "its full context); requests that do not fit wait, or are preempted and recomputed; "
                        "--plan: how many requests of --context tokens it holds")


def add_prefix_caching_argument(p, default: bool):
    """--enable-prefix-caching / --no-enable-prefix-caching (vLLM's flags; serve's default on, run's off)."""
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=default,
                   help="reuse the caches of prompt prefixes computed before, per DP group, in spans of 2 x "
                        "block_size tokens; cached blocks nobody holds are evicted least recently used first "
                        "(default: %s)" % ("on" if default else "off"))


MODEL_FLAGS = ("--config", "--layers", "--experts", "--engram-rows", "--checkpoint", "--no-verify-checksums", "--seed",
               "--executor", "--tp", "--dp", "--ep", "--granularity", "--backend", "--wiring", "--address",
               "--connect-timeout", "--debug", "--help")


def build_parser() -> rules.Parser:
    p = rules.Parser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", choices=("decode", "prefill"), default="decode")
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=4,
                   help="requests in total (spread over the DP groups; --plan: evenly)")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=8, help="--graph decode: tokens generated per request")
    add_budget_arguments(p)
    add_prefix_caching_argument(p, False)
    p.add_argument("--dashboard", action="store_true",
                   help="distributed: print the dashboard link when the cluster is up and wait after the run")
    p.add_argument("--hold", type=float, default=None, help="with --dashboard: seconds to wait instead of Enter")
    p.add_argument("--show-graph", default=None, metavar="NAME",
                   help="write the last step's graph as traces/NAME (NAME.dot, or NAME.svg with graphviz)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (progress goes to stderr)")
    p.add_argument("--check", action="store_true",
                   help="check every node against the Torch golden on its inputs (sync/threads executors)")
    p.add_argument("--pypto-per-shape", type=int, default=2, metavar="N",
                   help="with --check and a pypto backend: pypto computes the first N nodes of each kernel and "
                        "shape (each call compiles, ~1-2 s), the rest are checked on their Torch values; 0: every node")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="with --checkpoint; repeatable (the batch is the number of prompts)")
    p.add_argument("--prompt-file", default=None, metavar="PATH", help="with --checkpoint: one prompt per line")
    p.add_argument("--chat", action="store_true",
                   help="each prompt as one user turn of a chat: the checkpoint's chat_template, or the "
                        "DeepSeek-V4 chat encoding when it has none")
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="parse the prompts' text for control tokens (by default the text of EOS, <｜User｜>... "
                        "stays plain text; only the chat template inserts them)")
    sampling.add_arguments(p.add_argument_group("sampling"))
    speculative.add_arguments(p.add_argument_group("speculative decoding"))
    g = p.add_argument_group("telemetry")
    trace.add_arguments(g)
    plan.add_arguments(g)
    return p


APPLIES = {**rules.APPLIES, **sampling.APPLIES, **speculative.APPLIES, **trace.APPLIES, **plan.APPLIES}
FIRST = rules.FIRST     # before the config is known (it may come from --checkpoint)
CHECKS = rules.CHECKS + sampling.CHECKS + speculative.CHECKS + trace.CHECKS + plan.CHECKS + rules.LAST


def parse_args(argv=None, parser: rules.Parser | None = None):
    """Parsed and checked arguments; a usage error exits 2 with one line (raises with --debug).

    With --checkpoint, its config.json is read and the prompts encoded here (``rules.model_config``):
    ``codec`` and ``prompt_ids`` are set, and --batch/--prompt-len become the prompts' count and length.
    """
    return rules.parse_checked(parser or build_parser(), argv, APPLIES, _check_values)


def _check_values(a) -> None:
    rules.run_checks(a, None, FIRST, APPLIES)
    rules.run_checks(a, rules.model_config(a), CHECKS, APPLIES)
    if a.executor != REFERENCE or a.plan:
        rules.check_environment()


def main(argv=None) -> int:
    tolerant_streams()
    parser = build_parser()
    if sys.stdout is None:      # started with stdout closed (>&-): the answer would vanish, exit 0
        parser.error("stdout is closed; the run's answer has nowhere to go (redirect it, e.g. to a file)")
    args = parse_args(argv, parser)
    main_thread = threading.current_thread() is threading.main_thread()   # where signals are handled
    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None
    try:
        return run(args)
    except ConnectError as e:
        if args.debug:
            raise
        parser.error(str(e))
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        return stopped(parser.prog, e, leave=main_thread and argv is None)    # the process is the command's
    except Exception as e:   # a failure past the checks: one line, the traceback only with --debug
        if args.debug:
            raise
        print(f"{parser.prog}: error: {type(e).__name__}: {e} (--debug shows the traceback)", file=sys.stderr)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def run(args) -> int:
    ckpt = None
    if args.checkpoint is not None:
        from dsv41.checkpoint.reader import open_checkpoint
        try:
            # every header checked (and every tensor's digest): nothing is served from a bad folder
            ckpt = open_checkpoint(args.checkpoint, args.verify_checksums)
        except CheckpointError as e:
            return _refuse(e, args)
        except OSError as e:      # a file of the folder that cannot be read (permissions)
            return _refuse(rules.unreadable(e), args)
        rules.warn_unverified(PROG, args, ckpt)
        if args.speculative == "dspark":
            try:
                ckpt.require_dspark()
            except CheckpointError as e:
                return _refuse(e, args)
    cfg = rules.resolve_model(args, ckpt)
    topo = topology(args)
    progress = Progress(args.json)
    if args.plan:
        return plan.plan_command(args, cfg, topo, progress.say)
    progress.say(f"dsv41 {args.graph}: config={cfg.name} executor={args.executor} tp={topo.tp} dp={topo.dp} "
                 f"ep={topo.ep} batch={args.batch} prompt_len={args.prompt_len}")
    t0 = time.perf_counter()
    try:
        engine = make_engine(args, cfg, topo, progress, ckpt)
    except CheckpointError as e:   # a value found bad as the weights were read, before any step
        return _refuse(e, args)
    except OSError as e:
        return _refuse(rules.unreadable(e), args)
    try:
        progress.say(f"  built in {time.perf_counter() - t0:.2f} s")
        return generate(args, cfg, topo, engine, progress)
    except NonFiniteError as e:   # the checkpoint's numbers overflow: its fault, like a bad value read
        if ckpt is None:
            raise
        return _refuse(e, args)
    finally:
        engine.close()


def make_engine(args, cfg, topo, progress: Progress, checkpoint=None):
    context = max_context(args)
    if args.executor == REFERENCE:
        from dsv41.engine.reference import ReferenceEngine
        return ReferenceEngine(cfg, seed=args.seed, max_batch=args.batch, max_context=context, checkpoint=checkpoint,
                               cache_tokens=rules.cache_tokens(args), prefix_caching=args.enable_prefix_caching,
                               capacity=args.capacity)
    from dsv41.cluster.engine import GraphEngine
    from dsv41.cluster.settings import EngineConfig
    startup = Startup(args.connect_timeout, progress.on_workers, progress.on_ready)
    settings = EngineConfig(seed=args.seed, executor=args.executor, granularity=args.granularity, wiring=args.wiring,
                            capacity=args.capacity, max_batch=args.batch, max_context=context,
                            cache_tokens=rules.cache_tokens(args),
                            prefix_caching=args.enable_prefix_caching, backend=args.backend, address=args.address,
                            dashboard=args.dashboard, startup=startup)
    return GraphEngine(cfg, topo, settings, checkpoint=checkpoint)


def _refuse(problem, args) -> int:
    """A checkpoint found bad past the up-front checks: the usage-error line, exit status 2
    (--debug: the exception being handled)."""
    if args.debug:
        raise
    print(f"{PROG}: error: --checkpoint: {problem}", file=sys.stderr)
    return 2


# ---- the generation --------------------------------------------------------------------------------

def generate(args, cfg, topo, engine, progress: Progress) -> int:
    """The steps, then the result: printed, or one JSON object with --json."""
    tracing = trace.start(args, engine)
    try:
        checker = _start_check(args, engine)
        done = run_steps(args, engine, args.prompt_ids or prompts_for(cfg, args.batch, args.prompt_len, args.seed),
                         progress)
        result = summary(args, cfg, topo, done)
        if not args.json:       # the answer before the optional outputs: a file that fails cannot lose it
            _show(args, result, progress.say)
        try:
            if args.executor != REFERENCE:
                _graph_run(args, engine, done, result, checker, tracing, progress.say)
        finally:
            if args.json:       # one object, with what the outputs added, also when one of them failed
                _show(args, result, progress.say)
        return 0
    finally:
        if tracing is not None:
            tracing.close()


def logits_sha256(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.detach().float().contiguous().numpy().tobytes()).hexdigest()


@dataclass
class Steps:
    """What the steps gave: tokens per request, wall time per step, the engine's stats per step, the
    logits each request's last token came from, and speculative decoding's counts."""
    tokens: list[list[int]]
    texts: list[str] | None = None     # with a checkpoint: each request's text, cut before a stop string
    prefill_ms: float = 0.0
    prefill_steps: int = 0             # steps until every request had its first token (-1 once they all had)
    step_ms: list[float] = field(default_factory=list)
    # this process's CPU time per decode step, all its threads (on a shared machine a steadier cost than
    # the wall time; with workers in other processes, only this process's part)
    step_cpu_ms: list[float] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    final_logits: torch.Tensor | None = None
    speculative: dict | None = None
    prefix_cache: dict | None = None   # with --enable-prefix-caching: cached prompt tokens per request, queries, hits


class ShownJob(Request):
    """A run's request: its text printed as it grows (with a checkpoint)."""
    say = None
    index = 0
    eos = None

    def emit(self, kind: str, **f):
        if kind == "token" and self.say is not None:
            ended = self.stops.finish == "stop"
            if f["text"] or ended:
                mark = (" <eos>" if f["token"] == self.eos else " <stop>") if ended else ""
                self.say(f"    [{self.index}] {f['text']!r}{mark}")


def run_steps(args, engine, prompts: list[list[int]], progress: Progress) -> Steps:
    """Prefill, then (decode) up to --new-tokens tokens per request (greedy, or drawn on the card with
    the sampling flags), scheduled by ``engine.scheduler`` (with --speculative: verify steps); with a
    checkpoint's text, a request ends at its EOS or a --stop string and its text streams as it grows."""
    params = [sampling.params(args, j) for j in range(len(prompts))]
    context = args.context or 0
    n = args.new_tokens if args.graph == "decode" else 0
    codec = args.codec
    jobs = requests_for(prompts, params, max(n, 1), codec.decode if codec is not None else None,
                        codec.eos_id if codec is not None else None, cls=ShownJob)
    for j, job in enumerate(jobs):
        job.say, job.index = (progress.say if codec is not None and n else None), j
        job.eos = codec.eos_id if codec is not None else None
    sched = Scheduler(engine, speculative.drafter(args, engine), budget=args.max_num_batched_tokens, keep_logits=True,
                      context=context)
    for job in jobs:
        sched.add(job)
    done = Steps(tokens=[[] for _ in prompts])
    with progress.steps(1 + max(0, n - 1)), progress.compilations():
        progress.start(f"prefill {len(prompts)} x {args.prompt_len} tokens" +
                       (f" after {context} drawn" if context else ""))
        try:
            while sched.busy:
                cpu0 = time.process_time()
                turn = sched.step()
                cpu_ms = (time.process_time() - cpu0) * 1e3
                if turn is None:
                    continue
                done.stats.append(turn.stats)
                if done.prefill_steps >= 0:          # prompts still being fed: their chunks are the prefill
                    done.prefill_ms += turn.ms
                    done.prefill_steps += 1
                    if all(j.made for j in jobs):
                        chunks = f" in {done.prefill_steps} steps" if done.prefill_steps > 1 else ""
                        progress.done(f"  prefill   {done.prefill_ms:9.1f} ms{chunks}  {_describe(turn.stats)}")
                        done.prefill_steps = -1    # every request has its first token
                else:
                    done.step_ms.append(turn.ms)
                    done.step_cpu_ms.append(cpu_ms)
                    made = f"  +{sum(map(len, turn.out.tokens))} tokens" if turn.out is not None and \
                        turn.out.proposed else ""
                    progress.done(f"  {turn.phase} {len(done.step_ms):3d} {turn.ms:9.1f} ms  "
                                  f"{_describe(turn.stats)}{made}")
                if sched.busy and done.prefill_steps < 0:
                    progress.start(f"{'decode' if not sched.waiting else 'prefill'} {len(done.step_ms) + 1}")
        finally:
            sched.release_all()
    done.tokens = [j.made for j in jobs] if n or args.graph == "prefill" else [[] for _ in jobs]
    done.final_logits = torch.stack([j.final_logits for j in jobs])
    if sched.drafter is not None:
        done.speculative = sched.spec.summary()
    if args.enable_prefix_caching:
        done.prefix_cache = {"cached_tokens": [j.cached for j in jobs], "queries": sched.prefix_queries,
                             "hits": sched.prefix_hits}
    if codec is not None:
        for j, job in enumerate(jobs):
            rest = job.stops.text[job.stops.shown:]
            if rest and n:
                job.stops.shown = len(job.stops.text)
                progress.say(f"    [{j}] {rest!r}")
        done.texts = [job.stops.text for job in jobs] if n else [codec.decode(t) for t in done.tokens]
    return done


def summary(args, cfg, topo, done: Steps) -> dict:
    result = {
        "graph": args.graph, "config": cfg.name, "executor": args.executor,
        "topology": {"tp": topo.tp, "dp": topo.dp, "ep": topo.ep},
        "tokens": done.tokens, "step_ms": done.step_ms, "step_cpu_ms": done.step_cpu_ms, "prefill_ms": done.prefill_ms,
        "context": args.context or 0,
        # the logits each request's last token came from: the only logits that come home
        "last_logits_sha256": logits_sha256(done.final_logits),
    }
    if done.speculative is not None:
        result["speculative"] = done.speculative
    if done.prefix_cache is not None:
        result["prefix_cache"] = done.prefix_cache
    if done.texts is not None:
        result["text"] = done.texts
    return result


def _graph_run(args, engine, done: Steps, result: dict, checker, tracing, say) -> None:
    """What only a graph executor has: node counts, simulated device time, the check, the graph
    file, the traces and the dashboard."""
    stats = done.stats
    last = stats[-1]
    result.update(nodes=last.get("nodes"), submissions=last.get("submissions"),
                  dask_tasks=last.get("dask_tasks"), granularity=args.granularity, wiring=args.wiring,
                  backend=args.backend, cards=last.get("cards"), host_ms=[s.get("host_ms") for s in stats],
                  recovered=[r for s in stats for r in s.get("recovered", [])])
    if args.backend != "torch":
        result.update(device_sim_us=[s["device_sim_us"] for s in stats],
                      pypto_kernels=sorted({k for s in stats for k in s["pypto_kernels"]}))
        say(f"  {args.backend} kernels: {', '.join(result['pypto_kernels'])}")
        say(f"  torch only: {', '.join(sorted(engine.last_graph.kernels() - set(result['pypto_kernels'])))}")
    if checker is not None:
        say(checker.table())
        result["check"] = checker.summary()
    if args.show_graph:
        path = TRACES / args.show_graph
        path.parent.mkdir(exist_ok=True)
        engine.write_graph(str(path))
        result["graph_file"] = str(path)
        say(f"  graph written to {path}")
    if tracing is not None:
        tracing.finish(result, say)
    if args.dashboard:
        engine.hold_dashboard(args.hold, say)


def _show(args, result: dict, say) -> None:
    if args.json:
        print(json.dumps(result))
        return
    say(f"  tokens: {result['tokens']}")
    for j, text in enumerate(result.get("text", [])):
        say(f"  text[{j}]: {text!r}")
    say(f"  last_logits_sha256: {result['last_logits_sha256']}")


def _start_check(args, engine):
    if not args.check:
        return None
    from dsv41.kernels.check import NodeCheck
    checker = NodeCheck(args.backend, pypto_per_shape=args.pypto_per_shape)
    engine.check_nodes(checker)
    return checker


def _describe(stats: dict) -> str:
    if not stats:
        return ""
    line = f"nodes={stats['nodes']} submissions={stats['submissions']} dask_tasks={stats['dask_tasks']}"
    return line + (f" device_sim={stats['device_sim_us']:.1f} us" if "device_sim_us" in stats else "")
