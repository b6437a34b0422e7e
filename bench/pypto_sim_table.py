"""Simulated device time (pypto SIM cost model, Ascend 910B) per kernel at TINY and FLASH per-card shapes.

python bench/pypto_sim_table.py [--no-cold]
TINY: one decode step of one DP group at TP1 (48 rows). FLASH: one decode step per card at TP4,
EP8 (192 rows per DP group, 16 local heads, 48 local experts). Times land in the default cache (~/.cache/dsv41/pypto/), so
a rerun prints the table without simulating. The cold/warm part uses a throwaway cache file.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import FLASH, TINY  # noqa: E402
from dsv41.capacity import CAPACITIES  # noqa: E402
from dsv41.kernels.pypto.backend import SimCache, node_parts, sim_time_us  # noqa: E402

SETS = {"TINY": (TINY, CAPACITIES["tiny"].decode_max_tokens, 1, 1),
        "FLASH": (FLASH, CAPACITIES["flash"].decode_max_tokens, 4, 8)}


def fmt(shapes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shapes.items())


def unique_parts(cfg, rows, tp, ep) -> list[tuple[str, dict]]:
    seen, out = set(), []
    for parts in node_parts(cfg, rows, tp, ep).values():
        for k, s in parts:
            key = (k, tuple(sorted(s.items())))
            if key not in seen:
                seen.add(key)
                out.append((k, s))
    return out


def table() -> None:
    for name, (cfg, rows, tp, ep) in SETS.items():
        print(f"\n## {name}: {rows} rows per DP group, TP{tp} EP{ep}\n")
        print("| kernel | shapes | sim µs | wall s |\n|---|---|---|---|")
        for k, s in unique_parts(cfg, rows, tp, ep):
            t0 = time.perf_counter()
            us = sim_time_us(k, s)
            wall = time.perf_counter() - t0
            print(f"| {k} | {fmt(s)} | {'FAILED' if us is None else f'{us:.2f}'} | {wall:.2f} |", flush=True)
        print("\n| graph node | parts | sum µs |\n|---|---|---|")
        for node, parts in node_parts(cfg, rows, tp, ep).items():
            times = [sim_time_us(k, s) for k, s in parts]
            total = "n/a" if None in times else f"{sum(times):.2f}"
            print(f"| {node} | {len(parts)} | {total} |")


def cold_warm() -> None:
    parts = unique_parts(*SETS["TINY"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sim_times.json"
        from dsv41.kernels.pypto.sim import close_workers
        close_workers()  # cold includes starting the worker (import pypto)
        t0 = time.perf_counter()
        cold = [sim_time_us(k, s, cache=SimCache(path)) for k, s in [parts[0]]]
        cache = SimCache(path)
        cold += [sim_time_us(k, s, cache=cache) for k, s in parts[1:]]
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = [sim_time_us(k, s, cache=cache) for k, s in parts]
        t_mem = time.perf_counter() - t0

        def never(*a):
            raise AssertionError("simulated on a warm cache")
        t0 = time.perf_counter()
        disk = [sim_time_us(k, s, cache=SimCache(path), simulate=never) for k, s in parts]
        t_disk = time.perf_counter() - t0
        # a second process: the disk cache alone must answer, with pypto never imported
        code = ("import sys; from dsv41.kernels.pypto.sim import SimCache, sim_time_us; parts=%r; "
                "c=SimCache(%r); f=lambda *a: (_ for _ in ()).throw(AssertionError('simulated')); "
                "print([sim_time_us(k, s, cache=c, simulate=f) for k, s in parts]); "
                "assert 'pypto' not in sys.modules" % (parts, str(path)))
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1])
        t_proc = time.perf_counter() - t0
        assert out.returncode == 0, out.stderr
        assert cold == warm == disk == eval(out.stdout), (cold, warm, disk, out.stdout)
    n = len(parts)
    print(f"\n## cache: the TINY set ({n} kernel calls)\n")
    print("| cache | wall s | per call |\n|---|---|---|")
    print(f"| cold (worker start + {n} simulations) | {t_cold:.2f} | {t_cold / n:.2f} s |")
    print(f"| warm, memory | {t_mem:.4f} | {t_mem / n * 1e6:.0f} µs |")
    print(f"| warm, disk (new SimCache) | {t_disk:.4f} | {t_disk / n * 1e6:.0f} µs |")
    print(f"| warm, second process (incl. interpreter start) | {t_proc:.2f} | - |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-cold", action="store_true", help="skip the cold/warm cache measurement")
    a = ap.parse_args()
    table()
    if not a.no_cold:
        cold_warm()
