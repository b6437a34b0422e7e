"""The plan's ``cpu`` profile against this machine's clock: predicted vs measured decode step, per node kind.

    python bench/cpu_plan.py --checkpoint /tmp/flash-L40-E8 --contexts 16384 131072 1048000
    python bench/cpu_plan.py --checkpoint /tmp/flash-L1-E384 --contexts 0 --layout threads:4:2

For each context N: one traced run (``python -m dsv41.run --checkpoint ... --context N --batch B
--prompt-len 1 --new-tokens 2 --trace ...``, so a drawn history of N tokens, the one-token prompt step,
then one decode step), and the plan of that decode step on the ``cpu`` profile (``run_plan``: one
row per request, as the engine decodes, where ``--plan`` sizes the seed's 1 + 5 draft rows). Measured per node kind: the wall time of its node spans in the decode step;
predicted: the latency model's node times (``critical_path_us_by_kernel``: on one card every node is
on the path). The step: the run's decode step wall time against ``predicted_step_us``. One JSON object
per context with ``--json``; rows within ``--within`` (default 25%) are marked ok. ``--replan
FILE.jsonl`` plans those measured rows again with the plan as it is now (no run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from dsv41.checkpoint.reader import open_checkpoint
from dsv41.config import Topology
from dsv41.plan.step import run_plan


def _run(argv: list[str], cwd: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "dsv41.run", *argv], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _attrs(span: dict) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}


def node_us_by_step(otlp: Path, phase: str) -> dict[int, dict[str, float]]:
    """Step -> kernel -> µs summed over the run's node spans of ``phase`` (an OTLP JSON-lines file)."""
    by_step: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in otlp.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    a = _attrs(sp)
                    if a.get("dsv41.span") == "node" and a.get("dsv41.phase") == phase:
                        us = (int(sp["endTimeUnixNano"]) - int(sp["startTimeUnixNano"])) / 1e3
                        by_step[int(a["dsv41.step"])][a["dsv41.kernel"]] += us
    return by_step


def measured_by_kernel(otlp: Path, phase: str) -> dict[str, float]:
    """Kernel -> µs summed over the node spans of the run's last step of ``phase``."""
    by_step = node_us_by_step(otlp, phase)
    return dict(by_step[max(by_step)])


def planned(checkpoint: str, layout: str, batch: int, context: int) -> dict:
    """The plan's report of the measured decode step, one row per request as the engine decodes (the
    plan's default is the seed's 1 + 5 draft rows)."""
    _, tp, dp = layout.split(":")
    opened = open_checkpoint(checkpoint)
    return run_plan(opened.cfg, Topology(int(tp), int(dp), int(tp) * int(dp)), batch // int(dp), context + 2,
                    phase="decode", device="cpu",
                    capacity=dataclasses.replace(opened.capacity, decode_rows_per_request=1))[0]


def replan(row: dict) -> dict:
    """A measured row with its predictions made again by the plan as it is now."""
    plan = planned(row["checkpoint"], row["layout"], row["batch"], row["context"])
    kinds = [{**k, "predicted_ms": plan["critical_path_us_by_kernel"].get(k["kernel"], 0.0) / 1e3}
             for k in row["kinds"]]
    return {**row, "predicted_step_ms": plan["predicted_step_us"] / 1e3, "kinds": kinds,
            "plan_cards": [{k: c[k] for k in ("card", "weights_bytes", "cache_bytes", "transient_peak_bytes")}
                           for c in plan["cards"]]}


def show(result: dict, a) -> None:
    if a.json:
        print(json.dumps(result), flush=True)
        return
    step_ms, planned_ms = result["measured_step_ms"], result["predicted_step_ms"]
    print(f"{result['config']} {result['layout']} context {result['context']}: decode step measured {step_ms:.0f} ms, "
          f"predicted {planned_ms:.0f} ms ({planned_ms / step_ms - 1:+.0%}); node spans "
          f"{result['nodes_measured_ms']:.0f} ms")
    for c, pc in zip(result["cards"] or [], result["plan_cards"]):
        print(f"  card {c['card']}: weights {c['weights_bytes']:,} B (plan {pc['weights_bytes']:,}), caches "
              f"{c['cache_bytes']:,} B (plan {pc['cache_bytes']:,} for the step's context)")
    for r in result["kinds"]:
        ratio = r["predicted_ms"] / r["measured_ms"] - 1 if r["measured_ms"] else float("nan")
        mark = "ok" if abs(ratio) <= a.within else "miss"
        print(f"  {r['kernel']:<22} measured {r['measured_ms']:10.1f} ms  predicted {r['predicted_ms']:10.1f} ms "
              f" {ratio:+.0%} {mark}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint")
    p.add_argument("--contexts", type=int, nargs="+", default=[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layout", default="sync:1:1", help="executor:tp:dp")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--within", type=float, default=0.25)
    p.add_argument("--json", action="store_true")
    p.add_argument("--replan", nargs="+", metavar="JSONL", default=None,
                   help="plan again the rows an earlier --json run measured (no run)")
    a = p.parse_args(argv)
    if a.replan:
        for row in [replan(json.loads(line)) for f in a.replan for line in Path(f).read_text().splitlines() if line]:
            show(row, a)
        return 0
    if a.checkpoint is None:
        p.error("--checkpoint: needed to measure (or --replan FILE)")
    executor, tp, dp = a.layout.split(":")
    layout = ["--tp", tp, "--dp", dp]
    work = tempfile.mkdtemp(prefix="cpu_plan-")
    for n in a.contexts:
        run = _run(["--checkpoint", a.checkpoint, "--executor", executor, *layout, "--batch", str(a.batch),
                    "--prompt-len", "1", "--new-tokens", "2", "--trace", "cpu_plan", "--json",
                    *(["--context", str(n)] if n else [])], work)
        measured = measured_by_kernel(Path(work) / run["traces"]["otlp"], "decode")
        plan = planned(a.checkpoint, a.layout, a.batch, n)
        predicted = plan["critical_path_us_by_kernel"]
        kinds = sorted(measured, key=measured.get, reverse=True)[:a.top]
        rows = [{"kernel": k, "measured_ms": measured[k] / 1e3, "predicted_ms": predicted.get(k, 0.0) / 1e3}
                for k in kinds]
        result = {"checkpoint": a.checkpoint, "layout": a.layout, "context": n, "batch": a.batch,
                  "config": run["config"], "measured_step_ms": run["step_ms"][0],
                  "predicted_step_ms": plan["predicted_step_us"] / 1e3,
                  "nodes_measured_ms": sum(measured.values()) / 1e3, "kinds": rows,
                  "tokens": run["tokens"], "last_logits_sha256": run["last_logits_sha256"], "cards": run.get("cards"),
                  "plan_cards": [{k: c[k] for k in ("card", "weights_bytes", "cache_bytes", "transient_peak_bytes")}
                                 for c in plan["cards"]]}
        show(result, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
