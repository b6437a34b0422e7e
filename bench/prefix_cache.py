"""Prefix caching on this machine: time to first token and prompt rows computed, caching on and off.

    python bench/prefix_cache.py --config tiny
    python bench/prefix_cache.py --config tiny --scenario system --requests 8 --caching off

Scenario ``chat``: a ``--turns``-turn conversation resent whole each turn (the previous turns, their
answers and a new ``--user-tokens`` message; ``--answer-tokens`` greedy tokens per answer), one
request at a time. Scenario ``system``: ``--requests`` requests sharing a ``--system-tokens`` system
prompt, each with its own ``--suffix-tokens`` question, submitted together. Per scenario and
setting: each request's time to first token (from its submission), the prompt rows the engine
computed (prompt tokens less the cached ones), the wall time, and the hit rate the server's metrics
export (``serving.metrics``, fed as the server's engine loop feeds it). The answers with caching on
are checked equal to those with it off when both run. One torch thread; wall time (run it on a
quiet machine). Prints one JSON object.
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
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import Request, requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.serving.metrics import Metrics


class Timed(Request):
    """A request that notes when its first token came out."""
    first_at = None

    def emit(self, kind: str, **fields):
        if kind == "token" and self.first_at is None:
            self.first_at = time.perf_counter()


def make_engine(a, cfg, batch: int, context: int, caching: bool):
    context = min(context, cfg.max_position_embeddings)
    if a.executor == "reference":
        return ReferenceEngine(cfg, seed=0, max_batch=batch, max_context=context, prefix_caching=caching)
    settings = EngineConfig(seed=0, executor=a.executor, max_batch=batch, max_context=context, prefix_caching=caching)
    return GraphEngine(cfg, Topology(a.tp, a.dp, a.tp * a.dp), settings)


def tokens(cfg, n: int, salt: int) -> list[int]:
    return [(7 * j + j * j // 5 + 13 * salt) % cfg.vocab_size for j in range(n)]


def served(jobs: list[Timed], starts: list[float], metrics: Metrics, wall: float) -> dict:
    """A scenario's numbers; starts: each job's submission time."""
    for job in jobs:
        metrics.on_prefix(len(job.prompt), job.cached)
    ttft = [(j.first_at - t) * 1e3 for j, t in zip(jobs, starts)]
    return {"requests": len(jobs), "prompt_tokens": sum(len(j.prompt) for j in jobs),
            "cached_tokens": sum(j.cached for j in jobs),
            "prompt_rows_computed": sum(len(j.prompt) - j.cached for j in jobs),
            "ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_max": max(ttft),
            "wall_s": wall, "hit_rate": metrics.registry.get_sample_value("dsv41_prefix_cache_hit_rate", {"model_name": ""})}


def chat(a, cfg, caching: bool) -> tuple[dict, list]:
    context = a.turns * (a.user_tokens + a.answer_tokens) + 1
    engine = make_engine(a, cfg, 1, context, caching)
    jobs, starts, conversation = [], [], []
    t0 = time.perf_counter()
    try:
        for turn in range(a.turns):
            conversation += tokens(cfg, a.user_tokens, turn + 1)
            (job,) = requests_for([list(conversation)], None, a.answer_tokens, None, cls=Timed)
            starts.append(time.perf_counter())
            Scheduler(engine, budget=a.budget).run([job])
            conversation += job.made
            jobs.append(job)
    finally:
        engine.close()
    out = served(jobs, starts, Metrics(), time.perf_counter() - t0)
    out["turns"] = [{"prompt": len(j.prompt), "cached": j.cached, "ttft_ms": (j.first_at - t) * 1e3}
                    for j, t in zip(jobs, starts)]
    return out, [j.made for j in jobs]


def system(a, cfg, caching: bool) -> tuple[dict, list]:
    head = tokens(cfg, a.system_tokens, 0)
    prompts = [head + tokens(cfg, a.suffix_tokens, 100 + i) for i in range(a.requests)]
    engine = make_engine(a, cfg, min(a.batch, a.requests), a.system_tokens + a.suffix_tokens + a.answer_tokens + 1,
                         caching)
    jobs = requests_for(prompts, None, a.answer_tokens, None, cls=Timed)
    try:
        start = time.perf_counter()
        Scheduler(engine, budget=a.budget).run(jobs)
        wall = time.perf_counter() - start
    finally:
        engine.close()
    return served(jobs, [start] * len(jobs), Metrics(), wall), [j.made for j in jobs]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--executor", choices=("reference", "sync", "threads"), default="reference")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--scenario", choices=("chat", "system", "both"), default="both")
    p.add_argument("--caching", choices=("on", "off", "both"), default="both")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--answer-tokens", type=int, default=30)
    p.add_argument("--system-tokens", type=int, default=3000)
    p.add_argument("--suffix-tokens", type=int, default=40)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="requests the engine holds at once")
    p.add_argument("--budget", type=int, default=None, help="rows a step feeds (default: the prefill capacity)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = PRESETS[a.config]
    settings = ["on", "off"] if a.caching == "both" else [a.caching]
    result = {"config": cfg.name, "executor": a.executor, "argv": argv}
    for name, fn in (("chat", chat), ("system", system)):
        if a.scenario not in (name, "both"):
            continue
        answers = {}
        for s in settings:
            result[f"{name}_{s}"], answers[s] = fn(a, cfg, s == "on")
            print(json.dumps({f"{name}_{s}": result[f"{name}_{s}"]}), flush=True)
        if len(answers) == 2:
            result[f"{name}_same_answers"] = answers["on"] == answers["off"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
