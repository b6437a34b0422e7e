"""One core's FMA and L1 load rates for FP32 vectors of 8 lanes (and 16 with AVX-512): what bounds a
weight product's pass once its decode is cheap (docs/flash-shapes.md, issue 29).

    python bench/core_rates.py [--repeats 5]

Two loops compiled by llvmlite for this CPU, each with twelve independent accumulators:
``registers`` (every FMA's operands in registers: the FMA ports alone) and ``loads`` (each FMA reads
one operand from a 16 KB buffer that stays in L1, as a product's pass reads x), the buffer at a
64-byte boundary and 16 bytes off one (every other load then splits a cache line); then eight
accumulators, each loading from its own row of x over a 4 KB tile and multiplying by a vector loaded
from a ninth row (the weights' stream), with the rows 5,120 floats apart (they share L1 sets) and
5,136. Prints the best of ``--repeats`` runs of 200M lanes each, in G vector operations a second.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import llvmlite.binding as llvm
import numpy as np

CHAINS = 12
SPAN = 4096          # floats of the buffer the loads cycle over (16 KB)
ROWS, TILE_SPAN = 8, 1024    # the rows test: 8 chains, each over a 4 KB tile of its own row


def loop_ir(load: bool, width: int = 8, row: int = 0) -> str:
    """The loop; ``row``: chain i loads from row i of x, rows ``row`` floats apart (``ROWS`` chains), and
    every chain multiplies by the same vector, loaded from the row after them (as a weight stream)."""
    v = f"<{width} x float>"
    chains, span = (ROWS, TILE_SPAN) if row else (CHAINS, SPAN)
    body = [f"  %a{i} = phi {v} [ zeroinitializer, %entry ], [ %b{i}, %loop ]" for i in range(chains)]
    body += ["  %i = phi i64 [ 0, %entry ], [ %j, %loop ]", f"  %at = and i64 %i, {span - 1}"]
    if row:
        body += [f"  %ow = add i64 %at, {row * chains}", "  %pw = getelementptr float, ptr %buf, i64 %ow",
                 f"  %w = load {v}, ptr %pw, align 4"]
    for i in range(chains):
        if load:
            body += [f"  %p{i} = getelementptr float, ptr %buf, i64 %o{i}",
                     f"  %x{i} = load {v}, ptr %p{i}, align 4"]
            body.insert(len(body) - 2, f"  %o{i} = add i64 %at, {row * i if row else width * i}")
        operand = f"%x{i}" if load else "%c"
        body.append(f"  %b{i} = call {v} @llvm.fma.v{width}f32({v} {operand}, {v} {'%w' if row else '%c'}, "
                    f"{v} %a{i})")
    body += [f"  %j = add i64 %i, {width * chains}", "  %more = icmp slt i64 %j, %n",
             "  br i1 %more, label %loop, label %done"]
    stores = [f"  %s{i} = getelementptr {v}, ptr %out, i64 {i}\n  store {v} %b{i}, ptr %s{i}, align 4"
              for i in range(chains)]
    return "\n".join([
        f"declare {v} @llvm.fma.v{width}f32({v}, {v}, {v})",
        "define void @f(i64 %n, ptr %buf, ptr %out, float %s) {", "entry:",
        f"  %c0 = insertelement {v} poison, float %s, i64 0",
        f"  %c = shufflevector {v} %c0, {v} poison, <{width} x i32> zeroinitializer",
        "  br label %loop", "loop:", *body, "done:", *stores, "  ret void", "}"])


def rate(engine, repeats: int, offset: int = 0, lanes: int = 200_000_000, width: int = 8, row: int = 0) -> float:
    """G FMAs a second of the ``width``-lane loop ``engine`` holds (``offset``: bytes past a 64-byte
    boundary the buffer starts at; ``row``: the loop's, see ``loop_ir``)."""
    f = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float)(
        engine.get_function_address("f"))
    size = (ROWS + 1) * row + TILE_SPAN if row else SPAN + width * CHAINS
    room = np.zeros(size + 32, np.float32)
    skip = (-room.ctypes.data % 64 + offset) // 4
    buf, out = room[skip:skip + size], np.zeros(width * CHAINS, np.float32)
    f(100_000, buf.ctypes.data, out.ctypes.data, 1e-9)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(lanes, buf.ctypes.data, out.ctypes.data, 1e-9)
        best = min(best, time.perf_counter() - t0)
    return lanes / width / best / 1e9


def compiled(load: bool, width: int = 8, row: int = 0):
    """An execution engine holding the ``width``-lane loop (kept by the caller while the loop runs)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    mod = llvm.parse_assembly(loop_ir(load, width, row))
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    for width in (8, 16) if llvm.get_host_cpu_features().get("avx512f", False) else (8,):
        registers, loads = compiled(False, width), compiled(True, width)
        fma = rate(registers, a.repeats, width=width)
        aligned, split = rate(loads, a.repeats, width=width), rate(loads, a.repeats, 16, width=width)
        print(f"one core, {width}-lane FP32: {fma:.2f} G FMAs/s with register operands; {aligned:.2f} G FMAs/s "
              f"that each load an operand from L1 ({aligned * 4 * width:.0f} GB/s), {split:.2f} with the loads "
              f"16 bytes off a 64-byte boundary")
    # x's rows as a product's pass of 8 rows reads them: FLASH's K are multiples of 1024 floats
    per_row = {row: rate(compiled(True, 8, row), a.repeats, row=row) for row in (5120, 5120 + 16)}
    print(f"one core, {ROWS} chains each loading from its own row of x, the multiplier from a ninth: "
          + ", ".join(f"{r:.2f} G FMAs/s with rows {row} floats apart" for row, r in per_row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
