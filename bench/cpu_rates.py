"""This machine's rates for a ``cpu`` device profile: memory bandwidth, FP32/FP64 matmul rate, and the
cost of one small Torch op (dispatch), each the best of a few repeats (other work on the machine only
ever slows a repeat down).

    python bench/cpu_rates.py [--json]

Bandwidth: a 256 MiB FP32 copy (read + write bytes over time). Matmul: square GEMMs of 2048
(2 n^3 FLOPs over time). Dispatch: a 1-element add, per call.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def rates(repeats: int = 5) -> dict:
    src = torch.ones(64 << 20)                      # 256 MiB
    dst = torch.empty_like(src)
    copy_s = best(lambda: dst.copy_(src), repeats)
    out = {"threads": torch.get_num_threads(), "bytes_per_s": 2 * src.numel() * 4 / copy_s}
    n = 2048
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[f"{name}_flops_per_s"] = 2 * n ** 3 / best(lambda: a @ b, repeats)
    x, y = torch.ones(1), torch.ones(1)
    calls = 2000
    out["dispatch_us"] = best(lambda: [torch.add(x, y) for _ in range(calls)], repeats) / calls * 1e6
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    r = rates(a.repeats)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"threads {r['threads']}: copy {r['bytes_per_s'] / 1e9:.2f} GB/s, FP32 GEMM "
              f"{r['fp32_flops_per_s'] / 1e9:.1f} GFLOP/s, FP64 GEMM {r['fp64_flops_per_s'] / 1e9:.1f} GFLOP/s, "
              f"dispatch {r['dispatch_us']:.2f} us per small op")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
