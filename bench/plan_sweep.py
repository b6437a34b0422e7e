"""Predicted decode step and HBM per card of FLASH against batch and context, on two layouts.

    pip install -e ".[bench]"      # matplotlib, for the plot
    python bench/plan_sweep.py [--device-profile a5] [--grid]

Layouts: the seed's TP4/DP2/EP8 and TP8/EP8 (DP1). By default two lines through the space: batch
1..64 requests per DP group at --context (128K), and context 4K..1M at --batch (32); ``--grid`` plans
every (batch, context) pair instead. Each point is a full ``run_plan`` of the step's graph on meta
tensors (nothing allocated), so a point costs what ``--plan`` costs (seconds); points are exact and
independent, so they run in ``--jobs`` processes (default: one per CPU). The sweep prints its runtime. Batch 64 exceeds the seed's 32-request capacity contract, so the sweep plans with
``max_batch_per_dp`` raised to 64 (HBM then says whether it fits).

Writes traces/plan_sweep.csv and traces/plan_sweep.png (step time and HBM per card against batch and
against context, with the card's HBM capacity).
"""
from __future__ import annotations

import argparse
import csv
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from dsv41.config import FLASH, Topology
from dsv41.capacity import Capacity
from dsv41.plan.roofline import profile
from dsv41.plan.step import run_plan

LAYOUTS = {"TP4/DP2/EP8": Topology(4, 2, 8), "TP8/EP8": Topology(8, 1, 8)}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (4096, 16384, 65536, 262144, 1048576)
GB = 1e9


def points(batch: int, context: int, grid: bool) -> list[tuple[int, int]]:
    if grid:
        return [(b, c) for b in BATCHES for c in CONTEXTS]
    line = [(b, context) for b in BATCHES] + [(batch, c) for c in CONTEXTS]
    return list(dict.fromkeys(line))


def plan_point(layout: str, batch: int, context: int, device: str) -> dict:
    topo, dev = LAYOUTS[layout], profile(device)
    report, _ = run_plan(FLASH, topo, batch, context, device=device, capacity=Capacity(max_batch_per_dp=max(BATCHES)))
    return row(layout, topo, batch, context, report, dev)


def row(layout: str, topo, batch: int, context: int, report: dict, dev) -> dict:
    hbm = max(c["total_bytes"] for c in report["cards"])
    out = {"layout": layout, "requests_per_dp_group": batch, "requests": batch * topo.dp, "context": context,
           "predicted_step_ms": report["predicted_step_us"] / 1e3, "roofline_ms": report["roofline_step_us"] / 1e3,
           "floor_ms": report["floor_us"] / 1e3, "tokens_per_s": report["tokens_per_s"],
           "hbm_per_card_gb": hbm / GB, "fits": hbm <= dev.hbm_bytes}
    out.update({f"{k}_ms": v / 1e3 for k, v in report["breakdown_us"].items()})
    return out


def pyplot(p: argparse.ArgumentParser):
    """matplotlib's pyplot (headless), checked before the sweep spends its minutes."""
    try:
        import matplotlib
    except ImportError:
        p.error('the plot needs matplotlib: pip install -e ".[bench]"')
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw(plt, rows: list[dict], batch: int, context: int, dev, path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for col, (axis, fixed, value, label) in enumerate((("requests_per_dp_group", "context", context, "requests per DP group"),
                                                       ("context", "requests_per_dp_group", batch, "context (tokens)"))):
        for layout in LAYOUTS:
            line = sorted((r for r in rows if r["layout"] == layout and r[fixed] == value), key=lambda r: r[axis])
            xs = [r[axis] for r in line]
            top = axes[0][col].plot(xs, [r["predicted_step_ms"] for r in line], "o-", label=f"{layout} predicted")
            axes[0][col].plot(xs, [r["floor_ms"] for r in line], ":", color=top[0].get_color(),
                              label=f"{layout} memory floor")
            axes[0][col].plot(xs, [r["collectives_ms"] for r in line], "--", color=top[0].get_color(),
                              label=f"{layout} collectives on the critical path")
            axes[1][col].plot(xs, [r["hbm_per_card_gb"] for r in line], "o-", label=layout)
        axes[1][col].axhline(dev.hbm_bytes / GB, color="k", lw=0.8, label=f"{dev.name} HBM")
        for ax, ylabel in ((axes[0][col], "decode step (ms)"), (axes[1][col], "HBM per card (GB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{fixed.replace('_', ' ')} = {value}")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(f"FLASH decode on {dev.description}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device-profile", default="a5")
    p.add_argument("--batch", type=int, default=32, help="requests per DP group on the context line")
    p.add_argument("--context", type=int, default=131072, help="tokens per request on the batch line")
    p.add_argument("--grid", action="store_true", help="every (batch, context) pair")
    p.add_argument("--out", default="traces/plan_sweep")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes planning points at once")
    a = p.parse_args()
    if a.jobs < 1:
        p.error("--jobs must be >= 1")
    plt = pyplot(p)
    dev = profile(a.device_profile)
    todo = [(layout, b, c, dev.name) for layout in LAYOUTS for b, c in points(a.batch, a.context, a.grid)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(plan_point, *zip(*todo)))
    elapsed = time.perf_counter() - t0
    for r in rows:
        print(f"{r['layout']:12} batch {r['requests_per_dp_group']:3} context {r['context']:8}: step "
              f"{r['predicted_step_ms']:8.2f} ms (floor {r['floor_ms']:6.2f}) HBM {r['hbm_per_card_gb']:6.1f} GB"
              + ("" if r["fits"] else " (does not fit)"))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    draw(plt, rows, a.batch, a.context, dev, out.with_suffix(".png"))
    print(f"{len(rows)} plans in {elapsed:.1f} s with {a.jobs} processes: "
          f"{out.with_suffix('.csv')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
