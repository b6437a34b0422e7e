"""Distributed against threads on one checkpoint: the step, and how much of it is worker-to-worker transfer.

    python bench/dist_transfer.py --checkpoint /tmp/flash-L1-E384 --tp 4 --dp 2 --batch 2 --prompt-len 8

Both executors run the same prefill and one decode step (tokens and logits compared). For the
distributed run, Dask's task stream (``distributed.get_task_stream``) records every task's
``startstops``: its compute interval on its worker and the transfers that fetched its inputs from
other workers. Per step: wall time, the summed compute and transfer time over the workers, the
transfer share (transfer / (compute + transfer)) and the mean worker's transfer time over the step's
wall time (transfers overlap one another and other workers' compute, so these are upper figures of
what the wire costs). Per worker (one card each): RSS once built, the peak of the two steps (the
kernel's high-water mark, reset after the build through ``/proc/self/clear_refs``) and the step
transient: that peak less the mapped checkpoint pages resident after the steps and the anonymous
RSS once built, against the plan's transient peak for the card's decode step on the ``cpu`` profile
(whose nodes hold their largest decoded weight while they run). ``--json`` prints one object.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from collections import defaultdict

import torch


def engine(ckpt, topo, executor: str, batch: int, context: int):
    from dsv41.cluster.engine import GraphEngine
    from dsv41.cluster.settings import EngineConfig
    return GraphEngine(ckpt.cfg, topo, EngineConfig(executor=executor, max_batch=batch, max_context=context),
                       checkpoint=ckpt)


def streamed(client, fn):
    """(wall s, result, {action: summed s}, tasks) of fn() under the task stream."""
    from distributed import get_task_stream
    with get_task_stream(client) as ts:
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
    spent: dict[str, float] = defaultdict(float)
    for task in ts.data:
        for ss in task["startstops"]:
            spent[ss["action"]] += ss["stop"] - ss["start"]
    return wall, out, dict(spent), len(ts.data)


def _reset_peak() -> dict[str, int]:
    """This worker's RSS now, its high-water mark reset to it (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()


def _status() -> dict[str, int]:
    out = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def sha(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest()


def main(argv=None) -> int:
    from dsv41.checkpoint.reader import open_checkpoint
    from dsv41.config import Topology

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    ckpt = open_checkpoint(a.checkpoint)
    topo = Topology(a.tp, a.dp, a.tp * a.dp)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, ckpt.cfg.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    context = a.prompt_len + 2
    result = {"checkpoint": a.checkpoint, "config": ckpt.cfg.name, "topology": f"tp{a.tp}-dp{a.dp}-ep{topo.ep}"}
    for executor in ("threads", "distributed"):
        e = engine(ckpt, topo, executor, a.batch, context)
        try:
            if executor == "distributed":
                client = e.runner.client
                card_of = {addr: card for card, addr in e.runner.address_of.items()}
                built = {card_of[k]: v for k, v in e.runner.run_on_cards(_reset_peak).items()}
                pre_s, first, pre_spent, pre_tasks = streamed(client, lambda: e.prefill(prompts))
                dec_s, out, dec_spent, dec_tasks = streamed(client, lambda: e.decode(first.last))
                peaks = {card_of[k]: v for k, v in e.runner.run_on_cards(_status).items()}
                # the checkpoint is mapped: weight pages a step touches first join the RSS as file
                # pages; the transient is what the peak holds beyond them and the built anonymous RSS
                result["workers"] = [{"card": c, "built_rss": built[c]["VmRSS"], "step_peak_rss": peaks[c]["VmHWM"],
                                      "file_pages_after": peaks[c]["RssFile"],
                                      "step_transient": peaks[c]["VmHWM"] - peaks[c]["RssFile"] - built[c]["RssAnon"]}
                                     for c in sorted(built)]
            else:
                t0 = time.perf_counter()
                first = e.prefill(prompts)
                pre_s, t0 = time.perf_counter() - t0, time.perf_counter()
                out = e.decode(first.last)
                dec_s, pre_spent, dec_spent, pre_tasks, dec_tasks = time.perf_counter() - t0, {}, {}, None, None
            row = {"prefill_s": pre_s, "decode_s": dec_s, "tokens": [first.last, out.last],
                   "last_logits_sha256": sha(out.logits), "prefill_task_stream_s": pre_spent,
                   "decode_task_stream_s": dec_spent, "tasks": [pre_tasks, dec_tasks]}
            for phase, spent in (("prefill", pre_spent), ("decode", dec_spent)):
                if spent:
                    moved, busy = spent.get("transfer", 0.0), spent.get("compute", 0.0)
                    row[f"{phase}_transfer_share"] = moved / (moved + busy)
                    # of each worker's step, on average, the time its task-stream shows in transfers
                    row[f"{phase}_transfer_per_worker"] = moved / topo.ep / (pre_s if phase == "prefill" else dec_s)
            result[executor] = row
        finally:
            e.close()
    from dsv41.plan.step import run_plan
    plan, _ = run_plan(ckpt.cfg, topo, requests=a.batch // a.dp, context=context, phase="decode", device="cpu",
                       capacity=dataclasses.replace(ckpt.capacity, decode_rows_per_request=1))
    for w in result["workers"]:
        w["plan_transient"] = plan["cards"][w["card"]]["transient_peak_bytes"]
    t, d = result["threads"], result["distributed"]
    result["equal"] = t["tokens"] == d["tokens"] and t["last_logits_sha256"] == d["last_logits_sha256"]
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{result['config']} {result['topology']}: tokens and logits {'equal' if result['equal'] else 'DIFFER'}")
        for name in ("threads", "distributed"):
            r = result[name]
            line = f"  {name:<12} prefill {r['prefill_s']:.1f} s, decode step {r['decode_s']:.1f} s"
            for phase in ("prefill", "decode"):
                s = r[f"{phase}_task_stream_s"]
                if s:
                    line += (f"; {phase}: compute {s.get('compute', 0):.1f} s, transfer {s.get('transfer', 0):.2f} s "
                             f"over the workers ({r[f'{phase}_transfer_share']:.1%} transfer; "
                             f"{r[f'{phase}_transfer_per_worker']:.0%} of a worker's step; "
                             f"{r['tasks'][phase == 'decode']} tasks)")
            print(line)
        for w in result["workers"]:
            print(f"  card {w['card']}: RSS built {w['built_rss'] / 2**30:.2f} GiB, step peak "
                  f"{w['step_peak_rss'] / 2**30:.2f} GiB, transient {w['step_transient'] / 2**20:.0f} MiB "
                  f"(plan {w['plan_transient'] / 2**20:.1f} MiB)")
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
