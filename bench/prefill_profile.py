"""A long prompt's prefill against this machine's arithmetic floor: time to first token, the time by
node kind, and the plan's multiply-adds for that prefill at the cores' measured FMA rate.

    python bench/prefill_profile.py --config flash --layers 4 --experts 8 --engram-rows 4099 --tokens 4096
    python bench/prefill_profile.py --config tiny --tokens 4095 --budget 512

One request alone, its prompt fed in chunks of at most ``--budget`` rows (``bench/long_prompt.py``'s
prompt and scheduler, one torch thread) on the graph engine, ``sync`` executor, TP1 (the reference engine's stage
methods, one node at a time, so the node times add up to the steps). Measured: the time to first
token; the process's user and system CPU over it; each node kind's summed wall time (a hook on the
card's node runs, holding nothing); the load average before and after (the machine is shared: say
it with every number). Floor: for each chunk step, the plan of that step (``plan.step.run_plan``,
``prefill``, the chunk's rows ending at its last position) gives each node kind's matrix
multiply-adds (its ``mx`` and ``dense`` flops over 2); at one core's measured FP32 FMA rate for the
kernels' vectors on every core (``bench/core_rates.py``, on the thread's CPU clock) that is the least
time the arithmetic takes. Prints one JSON object: totals, then kinds by time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time
from collections import defaultdict

import torch

from core_rates import compiled, rate    # bench/core_rates.py, beside this script
from long_prompt import Timed, prompt     # bench/long_prompt.py, beside this script

from dsv41.capacity import capacity_of
from dsv41.checkpoint.headers import without_dspark
from dsv41.cluster import registry
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import PRESETS, Topology
from dsv41.cpu import cores
from dsv41.cpu.fused_product import permute_width
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.plan.step import run_plan


class KindTimer:
    """A card's node hook (``registry.Hooks.tracer``): wall time summed per node kind."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.count: dict[str, int] = defaultdict(int)

    def begin_submission(self, sub, st):
        pass

    def end_submission(self, sub):
        pass

    def run(self, st, node, kernel_fn, args, sim_us=None):
        t0 = time.perf_counter_ns()
        value = kernel_fn(st, node, *args)
        self.ns[node.kernel] += time.perf_counter_ns() - t0
        self.count[node.kernel] += 1
        return value


def planned_macs(cfg, tokens: int, budget: int) -> dict[str, float]:
    """Node kind -> the plan's matrix multiply-adds over the prompt's chunk steps."""
    macs: dict[str, float] = defaultdict(float)
    capacity = capacity_of(cfg)
    for start in range(0, tokens, budget):
        rows = min(budget, tokens - start)
        _, step = run_plan(cfg, Topology(1, 1, 1), 1, start + rows, phase="prefill", device="cpu",
                           capacity=dataclasses.replace(capacity, prefill_max_tokens=rows))
        for key, c in step.costs.items():
            macs[step.plan.graph.nodes[key].kernel] += (c.flops.get("mx", 0) + c.flops.get("dense", 0)) / 2
    return dict(macs)


def fma_per_s() -> float:
    """FP32 multiply-adds a second on all cores at one core's FMA rate for the kernels' vectors (16 lanes
    with AVX-512, else 8; ``bench/core_rates.py``, register operands), timed on the thread's CPU
    clock: on a shared machine the wall clock counts other processes' turns."""
    width = 16 if permute_width() == 16 else 8
    return rate(compiled(False, width), 5, width=width, clock=time.thread_time) * 1e9 * width * cores.cores()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--engram-rows", type=int, default=None)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024, help="rows of a chunk step")
    a = p.parse_args(argv)
    torch.set_num_threads(1)        # as bench/long_prompt.py: the weight products share the cores themselves
    cfg = without_dspark(PRESETS[a.config].reduced(a.layers, a.experts, a.engram_rows))
    macs = planned_macs(cfg, a.tokens, a.budget)
    fma = fma_per_s()
    engine = GraphEngine(cfg, Topology(1, 1, 1), EngineConfig(seed=0, executor="sync", max_batch=1,
                                                              max_context=min(a.tokens + 2, cfg.max_position_embeddings)))
    timer = KindTimer()
    registry.owned(engine.id).hooks.tracer = timer
    try:
        (job,) = requests_for([prompt(cfg, a.tokens, 0)], None, 1, None, cls=Timed)
        load_before, used = os.getloadavg(), resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        steps = len(Scheduler(engine, budget=a.budget).run([job]))
        ttft = job.times[0] - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        load_after = os.getloadavg()
    finally:
        engine.close()
    total_macs = sum(macs.values())
    kinds = sorted(set(timer.ns) | set(macs), key=lambda k: -timer.ns.get(k, 0))
    nodes_s = sum(timer.ns.values()) / 1e9
    out = {"config": cfg.name, "tokens": a.tokens, "budget": a.budget, "steps": steps, "ttft_s": round(ttft, 2),
           "cpu_user_s": round(after.ru_utime - used.ru_utime, 1), "cpu_system_s": round(after.ru_stime - used.ru_stime, 1),
           "load_average_before": [round(v, 2) for v in load_before],
           "load_average_after": [round(v, 2) for v in load_after],
           "multiply_adds": total_macs, "fma_per_s": fma, "floor_s": round(total_macs / fma, 2),
           "ttft_over_floor": round(ttft / (total_macs / fma), 2), "nodes_s": round(nodes_s, 2),
           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
           "torch_threads": torch.get_num_threads(),
           "kinds": [{"kind": k, "s": round(timer.ns.get(k, 0) / 1e9, 2), "share": round(timer.ns.get(k, 0) / 1e9 / nodes_s, 3),
                      "nodes": timer.count.get(k, 0), "multiply_adds": macs.get(k, 0.0),
                      "floor_s": round(macs.get(k, 0.0) / fma, 3),
                      "over_floor": round(timer.ns[k] / 1e9 / (macs[k] / fma), 2) if macs.get(k) and timer.ns.get(k) else None}
                     for k in kinds]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
