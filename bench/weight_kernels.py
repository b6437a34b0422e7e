"""The weight products alone: ns per weight value for each checkpoint format, activation rows 1, 2, 4
and 8, on one core and on all of them, against what reading the value's bytes at the copy bandwidth
costs.

    python bench/weight_kernels.py [--rows 1,2,4,8] [--repeats 5] [--model haswell] [--json]

Each format multiplies a set of FLASH-shaped matrices larger than the last-level cache (so the
bytes come from memory, as in a decode step): FP8 the Q projection's ``wq_b`` (32768 x 1280) and
eight O-projection groups as column slices of one 5120 x 8192 matrix, FP4 routed experts' ``w1``
(2304 x 5120), BF16 8192-row slices of the head (5120 wide), FP32 the mHC ``fn`` (24 x 20480). Each
time is the best of ``--repeats`` passes over the set (``PackedMatrix.matmul_t``, the engine's call).
``--model``: one thread of code compiled for that x86 CPU model instead (``haswell``: AVX2 without
AVX-512, run here; FP4 then takes the FP16 route, FP8 its in-register scale).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from cpu_rates import best                  # bench/cpu_rates.py and cpu_roofline.py, beside this script
from cpu_roofline import copy_bytes_per_s

from dsv41.cpu import cores
from dsv41.ops.packed import PackedMatrix
from dsv41.ops.quant import block_mxfp8_encode, expert_mxfp4_encode


def matrices(g: torch.Generator) -> dict[str, list[PackedMatrix]]:
    def fp8(n, k):
        return PackedMatrix("fp8", *block_mxfp8_encode(torch.randn(n, k, generator=g) * 0.02))

    def fp4(n, k):
        p, s = expert_mxfp4_encode(torch.randn(n, k, generator=g) * 0.02)
        return PackedMatrix("fp4", p.view(torch.int8), s)
    wo = fp8(5120, 8192)
    return {"fp8": [fp8(32768, 1280), *(wo.cols(1024 * i, 1024 * (i + 1)) for i in range(8))],
            "fp4": [fp4(2304, 5120) for _ in range(12)],
            "bf16": [PackedMatrix("bf16", torch.randn(8192, 5120, generator=g).to(torch.bfloat16)) for _ in range(6)],
            "f32": [PackedMatrix("f32", torch.randn(24, 20480, generator=g)) for _ in range(64)]}


def product(m: PackedMatrix, x: torch.Tensor, model: str | None) -> None:
    if model is None:
        m.matmul_t(x)
    else:
        m.sums(x, 0, m.shape[0], "widen" if m.fmt in ("bf16", "f32") else "shifts", model)


def measure(rows_list: list[int], repeats: int, model: str | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    bw = copy_bytes_per_s(repeats)
    out = {"copy_bytes_per_s": bw, "cores": cores.cores(), "formats": {}}
    all_cores = cores.cores
    for fmt, ms in matrices(g).items():
        values = sum(m.shape.numel() for m in ms)
        stored = sum(m.payload.numel() * m.payload.element_size() + (m.scale.numel() if m.scale is not None else 0)
                     for m in ms)
        row = {"values": values, "floor_ns": stored / bw / values * 1e9, "ns": {}}
        for threads in ("one",) if model else ("one", "all"):
            cores.cores = (lambda: 1) if threads == "one" else all_cores
            for rows in rows_list:
                xs = [torch.randn(rows, m.shape[1], generator=g).to(torch.bfloat16).float() for m in ms]
                t = best(lambda: [product(m, x, model) for m, x in zip(ms, xs)], repeats)
                row["ns"][f"{threads}:{rows}"] = t / values * 1e9
        cores.cores = all_cores
        out["formats"][fmt] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8", help="activation row counts, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", help="an x86 CPU model by LLVM's name to compile for (one thread)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = [int(n) for n in a.rows.split(",")]
    r = measure(rows, a.repeats, a.model)
    lines = [f"copy {r['copy_bytes_per_s'] / 1e9:.2f} GB/s, {r['cores']} cores; ns per weight value (rows of x: "
             f"{', '.join(map(str, rows))})"]
    for fmt, row in r["formats"].items():
        cells = "  ".join(f"{threads} core{'s' if threads == 'all' else ''}: "
                          + " ".join(f"{row['ns'][f'{threads}:{n}']:.3f}" for n in rows)
                          for threads in ("one", "all") if f"{threads}:{rows[0]}" in row["ns"])
        lines.append(f"  {fmt:<5} floor {row['floor_ns']:.3f}  {cells}")
    print(json.dumps(r) if a.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
