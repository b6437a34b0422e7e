"""The compiled product for weights in their checkpoint formats: each weight value is decoded in a
register and multiplied into every activation row of the pass while its bytes are in cache, so a
decode step reads each weight byte once from memory and never writes a decoded value.

The kernels are LLVM IR written here (``cpu.ir_text``) and compiled by llvmlite (numba's compiler, a
dependency) for the CPU at hand, once per (format, rows per pass, weight rows per pass, decode) and
process:

- **Decode** (exact: every value is an FP32, subnormals included, for the scale codes this path
  takes). E4M3 bytes become FP16 bits by a sign extension, a shift and a mask (the FP16 layout
  holds E4M3's exponent and significand at 2^-8 of the value), then FP32 by the CPU's conversion,
  times the block's E8M0 scale (or, with AVX2 where x carries the scales, BF16 bits at 2^-120 by
  unpacks, a shift and a mask). E2M1 nibbles become FP16 bits by shifts at 2^-14, or index a table
  of the codes times the scale: with AVX-512 all 16 as FP32 (``vpermps`` of nibbles shifted into
  place in each 32-bit lane), with AVX2 two tables per scale code of the bytes of their FP32s' upper
  halves (``vpshufb``; the lower halves are zero). BF16 and FP32 widen. The AVX2 unpacks and the
  AVX-512 shifts give a block's columns in their own order; x is staged in it (``x_order``) and the
  lane sums are put back in column order before the tree. The portable kernels (0 lanes, as
  ``cpu.dispatch`` chooses where the CPU lacks AVX2, FMA or F16C) decode by generic vector
  operations alone: E4M3 codes become FP32 bits by integer shifts and masks (the value times
  2^-120), E2M1 codes their values' bits, then times 2^120 and the block scale, all exact; LLVM
  lowers that for any CPU (NEON or SVE on ARM).
- **Sums** (``docs/numerics.md``). Each output is an FP32 sum of FP32 fused multiply-adds in one
  fixed order: two vectors of 16 lanes, lane ``j`` of the first taking column ``j`` of every 32-column
  block in block order and lane ``j`` of the second column ``j + 16``; then the two vectors added, the
  16 lanes summed as a tree (8 + 8, 4 + 4, 2 + 2, 1 + 1), then columns past the last whole block one
  by one. No fast-math flag is set, so the compiler keeps that order, and every row runs the same
  operations whether it shares a pass with 0 or 3 others, or a weight row's pass with 3 other weight
  rows: a row's bits do not depend on the batch, the layout or the threads, nor on the weights'
  format (a matrix decoded to FP32 first gives the same bits as the format's own decode).

Passes take 1-8 activation rows with AVX-512 and 1-3 with AVX2 (``PASS_ROWS``; one FP32 FMA per
weight value per row is the cost that grows with the batch) and up to four weight rows
(``WEIGHT_ROWS``, as many as the CPU's vector registers hold the accumulators of), so that FMA chains
overlap and each load of x serves several weight rows. A pass of two or more rows over more than one
K tile runs a block row of weight rows one tile at a time (``tiled``), so that x's tile is read from
L1, except BF16 and FP8 passes with AVX-512, which take four weight rows over the whole of K
(``WIDE``: measured faster on Zen 4); from ``HALF_ROWS`` rows on with AVX-512 a pass takes the
blocks' columns 0-15 (over the tile), then 16-31, each lane's sum still one chain in block order.
With more than one pass, every pass runs over a chunk of the weight rows (``CHUNK_BYTES``) before
the next chunk, so that the chunk comes from memory once. The weight rows the sweeps reach a few
groups on are prefetched in software. Compiled code is kept as object files beside this module
(``DSV41_KERNEL_CACHE`` moves them), so later processes load it instead of compiling.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import threading
from functools import cache
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import torch

from dsv41.cpu import dispatch
from dsv41.cpu.ir_text import Function, interleave, lanes, splat, vec
from dsv41.outputs import write_output

# decodes of each format, all exact: "shifts" builds FP16 bits (any x86-64 with F16C); "prescaled"
# (fp8) multiplies x by the block's scale (and 2^8) once per 32 weight rows instead of each value by it;
# "table" (fp4) looks the codes up (a permute with AVX-512, byte shuffles with AVX2); "widen" (bf16, f32) converts
VARIANTS = {"fp8": ("prescaled", "shifts"), "fp4": ("table", "shifts"), "bf16": ("widen",), "f32": ("widen",)}
BLOCK = 32                  # columns per block: one E8M0 scale for fp8 and fp4
_BLOCK_BYTES = {"fp8": 32, "fp4": 16, "bf16": 64, "f32": 128}
_AHEAD = 8                  # weight rows the software prefetch runs ahead (best of 4, 8, 16 measured)
# activation rows per pass by the vector registers' lanes: with AVX2 a tiled 3-row pass ran faster per
# row than a 4-row one (its accumulators fit the registers; in cache, Zen 3); with AVX-512 an 8-row pass
# of one weight row decodes each weight once for 8 rows (a batch-8 step 466 and 651 ms against 605 and
# 754 in passes of 4, Emerald Rapids; docs/flash-shapes.md)
PASS_ROWS = {16: 8, 8: 3}
MAX_ROWS = max(PASS_ROWS.values())      # activation rows of a pass on any CPU (more spill the accumulators)
TILE = 32                   # blocks of a K tile (``tiled``): x's tile for 4 rows is 16 KB, for 8 32 KB
# weight rows per pass for each count of activation rows, by the vector registers' lanes: each load of
# x serves the group, and the group's accumulators (rows x weight rows x 32 FP32 lanes) fit the
# registers beside the decode's: AVX-512 has 32 of 16 lanes (measured for the FP64 sums,
# docs/flash-shapes.md), AVX2 16 of 8 (the same budget in registers: a 2-row pass of one weight row ran
# faster than of two or four, Zen 3). A divisor of 32, so a group never straddles an FP8 32-row block.
# From HALF_ROWS rows on (AVX-512) a pass sweeps the blocks' two halves one after the other, so only
# half the accumulators are live and two weight rows share each load of x: fewer loads per FMA,
# where loads, not the FMA ports, bound an 8-row pass (bench/core_rates.py: 3.1 G FMAs/s that load
# an operand against 5.1 G without, one core, Emerald Rapids; docs/flash-shapes.md)
WEIGHT_ROWS = {16: {1: 4, 2: 4, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2}, 8: {1: 2, 2: 1, 3: 1, 4: 1}}
HALF_ROWS = 5
# except BF16 and FP8 passes of two or more rows with AVX-512, which take four weight rows over the whole
# of K (no K tiles): each load of x then serves four weight rows. From memory (16,384 x 5,120, one core,
# CPU time, Zen 4), ns a value, against two weight rows in K tiles: 8 rows BF16 0.22 against 0.29, FP8
# 0.19 against 0.22; 6 rows 0.18 against 0.23 and 0.15 against 0.17; 4 rows 0.13 against 0.18 and 0.11
# against 0.12; 3 rows 0.14 against 0.17 and 0.10 against 0.11. Four weight rows in K tiles gained little,
# and FP4, whose table decode holds registers of its own, ran slower with four (docs/flash-shapes.md).
WIDE = ("bf16", "fp8")
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the FP16 stand-ins are the value times 2^-8 (E4M3) or 2^-14 (E2M1); E4M3's BF16 one (the 8-lane
# decode's) is the value times 2^-120
_STAND_IN = {"fp8": 8, "fp4": 14}
_BF16_STAND_IN = 120
_F32_FP4_STAND_IN = 0             # E2M1's FP32 one (the portable decode's) is the value itself
_FP8_HALF_MASK = -0x4080          # 0xBF80 as an i16: FP16's sign bit and the E4M3 magnitude's 7 bits
_FP8_BF16_MASK = -0x7801          # 0x87FF as an i16: BF16's sign bit and the E4M3 magnitude's 7 bits
_ARGS = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


def _float(v: float) -> str:
    """An FP32 constant as LLVM writes it (the FP64 bits of the same value)."""
    return f"0x{struct.unpack('<Q', struct.pack('<d', float(np.float32(v))))[0]:016X}"


def _power_of_two(f: Function, srow: str, b: str, shift: int) -> str:
    """The block's E8M0 code s as the FP32 2^(s - 127 + shift), exactly: s + shift is its exponent
    field, except 2^-127 (s = 0, shift 0), FP32's subnormal 0x00400000 (the codes this path takes
    keep s + shift <= 254)."""
    code = f.let(f"load i8, ptr {f.let(f'getelementptr i8, ptr {srow}, i64 {b}')}")
    exp = f.let(f"add i32 {f.let(f'zext i8 {code} to i32')}, {shift}")
    normal = f.let(f"shl i32 {exp}, 23")
    # the subnormal's bit set by a flag, not a select: the optimiser made the select a branch
    zero = f.let(f"icmp eq i32 {exp}, 0")
    tiny = f.let(f"shl i32 {f.let(f'zext i1 {zero} to i32')}, 22")
    return f.let(f"bitcast i32 {f.let(f'or i32 {normal}, {tiny}')} to float")


def _block_at(f: Function, fmt: str, prow: str, b: str) -> str:
    """&(block b of the weight row at prow)."""
    return f.let(f"getelementptr i8, ptr {prow}, i64 {f.let(f'mul i64 {b}, {_BLOCK_BYTES[fmt]}')}")


def _load(f: Function, ty: str, fmt: str, prow: str, b: str) -> str:
    return f.let(f"load {ty}, ptr {_block_at(f, fmt, prow, b)}, align 1")


def _times(f: Function, values: str, factor: str, n: int = 32) -> str:
    return f.let(f"fmul <{n} x float> {values}, {f.broadcast('float', factor, n)}")


def _from_half(f: Function, bits: str, n: int = 32) -> str:
    """<n x i16> FP16 bits as <n x float> (exact)."""
    return f.let(f"fpext <{n} x half> {f.let(f'bitcast <{n} x i16> {bits} to <{n} x half>')} to <{n} x float>")


def _to_half(f: Function, codes: str, shift: int, magnitude: int, sign_shift: int) -> str:
    """<32 x i16> codes as FP16 bits: the magnitude bits shifted into FP16's exponent and significand,
    the sign bit into bit 15."""
    mag = f.let(f"shl <32 x i16> {codes}, {splat('i16', 32, shift)}")
    mag = f.let(f"and <32 x i16> {mag}, {splat('i16', 32, magnitude)}")
    sign = f.let(f"shl <32 x i16> {codes}, {splat('i16', 32, sign_shift)}")
    sign = f.let(f"and <32 x i16> {sign}, {splat('i16', 32, 0x8000)}")
    return f.let(f"or <32 x i16> {mag}, {sign}")


def _nibbles(f: Function, prow: str, b: str) -> str:
    """Block ``b``'s 16 bytes of E2M1 pairs as <32 x i8> codes in column order (low nibble first)."""
    raw = _load(f, "<16 x i8>", "fp4", prow, b)
    lo = f.let(f"and <16 x i8> {raw}, {splat('i8', 16, 15)}")
    hi = f.let(f"lshr <16 x i8> {raw}, {splat('i8', 16, 4)}")
    return f.let(f"shufflevector <16 x i8> {lo}, <16 x i8> {hi}, {interleave(16)}")


def _table_decode(f: Function, prow: str, srow: str, b: str, width: int) -> list[str]:
    """An E2M1 block by table: the codes times the block scale. With 16 lanes (AVX-512) the block's 16
    bytes go to all four 128-bit lanes (a broadcast load), a variable shift puts a different nibble in
    the low 4 bits of each 32-bit lane (``vpsrlvd``), and a ``vpermps`` of the scale code's row of
    ``@value_tables`` (the 16 codes times the scale, read from memory) takes those 4 bits as its index:
    two shifts and two permutes a block, where zero-extending the codes to 32-bit lanes took nine
    shuffles on port 5, the port the second FMA shares (columns in ``_FP4_ORDER_16``). With 8 (AVX2)
    see ``_byte_decode``."""
    if width == 8:
        return _byte_decode(f, prow, srow, b)
    byte = f.let(f"load i8, ptr {f.let(f'getelementptr i8, ptr {srow}, i64 {b}')}")
    at = f.let(f"getelementptr <16 x float>, ptr @value_tables, i64 {f.let(f'zext i8 {byte} to i64')}")
    table = f.let(f"load <16 x float>, ptr {at}, align 64")
    raw = _load(f, "<4 x i32>", "fp4", prow, b)
    wide = f.let(f"shufflevector <4 x i32> {raw}, <4 x i32> poison, <16 x i32> {vec('i32', [*range(4)] * 4)}")
    out = []
    for h in (0, 1):
        shifts = vec("i32", [4 * (j // 4 + 4 * h) for j in range(16)])
        idx = f.let(f"lshr <16 x i32> {wide}, {shifts}")
        out.append(f.let(f"call <16 x float> @llvm.x86.avx512.permvar.sf.512(<16 x float> {table}, <16 x i32> {idx})"))
    return out


# the 8-lane decodes' unpacks (in-lane on AVX2, so no lane-crossing shuffle) give a block's 32 values in
# these column orders (``x_order``): E2M1 low codes then high codes of each 128-bit lane, E4M3 bytes 0-7
# and 16-23, then 8-15 and 24-31, each as two 4-value halves
_FP4_ORDER = [16 * h + c for h in (0, 1) for c in (0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)]
_FP8_ORDER = [c + q for part in (0, 8) for q in (0, 4) for c in (part, part + 1, part + 2, part + 3,
                                                                  part + 16, part + 17, part + 18, part + 19)]
# the 16-lane E2M1 decode's: lane j of half h takes nibble j // 4 + 4 h of the block's 32-bit word j % 4
_FP4_ORDER_16 = [8 * (j % 4) + j // 4 + 4 * h for h in (0, 1) for j in range(16)]
_ORDERS = {("fp8", "prescaled", 8): _FP8_ORDER, ("fp4", "table", 8): _FP4_ORDER, ("fp4", "table", 16): _FP4_ORDER_16}


def _words(f: Function, low: str, high: str) -> list[str]:
    """Two <32 x i8> as 16-bit lanes (``low`` the low bytes, ``high`` the high ones) by byte unpacks in
    each 128-bit lane: bytes 0-7 and 16-23, then 8-15 and 24-31, as two <16 x i16>."""
    out = []
    for part in (range(8), range(8, 16)):
        mask = vec("i32", [j for lane in (0, 1) for i in part for j in (16 * lane + i, 32 + 16 * lane + i)])
        out.append(f.let(f"bitcast <32 x i8> {f.let(f'shufflevector <32 x i8> {low}, <32 x i8> {high}, <32 x i32> {mask}')} "
                         f"to <16 x i16>"))
    return out


def _upper_halves(f: Function, words: list[str]) -> list[str]:
    """<16 x i16> as the upper halves of FP32s whose lower halves are zero (word unpacks with zeros in
    each 128-bit lane, four values from each lane at a time): a block's two halves, <16 x float> each,
    in the order the unpacks give."""
    floats = []
    for w in words:
        for quarter in (range(4), range(4, 8)):
            mask = vec("i32", [j for lane in (0, 1) for i in quarter for j in (8 * lane + i, 16 + 8 * lane + i)])
            wide = f.let(f"shufflevector <16 x i16> zeroinitializer, <16 x i16> {w}, <16 x i32> {mask}")
            floats.append(f.let(f"bitcast <16 x i16> {wide} to <8 x float>"))
    return [f.let(f"shufflevector <8 x float> {floats[2 * h]}, <8 x float> {floats[2 * h + 1]}, {lanes(0, 16)}")
            for h in (0, 1)]


def _fp8_bf16_decode(f: Function, prow: str, b: str) -> list[str]:
    """The 8-lane E4M3 decode: a byte's sign in bit 15 and its magnitude in bits 4-10 are the BF16 bits
    of the value times 2^-120 (E4M3's exponent field in BF16's, subnormals included), the upper half of
    its FP32. Each byte becomes a word's high byte (an unpack with zeros), shifted down 4 arithmetically
    (the sign spreads over bits 11-15; the mask keeps 15), then the words FP32s: no conversion
    instruction, and columns in ``_FP8_ORDER``. For ``prescaled`` only (x carries 2^120 and the block
    scale): multiplying the stand-ins here instead took twice as long as the FP16 route (Zen 3, a
    multiply of a subnormal, as E4M3's subnormals' stand-ins are, needs an assist; an FMA does not)."""
    words = []
    for w in _words(f, "zeroinitializer", _load(f, "<32 x i8>", "fp8", prow, b)):
        w = f.let(f"ashr <16 x i16> {w}, {splat('i16', 16, 4)}")
        words.append(f.let(f"and <16 x i16> {w}, {splat('i16', 16, _FP8_BF16_MASK)}"))
    return _upper_halves(f, words)


def x_order(fmt: str, variant: str, width: int) -> list[int] | None:
    """The column order of a block's 32 values in the decode for ``width`` lanes (None: column
    order). The kernel reads x stored in that order: lanes hold the same columns in every block, so
    each lane's sum is the same sum, and the sums are put back in column order before the tree, which
    is then the defined one."""
    return _ORDERS.get((fmt, variant, 16 if width == 16 else 8)) if width else None


def _byte_decode(f: Function, prow: str, srow: str, b: str) -> list[str]:
    """The AVX2 E2M1 decode: every value's FP32 has a zero low half, so two ``vpshufb`` lookups of the
    block scale's byte tables (``_tables_ir``, 32 bytes a scale code, read as two 16-byte
    broadcasts) give its upper half's two bytes for all 32 codes at once; byte and word unpacks with
    zeros then make the FP32s: nine shuffles a block and no lane-crossing permute; columns in
    ``_FP4_ORDER``."""
    byte = f.let(f"load i8, ptr {f.let(f'getelementptr i8, ptr {srow}, i64 {b}')}")
    code = f.let(f"zext i8 {byte} to i64")
    at = f.let(f"getelementptr i8, ptr @byte_tables, i64 {f.let(f'mul i64 {code}, 32')}")
    tables = []
    for part in (0, 1):
        t = f.let(f"load <16 x i8>, ptr {f.let(f'getelementptr i8, ptr {at}, i64 {16 * part}')}, align 1")
        tables.append(f.let(f"shufflevector <16 x i8> {t}, <16 x i8> poison, <32 x i32> {vec('i32', [*range(16), *range(16)])}"))
    raw = _load(f, "<16 x i8>", "fp4", prow, b)
    lo = f.let(f"and <16 x i8> {raw}, {splat('i8', 16, 15)}")
    hi = f.let(f"lshr <16 x i8> {raw}, {splat('i8', 16, 4)}")
    idx = f.let(f"shufflevector <16 x i8> {lo}, <16 x i8> {hi}, {lanes(0, 32)}")
    low, high = (f.let(f"call <32 x i8> @llvm.x86.avx2.pshuf.b(<32 x i8> {t}, <32 x i8> {idx})") for t in tables)
    return _upper_halves(f, _words(f, low, high))


def _stand_in(f: Function, fmt: str, at: str, n: int) -> str:
    """The n E4M3 or E2M1 codes at ``at`` as FP32s by integer operations alone, each code's sign and
    magnitude moved into BF16's sign, exponent and significand bits, then BF16 widened to FP32:
    E4M3's exponent field becomes FP32's and its subnormals FP32 subnormals (the value times
    2^-120), E2M1's the value itself. The portable decode's: no FP16 conversion, no table, every
    value exact."""
    if fmt == "fp8":
        # sign-extended and shifted by 4, the sign lands in bits 11-15 (15 kept) and the magnitude in
        # bits 4-10: BF16's low exponent bits and top significand bits
        codes = f.let(f"sext <{n} x i8> {f.let(f'load <{n} x i8>, ptr {at}, align 1')} to <{n} x i16>")
        bits = f.let(f"and <{n} x i16> {_shl16(f, codes, 4, n)}, {splat('i16', n, 0x87F0 - (1 << 16))}")
    else:
        # the value itself, a normal number or zero (a subnormal stand-in's multiply took a microcode
        # assist a block, 5x the time, Zen 4): codes 2-7 are BF16 0x3F00 + (m << 6); 0 and 1 are m
        # times 0x3F00 (0, 0.5), the smaller of the two for every m (min(m, 2) 0x3F00 above the first)
        codes = f.let(f"zext <{n} x i8> {_nibbles(f, at, '0')} to <{n} x i16>")
        m = f.let(f"and <{n} x i16> {codes}, {splat('i16', n, 7)}")
        normal = f.let(f"add <{n} x i16> {_shl16(f, m, 6, n)}, {splat('i16', n, 0x3F00)}")
        low = f.let(f"mul <{n} x i16> {_umin(f, m, splat('i16', n, 2), n)}, {splat('i16', n, 0x3F00)}")
        sign = f.let(f"and <{n} x i16> {_shl16(f, codes, 12, n)}, {splat('i16', n, -0x8000)}")
        bits = f.let(f"or <{n} x i16> {_umin(f, normal, low, n)}, {sign}")
    wide = f.let(f"shl <{n} x i32> {f.let(f'zext <{n} x i16> {bits} to <{n} x i32>')}, {splat('i32', n, 16)}")
    return f.let(f"bitcast <{n} x i32> {wide} to <{n} x float>")


def _shl16(f: Function, a: str, k: int, n: int) -> str:
    return f.let(f"shl <{n} x i16> {a}, {splat('i16', n, k)}")


def _umin(f: Function, a: str, b: str, n: int) -> str:
    return f.let(f"select <{n} x i1> {f.let(f'icmp ult <{n} x i16> {a}, {b}')}, <{n} x i16> {a}, <{n} x i16> {b}")


def _portable_decode(f: Function, fmt: str, variant: str, at: str, srow: str, b: str, n: int) -> str:
    """The n E4M3 or E2M1 values at ``at`` of block ``b`` as <n x float>, with generic vector operations
    only (``lanes`` 0): the FP32 stand-in v 2^-k (``_stand_in``), then (but for ``prescaled``, whose x
    carries 2^k and the block scale) times 2^k and the block scale 2^(s - 127): one exact multiply
    by 2^(s - 127 + k) where that is an FP32 (s + k <= 254, all but the largest scales), else two,
    each exact. Every value is the FP32 the x86 decodes give."""
    d = _stand_in(f, fmt, at, n)
    if variant == "prescaled":
        return d
    k = _BF16_STAND_IN if fmt == "fp8" else _F32_FP4_STAND_IN
    out = f.slot(f"<{n} x float>", 64)
    f.do(f"store <{n} x float> {_times(f, d, _power_of_two(f, srow, b, k), n)}, ptr {out}")
    code = f.let(f"load i8, ptr {f.let(f'getelementptr i8, ptr {srow}, i64 {b}')}")
    large = f.let(f"icmp ugt i8 {code}, {254 - k}")
    f.when(large, lambda: f.do(f"store <{n} x float> "
                               f"{_times(f, _times(f, d, _float(2.0 ** k), n), _power_of_two(f, srow, b, 0), n)}, "
                               f"ptr {out}"))
    return f.let(f"load <{n} x float>, ptr {out}")


def _decode(f: Function, fmt: str, variant: str, prow: str, srow: str, b: str, width: int) -> list[str]:
    """Block ``b`` of a weight row as two <16 x float>: its columns 0-15 and 16-31 (``prescaled``: the
    FP16 stand-ins, whose 2^8 and block scale x carries; ``table``: by ``width``, AVX-512's or AVX2's;
    ``width`` 0: the portable decode)."""
    if not width and fmt in ("fp8", "fp4"):
        return f.halves("float", _portable_decode(f, fmt, variant, _block_at(f, fmt, prow, b), srow, b, 32))
    if fmt == "fp8" and variant == "prescaled" and width != 16:
        return _fp8_bf16_decode(f, prow, b)
    if variant == "table":
        return _table_decode(f, prow, srow, b, width)
    if fmt == "fp4":
        z = f.let(f"zext <32 x i8> {_nibbles(f, prow, b)} to <32 x i16>")
        d = _times(f, _from_half(f, _to_half(f, z, 9, 0x0E00, 12)), _float(2.0 ** _STAND_IN[fmt]))
        return f.halves("float", _times(f, d, _power_of_two(f, srow, b, 0)))
    return f.halves("float", _widened(f, fmt, variant, _block_at(f, fmt, prow, b), srow, b, 32))


def _half(f: Function, fmt: str, variant: str, prow: str, srow: str, b: str, h: int) -> str:
    """Columns 16 h to 16 h + 15 of block ``b`` alone as <16 x float>, with 16 lanes (AVX-512): the
    same values as that half of ``_decode``'s, from half the bytes (a sweep of one half at a time)."""
    if fmt == "fp4":
        return _decode(f, fmt, variant, prow, srow, b, 16)[h]     # each half is its own permute
    at = f.let(f"getelementptr i8, ptr {_block_at(f, fmt, prow, b)}, i64 {_BLOCK_BYTES[fmt] // 2 * h}")
    return _widened(f, fmt, variant, at, srow, b, 16)


def _widened(f: Function, fmt: str, variant: str, at: str, srow: str, b: str, n: int) -> str:
    """The n FP8 (FP16 route), BF16 or FP32 values at ``at`` of block ``b`` as <n x float>."""
    if fmt == "fp8":
        # sign-extended and shifted by 7, a byte's sign lands in bit 15 (and 14, cleared by the mask) and
        # its magnitude in FP16's exponent and significand: three operations per 16 values
        z = f.let(f"sext <{n} x i8> {f.let(f'load <{n} x i8>, ptr {at}, align 1')} to <{n} x i16>")
        shifted = f.let(f"shl <{n} x i16> {z}, {splat('i16', n, 7)}")
        d = _from_half(f, f.let(f"and <{n} x i16> {shifted}, {splat('i16', n, _FP8_HALF_MASK)}"), n)
        return d if variant == "prescaled" else _times(f, d, _power_of_two(f, srow, b, _STAND_IN[fmt]), n)
    if fmt == "bf16":
        z = f.let(f"zext <{n} x i16> {f.let(f'load <{n} x i16>, ptr {at}, align 1')} to <{n} x i32>")
        upper = f.let(f"shl <{n} x i32> {z}, {splat('i32', n, 16)}")
        return f.let(f"bitcast <{n} x i32> {upper} to <{n} x float>")
    return f.let(f"load <{n} x float>, ptr {at}, align 1")


def _at(f: Function, ty: str, base: str, i: str, j: str) -> str:
    """&base[i + j] for elements of type ``ty``."""
    return f.let(f"getelementptr {ty}, ptr {base}, i64 {f.let(f'add i64 {i}, {j}')}")


def _tail_value(f: Function, fmt: str, prow: str, j: str) -> str:
    if fmt == "bf16":
        bits = f.let(f"load i16, ptr {f.let(f'getelementptr i16, ptr {prow}, i64 {j}')}")
        wide = f.let(f"shl i32 {f.let(f'zext i16 {bits} to i32')}, 16")
        return f.let(f"bitcast i32 {wide} to float")
    return f.let(f"load float, ptr {f.let(f'getelementptr float, ptr {prow}, i64 {j}')}")


def kernel_ir(fmt: str, rows: int, weight_rows: int, variant: str, width: int = 16, tile: int = 0,
              halves: bool = False) -> str:
    """``void product(p, pstride, s, sstride, sdiv, x, xstride, out, ostride, k, r0, r1, xs)``:
    out[r, n] = sum_c x[r, c] w[n, c] for r < ``rows`` and n in [r0, r1), ``weight_rows`` at a time;
    weight row n at p + n pstride bytes, its scale codes at s + (n / sdiv) sstride; x [rows, xstride]
    FP32, out [rows, ostride] FP32; xs FP32 [rows, k] scratch: x in the decode's column order
    (``x_order``), made once, or (``prescaled``) x times the stand-in's 2^8 or 2^120 and the scales of
    the weight rows' block row, remade when the block row changes (a group of weight rows never
    straddles two). ``width``: the vector lanes of the decode, 16 (AVX-512) or 8 (AVX2). ``tile``:
    blocks of a K tile (``tiled``; 0: none). ``halves``: each sweep takes the blocks' columns 0-15,
    then 16-31 (16 lanes only; see ``HALF_ROWS``)."""
    f = Function()
    sweeps = [(0,), (1,)] if halves else [(0, 1)]
    f.do("%blocks = udiv i64 %k, 32")
    f.do("%whole = mul i64 %blocks, 32")
    acc = {(u, r, h): f.slot("<16 x float>", 64)
           for u in range(weight_rows) for r in range(rows) for h in (0, 1)}
    x_row = [f.let(f"mul i64 %xstride, {r}") for r in range(rows)]
    xs_row = [f.let(f"mul i64 %k, {r}") for r in range(rows)]
    made_for = f.slot("i64")          # the block row whose scales xs holds
    f.do(f"store i64 -1, ptr {made_for}")

    def columns(b: str) -> list[str]:
        base = f.let(f"mul i64 {b}, 32")
        return [base, f.let(f"add i64 {base}, 16")]

    order = x_order(fmt, variant, width)
    back = None if order is None else vec("i32", [order.index(c) for c in range(32)])

    def stage(srow: str | None) -> None:
        """xs: x in ``order``, times the block scales and the stand-in's power of two with ``srow``."""
        def block(b: str) -> None:
            c = f.let(f"mul i64 {b}, 32")
            for r in range(rows):
                v = f.let(f"load <32 x float>, ptr {_at(f, 'float', '%x', c, x_row[r])}, align 4")
                if srow is not None:
                    factor = _power_of_two(f, srow, b, stand_in(fmt, width))
                    v = f.let(f"fmul <32 x float> {v}, {f.broadcast('float', factor, 32)}")
                if order is not None:
                    v = f.let(f"shufflevector <32 x float> {v}, <32 x float> poison, <32 x i32> {vec('i32', order)}")
                f.do(f"store <32 x float> {v}, ptr {_at(f, 'float', '%xs', c, xs_row[r])}, align 4")
        f.loop("0", "%blocks", 1, block)

    if order is not None and variant != "prescaled":
        stage(None)

    src, src_row = ("%xs", xs_row) if variant == "prescaled" or order is not None else ("%x", x_row)

    def group(n0: str) -> tuple[list[str], list[str], list[str], list[str]]:
        """(the group's weight rows, their addresses, their scale rows' addresses, their block rows)."""
        ns = [f.let(f"add i64 {n0}, {u}") for u in range(weight_rows)]
        prows = [f.let(f"getelementptr i8, ptr %p, i64 {f.let(f'mul i64 {n}, %pstride')}") for n in ns]
        block_rows = [f.let(f"udiv i64 {n}, %sdiv") for n in ns]
        srows = [f.let(f"getelementptr i8, ptr %s, i64 {f.let(f'mul i64 {r}, %sstride')}") for r in block_rows]
        return ns, prows, srows, block_rows

    def restage(block_rows: list[str], srows: list[str]) -> None:
        if variant == "prescaled":
            stale = f.let(f"icmp ne i64 {block_rows[0]}, {f.let(f'load i64, ptr {made_for}')}")

            def remake() -> None:
                stage(srows[0])
                f.do(f"store i64 {block_rows[0]}, ptr {made_for}")
            f.when(stale, remake)

    def sweep(lo: str, hi: str, prows: list[str], srows: list[str], hs: tuple, ahead: list[str] | None = None) -> None:
        """The group's products over blocks [lo, hi) and halves ``hs``, into the accumulators;
        ``ahead``: where the prefetch reads for each weight row at block 0 (None: _AHEAD rows on)."""
        # the rows _AHEAD on, fetched a block at a time while this group works: a column slice's rows
        # are short strided runs the hardware prefetcher does not follow (1.6x slower from memory)
        if ahead is None:
            ahead = [f.let(f"getelementptr i8, ptr {p}, i64 {f.let(f'mul i64 %pstride, {_AHEAD}')}") for p in prows]

        def block(b: str) -> None:
            for p in ahead if hs[0] == 0 else ():        # the second half's sweep finds them in cache
                f.do(f"call void @llvm.prefetch.p0(ptr {_block_at(f, fmt, p, b)}, i32 0, i32 3, i32 1)")
            if len(hs) == 2:
                ws = [_decode(f, fmt, variant, prows[u], srows[u], b, width) for u in range(weight_rows)]
            else:
                ws = [{hs[0]: _half(f, fmt, variant, prows[u], srows[u], b, hs[0])} for u in range(weight_rows)]
            cols = columns(b)
            for r in range(rows):
                xs = {h: f.let(f"load <16 x float>, ptr {_at(f, 'float', src, cols[h], src_row[r])}, align 4")
                      for h in hs}
                for u in range(weight_rows):
                    for h in hs:
                        a = f.let(f"load <16 x float>, ptr {acc[u, r, h]}")
                        y = f.let(f"call <16 x float> @llvm.fma.v16f32(<16 x float> {xs[h]}, <16 x float> {ws[u][h]}, "
                                  f"<16 x float> {a})")
                        f.do(f"store <16 x float> {y}, ptr {acc[u, r, h]}")
        f.loop(lo, hi, 1, block)

    def finish(ns: list[str], prows: list[str]) -> None:
        """Each accumulator's lane sums back in column order, the defined tree, the tail, the output."""
        for u in range(weight_rows):
            for r in range(rows):
                a0, a1 = (f.let(f"load <16 x float>, ptr {acc[u, r, h]}") for h in (0, 1))
                if back is not None:        # each lane's sum back to its column's lane
                    both = f.let(f"shufflevector <16 x float> {a0}, <16 x float> {a1}, <32 x i32> {back}")
                    a0, a1 = f.halves("float", both)
                v = f.let(f"fadd <16 x float> {a0}, {a1}")
                for n in (8, 4, 2, 1):
                    lo = f.let(f"shufflevector <{2 * n} x float> {v}, <{2 * n} x float> poison, {lanes(0, n)}")
                    hi = f.let(f"shufflevector <{2 * n} x float> {v}, <{2 * n} x float> poison, {lanes(n, 2 * n)}")
                    v = f.let(f"fadd <{n} x float> {lo}, {hi}")
                total = f.slot("float", 4)
                f.do(f"store float {f.let(f'extractelement <1 x float> {v}, i64 0')}, ptr {total}")
                if fmt in ("bf16", "f32"):
                    def column(j: str, u=u, r=r, total=total) -> None:
                        xv = f.let(f"load float, ptr {_at(f, 'float', '%x', j, x_row[r])}")
                        so_far = f.let(f"load float, ptr {total}")
                        s = f.let(f"call float @llvm.fma.f32(float {xv}, float {_tail_value(f, fmt, prows[u], j)}, "
                                  f"float {so_far})")
                        f.do(f"store float {s}, ptr {total}")
                    f.loop("%whole", "%k", 1, column)
                result = f.let(f"load float, ptr {total}")
                f.do(f"store float {result}, ptr {_at(f, 'float', '%out', ns[u], f.let(f'mul i64 %ostride, {r}'))}")

    if not tile:
        def weight_group(n0: str) -> None:
            ns, prows, srows, block_rows = group(n0)
            for slot in acc.values():
                f.do(f"store <16 x float> zeroinitializer, ptr {slot}")
            restage(block_rows, srows)
            for hs in sweeps:
                sweep("0", "%blocks", prows, srows, hs)
            finish(ns, prows)
        f.loop("%r0", "%r1", weight_rows, weight_group)
    else:
        tiled(f, fmt, tile, rows, weight_rows, acc, group, restage, sweep, finish, sweeps)
    f.do("ret void")
    return f.text("define void @product(ptr noalias %p, i64 %pstride, ptr noalias %s, i64 %sstride, i64 %sdiv, "
                  "ptr noalias %x, i64 %xstride, ptr noalias %out, i64 %ostride, i64 %k, i64 %r0, i64 %r1, "
                  "ptr noalias %xs) {",
                  ["declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
                   "declare float @llvm.fma.f32(float, float, float)",
                   "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
                   *([_TABLE_INTRINSICS[width], _tables_ir(width)] if fmt == "fp4" and variant == "table" else [])])


# the x86 instructions the table decodes call, by lanes (every other decode is generic LLVM operations)
_TABLE_INTRINSICS = {16: "declare <16 x float> @llvm.x86.avx512.permvar.sf.512(<16 x float>, <16 x i32>)",
                     8: "declare <32 x i8> @llvm.x86.avx2.pshuf.b(<32 x i8>, <32 x i8>)"}


def tiled(f: Function, fmt: str, tile: int, rows: int, weight_rows: int, acc: dict, group, restage, sweep, finish,
          sweeps: list[tuple]) -> None:
    """The weight rows a block row (32 rows) at a time, and each block row a K tile at a time: every
    group of weight rows sweeps a tile's blocks, its accumulators kept between tiles in a stack
    array, then all groups finish. Each lane's sum is still one chain in block order (the same bits),
    and x's tile is reread from L1 by every group instead of all of x from L2."""
    state = f.slot(f"[{32 * rows * 2} x <16 x float>]", 64)
    base = f.let("and i64 %r0, -32")
    span = f.let(f"sub i64 %r1, {base}")
    chunks = f.let(f"udiv i64 {f.let(f'add i64 {span}, 31')}, 32")
    tiles = f.let(f"udiv i64 {f.let(f'add i64 %blocks, {tile - 1}')}, {tile}")

    def saved(n: str, lo: str, u: int, r: int, h: int) -> str:
        first = f.let(f"mul i64 {f.let(f'sub i64 {n}, {lo}')}, {rows * 2}")
        at = f.let(f"add i64 {first}, {(u * rows + r) * 2 + h}")
        return f.let(f"getelementptr <16 x float>, ptr {state}, i64 {at}")

    def ahead(n0: str, lo: str, hi: str) -> list[str]:
        """The prefetch's rows: those the sweeps reach _AHEAD rows on, past the block row's last row
        its first rows in the next tile (not the next block row's, which come after every tile)."""
        out = []
        span = f.let(f"sub i64 {hi}, {lo}")
        for u in range(weight_rows):
            m = f.let(f"add i64 {n0}, {u + _AHEAD}")
            past = f.let(f"icmp uge i64 {m}, {hi}")
            row = f.let(f"select i1 {past}, i64 {f.let(f'sub i64 {m}, {span}')}, i64 {m}")
            shift = f.let(f"select i1 {past}, i64 {tile * _BLOCK_BYTES[fmt]}, i64 0")
            at = f.let(f"add i64 {f.let(f'mul i64 {row}, %pstride')}, {shift}")
            out.append(f.let(f"getelementptr i8, ptr %p, i64 {at}"))
        return out

    def chunk(c: str) -> None:
        start = f.let(f"add i64 {base}, {f.let(f'mul i64 {c}, 32')}")
        lo = f.let(f"select i1 {f.let(f'icmp ugt i64 %r0, {start}')}, i64 %r0, i64 {start}")
        end = f.let(f"add i64 {start}, 32")
        hi = f.let(f"select i1 {f.let(f'icmp ult i64 %r1, {end}')}, i64 %r1, i64 {end}")
        n_saved = f.let(f"mul i64 {f.let(f'sub i64 {hi}, {lo}')}, {rows * 2}")
        f.loop("0", n_saved, 1, lambda j: f.do(
            f"store <16 x float> zeroinitializer, ptr {f.let(f'getelementptr <16 x float>, ptr {state}, i64 {j}')}"))

        def k_tile(t: str) -> None:
            t0 = f.let(f"mul i64 {t}, {tile}")
            t_end = f.let(f"add i64 {t0}, {tile}")
            t1 = f.let(f"select i1 {f.let(f'icmp ult i64 %blocks, {t_end}')}, i64 %blocks, i64 {t_end}")

            def weight_group(n0: str) -> None:
                _, prows, srows, block_rows = group(n0)
                restage(block_rows, srows)
                for hs in sweeps:       # only a sweep's own accumulators are in registers
                    mine = [(key, slot) for key, slot in acc.items() if key[2] in hs]
                    for (u, r, h), slot in mine:
                        f.do(f"store <16 x float> {f.let(f'load <16 x float>, ptr {saved(n0, lo, u, r, h)}')}, "
                             f"ptr {slot}")
                    sweep(t0, t1, prows, srows, hs, ahead(n0, lo, hi))
                    for (u, r, h), slot in mine:
                        f.do(f"store <16 x float> {f.let(f'load <16 x float>, ptr {slot}')}, "
                             f"ptr {saved(n0, lo, u, r, h)}")
            f.loop(lo, hi, weight_rows, weight_group)
        f.loop("0", tiles, 1, k_tile)

        def finished(n0: str) -> None:
            ns, prows, _, _ = group(n0)
            for (u, r, h), slot in acc.items():
                f.do(f"store <16 x float> {f.let(f'load <16 x float>, ptr {saved(n0, lo, u, r, h)}')}, ptr {slot}")
            finish(ns, prows)
        f.loop(lo, hi, weight_rows, finished)
    f.loop("0", chunks, 1, chunk)


def _fp4_values() -> np.ndarray:
    """[256, 16] FP32: for each E8M0 code s, the 16 E2M1 codes times 2^(s - 127), exactly (codes past
    ``packed``'s 252 never come; past 254 2^(s - 127) is no FP32)."""
    codes = np.array(list(_E2M1) + [-v for v in _E2M1], np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        scales = np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)
        return codes[None, :] * scales[:, None]


@cache
def _tables_ir(width: int) -> str:
    """The table decode's constant: with 16 lanes ``@value_tables``, ``_fp4_values`` itself (64 bytes a
    code); with 8 ``@byte_tables``: every value's FP32 has its low 16 bits zero (two significant bits,
    the lowest at 2^-149 * 2^21 or above), so for each code the low bytes of the upper halves, then
    the high bytes (32 bytes a code)."""
    values = _fp4_values()
    if width == 16:
        name, data = "value_tables", values.tobytes()
    else:
        upper = (values.view(np.uint32) >> 16).astype(np.uint16)
        name = "byte_tables"
        data = np.concatenate([(upper & 0xFF).astype(np.uint8), (upper >> 8).astype(np.uint8)], 1).tobytes()
    return (f"@{name} = private unnamed_addr constant [{len(data)} x i8] c\""
            + "".join(f"\\{v:02X}" for v in data) + "\", align 64")


def _target(model: str | None) -> tuple[str, str]:
    """(CPU name, features) the code is for: this CPU, or an x86 model by LLVM's name with that model's
    own features (``haswell``: AVX2 without AVX-512, as the tests compile it; it must run here)."""
    if model is None:
        return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    return model, ""


def _machine(model: str | None = None) -> llvm.TargetMachine:
    """A target machine (each engine takes one: it owns and frees it)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    cpu, features = _target(model)
    return llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=3, jit=True)


# x86 CPU models the tests compile for (it must run here): ``haswell`` AVX2 without AVX-512 (8 lanes),
# ``x86-64`` the baseline without AVX, F16C or FMA (the portable kernels, 0)
MODEL_LANES = {"haswell": 8, "x86-64": 0}


def permute_width(model: str | None = None) -> int:
    """The kernels' lanes on this CPU as ``cpu.dispatch`` chooses them (or for x86 CPU ``model``,
    ``MODEL_LANES``): 16 (AVX-512) or 8 (AVX2) for the x86 kernels, 0 for the portable ones."""
    return dispatch.lanes() if model is None else MODEL_LANES[model]


_compile_lock = threading.Lock()
_compiled: dict[tuple, tuple] = {}     # process-wide like numba's dispatchers: compiled code, no run state


def kernel(fmt: str, rows: int, weight_rows: int, variant: str, width: int, model: str | None = None,
           tiled: bool = False, halves: bool = False):
    """The compiled kernel (a ctypes function; the call releases the GIL), compiled once per process
    (``width``: its lanes, ``permute_width``; ``model``: for that CPU model instead of this one;
    ``tiled``: K in tiles of ``TILE`` blocks; ``halves``: see ``kernel_ir``)."""
    key = (fmt, rows, weight_rows, variant, width, model, tiled, halves)
    found = _compiled.get(key)
    if found is None:
        with _compile_lock:
            found = _compiled.get(key) or _compiled.setdefault(key, _compile(*key))
    return found[0]


def _cache_dir() -> Path:
    return Path(os.environ.get("DSV41_KERNEL_CACHE") or Path(__file__).parent / "__pycache__" / "kernels")


def optimised(ir: str, model: str | None = None) -> tuple[llvm.ModuleRef, llvm.TargetMachine]:
    """The kernel's IR parsed, checked and optimised as it is compiled, with the target machine that
    emits it (``bench/kernel_mca.py`` reads its assembly)."""
    mod = llvm.parse_assembly(ir)
    mod.verify()
    tm = _machine(model)
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)     # the builder borrows it
    passes = llvm.create_pass_builder(tm, tuning)
    passes.getModulePassManager().run(mod, passes)
    return mod, tm


def _object_code(ir: str, model: str | None) -> bytes:
    """The kernel's machine code: from the cache where an earlier process wrote it (keyed by the IR, the
    CPU and the compiler), else optimised and compiled now and written there if it can be."""
    cpu = f"{' '.join(_target(model))} {llvm.llvm_version_info}"
    path = _cache_dir() / (hashlib.sha256((cpu + "\n" + ir).encode()).hexdigest() + ".o")
    try:
        stored = path.read_bytes()
        if hashlib.sha256(stored[32:]).digest() == stored[:32]:      # a damaged file is compiled again
            return stored[32:]
    except OSError:
        pass
    mod, tm = optimised(ir, model)
    code = tm.emit_object(mod)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_output(path, hashlib.sha256(code).digest() + code)
    except OSError:
        pass        # a read-only tree compiles in every process instead
    return code


def _compile(fmt: str, rows: int, weight_rows: int, variant: str, width: int, model: str | None, tiled: bool,
             halves: bool):
    """(the kernel's ctypes function, the engine that owns its code)."""
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _machine())
    engine.add_object_file(llvm.ObjectFileRef.from_data(
        _object_code(kernel_ir(fmt, rows, weight_rows, variant, width, TILE if tiled else 0, halves), model)))
    engine.finalize_object()
    return ctypes.CFUNCTYPE(None, *_ARGS)(engine.get_function_address("product")), engine


def pass_rows(width: int | None = None) -> int:
    """Activation rows of a pass for ``width`` lanes (None: this CPU's)."""
    return PASS_ROWS[16 if (permute_width() if width is None else width) == 16 else 8]


def half_sweeps(rows: int, width: int) -> bool:
    """Whether a pass of ``rows`` activation rows with ``width`` lanes sweeps half blocks
    (``HALF_ROWS``, AVX-512 only)."""
    return width == 16 and rows >= HALF_ROWS


def _wide(fmt: str, rows: int, width: int) -> bool:
    return width == 16 and rows > 1 and fmt in WIDE


def weight_rows(fmt: str, rows: int, width: int) -> int:
    """Weight rows a group of a pass of ``rows`` activation rows takes (``WEIGHT_ROWS``, ``WIDE``)."""
    return 4 if _wide(fmt, rows, width) else WEIGHT_ROWS[16 if width == 16 else 8][rows]


def k_tiles(fmt: str, rows: int, width: int, k: int) -> bool:
    """Whether a pass sweeps K a tile at a time (``tiled``): two or more rows over more than one tile
    (over one tile the saved accumulators would only cost), except the ``WIDE`` passes."""
    return rows > 1 and k > TILE * BLOCK and not _wide(fmt, rows, width)


def stand_in(fmt: str, width: int) -> int:
    """k where the decode's stand-in for a value v (before the block scale) is v 2^-k: E4M3 in FP16 (8),
    or in BF16 where x carries the scales with 8 lanes (120); E2M1 in FP16 (14)."""
    return _BF16_STAND_IN if fmt == "fp8" and width != 16 else _STAND_IN[fmt]


def prescale_safe(x: np.ndarray | torch.Tensor, codes: tuple[int, int], width: int | None = None) -> bool:
    """Whether x times 2^(s - 127 + k) is exact (no overflow, and no bits lost: a normal FP32 or 0
    where the factor is below 1) for every E8M0 code s in ``codes`` (lowest, highest), k the FP8
    stand-in's (``stand_in``, for ``width`` lanes; None: this CPU's), so that x carrying the scale and
    2^k multiplies each value into the same real number as the decoded value does (and FMA rounds it
    the same way)."""
    k = stand_in("fp8", permute_width() if width is None else width)
    if codes[1] + k > 254:              # 2^(s - 127 + k) itself is no FP32
        return False
    x = np.asarray(x)
    if not x.size:
        return True
    big = max(float(x.max()), -float(x.min()))
    if not np.isfinite(big) or big * 2.0 ** (codes[1] - 127 + k) >= 2.0 ** 128:
        return False
    if codes[0] - 127 + k >= 0:         # x times a power of two of at least 1 loses no bits
        return True
    a = np.abs(x)
    nonzero = a[a > 0]
    return not nonzero.size or float(nonzero.min()) * 2.0 ** (codes[0] - 127 + k) >= 2.0 ** -126


# below this much work (weight values x passes of x's rows) an FP8 product keeps its scales in
# registers: carrying them on x saves a multiply a value, but the range check over x costs more than
# that on a small product
_PRESCALE_WORK = 1 << 20


def pick_variant(fmt: str, x: np.ndarray | torch.Tensor, codes: tuple[int, int] | None = None, work: int = _PRESCALE_WORK,
                 width: int | None = None) -> str:
    """The fastest decode that gives the defined bits with ``width`` lanes (None: this CPU's);
    ``codes``: the lowest and highest scale codes of the fp8 matrix; ``work``: the product's weight
    values times passes of x's rows (by default taken as large enough to carry the scales on x)."""
    width = permute_width() if width is None else width
    if fmt == "fp8":
        return "prescaled" if work >= _PRESCALE_WORK and codes is not None and prescale_safe(x, codes, width) \
            else "shifts"
    if fmt == "fp4":
        return "table" if width else "shifts"
    return "widen"


def product(fmt: str, weights: tuple, x: torch.Tensor, out: torch.Tensor, r0: int, r1: int,
            variant: str | None = None, model: str | None = None, codes: tuple[int, int] | None = None) -> None:
    """out[:, n] = x @ w[n] for weight rows n in [r0, r1). ``weights``: (address of row 0, bytes
    between rows, address of the scale codes or None, bytes between scale rows, weight rows per scale
    row): each row's stored values contiguous within the row (u8 E4M3 bytes, u8 packed E2M1 pairs,
    u16 BF16 bits or FP32), the u8 E8M0 codes of a scale row (fp8 and fp4) contiguous, one per 32
    columns; x FP32 [M, K] and out FP32 [M, N], C-contiguous tensors. ``variant``: one of
    ``VARIANTS[fmt]`` (None: ``pick_variant`` with ``codes``, the lowest and highest scale codes or
    bounds of them); every variant gives the same bits. ``model``: run code compiled for that x86 CPU
    model (see ``_target``)."""
    m, k = x.shape
    if fmt in ("fp8", "fp4") and k % BLOCK:
        raise ValueError(f"fused_product: K must be a multiple of {BLOCK} for {fmt}, got {k}")
    width = permute_width(model)
    if variant is None:
        variant = pick_variant(fmt, x, codes, (r1 - r0) * k * -(-m // pass_rows(width)), width)
    if variant not in VARIANTS[fmt] or (variant == "table" and not width):
        raise ValueError(f"fused_product: variant must be one of {VARIANTS[fmt]} for {fmt} "
                         f"(table needs the x86 kernels: AVX2 or AVX-512), got {variant!r}")
    # x and its scratch at 64-byte boundaries, as Torch allocates them: 16 bytes off one, every other
    # load of x splits a cache line (a 4-row pass ~20% slower in L1, Zen 3; bench/core_rates.py)
    if x.data_ptr() % 64:
        x = x.clone()
    scratch = variant == "prescaled" or x_order(fmt, variant, width) is not None
    xs = torch.empty(min(m, MAX_ROWS), k) if scratch else None
    # addresses read once per call: small products are many
    x_at, out_at, xs_at = x.data_ptr(), out.data_ptr(), None if xs is None else xs.data_ptr()
    x_row, out_row = x.stride(0) * 4, out.stride(0)
    per_pass = pass_rows(width)
    passes = [(g, min(per_pass, m - g)) for g in range(0, m, per_pass)]
    for c0, c1 in _chunks(r0, r1, k * _BLOCK_BYTES[fmt] // BLOCK, len(passes)):
        for g, rows in passes:
            # weight rows a group at a time, from a multiple of the group (so never across a 32-row block)
            halves, tiles = half_sweeps(rows, width), k_tiles(fmt, rows, width, k)
            per = weight_rows(fmt, rows, width)
            a = min(c1, -(-c0 // per) * per)
            b = a + (c1 - a) // per * per
            for lo, hi, group in ((c0, a, 1), (a, b, per), (b, c1, 1)):
                if hi > lo:
                    kernel(fmt, rows, group, variant, width, model, tiles, halves)(
                        *weights, x_at + g * x_row, x_row // 4, out_at + g * out_row * 4, out_row, k, lo, hi, xs_at)


# weight bytes of a chunk that every pass of x's rows runs over before the next chunk
CHUNK_BYTES = 1 << 22


def _chunks(r0: int, r1: int, row_bytes: int, passes: int) -> list[tuple[int, int]]:
    """Weight rows [r0, r1) as the ranges each pass runs over in turn: with more than one pass,
    chunks of about CHUNK_BYTES that start at multiples of 32 rows, so that the passes after the
    first find the chunk in cache and each weight byte comes from memory once."""
    if passes == 1:
        return [(r0, r1)]
    step = max(32, CHUNK_BYTES // max(row_bytes, 1) // 32 * 32)
    bounds = [r0, *range((r0 // step + 1) * step, r1, step), r1]
    return list(zip(bounds, bounds[1:]))
