"""The predicted-step table of docs/plan.md: FLASH decode on TP4/DP2/EP8 on every device profile.

    python bench/plan_table.py [--jobs N]
    python bench/plan_table.py --profiles

Each row is what ``python -m dsv41.run --graph decode --config flash --plan --tp 4 --dp 2 --ep 8
--batch B --context C --device-profile P --json`` reports (the same ``run_plan`` call, graph
dispatch, without writing the trace files): B=2, C=131072 (one request per DP group) and B=64,
C=1048576 (32 per group). Prints the table's markdown and its runtime. ``--profiles`` prints the
device-profile tables instead (``dsv41/plan/profiles.py``: the peaks, then each link's fitted primitives).
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor

from dsv41.config import FLASH, Topology
from dsv41.plan.latency import PARTS
from dsv41.plan.profiles import PROFILES
from dsv41.plan.roofline import profile
from dsv41.plan.step import run_plan

TOPO = Topology(4, 2, 8)
SHAPES = ((2, 131072), (64, 1048576))     # (--batch, --context)
ON_PATH = tuple(p for p in PARTS if p != "idle")   # the critical path waits on nothing
GB, T = 1e9, 1e12


def _ms(us: float) -> float:
    return us / 1e3


def plan_row(batch: int, context: int, device: str) -> str:
    report, _ = run_plan(FLASH, TOPO, batch // TOPO.dp, context, device=device)
    dev = profile(device)
    hbm = max(c["total_bytes"] for c in report["cards"])
    fits = f"{'yes' if hbm <= dev.hbm_bytes else 'no'} ({hbm / GB:.0f} of {dev.hbm_bytes / GB:.0f} GB)"
    path = " / ".join(f"{_ms(report['breakdown_us'][p]):.2f}" for p in ON_PATH)
    largest = ", ".join(f"{k} {_ms(v):.1f}" for k, v in list(report["critical_path_us_by_kernel"].items())[:2])
    return (f"| {report['requests_per_dp_group']} x {context} | `{device}` | {_ms(report['predicted_step_us']):.2f} ms "
            f"| {report['tokens_per_s_per_request']:.1f} / {report['tokens_per_s']:.0f} "
            f"| {_ms(report['roofline_step_us']):.2f} / {_ms(report['floor_us']):.2f} ms | {path} | {fits} | {largest} |")


def profile_tables() -> list[str]:
    out = ["| profile | part | HBM | HBM BW | mx / dense / vector (TFLOPS) | cards per node |", "|" + "---|" * 6]
    for p in PROFILES.values():
        rates = " / ".join(f"{p.flops_per_s[k] / T:g}" for k in ("mx", "dense", "vector"))
        out.append(f"| `{p.name}` | {p.description} | {p.hbm_bytes / GB:g} GB | {p.hbm_bytes_per_s / T:g} TB/s "
                   f"| {rates} | {p.cards_per_node} |")
    out += ["", "| profile | link | peak one way × achieved | collective: alpha µs / beta GB/s "
                "| dispatch/combine call by EP ranks: alpha µs / beta GB/s |", "|" + "---|" * 5]
    for p in PROFILES.values():
        for name, link in (("intra-node", p.intra), ("inter-node", p.inter)):
            a2a = ", ".join(f"{r}: {ab.alpha_us:.1f} / {ab.bytes_per_s / GB:.0f}" for r, ab in link.a2a.fits)
            out.append(f"| `{p.name}` | {name} | {link.bytes_per_s / GB:g} GB/s × {link.efficiency:g} "
                       f"| {link.collective.alpha_us:.1f} / {link.collective.bytes_per_s / GB:.0f} | {a2a} |")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes planning rows at once")
    p.add_argument("--profiles", action="store_true", help="print the device-profile tables and stop")
    a = p.parse_args()
    if a.profiles:
        print("\n".join(profile_tables()))
        return
    if a.jobs < 1:
        p.error("--jobs must be >= 1")
    todo = [(b, c, name) for b, c in SHAPES for name in PROFILES]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(plan_row, *zip(*todo)))
    print("| requests/group × context | profile | predicted step | tokens/s per request / total | roofline / floor "
          f"| critical path: {' / '.join(ON_PATH)} (ms) | fits HBM | largest on the path (ms) |")
    print("|" + "---|" * 8)
    print("\n".join(rows))
    print(f"{len(rows)} plans in {time.perf_counter() - t0:.1f} s with {a.jobs} processes")


if __name__ == "__main__":
    main()
