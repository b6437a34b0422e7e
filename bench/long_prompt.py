"""Long prompts on this machine: time to first token against prompt length, and what a long prompt
arriving does to the streams already running, with and without interleaving.

    python bench/long_prompt.py --config tiny
    python bench/long_prompt.py --config tiny --lengths 512 1024 --long 1024 --streams 8 --budgets 512

Part 1: one request per prompt length, alone; its time to first token (the prompt fed in chunks of
at most ``--budget`` rows, the last chunk's logits give the token) and the steps it took. Part 2:
``--streams`` requests with short prompts decode; once each has made two tokens a ``--long``-token
prompt arrives; the inter-token gaps of the running streams from its arrival to its first token are
summarised (p50, p99, max; each stream's gaps from the arrival up to its first token after the
prompt's first token), with interleaving (each step gives every stream its row and the prompt's
chunk fills the rest of the budget, vLLM v1's policy) and without it (the prompt's chunks run alone;
the streams wait); the engine's batch slots per DP group are raised to hold the streams and the
prompt (TINY has 8). One torch thread; wall time (run it on a quiet machine). Prints one JSON object,
with the process's peak RSS.

FLASH width (``docs/benchmarks.md``): ``--config flash --layers 4 --experts 8 --engram-rows 4099
--lengths 4096 16384 --parts 1`` (FLASH's full Engram tables are 94 GiB; ``--budgets`` below the
4,096-row capacity keeps a step's activations to a few GiB). The model is the backbone alone: the
bench never drafts, and DSpark's stages are a GiB at FLASH width.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from dataclasses import replace

import torch

from dsv41.checkpoint.headers import without_dspark
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import PRESETS, Topology
from dsv41.capacity import capacity_of
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import Request, requests_for
from dsv41.engine.scheduler import Scheduler


class Timed(Request):
    """A job that notes when each of its tokens came out."""

    def emit(self, kind: str, **fields):
        if kind == "token":
            self.__dict__.setdefault("times", []).append(time.perf_counter())


def make_engine(a, cfg, batch: int, context: int, capacity=None):
    context = min(context, cfg.max_position_embeddings)
    if a.executor == "reference":
        return ReferenceEngine(cfg, seed=0, max_batch=batch, max_context=context, capacity=capacity)
    return GraphEngine(cfg, Topology(a.tp, a.dp, a.tp * a.dp),
                       EngineConfig(seed=0, executor=a.executor, capacity=capacity, max_batch=batch,
                                    max_context=context))


def prompt(cfg, n: int, salt: int) -> list[int]:
    return [(7 * j + 13 * salt) % cfg.vocab_size for j in range(n)]


def ttft(a, cfg) -> list[dict]:
    engine = make_engine(a, cfg, 1, max(a.lengths) + 2)
    rows = []
    try:
        for n in a.lengths:
            for budget in a.budgets:
                (job,) = requests_for([prompt(cfg, n, 0)], None, 1, None, cls=Timed)
                sched = Scheduler(engine, budget=budget)
                t0 = time.perf_counter()
                turns = sched.run([job])
                rows.append({"prompt_tokens": n, "budget": budget, "steps": len(turns),
                             "ttft_s": round(job.times[0] - t0, 3)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.close()
    return rows


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def arrival(a, cfg) -> list[dict]:
    # the streams and the long prompt in one DP group: TINY's 8 slots per group raised to hold them
    slots = -(-(a.streams + 1) // a.dp)
    capacity = capacity_of(cfg)
    capacity = replace(capacity, max_batch_per_dp=max(capacity.max_batch_per_dp, slots))
    engine = make_engine(a, cfg, a.streams + 1, a.long + a.new + 2, capacity)
    rows = []
    try:
        for budget in a.budgets:
            for interleave in (True, False):
                streams = requests_for([prompt(cfg, 16, i + 1) for i in range(a.streams)], None, a.new, None, cls=Timed)
                (long,) = requests_for([prompt(cfg, a.long, 0)], None, 1, None, cls=Timed)
                sched = Scheduler(engine, budget=budget, interleave=interleave)
                for job in streams:
                    sched.add(job)
                try:
                    while not all(len(j.made) >= 2 for j in streams):
                        sched.step()
                    t0 = time.perf_counter()
                    sched.add(long)
                    steps = 0
                    while not long.made:
                        sched.step()
                        steps += 1
                    end = long.times[0]
                    while not all(j.times[-1] > end for j in streams):    # each stream's next token after it
                        sched.step()
                finally:
                    sched.release_all()
                # every gap of a stream that ended after the prompt arrived, up to its first token after
                # the prompt's first token (without interleaving: the stall)
                gaps = []
                for j in streams:
                    last = next(t for t in j.times if t > end)
                    gaps += [(b - c) * 1e3 for c, b in zip(j.times, j.times[1:]) if t0 < b <= last]
                rows.append({"budget": budget, "interleave": interleave, "long_prompt": a.long, "streams": a.streams,
                             "steps_to_first_token": steps, "ttft_s": round(end - t0, 3),
                             "itl_ms_p50": round(statistics.median(gaps), 1), "itl_ms_p99": round(percentile(gaps, 0.99), 1),
                             "itl_ms_max": round(max(gaps), 1), "stream_tokens_meanwhile":
                             sum(sum(1 for t in j.times if t0 <= t <= end) for j in streams)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.close()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--engram-rows", type=int, default=None)
    p.add_argument("--executor", default="reference", choices=("reference", "sync", "threads"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4095])
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="default: the model's prefill capacity")
    p.add_argument("--long", type=int, default=4095, help="part 2: the arriving prompt's tokens")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--new", type=int, default=400, help="part 2: tokens a stream may make (it is cut at the end)")
    p.add_argument("--parts", default="12")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = without_dspark(PRESETS[a.config].reduced(a.layers, a.experts, a.engram_rows))
    a.budgets = a.budgets or [capacity_of(cfg).prefill_max_tokens]
    out = {"config": cfg.name, "executor": a.executor, "tp": a.tp, "dp": a.dp}
    if "1" in a.parts:
        out["ttft"] = ttft(a, cfg)
    if "2" in a.parts:
        out["arrival"] = arrival(a, cfg)
    out["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
