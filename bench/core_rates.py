"""One core's FMA and L1 load rates for FP32 vectors of 8 lanes (and 16 with AVX-512): what bounds a
weight product's pass once its decode is cheap (docs/flash-shapes.md, issues 29 and 48).

    python bench/core_rates.py [--repeats 5] [--threads 2]

Two loops compiled by llvmlite for this CPU, each with twelve independent accumulators:
``registers`` (every FMA's operands in registers: the FMA ports alone) and ``loads`` (each FMA reads
one operand from a 16 KB buffer that stays in L1, as a product's pass reads x), the buffer at a
64-byte boundary and 16 bytes off one (every other load then splits a cache line); then eight
accumulators, each loading from its own row of x over a 4 KB tile and multiplying by a vector loaded
from a ninth row (the weights' stream), with the rows 5,120 floats apart (they share L1 sets) and
5,136. With AVX512_BF16, the register loop again with ``vdpbf16ps`` (BF16 pair products into 16 and 8
FP32 lanes: two multiply-adds a lane) in place of the FMA; skipped, saying so, elsewhere. Prints the
best of ``--repeats`` runs of 200M lanes each, in G instructions and G multiply-adds a second; the
register loops also on ``--threads`` threads at once (each its own 200M lanes), where that is over 1.
"""
from __future__ import annotations

import argparse
import ctypes
import threading
import time

import llvmlite.binding as llvm
import numpy as np

CHAINS = 12
SPAN = 4096          # floats of the buffer the loads cycle over (16 KB)
ROWS, TILE_SPAN = 8, 1024    # the rows test: 8 chains, each over a 4 KB tile of its own row


def loop_ir(load: bool, width: int = 8, row: int = 0, pairs: bool = False) -> str:
    """The loop; ``row``: chain i loads from row i of x, rows ``row`` floats apart (``ROWS`` chains), and
    every chain multiplies by the same vector, loaded from the row after them (as a weight stream);
    ``pairs``: register operands, ``vdpbf16ps`` of ``2 * width`` BF16 copies of ``%s`` in place of the FMA."""
    v, p = f"<{width} x float>", f"<{2 * width} x bfloat>"
    dot = f"@llvm.x86.avx512bf16.dpbf16ps.{32 * width}"
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
        body.append(f"  %b{i} = call {v} {dot}({v} %a{i}, {p} %d, {p} %d)" if pairs else
                    f"  %b{i} = call {v} @llvm.fma.v{width}f32({v} {operand}, {v} {'%w' if row else '%c'}, "
                    f"{v} %a{i})")
    body += [f"  %j = add i64 %i, {width * chains}", "  %more = icmp slt i64 %j, %n",
             "  br i1 %more, label %loop, label %done"]
    stores = [f"  %s{i} = getelementptr {v}, ptr %out, i64 {i}\n  store {v} %b{i}, ptr %s{i}, align 4"
              for i in range(chains)]
    return "\n".join([
        f"declare {v} {dot}({v}, {p}, {p})" if pairs else f"declare {v} @llvm.fma.v{width}f32({v}, {v}, {v})",
        "define void @f(i64 %n, ptr %buf, ptr %out, float %s) {", "entry:",
        *(["  %h = fptrunc float %s to bfloat", f"  %d0 = insertelement {p} poison, bfloat %h, i64 0",
           f"  %d = shufflevector {p} %d0, {p} poison, <{2 * width} x i32> zeroinitializer"] if pairs else
          [f"  %c0 = insertelement {v} poison, float %s, i64 0",
           f"  %c = shufflevector {v} %c0, {v} poison, <{width} x i32> zeroinitializer"]),
        "  br label %loop", "loop:", *body, "done:", *stores, "  ret void", "}"])


def rate(engine, repeats: int, offset: int = 0, lanes: int = 200_000_000, width: int = 8, row: int = 0,
         threads: int = 1, clock=time.perf_counter) -> float:
    """G instructions a second of the ``width``-lane loop ``engine`` holds (``offset``: bytes past a 64-byte
    boundary the buffer starts at; ``row``: the loop's, see ``loop_ir``; ``threads``: that many loops at
    once, each ``lanes`` long, the rate their sum: ctypes lets go of the GIL while each runs; ``clock``:
    ``time.thread_time`` gives one thread's rate on a core it shares with other processes)."""
    f = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float)(
        engine.get_function_address("f"))
    size = (ROWS + 1) * row + TILE_SPAN if row else SPAN + width * CHAINS
    room = np.zeros(size + 32, np.float32)
    skip = (-room.ctypes.data % 64 + offset) // 4
    buf, outs = room[skip:skip + size], [np.zeros(width * CHAINS, np.float32) for _ in range(threads)]
    f(100_000, buf.ctypes.data, outs[0].ctypes.data, 1e-9)
    best = float("inf")
    for _ in range(repeats):
        others = [threading.Thread(target=f, args=(lanes, buf.ctypes.data, out.ctypes.data, 1e-9))
                  for out in outs[1:]]
        t0 = clock()
        for t in others:
            t.start()
        f(lanes, buf.ctypes.data, outs[0].ctypes.data, 1e-9)
        for t in others:
            t.join()
        best = min(best, clock() - t0)
    return threads * lanes / width / best / 1e9


def compiled(load: bool, width: int = 8, row: int = 0, pairs: bool = False):
    """An execution engine holding the ``width``-lane loop (kept by the caller while the loop runs)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    mod = llvm.parse_assembly(loop_ir(load, width, row, pairs))
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.threads < 1:
        p.error(f"--repeats and --threads must be at least 1 (got {a.repeats} and {a.threads})")
    features = llvm.get_host_cpu_features()
    counts = sorted({1, a.threads})

    def registers(width: int, pairs: bool = False) -> str:
        """The register loop's rates on 1 and ``--threads`` threads: G instructions and G multiply-adds a second."""
        engine, per = compiled(False, width, pairs=pairs), width * (2 if pairs else 1)
        rates = [rate(engine, a.repeats, width=width, threads=n) for n in counts]
        return "; ".join(f"{n} thread{'s' * (n > 1)}: {r:.2f} G/s ({r * per:.1f} G multiply-adds/s)"
                         for n, r in zip(counts, rates))

    for width in (8, 16) if features.get("avx512f", False) else (8,):
        loads = compiled(True, width)
        aligned, split = rate(loads, a.repeats, width=width), rate(loads, a.repeats, 16, width=width)
        print(f"{width}-lane FP32 FMAs with register operands, {registers(width)}")
        print(f"one core, {width}-lane FP32: {aligned:.2f} G FMAs/s that each load an operand from L1 "
              f"({aligned * 4 * width:.0f} GB/s), {split:.2f} with the loads 16 bytes off a 64-byte boundary")
    if features.get("avx512bf16", False) and features.get("avx512vl", False):
        for width in (16, 8):
            print(f"vdpbf16ps, {2 * width} BF16 pairs into {width} FP32 lanes, register operands, "
                  f"{registers(width, pairs=True)}")
    else:
        print("vdpbf16ps: skipped, this CPU does not report both avx512bf16 and avx512vl")
    # x's rows as a product's pass of 8 rows reads them: FLASH's K are multiples of 1024 floats
    per_row = {row: rate(compiled(True, 8, row), a.repeats, row=row) for row in (5120, 5120 + 16)}
    print(f"one core, {ROWS} chains each loading from its own row of x, the multiplier from a ninth: "
          + ", ".join(f"{r:.2f} G FMAs/s with rows {row} floats apart" for row, r in per_row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
