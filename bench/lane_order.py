"""Would another sum order make 8-row weight products faster? A probe for issue 29's batch-8 measure.

    python bench/lane_order.py [--rows 8] [--n 4096] [--repeats 5]

The product's defined order (``docs/numerics.md``) keeps 32 FP32 chains per output, so with AVX2 a
pass holds 3 activation rows and a batch of 8 takes three passes (3 + 3 + 2). An order of 8 chains
per output (lane j over columns j, j + 8, ... in order) would let one pass hold all 8 rows: one
weight load and decode for 8 FMAs. This compiles that pass for BF16 weights (K in tiles of
``--tile`` columns, ``--group`` weight rows a tile, the accumulators kept across tiles) and times it
on one thread against the product as it is (``PackedMatrix.matmul_t``, one thread), on the same x and
weights, a FLASH-width K (5120) and ``--n`` weight rows (BF16, larger than the last-level cache):

- ``present``: the product as it is (32 chains per output);
- ``8 lanes``: the probe over the weights as stored (row after row), as a decode step reads them;
- ``8 lanes, tile-major``: the same weights stored tile after tile (each tile's rows contiguous);
- ``8 lanes, resident``: every weight row the same 5120 values (in cache): the loop's own rate.

Each is the best of ``--repeats`` runs: ns per weight value (all rows) and G 8-lane FMAs a second.
The probe's sums are checked against FP64 within FP32 summation's bound. Its order is not the
project's: no result of it is used elsewhere.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import llvmlite.binding as llvm
import numpy as np
import torch

from dsv41.cpu.fused_product import optimised
from dsv41.cpu.ir_text import Function
from dsv41.ops.packed import PackedMatrix

V = "<8 x float>"
K = 5120
X_STRIDE = K + 16        # rows of x 64 bytes apart in L1 sets (K floats apart they share them)


def probe_ir(rows: int, tile: int, group: int, tile_major: bool) -> str:
    """product(w, x, acc, n, weight_row_stride): acc[n, r, 8] += the 8-lane chains of w's rows."""
    f = Function()

    def weight_at(g: str, t: str, n: str, c: str) -> str:
        if tile_major:      # [n / group][K / tile][group][tile]
            base = f.let(f"add i64 {f.let(f'mul i64 {g}, {K}')}, {f.let(f'mul i64 {t}, {group}')}")
            row = f.let(f"mul i64 {f.let(f'sub i64 {n}, {g}')}, {tile}")
            inner = f.let(f"add i64 {row}, {f.let(f'sub i64 {c}, {t}')}")
            return f.let(f"add i64 {base}, {inner}")
        return f.let(f"add i64 {f.let(f'mul i64 {n}, %ws')}, {c}")

    def weight_rows(g: str):
        def k_tile(t: str):
            def weight_row(n: str):
                accs = [f.slot(V) for _ in range(rows)]
                first = f.let(f"mul i64 {n}, {rows * 8}")
                at = [f.let(f"getelementptr float, ptr %acc, i64 {f.let(f'add i64 {first}, {r * 8}')}")
                      for r in range(rows)]
                for s, p in zip(accs, at):
                    f.do(f"store {V} {f.let(f'load {V}, ptr {p}, align 4')}, ptr {s}")

                def chunk(c: str):
                    xs = []
                    for r in range(rows):
                        px = f.let(f"getelementptr float, ptr %x, i64 {f.let(f'add i64 {c}, {r * X_STRIDE}')}")
                        xs.append(f.let(f"load {V}, ptr {px}, align 4"))
                    pw = f.let(f"getelementptr i16, ptr %w, i64 {weight_at(g, t, n, c)}")
                    half = f.let(f"load <8 x i16>, ptr {pw}, align 2")
                    wide = f.let(f"shl <8 x i32> {f.let(f'zext <8 x i16> {half} to <8 x i32>')}, "
                                 "<i32 16, i32 16, i32 16, i32 16, i32 16, i32 16, i32 16, i32 16>")
                    w = f.let(f"bitcast <8 x i32> {wide} to {V}")
                    for x, s in zip(xs, accs):
                        total = f.let(f"call {V} @llvm.fma.v8f32({V} {x}, {V} {w}, {V} {f.let(f'load {V}, ptr {s}')})")
                        f.do(f"store {V} {total}, ptr {s}")
                f.loop(t, f.let(f"add i64 {t}, {tile}"), 8, chunk)
                for s, p in zip(accs, at):
                    f.do(f"store {V} {f.let(f'load {V}, ptr {s}')}, ptr {p}, align 4")
            f.loop(g, f.let(f"add i64 {g}, {group}"), 1, weight_row)
        f.loop("0", str(K), tile, k_tile)
    f.loop("0", "%n", group, weight_rows)
    f.do("ret void")
    return f.text("define void @product(ptr %w, ptr %x, ptr %acc, i64 %n, i64 %ws) {",
                  [f"declare {V} @llvm.fma.v8f32({V}, {V}, {V})"])


def compiled(rows: int, tile: int, group: int, tile_major: bool):
    mod, tm = optimised(probe_ir(rows, tile, group, tile_major))
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
    engine.add_object_file(llvm.ObjectFileRef.from_data(tm.emit_object(mod)))
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                          ctypes.c_int64)(engine.get_function_address("product"))
    return fn, engine


def best_of(repeats: int, fn) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--n", type=int, default=4096, help="weight rows (a multiple of --group)")
    p.add_argument("--tile", type=int, default=512, help="columns of a K tile (divides 5120)")
    p.add_argument("--group", type=int, default=32, help="weight rows a tile")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.n % a.group or K % a.tile or a.tile % 8:
        raise SystemExit("--n must be a multiple of --group, --tile a multiple of 8 dividing 5120")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(a.n, K, generator=g) * 0.02).bfloat16()
    bits = weights.view(torch.int16).numpy()
    by_tile = np.ascontiguousarray(bits.reshape(a.n // a.group, a.group, K // a.tile, a.tile).transpose(0, 2, 1, 3))
    x = torch.randn(a.rows, K, generator=g).bfloat16().float()
    xs = np.zeros((a.rows, X_STRIDE), np.float32)
    xs[:, :K] = x.numpy()
    acc = np.zeros((a.n, a.rows, 8), np.float32)
    row_major, tile_major = compiled(a.rows, a.tile, a.group, False), compiled(a.rows, a.tile, a.group, True)

    def probe(fn, w, stride):
        def call():
            acc.fill(0)
            fn(w.ctypes.data, xs.ctypes.data, acc.ctypes.data, a.n, stride)
        return call

    present = PackedMatrix("bf16", weights)
    runs = {"present": lambda: present.matmul_t(x, split=False),
            "8 lanes": probe(row_major[0], bits, K),
            "8 lanes, tile-major": probe(tile_major[0], by_tile, K),
            "8 lanes, resident": probe(row_major[0], bits, 0)}
    exact = (weights.double() @ x.double().T).numpy()
    for name in ("8 lanes", "8 lanes, tile-major"):
        runs[name]()
        bound = (K / 8 + 3) * 2.0 ** -24 * (weights.double().abs() @ x.double().abs().T).numpy()
        if not (np.abs(acc.sum(-1, dtype=np.float64) - exact) <= bound + 1e-30).all():
            raise SystemExit(f"{name}: the probe's sums are off by more than FP32's bound")
    values = a.n * K
    print(f"one thread, {a.rows} rows of x, {a.n} x {K} BF16 weights, K tiles of {a.tile} columns:")
    for name, fn in runs.items():
        s = best_of(a.repeats, fn)
        print(f"  {name:22s} {s / values * 1e9:6.3f} ns a weight value  {a.rows * values / 8 / s / 1e9:5.2f} "
              "G 8-lane FMAs/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
