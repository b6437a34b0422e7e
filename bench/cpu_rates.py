"""This machine's rates for a ``cpu`` device profile: memory bandwidth, FP32/FP64 matmul rate, the
cost of one small Torch op (dispatch), and what a weight costs per value on each use, each the best
of a few repeats (other work on the machine only ever slows a repeat down).

    python bench/cpu_rates.py [--json]

Bandwidth: a 256 MiB FP32 copy (read + write bytes over time). Matmul: square GEMMs of 2048
(2 n^3 FLOPs over time). Dispatch: a 1-element add, per call. Weight use: the kernels multiply a
weight held in its checkpoint format, decoding each value in a register inside the product
(``dsv41.ops.packed.PackedMatrix.matmul_t``, every core on a large one); per value of a FLASH matrix (the FP8 ``wq_b``
32768 x 1280, an FP4 expert ``w1`` 2304 x 5120, 16384 rows of the BF16 head, the FP32 mHC ``fn``
24 x 20480), one row multiplied by it. Importing dsv41 sets Torch's threads as the engine runs them
(``DSV41_TORCH_THREADS``, default 1), so every rate is the engine's.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from dsv41.config import FLASH
from dsv41.ops.packed import PackedMatrix
from dsv41.ops.quant import block_mxfp8_encode, expert_mxfp4_encode


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
    out["weight_use_ns"] = weight_use_ns(repeats)
    return out


def weight_use_ns(repeats: int) -> dict:
    """Format -> ns per value of multiplying one row by a weight held in that format."""
    g = torch.Generator().manual_seed(0)
    d, f = FLASH.hidden_size, FLASH
    fp8 = block_mxfp8_encode(torch.randn(f.num_attention_heads * f.head_dim, f.q_lora_rank, generator=g) * 0.02)
    fp4 = expert_mxfp4_encode(torch.randn(f.moe_intermediate_size, d, generator=g) * 0.02)
    weights = {"fp8": PackedMatrix("fp8", *fp8), "fp4": PackedMatrix("fp4", fp4[0].view(torch.int8), fp4[1]),
               "bf16": PackedMatrix("bf16", torch.randn(16384, d, generator=g).to(torch.bfloat16)),
               "f32": PackedMatrix("f32", torch.randn(f.mix_hc, f.hc_dim, generator=g))}
    out = {}
    for fmt, w in weights.items():
        row = torch.randn(1, w.shape[1], generator=g)
        out[fmt] = best(lambda: w.matmul_t(row), repeats) / w.shape.numel() * 1e9
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
              f"dispatch {r['dispatch_us']:.2f} us per small op; a one-row product with a weight held as "
              + ", ".join(f"{k} {v:.2f} ns" for k, v in r["weight_use_ns"].items()) + " per value")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
