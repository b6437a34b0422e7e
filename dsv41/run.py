"""Command line: ``python -m dsv41.run --graph decode|prefill``.

Runs a prefill of ``--batch`` random prompts of ``--prompt-len`` tokens (or, with ``--checkpoint``,
the ``--prompt`` texts), then (decode) greedy steps, on the chosen executor, and prints a readable
summary or one JSON object (``--json``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

from dsv41.checkpoint.cli import open_for_text
from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.text import TextStream
from dsv41.config import PRESETS, Topology
from dsv41.kernels.device_time import BACKENDS
from dsv41.plan import cli as plan_cli
from dsv41.telemetry import cli as telemetry

EXECUTORS = ("threads", "sync", "distributed", "reference")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsv41.run", description=__doc__.splitlines()[0])
    p.add_argument("--graph", choices=("decode", "prefill"), default="decode")
    p.add_argument("--config", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor", choices=EXECUTORS, default="threads")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--ep", type=int, default=None, help="default tp*dp")
    p.add_argument("--granularity", choices=("submission", "node"), default="submission")
    p.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="pypto-sim: values from Torch, simulated device time per pypto-backed node")
    p.add_argument("--wiring", choices=("sharded", "replicated"), default="sharded")
    p.add_argument("--address", default=None, help="distributed: connect to this scheduler")
    p.add_argument("--dashboard", action="store_true", help="distributed: print the dashboard link and wait")
    p.add_argument("--hold", type=float, default=None, help="with --dashboard: seconds to wait instead of Enter")
    p.add_argument("--show-graph", default=None, metavar="PATH", help="write the decode graph as DOT (SVG if .svg)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true",
                   help="check every node against the Torch golden on its inputs (sync/threads executors)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="serve a checkpoint folder in the released layout (its config.json replaces --config)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT", help="with --checkpoint; repeatable")
    p.add_argument("--prompt-file", default=None, metavar="PATH", help="with --checkpoint: one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template to each prompt")
    telemetry.add_arguments(p)
    a = p.parse_args(argv)
    if a.ep is None:
        a.ep = a.tp * a.dp
    for name in ("batch", "prompt_len"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.new_tokens < 0:
        p.error("--new-tokens must be >= 0")
    for flag, given in (("--prompt", a.prompt), ("--prompt-file", a.prompt_file), ("--chat", a.chat)):
        if given and not a.checkpoint:
            p.error(f"{flag}: needs --checkpoint (the tokenizer comes from the checkpoint)")
    if a.chat and not (a.prompt or a.prompt_file):
        p.error("--chat: needs --prompt or --prompt-file")
    telemetry.check_arguments(p, a)
    if a.check and a.executor not in ("sync", "threads"):
        p.error(f"--check runs in this process: --executor must be sync or threads, got {a.executor}")
    return a


def prompts_for(cfg, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=g).tolist()


def logits_sha256(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.detach().float().contiguous().numpy().tobytes()).hexdigest()


def make_engine(args, cfg, topo, prompts, checkpoint=None):
    max_context = max(map(len, prompts)) + args.new_tokens + 1
    if args.executor == "reference":
        from dsv41.ops.reference import ReferenceModel
        return ReferenceModel(cfg, seed=args.seed, max_batch=len(prompts), max_context=max_context,
                              checkpoint=checkpoint)
    from dsv41.cluster.engine import GraphEngine
    return GraphEngine(cfg, topo, seed=args.seed, executor=args.executor, granularity=args.granularity,
                       wiring=args.wiring, max_batch=len(prompts), address=args.address, dashboard=args.dashboard,
                       max_context=max_context, backend=args.backend, checkpoint=checkpoint)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ckpt, codec, encoded = open_for_text(args.checkpoint, args.prompt, args.prompt_file, args.chat)
    except ValueError as e:   # CheckpointError included: nothing is served from a bad checkpoint
        return _refuse(e)
    cfg = PRESETS[args.config] if ckpt is None else ckpt.cfg
    topo = Topology(1, 1, 1) if args.executor == "reference" else Topology(args.tp, args.dp, args.ep).check(cfg)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.plan:
        return plan_cli.plan_command(args, cfg, topo, say)
    prompts = encoded or prompts_for(cfg, args.batch, args.prompt_len, args.seed)
    say(f"dsv41 {args.graph}: config={cfg.name} executor={args.executor} tp={topo.tp} dp={topo.dp} ep={topo.ep} "
        f"batch={len(prompts)} prompt_len={max(map(len, prompts))}")
    t0 = time.perf_counter()
    try:
        engine = make_engine(args, cfg, topo, prompts, ckpt)
    except CheckpointError as e:   # a value found bad as the weights were read, before any step
        return _refuse(e)
    say(f"  built in {time.perf_counter() - t0:.2f} s")
    tracing = telemetry.start(args, engine)
    checker = _start_check(args, engine)
    stats = []

    t0 = time.perf_counter()
    logits = engine.prefill(prompts)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    stats.append(getattr(engine, "last_stats", {}))
    say(f"  prefill   {prefill_ms:9.1f} ms  {_describe(stats[-1])}")
    rids = list(engine.last_request_ids)
    tokens = [[] for _ in prompts]
    step_ms = []
    steps = args.new_tokens if args.graph == "decode" else 0
    stream = TextStream(codec, len(prompts)) if codec is not None else None
    live = list(range(len(prompts)))      # requests still generating (EOS ends one)
    for i in range(steps):
        nxt = dict(zip(live, torch.argmax(logits, -1).tolist()))
        for j, t in nxt.items():
            tokens[j].append(t)
        if stream is not None:
            live = stream.step(nxt, say)
        if i + 1 == steps or not live:
            break
        t0 = time.perf_counter()
        logits = engine.decode([nxt[j] for j in live], [rids[j] for j in live])
        step_ms.append((time.perf_counter() - t0) * 1e3)
        stats.append(getattr(engine, "last_stats", {}))
        say(f"  decode {i + 1:3d} {step_ms[-1]:9.1f} ms  {_describe(stats[-1])}")
    if stream is not None:
        stream.finish(say)
    if args.graph == "prefill":
        tokens = [[t] for t in torch.argmax(logits, -1).tolist()]
    result = {
        "graph": args.graph, "config": cfg.name, "executor": args.executor,
        "topology": {"tp": topo.tp, "dp": topo.dp, "ep": topo.ep},
        "tokens": tokens, "step_ms": step_ms, "prefill_ms": prefill_ms,
        "last_logits_sha256": logits_sha256(logits),
    }
    if codec is not None:
        result["text"] = [codec.decode(t) for t in tokens]
    if args.executor != "reference":
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
            _finish_check(checker, result, say)
        if args.show_graph:
            engine.write_graph(args.show_graph)
            say(f"  graph written to {args.show_graph}")
        if tracing is not None:
            tracing.finish(result, say)
        if args.dashboard:
            engine.hold_dashboard(args.hold, say)
        engine.close()
    if args.json:
        print(json.dumps(result))
    else:
        say(f"  tokens: {tokens}")
        for j, text in enumerate(result.get("text", [])):
            say(f"  text[{j}]: {text!r}")
        say(f"  last_logits_sha256: {result['last_logits_sha256']}")
    return 0


def _start_check(args, engine):
    if not args.check:
        return None
    from dsv41.kernels.check import NodeCheck
    checker = NodeCheck(args.backend)
    engine.check_nodes(checker)
    return checker


def _finish_check(checker, result, say):
    say(checker.table())
    result["check"] = checker.summary()


def _refuse(e: ValueError) -> int:
    flag = "" if str(e).startswith("--") else "--checkpoint: "
    print(f"python -m dsv41.run: error: {flag}{e}", file=sys.stderr)
    return 2


def _describe(stats: dict) -> str:
    if not stats:
        return ""
    if "device_sim_us" in stats:
        return (f"nodes={stats['nodes']} submissions={stats['submissions']} dask_tasks={stats['dask_tasks']} "
                f"device_sim={stats['device_sim_us']:.1f} us")
    return f"nodes={stats['nodes']} submissions={stats['submissions']} dask_tasks={stats['dask_tasks']}"


if __name__ == "__main__":
    sys.exit(main())
