"""A decode step on this CPU against its memory floor: the bytes the step must read over the measured
copy bandwidth, the measured step, their ratio, and the same per node kind.

    python bench/cpu_roofline.py --config flash --layers 4 --experts 8 --context 16384 --batch 1
    python bench/cpu_roofline.py --checkpoint /tmp/flash-L4-E8 --context 16384 --steps 3 --json > l4.json
    python bench/cpu_roofline.py --replan l4.json     # that step planned again on the cpu profile as it is now

The plan prices the step with the ``cpu`` device profile, which is this machine's kind: ``cpu-avx512``
(Zen 5), ``cpu-avx512-emr`` (Emerald Rapids) or ``cpu-avx2`` (``dsv41/plan/profiles.py``).

Bytes: the plan of the same decode step (``plan.step.run_plan``, TP1, one row per request as the
engine decodes): every node's reads and writes (weights in their stored formats, caches, activations),
summed per node kind and over the step. Bandwidth: a 256 MiB FP32 copy (read + write bytes over time),
best of 5. Floor: bytes / bandwidth. Measured: one ``python -m dsv41.run`` (``sync``, TP1) that starts
each request at ``--context`` tokens of drawn history, runs the one-token prompt step, then
``--steps`` decode steps; the step is their median wall time (and, steadier on a shared machine, the
median of the process's CPU time a step, all its threads), a node kind's time the median over
those steps of its node spans' summed wall time (``--trace``). Per weight value: for each checkpoint
format, the time of the node kinds that multiply weights of that format only (weights that are most of
the kind's bytes, and take at least 1% of the step) over the weight values the plan says they
multiply: the ``cpu`` profile's ``weight_use_ns``. FMA floor: the plan's matrix multiply-adds (its
``mx`` and ``dense`` flops over 2) as FP32 fused multiply-adds at one core's measured rate for the
weight kernels' vectors, 16 lanes with AVX-512, 8 without (``bench/core_rates.py``, register
operands), on every core: the time the step's arithmetic takes at the least, as the products compute
it; at a larger batch it can exceed the memory floor.
Weights are drawn at random (``--config`` and the reductions) or served from ``--checkpoint``
(drawing FLASH-width layers takes about a minute each; a written checkpoint is read in seconds).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from core_rates import compiled, rate    # bench/core_rates.py, beside this script
from cpu_plan import node_us_by_step     # bench/cpu_plan.py, beside this script

from dsv41.config import PRESETS, Topology
from dsv41.capacity import capacity_of
from dsv41.cpu import cores
from dsv41.cpu.fused_product import permute_width
from dsv41.plan.step import run_plan


def copy_bytes_per_s(repeats: int = 5) -> float:
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def model_args(a) -> list[str]:
    if a.checkpoint:
        return ["--checkpoint", a.checkpoint]
    return ["--config", a.config, *(["--layers", str(a.layers)] if a.layers else []),
            *(["--experts", str(a.experts)] if a.experts else []),
            *(["--engram-rows", str(a.engram_rows)] if a.engram_rows else [])]


def model_cfg(a):
    if a.checkpoint:
        from dsv41.checkpoint.reader import open_checkpoint
        return open_checkpoint(a.checkpoint).cfg
    cfg = PRESETS[a.config]
    if a.layers or a.experts or a.engram_rows:
        cfg = cfg.reduced(layers=a.layers, experts=a.experts, engram_rows=a.engram_rows)
    return cfg


def planned(cfg, batch: int, context: int) -> tuple[dict[str, int], dict[str, dict[str, int]], dict, float]:
    """Node kind -> bytes the plan's decode step moves (reads + writes); node kind -> weight values it
    multiplies by checkpoint format; the plan's report; the step's matrix multiply-adds."""
    capacity = dataclasses.replace(capacity_of(cfg), decode_rows_per_request=1)
    report, step = run_plan(cfg, Topology(1, 1, 1), batch, context, phase="decode", device="cpu", capacity=capacity)
    by_kind: dict[str, int] = defaultdict(int)
    values: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    macs = 0.0
    for key, c in step.costs.items():
        macs += (c.flops.get("mx", 0) + c.flops.get("dense", 0)) / 2
        kind = step.plan.graph.nodes[key].kernel
        by_kind[kind] += c.bytes_read + c.bytes_written
        for fmt, n in c.decoded.items():
            values[kind][fmt] += n
    return dict(by_kind), {k: dict(v) for k, v in values.items()}, report, macs


def fma_per_s() -> float:
    """FP32 multiply-adds a second on all cores at one core's measured FMA rate for the vectors the
    weight kernels use (16 lanes with AVX-512, else 8)."""
    width = 16 if permute_width() == 16 else 8
    return rate(compiled(False, width), 5, width=width) * 1e9 * width * cores.cores()


# bytes a stored weight value takes (FP4: a nibble and its share of a 32-value block's scale byte)
_VALUE_BYTES = {"fp8": 1 + 1 / 32, "fp4": 0.5 + 1 / 32, "bf16": 2, "f32": 4}


def weight_use_ns(measured_ms: dict[str, float], values: dict[str, dict[str, int]], bytes_by_kind: dict[str, int],
                  least: float = 0.01) -> dict:
    """Checkpoint format -> ns per weight value, from the node kinds whose multiplied weights are all of
    that one format, are most of the bytes the kind moves, and take at least ``least`` of the step's node
    time (their time over their values: what the ``cpu`` profile's ``weight_use_ns`` prices, measured in
    the step itself). An attention leaf multiplies a few FP32 values (its sinks) but spends its time on
    the cache: it prices nothing."""
    total = sum(measured_ms.values())
    time_ns: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for kind, by_fmt in values.items():
        if len(by_fmt) != 1 or measured_ms.get(kind, 0.0) < least * total:
            continue
        (fmt, n), = by_fmt.items()
        if n * _VALUE_BYTES[fmt] >= 0.5 * bytes_by_kind.get(kind, 0):
            time_ns[fmt] += measured_ms[kind] * 1e6
            count[fmt] += n
    return {fmt: time_ns[fmt] / count[fmt] for fmt in sorted(count)}


def measured_by_kind(otlp: Path) -> dict[str, float]:
    """Node kind -> median over the decode steps of its node spans' summed wall time, in ms."""
    by_step = node_us_by_step(otlp, "decode")
    kinds = {k for s in by_step.values() for k in s}
    return {k: statistics.median(s.get(k, 0.0) / 1e3 for s in by_step.values()) for k in kinds}


def measure(a, work: str) -> dict:
    argv = [sys.executable, "-m", "dsv41.run", *model_args(a), "--executor", "sync", "--tp", "1", "--dp", "1",
            "--batch", str(a.batch), "--prompt-len", "1", "--new-tokens", str(a.steps + 1),
            "--context", str(a.context), "--trace", "roofline", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=work,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    run = json.loads(proc.stdout)
    run["by_kind_ms"] = measured_by_kind(Path(work) / run["traces"]["otlp"])
    return run


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The model and the run a measurement takes (``model_args``, ``measure``; also bench/batch_growth.py)."""
    p.add_argument("--config", default="flash", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--engram-rows", type=int, help="default 4099 with --config flash (the docs' runs: FLASH's "
                                                   "whole tables do not fit here), else the preset's")
    p.add_argument("--checkpoint", help="serve the weights from this checkpoint folder (its config.json holds "
                                        "the model) instead of drawing them")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3, help="decode steps measured (the median is reported)")


def default_engram_rows(a: argparse.Namespace) -> None:
    if a.engram_rows is None and a.config == "flash" and not a.checkpoint:
        a.engram_rows = 4099


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--replan", metavar="JSON", help="plan the step an earlier --json run measured again (no run)")
    a = p.parse_args(argv)
    if a.replan:
        row = json.loads(Path(a.replan).read_text())
        _, _, report, _ = planned(model_cfg(argparse.Namespace(**row["model"])), row["batch"],
                               row["context"] + len(row["steps"]))
        ms = report["predicted_step_us"] / 1e3
        print(f"{row['config']} batch {row['batch']} context {row['context']}: measured {row['measured_step_ms']:.0f} "
              f"ms, the {report['device_profile']} profile now predicts {ms:.0f} ms "
              f"({ms / row['measured_step_ms'] - 1:+.0%})")
        return 0
    if a.steps < 1 or a.batch < 1 or a.context < 1:
        p.error("--steps, --batch and --context must be at least 1")
    default_engram_rows(a)
    cfg = model_cfg(a)
    by_kind_bytes, values, report, macs = planned(cfg, a.batch, a.context + a.steps)
    bw = copy_bytes_per_s()
    fma = fma_per_s()
    fma_floor_ms = macs / fma * 1e3
    run = measure(a, tempfile.mkdtemp(prefix="cpu_roofline-"))
    step_ms = statistics.median(run["step_ms"])
    total = sum(by_kind_bytes.values())
    floor_ms = total / bw * 1e3
    kinds = sorted(run["by_kind_ms"], key=run["by_kind_ms"].get, reverse=True)[:a.top]
    rows = [{"kernel": k, "measured_ms": run["by_kind_ms"][k], "bytes": by_kind_bytes.get(k, 0),
             "floor_ms": by_kind_bytes.get(k, 0) / bw * 1e3} for k in kinds]
    model = {k: getattr(a, k) for k in ("config", "layers", "experts", "engram_rows", "checkpoint")}
    out = {"config": run["config"], "model": model, "batch": a.batch, "context": a.context, "steps": run["step_ms"],
           "bytes": total, "copy_bytes_per_s": bw, "floor_ms": floor_ms, "measured_step_ms": step_ms,
           "step_cpu_ms": run["step_cpu_ms"], "measured_step_cpu_ms": statistics.median(run["step_cpu_ms"]),
           "ratio": step_ms / floor_ms, "multiply_adds": macs, "multiply_adds_per_s": fma,
           "fma_floor_ms": fma_floor_ms,
           "predicted_step_ms": report["predicted_step_us"] / 1e3,
           "device_profile": report["device_profile"],
           "tokens": run["tokens"], "last_logits_sha256": run["last_logits_sha256"], "kinds": rows,
           "weight_use_ns": weight_use_ns(run["by_kind_ms"], values, by_kind_bytes)}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{out['config']} batch {a.batch} context {a.context}: a decode step moves {total / 1e9:.3f} GB (plan); "
          f"copy {bw / 1e9:.2f} GB/s -> floor {floor_ms:.0f} ms; measured {step_ms:.0f} ms (median of "
          f"{len(run['step_ms'])}: {', '.join(f'{s:.0f}' for s in run['step_ms'])}; CPU time "
          f"{out['measured_step_cpu_ms']:.0f} ms) = {out['ratio']:.1f}x the floor; "
          f"the {out['device_profile']} profile predicts {out['predicted_step_ms']:.0f} ms "
          f"({out['predicted_step_ms'] / step_ms - 1:+.0%})")
    print(f"  FMA floor: {macs / 1e9:.2f} G multiply-adds (plan) at {fma / 1e9:.0f} G FP32 FMAs/s ({cores.cores()} "
          f"cores) -> {fma_floor_ms:.0f} ms; measured {step_ms / fma_floor_ms:.1f}x it")
    print("  per weight value in the step (kinds of one format, >= 1% of it): "
          + ", ".join(f"{fmt} {ns:.2f} ns" for fmt, ns in out["weight_use_ns"].items()))
    for r in rows:
        ratio = f"{r['measured_ms'] / r['floor_ms']:8.1f}x" if r["floor_ms"] else "       -"
        print(f"  {r['kernel']:<22} {r['measured_ms']:10.1f} ms  {r['bytes'] / 1e6:10.1f} MB  floor "
              f"{r['floor_ms']:8.1f} ms {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
