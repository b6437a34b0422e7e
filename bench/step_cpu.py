"""CPU time of a decode step: graph layouts on the one-process executors against the reference.

    python bench/step_cpu.py --config tiny
    python bench/step_cpu.py --config small --steps 3 --profile 15

Each engine prefills the same prompts (batch 4, 32 tokens by default), then runs --steps decode
steps; the figure is the median step's process CPU time (``time.process_time``) with one Torch
thread, so it counts the math and the host work the step costs and stays meaningful on a machine
other jobs share (wall time there measures the neighbours). Prints one JSON object with each
layout's step time and its ratio to the reference; ``--profile N`` adds the N largest own-time
functions of one TP2/DP2/EP4 sync step (cProfile).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import PRESETS, Topology
from dsv41.engine.reference import ReferenceEngine

LAYOUTS = {"tp1_sync": ((1, 1), "sync"), "tp1_threads": ((1, 1), "threads"), "tp2dp2ep4_sync": ((2, 2), "sync")}


def step_cpu_ms(engine, prompts, steps: int, profile: cProfile.Profile | None = None) -> tuple[float, list[int]]:
    logits = engine.prefill(prompts).logits
    rids = list(engine.last_request_ids)
    times = []
    for i in range(steps):
        toks = torch.argmax(logits, -1).tolist()
        if profile is not None and i == steps - 1:
            profile.enable()
        t0 = time.process_time()
        logits = engine.decode(toks, rids).logits
        times.append((time.process_time() - t0) * 1e3)
        if profile is not None and i == steps - 1:
            profile.disable()
    return statistics.median(times), torch.argmax(logits, -1).tolist()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--profile", type=int, default=0, help="top N functions of one TP2/DP2/EP4 sync step")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = PRESETS[args.config]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    context = args.prompt_len + args.steps + 2
    ref_ms, ref_tokens = step_cpu_ms(ReferenceEngine(cfg, max_batch=args.batch, max_context=context), prompts,
                                     args.steps)
    out = {"config": cfg.name, "batch": args.batch, "prompt_len": args.prompt_len, "reference_ms": round(ref_ms, 1)}
    for name in args.layouts.split(","):
        (tp, dp), executor = LAYOUTS[name]
        prof = cProfile.Profile() if args.profile and name == "tp2dp2ep4_sync" else None
        engine = GraphEngine(cfg, Topology(tp, dp, tp * dp), EngineConfig(executor=executor, max_batch=args.batch,
                                                                          max_context=context))
        ms, tokens = step_cpu_ms(engine, prompts, args.steps, prof)
        engine.close()
        out[name] = {"step_ms": round(ms, 1), "over_reference": round(ms / ref_ms, 3),
                     "tokens_match": tokens == ref_tokens}
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
            out["profile_tp2dp2ep4_sync"] = s.getvalue().splitlines()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
