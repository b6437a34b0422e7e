"""Speculative decoding on this machine: what a verify step costs per row, and what forced acceptance buys.

    python bench/speculative.py --config tiny
    python bench/speculative.py --config flash --layers 3 --experts 8 --engram-rows 4099 --batch 1 --tokens 8

Part 1, step cost: the engine prefills ``--batch`` prompts, then runs ``--steps`` decode steps with
R = 1, 2, 4, 6 rows per request (the last token and R - 1 drafts, all rejected, so every step
starts at the same position); the figure is the median step's wall time and its ratio to R = 1
(``--kinds``: also each node kind's time in those steps, traced).
Part 2, tokens per second: plain greedy generation of ``--tokens`` tokens per request, then the
same generation with an oracle drafter (``engine.drafters.OracleDrafter``) proposing ``--drafts``
tokens a step and forced to an acceptance of 0, 50 and 100% (the accepted drafts are the plain
run's tokens, the next one is wrong); the tokens are checked equal to the plain run's. One torch
thread; wall time (run it on a quiet machine). Part 3, with a model that has DSpark stages: the same
generation with the DSpark drafter. On a graph engine (``--executor sync|threads``) DSpark's seeding
and drafting are nodes of every step, so part 1 also times the 1- and 6-row steps with them, traced:
DSpark's share is its nodes' part of the decode steps' node time (spans marked ``dsv41.part =
draft``), measured inside the same steps, and ``vs_plain_step`` what the step gained over the plain
one timed before (noisier: two runs); on the reference engine the golden drafter runs beside the
steps and its time is summed (``Timed``). ``--parts`` picks the parts to run. Prints one JSON object.

    python bench/speculative.py --config flash --layers 3 --experts 8 --engram-rows 4099 --batch 1 \
        --executor sync --prompt-len 16 --steps 2 --parts 1
    python bench/speculative.py --checkpoint /tmp/flash-L4-E8 --batch 1 --executor sync --parts 1

``--checkpoint``: serve a written checkpoint's weights (``python -m dsv41.checkpoint.write``) instead of
drawing them (minutes a FLASH-width layer); its config.json replaces ``--config`` and the reductions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import PRESETS, Topology
from dsv41.engine.drafters import OracleDrafter
from dsv41.engine.dspark import dspark_drafter
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.telemetry.session import TraceSession


def step_ms(engine, prompts, rows: int, steps: int, cpu: list | None = None) -> float:
    """The median decode step's wall time; ``cpu``: gets the median of this process's CPU time a step
    (all its threads: steadier than the wall time on a shared machine)."""
    out = engine.prefill(prompts)
    rids, last = out.request_ids, out.last
    vocab = engine.cfg.vocab_size
    times, cpu_times = [], []
    try:
        for _ in range(steps):
            drafts = [[(t + 1 + j) % vocab for j in range(rows - 1)] for t in last] if rows > 1 else None
            t0, c0 = time.perf_counter(), time.process_time()
            out = engine.decode(last, rids, drafts)
            times.append((time.perf_counter() - t0) * 1e3)
            cpu_times.append((time.process_time() - c0) * 1e3)
            # every draft rejected: the next step feeds the model's own token at the next position
            last = out.last
    finally:
        for r in rids:
            engine.release(r)
    if cpu is not None:
        cpu.append(statistics.median(cpu_times))
    return statistics.median(times)


def kind_ms(records: list[dict]) -> dict[str, float]:
    """Node kind -> median over the decode steps of its node spans' summed wall time, in ms."""
    by_step: dict = {}
    for r in records:
        a = r["attributes"]
        if a.get("dsv41.span") == "node" and a["dsv41.phase"] == "decode":
            step = by_step.setdefault(a["dsv41.step"], {})
            step[a["dsv41.kernel"]] = step.get(a["dsv41.kernel"], 0.0) + (r["end_ns"] - r["start_ns"]) / 1e6
    kinds = {k for s in by_step.values() for k in s}
    return {k: statistics.median(s.get(k, 0.0) for s in by_step.values()) for k in sorted(kinds)}


def draft_share(records: list[dict]) -> float:
    """Of the decode steps' node time (node spans, ``telemetry``), the part in DSpark's nodes."""
    time = {"draft": 0, "target": 0}
    for r in records:
        a = r["attributes"]
        if a.get("dsv41.span") == "node" and a["dsv41.phase"] == "decode":
            time[a["dsv41.part"]] += r["end_ns"] - r["start_ns"]
    return time["draft"] / (time["draft"] + time["target"])


def forced(truth: list[list[int]], prompts, rate: float, vocab: int):
    """An oracle that accepts round(rate * drafts) of each step's drafts (alternating up and down
    so the mean is the rate), then proposes a wrong token."""
    steps = {}

    def propose(job, room):
        i = prompts.index(job.prompt)
        n = steps[i] = steps.get(i, -1) + 1
        m, t = len(job.made), truth[i]
        want = rate * room
        a = min(room, int(want) + (1 if (want - int(want)) * 2 >= 1 and n % 2 == 0 else 0))
        drafts = t[m:m + a]
        if a < room:
            drafts = drafts + [(t[m + a] + 1) % vocab] + t[m + a + 1:m + room]
        return drafts[:room]
    return OracleDrafter(propose)


class Timed:
    """A drafter whose seeding and drafting time is added up (the drafter's share of a step)."""

    def __init__(self, drafter):
        self.drafter, self.seconds = drafter, 0.0

    def __getattr__(self, name):
        fn = getattr(self.drafter, name)

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def generation(engine, prompts, tokens: int, drafter=None):
    jobs = requests_for(prompts, None, tokens, None)
    sched = Scheduler(engine, drafter)
    t0 = time.perf_counter()
    turns = sched.run(jobs)
    wall = time.perf_counter() - t0
    decode_s = sum(t.ms for t in turns if t.phase == "decode") / 1e3
    made = sum(len(j.made) for j in jobs)
    return [j.made for j in jobs], {"wall_s": wall, "decode_steps": sum(t.phase == "decode" for t in turns),
                                    "decode_s": decode_s, "tokens": made,
                                    "decode_tokens_per_s": (made - len(jobs)) / decode_s if decode_s else None,
                                    "acceptance": sched.spec.summary()["acceptance"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--engram-rows", type=int, default=None, help="rows per Engram table (FLASH's are 12 GB)")
    p.add_argument("--checkpoint", help="serve the weights from this checkpoint folder")
    p.add_argument("--executor", default="reference", choices=("reference", "sync", "threads"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="decode steps timed per row count (median)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per request in part 2")
    p.add_argument("--drafts", type=int, default=5)
    p.add_argument("--parts", default="1,2,3", help="which parts to run (comma-separated of 1, 2, 3)")
    p.add_argument("--kinds", action="store_true", help="part 1 on a graph engine: trace the steps and add each "
                                                        "node kind's median time a step (kind_ms, by rows)")
    args = p.parse_args()
    parts = {int(x) for x in args.parts.split(",")}
    if not parts <= {1, 2, 3}:
        raise SystemExit(f"--parts: must name parts among 1, 2, 3, got {args.parts!r}")
    torch.set_num_threads(1)
    ckpt = None
    if args.checkpoint:
        from dsv41.checkpoint.reader import open_checkpoint
        ckpt = open_checkpoint(args.checkpoint)
    cfg = ckpt.cfg if ckpt else PRESETS[args.config].reduced(args.layers, args.experts, args.engram_rows)
    ctx = args.prompt_len + max(args.tokens, args.steps * 6) + 8
    if args.executor == "reference":
        engine = ReferenceEngine(cfg, seed=0, max_batch=args.batch, max_context=ctx, checkpoint=ckpt)
    else:
        settings = EngineConfig(seed=0, executor=args.executor, max_batch=args.batch, max_context=ctx)
        engine = GraphEngine(cfg, Topology(args.tp, args.dp, args.tp * args.dp), settings, checkpoint=ckpt)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    out = {"config": cfg.name, "layers": len(cfg.layers), "experts": cfg.n_routed_experts, "hidden": cfg.hidden_size,
           "executor": args.executor, "topology": f"tp{args.tp}-dp{args.dp}", "batch": args.batch,
           "prompt_len": args.prompt_len, "step_ms": {}, "generation": {}}
    graph = args.executor != "reference"
    try:
        if 1 in parts:
            base = cpu_base = None
            for rows in (1, 2, 4, 6):
                session = TraceSession(engine) if args.kinds and graph else None
                cpu = []
                try:
                    ms = step_ms(engine, prompts, rows, args.steps, cpu)
                    if session is not None:
                        out.setdefault("kind_ms", {})[rows] = kind_ms(session.collect())
                finally:
                    if session is not None:
                        session.close()
                base, cpu_base = base or ms, cpu_base or cpu[0]
                out["step_ms"][rows] = {"ms": ms, "ratio": ms / base, "cpu_ms": cpu[0], "cpu_ratio": cpu[0] / cpu_base}
                print(f"rows/request {rows}: {ms:9.1f} ms  x{ms / base:.2f}  (CPU time {cpu[0]:9.1f} ms  "
                      f"x{cpu[0] / cpu_base:.2f})", flush=True)
            if cfg.dspark and graph:           # the same steps seeding and drafting DSpark's next block
                engine.dspark, out["step_ms_dspark"] = True, {}
                for rows in (1, 6):
                    session = TraceSession(engine)
                    try:
                        ms = step_ms(engine, prompts, rows, args.steps)
                        share = draft_share(session.collect())
                    finally:
                        session.close()
                    out["step_ms_dspark"][rows] = {"ms": ms, "dspark_node_share": share,
                                                   "vs_plain_step": 1 - out["step_ms"][rows]["ms"] / ms}
                    print(f"rows/request {rows} with DSpark: {ms:9.1f} ms  DSpark's nodes {share:.0%} of the "
                          f"decode steps' node time", flush=True)
                engine.dspark = False
        if parts & {2, 3}:
            truth, plain = generation(engine, prompts, args.tokens)
            out["generation"]["plain"] = plain
            print(f"plain: {plain}", flush=True)
        if 2 in parts:
            for rate in (0.0, 0.5, 1.0):
                made, row = generation(engine, prompts, args.tokens, forced(truth, prompts, rate, cfg.vocab_size))
                if made != truth:
                    raise SystemExit(f"acceptance {rate}: tokens differ from plain generation")
                out["generation"][f"accept_{int(rate * 100)}"] = row
                print(f"forced acceptance {rate:.0%}: {row}", flush=True)
        if 3 in parts and cfg.dspark:
            drafter = dspark_drafter(engine)
            timed = None if graph else Timed(drafter)
            made, row = generation(engine, prompts, args.tokens, timed or drafter)
            if made != truth:
                raise SystemExit("dspark: tokens differ from plain generation")
            if timed is not None:
                row["drafter_s"] = timed.seconds
                row["drafter_share_of_decode"] = timed.seconds / (row["decode_s"] + timed.seconds)
            out["generation"]["dspark"] = row
            print(f"dspark: {row}", flush=True)
    finally:
        engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
