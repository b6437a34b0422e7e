"""Load on the OpenAI-compatible server over loopback: concurrent streaming clients, mixed prompt
and answer lengths, greedy and sampled requests, clients that hang up mid-answer; every answer is
checked against a solo run of the same request (same seed) on the same server.

    python -m dsv41.serve --executor reference --max-context 64 --port 8471 &
    python bench/serve_load.py --url http://127.0.0.1:8471 --clients 32 --requests 300

The server must run without --checkpoint (token-id prompts and answers). Steps: one solo run per
distinct request (``--specs`` of them; this also warms the server), the server's RSS read from
/metrics, then ``--requests`` streamed requests from ``--clients`` concurrent clients (a request
picks spec i % specs; ``--cancel`` of them hang up after their first token or two), then the
server is polled until no request runs and no cache block is held, and its RSS read again.

Prints one JSON object: requests/s over the load phase, time to first token and inter-token
latency (p50/p99, ms), counts (completed, cancelled, 429s, errors, mismatches), RSS after the
solo runs and after the load, blocks in use at the end. Exit status 1 when an answer differs
from its solo run (a cancelled one: is not a prefix of it), a request failed other than by 429,
or blocks stay in use.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time

import httpx


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def make_specs(n: int, seed: int, vocab: int, max_prompt: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        spec = {"prompt": [rng.randrange(vocab) for _ in range(rng.randint(2, max_prompt))],
                "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0.0, 0.7, 1.0])}
        if spec["temperature"]:
            spec.update(seed=rng.randrange(1 << 31), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 50]))
        specs.append(spec)
    return specs


async def stream(client: httpx.AsyncClient, model: str, spec: dict, hang_up_after: int | None) -> dict:
    """One streamed request: its token ids, the arrival time of each, and how it ended."""
    t0 = time.perf_counter()
    out = {"tokens": [], "times": [], "status": None, "finish": None, "error": None, "cancelled": False, "t0": t0}
    async with client.stream("POST", "/v1/completions", json={"model": model, "stream": True, **spec}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]["message"]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            body = json.loads(data)
            if "error" in body:
                out["error"] = body["error"]["message"]
                break
            choice = body["choices"][0]
            if choice["token_ids"]:
                out["tokens"] += choice["token_ids"]
                out["times"].append(time.perf_counter())
            out["finish"] = choice["finish_reason"] or out["finish"]
            if hang_up_after is not None and len(out["tokens"]) >= hang_up_after:
                out["cancelled"] = True
                break                # leaving the block closes the connection
    return out


async def server_state(client: httpx.AsyncClient, model: str) -> dict:
    health = (await client.get("/health")).json()
    metrics = (await client.get("/metrics")).text
    rss = re.search(r"^process_resident_memory_bytes (\S+)$", metrics, re.M)
    # dsv41's own series carry the served model's name (the only label this counter has)
    cancelled = re.search(rf'^dsv41_cancelled_requests_total{{model_name="{re.escape(model)}"}} (\S+)$', metrics, re.M)
    return {**health, "rss_mb": float(rss.group(1)) / 2 ** 20 if rss else None,
            "cancelled_seen": float(cancelled.group(1)) if cancelled else 0.0}


async def load(url: str, clients: int, requests: int, specs_n: int, cancel: float, seed: int, vocab: int,
               max_prompt: int, max_tokens: int, settle_s: float = 60.0) -> dict:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = models[0]["id"]
        specs = make_specs(specs_n, seed, vocab, min(max_prompt, models[0]["max_model_len"] - max_tokens), max_tokens)
        solo = []
        for spec in specs:               # one at a time: nothing else shares the batch
            r = await stream(client, model, spec, None)
            if r["error"] is not None:
                raise SystemExit(f"solo run failed: {r['error']}")
            solo.append(r["tokens"])
        warm = await server_state(client, model)

        rng = random.Random(seed + 1)
        plan = [(i % specs_n, rng.randint(1, 2) if rng.random() < cancel else None) for i in range(requests)]
        gate = asyncio.Semaphore(clients)

        async def one(spec_i, hang_up):
            async with gate:
                return await stream(client, model, specs[spec_i], hang_up)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, h) for i, h in plan))
        wall = time.perf_counter() - t0

        deadline = time.perf_counter() + settle_s
        while True:
            end = await server_state(client, model)
            if (end["running"] == 0 and end["waiting"] == 0 and end["cache_blocks_in_use"] == 0) \
                    or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.2)

    ttft, itl, mismatches, errors = [], [], [], []
    for (spec_i, _), r in zip(plan, results):
        if r["status"] == 429:
            continue
        if r["error"] is not None:
            errors.append(r["error"])
            continue
        want = solo[spec_i]
        if (r["tokens"] != want[:len(r["tokens"])]) if r["cancelled"] else (r["tokens"] != want):
            mismatches.append({"spec": spec_i, "got": r["tokens"], "solo": want, "cancelled": r["cancelled"]})
        if r["times"]:
            ttft.append((r["times"][0] - r["t0"]) * 1e3)
            itl += [(b - a) * 1e3 for a, b in zip(r["times"], r["times"][1:])]
    done = [r for r in results if r["status"] == 200 and r["error"] is None]
    ms = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {
        "clients": clients, "requests": requests, "specs": specs_n, "wall_s": round(wall, 2),
        "requests_per_s": round(len(done) / wall, 3),
        "tokens_per_s": round(sum(len(r["tokens"]) for r in done) / wall, 2),
        "completed": sum(not r["cancelled"] for r in done), "cancelled": sum(r["cancelled"] for r in done),
        "cancellations_seen_by_server": end["cancelled_seen"] - warm["cancelled_seen"],
        "rejected_429": sum(r["status"] == 429 for r in results), "errors": errors, "mismatches": mismatches,
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99))},
        "itl_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99))},
        "rss_mb": {"after_solo_runs": ms(warm["rss_mb"]), "after_load": ms(end["rss_mb"])},
        "blocks_in_use_end": end["cache_blocks_in_use"], "running_end": end["running"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8471")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--specs", type=int, default=24, help="distinct requests (each has a solo run)")
    p.add_argument("--cancel", type=float, default=0.15, help="fraction of clients that hang up early")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=512, help="prompt token ids are drawn below this")
    p.add_argument("--max-prompt", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=10)
    a = p.parse_args(argv)
    result = asyncio.run(load(a.url, a.clients, a.requests, a.specs, a.cancel, a.seed, a.vocab, a.max_prompt,
                              a.max_tokens))
    print(json.dumps(result))
    ok = not result["errors"] and not result["mismatches"] and result["blocks_in_use_end"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
