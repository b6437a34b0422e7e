"""A real ``dsv41.serve`` run against the same workload simulated (``python -m dsv41.run --plan --simulate``).

    python -m dsv41.serve --config tiny --executor sync --tp 1 --dp 1 --max-batch 8 --max-context 128 --port 8471 &
    python bench/serve_vs_simulated.py --url http://127.0.0.1:8471 --device-profile tiny-profile.json \
        --num-prompts 16 --max-concurrency 8 --random-input-len 32 --random-output-len 16

Real: ``--num-prompts`` streamed greedy requests of ``--random-input-len`` random prompt tokens and
``--random-output-len`` tokens each, ``--max-concurrency`` clients (``serve_load.stream``), after one
warm-up request; TTFT and TPOT as ``vllm bench serve`` defines them (TPOT: the time after the first
token over the tokens after it). Simulated: the same workload through the engine's scheduler on the
simulated clock (``dsv41.plan.simulate``), each step priced by the plan on ``--device-profile`` (a
profile measured here: ``bench/cpu_profile.py``), with the server's limits (its max batch and
context, one DP group, prefix caching as the server's default). Prints one JSON object with both
and their ratios, and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import httpx

from serve_load import stream       # bench/serve_load.py, beside this script

from dsv41.capacity import capacity_of
from dsv41.config import PRESETS, Topology
from dsv41.plan.simulate import PlanPricer, SimulatedEngine, Workload, simulate


async def real(url: str, work: Workload) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = work.prompts(512)
        await stream(client, model, {"prompt": prompts[0], "max_tokens": 2, "temperature": 0.0}, None)   # warm-up
        gate = asyncio.Semaphore(work.max_concurrency or work.num_prompts)

        async def one(p):
            async with gate:
                return await stream(client, model, {"prompt": p, "max_tokens": work.output_len, "temperature": 0.0},
                                    None)
        results = await asyncio.gather(*(one(p) for p in prompts))
    ttft = [(r["times"][0] - r["t0"]) * 1e3 for r in results]
    tpot = [(r["times"][-1] - r["times"][0]) * 1e3 / (len(r["tokens"]) - 1) for r in results if len(r["tokens"]) > 1]
    return {"median_ttft_ms": statistics.median(ttft), "median_tpot_ms": statistics.median(tpot),
            "mean_ttft_ms": statistics.mean(ttft), "mean_tpot_ms": statistics.mean(tpot),
            "tokens": [len(r["tokens"]) for r in results]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8471")
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--device-profile", required=True)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    p.add_argument("--max-context", type=int, default=128, help="the server's --max-context")
    a = p.parse_args(argv)
    work = Workload(a.num_prompts, a.random_input_len, a.random_output_len, max_concurrency=a.max_concurrency)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    measured = asyncio.run(real(a.url, work))
    real_s = time.perf_counter() - t0
    cfg = PRESETS[a.config]
    cap = capacity_of(cfg)
    price = PlanPricer(cfg, Topology(1, 1, 1), a.device_profile, a.random_input_len + a.random_output_len // 2,
                       0, cap.prefill_max_tokens, a.max_batch)
    engine = SimulatedEngine(cfg, cap, price, 1, a.max_batch, a.max_context, prefix_caching=True)
    sim, _ = simulate(engine, work)
    out = {"workload": work.__dict__, "load_average": [load_before, os.getloadavg()], "real_s": real_s,
           "real": measured, "simulated": {k: sim[k] for k in ("median_ttft_ms", "median_tpot_ms", "mean_ttft_ms",
                                                               "mean_tpot_ms")},
           "simulated_steps": len(engine.steps)}
    out["ratio"] = {k: out["simulated"][k] / measured[k] for k in ("median_ttft_ms", "median_tpot_ms")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
