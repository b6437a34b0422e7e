"""The compiled product for weights in their checkpoint formats: each weight value is decoded in a
register and multiplied into every activation row of the pass while its bytes are in cache, so a
decode step reads each weight byte once from memory and never writes a decoded value.

The kernels are LLVM IR written here and compiled by llvmlite (numba's compiler, a dependency) for
the CPU at hand, once per (format, rows per pass, weight rows per pass) and process:

- **Decode** (exact: every value has at most 4 significant bits). E4M3 bytes become FP16 bits by two
  shifts (the FP16 layout holds E4M3's exponent and significand, subnormals included, at 2^-8 of the
  value), then FP64 by the CPU's conversions, times the block's E8M0 scale. E2M1 nibbles do the same
  at 2^-14, or, where the CPU has AVX-512, index a 16-entry table of the codes times the scale
  (``vpermi2pd``): the same values with no conversion. BF16 and FP32 widen to FP64.
- **Sums.** Each output is an FP64 sum of exact FP64 products in one fixed order: 16 lanes, lane
  ``j`` of a 32-column block taking columns ``j`` and ``j + 16`` of the block's four vectors of 8
  (for FP4, the block's even columns then its odd ones: ``even_odd``), each lane in column order;
  then the lanes summed as a tree (8 + 8, 4 + 4, 2 + 2, 1 + 1), then columns past the last whole
  block one by one. No fast-math flag is set, so the compiler keeps that order, and every row runs
  the same operations whether it shares a pass with 0 or 3 others, or a weight row's pass with 3
  other weight rows: a row's bits do not depend on the batch, the layout or the threads.

Passes take 1-4 activation rows (one FP64 FMA per weight value per row is the cost that grows with
the batch) and two or four weight rows (``WEIGHT_ROWS``), so that FMA chains overlap and each load of
x serves several weight rows. The weight rows a few groups on are prefetched in software. Compiled
code is kept as object files beside this module (``DSV41_KERNEL_CACHE`` moves them), so later
processes load it instead of compiling.
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

# decodes of each format, all exact: "shifts" builds FP16 bits (any x86-64 with F16C); "prescaled"
# (fp8) multiplies x by the block's scale once per 32 weight rows instead of each value by it;
# "table" (fp4) looks the codes up with AVX-512's permute; "widen" (bf16, f32) converts
VARIANTS = {"fp8": ("prescaled", "shifts"), "fp4": ("table", "shifts"), "bf16": ("widen",), "f32": ("widen",)}
BLOCK = 32                  # columns per block: one E8M0 scale for fp8 and fp4
_BLOCK_BYTES = {"fp8": 32, "fp4": 16, "bf16": 64, "f32": 128}
_AHEAD = 8                  # weight rows the software prefetch runs ahead (best of 4, 8, 16 measured)
MAX_ROWS = 4                # activation rows per pass (more spill the accumulators)
# weight rows per pass for each count of activation rows: x's loads are shared by the group (x [4, K]
# FP64 sits in L2, not L1), and each group's accumulators fit the registers; a divisor of 32, so a group
# never straddles an FP8 32-row block (measured per format; docs/flash-shapes.md)
WEIGHT_ROWS = {1: 4, 2: 4, 3: 2, 4: 2}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# exponent-field offsets that make 2^(s-127) times the FP16 stand-in's 2^8 (E4M3) or 2^14 (E2M1)
_SCALE_BIAS = {"fp8": 1023 - 127 + 8, "fp4": 1023 - 127 + 14}
_ARGS = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


def _vec(ty: str, values) -> str:
    """A constant vector operand (its type given by the instruction)."""
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def _splat(ty: str, n: int, v) -> str:
    return _vec(ty, [v] * n)


def _lanes(lo: int, hi: int) -> str:
    """The shuffle mask that takes lanes [lo, hi)."""
    return f"<{hi - lo} x i32> " + _vec("i32", range(lo, hi))


def _double(v: float) -> str:
    return f"0x{struct.unpack('<Q', struct.pack('<d', v))[0]:016X}"


class _Function:
    """Text of one LLVM function body: ``let`` names a value, ``loop`` a counted loop, ``slot`` a stack
    slot (loop counters, accumulators) placed in the entry block, where the optimiser turns it into a
    register."""

    def __init__(self):
        self.lines: list[str] = []
        self.slots: list[str] = []
        self.n = 0

    def slot(self, ty: str, align: int = 8) -> str:
        self.n += 1
        name = f"%slot{self.n}"
        self.slots.append(f"  {name} = alloca {ty}, align {align}")
        return name

    def text(self, header: str, footer: list[str]) -> str:
        return "\n".join([header, "entry:", *self.slots, *self.lines, "}", *footer])

    def let(self, expr: str) -> str:
        self.n += 1
        name = f"%t{self.n}"
        self.lines.append(f"  {name} = {expr}")
        return name

    def do(self, stmt: str) -> None:
        self.lines.append(f"  {stmt}")

    def loop(self, lo: str, hi: str, step: int, body) -> None:
        """for i in range(lo, hi, step): body(i)"""
        self.n += 1
        tag = self.n
        slot = self.slot("i64")
        self.do(f"store i64 {lo}, ptr {slot}")
        self.do(f"br label %head{tag}")
        self.lines.append(f"head{tag}:")
        i = self.let(f"load i64, ptr {slot}")
        more = self.let(f"icmp slt i64 {i}, {hi}")
        self.do(f"br i1 {more}, label %body{tag}, label %done{tag}")
        self.lines.append(f"body{tag}:")
        body(i)
        self.do(f"store i64 {self.let(f'add i64 {i}, {step}')}, ptr {slot}")
        self.do(f"br label %head{tag}")
        self.lines.append(f"done{tag}:")

    def when(self, cond: str, body) -> None:
        """if cond: body()"""
        self.n += 1
        tag = self.n
        self.do(f"br i1 {cond}, label %then{tag}, label %after{tag}")
        self.lines.append(f"then{tag}:")
        body()
        self.do(f"br label %after{tag}")
        self.lines.append(f"after{tag}:")


def _scale(f: _Function, fmt: str, srow: str, b: str) -> str:
    """The block's E8M0 code as the FP64 power of two that turns the FP16 stand-ins into values."""
    code = f.let(f"load i8, ptr {f.let(f'getelementptr i8, ptr {srow}, i64 {b}')}")
    exp = f.let(f"add i64 {f.let(f'zext i8 {code} to i64')}, {_SCALE_BIAS[fmt]}")
    return f.let(f"bitcast i64 {f.let(f'shl i64 {exp}, 52')} to double")


def _block_at(f: _Function, fmt: str, prow: str, b: str) -> str:
    """&(block b of the weight row at prow)."""
    return f.let(f"getelementptr i8, ptr {prow}, i64 {f.let(f'mul i64 {b}, {_BLOCK_BYTES[fmt]}')}")


def _load(f: _Function, ty: str, fmt: str, prow: str, b: str) -> str:
    return f.let(f"load {ty}, ptr {_block_at(f, fmt, prow, b)}, align 1")


def _quarters(f: _Function, wide: str) -> list[str]:
    return [f.let(f"shufflevector <32 x double> {wide}, <32 x double> poison, {_lanes(8 * q, 8 * q + 8)}")
            for q in range(4)]


def _broadcast(f: _Function, value: str, n: int) -> str:
    one = f.let(f"insertelement <{n} x double> poison, double {value}, i64 0")
    return f.let(f"shufflevector <{n} x double> {one}, <{n} x double> poison, <{n} x i32> zeroinitializer")


def _from_half(f: _Function, bits: str) -> str:
    """<32 x i16> FP16 bits as <32 x double> (exact)."""
    return f.let(f"fpext <32 x half> {f.let(f'bitcast <32 x i16> {bits} to <32 x half>')} to <32 x double>")


def _scaled(f: _Function, values: str, scale: str) -> str:
    return f.let(f"fmul <32 x double> {values}, {_broadcast(f, scale, 32)}")


def _to_half(f: _Function, codes: str, shift: int, magnitude: int, sign_shift: int) -> str:
    """<32 x i16> codes as FP16 bits: the magnitude bits shifted into FP16's exponent and significand,
    the sign bit into bit 15."""
    mag = f.let(f"shl <32 x i16> {codes}, {_splat('i16', 32, shift)}")
    mag = f.let(f"and <32 x i16> {mag}, {_splat('i16', 32, magnitude)}")
    sign = f.let(f"shl <32 x i16> {codes}, {_splat('i16', 32, sign_shift)}")
    sign = f.let(f"and <32 x i16> {sign}, {_splat('i16', 32, 0x8000)}")
    return f.let(f"or <32 x i16> {mag}, {sign}")


def _decode(f: _Function, fmt: str, variant: str, prow: str, srow: str, b: str) -> list[str]:
    """Block ``b`` of a weight row as four <8 x double>, in the column order of ``_x_columns``
    (``prescaled``: without the block's scale, which x carries)."""
    if fmt == "fp8":
        z = f.let(f"zext <32 x i8> {_load(f, '<32 x i8>', fmt, prow, b)} to <32 x i16>")
        d = _from_half(f, _to_half(f, z, 7, 0x3F80, 8))
        return _quarters(f, d if variant == "prescaled" else _scaled(f, d, _scale(f, fmt, srow, b)))
    if variant == "table":
        s = _broadcast(f, _scale(f, fmt, srow, b), 8)
        codes = [v * 2.0 ** -14 for v in _E2M1] + [-v * 2.0 ** -14 for v in _E2M1]
        pos = f.let(f"fmul <8 x double> {s}, {_vec('double', [_double(v) for v in codes[:8]])}")
        neg = f.let(f"fmul <8 x double> {s}, {_vec('double', [_double(v) for v in codes[8:]])}")
        raw = f.let(f"zext <16 x i8> {_load(f, '<16 x i8>', fmt, prow, b)} to <16 x i64>")
        lo = [f.let(f"shufflevector <16 x i64> {raw}, <16 x i64> poison, {_lanes(8 * q, 8 * q + 8)}") for q in (0, 1)]
        idx = lo + [f.let(f"lshr <8 x i64> {v}, {_splat('i64', 8, 4)}") for v in lo]   # the table reads bits 0-3
        return [f.let(f"call <8 x double> @llvm.x86.avx512.vpermi2var.pd.512(<8 x double> {pos}, "
                      f"<8 x i64> {i}, <8 x double> {neg})") for i in idx]
    if fmt == "fp4":
        z = f.let(f"zext <16 x i8> {_load(f, '<16 x i8>', fmt, prow, b)} to <16 x i16>")
        hi = f.let(f"lshr <16 x i16> {z}, {_splat('i16', 16, 4)}")
        both = f.let(f"shufflevector <16 x i16> {z}, <16 x i16> {hi}, {_lanes(0, 32)}")
        return _quarters(f, _scaled(f, _from_half(f, _to_half(f, both, 9, 0x0E00, 12)), _scale(f, fmt, srow, b)))
    if fmt == "bf16":
        z = f.let(f"zext <32 x i16> {_load(f, '<32 x i16>', fmt, prow, b)} to <32 x i32>")
        upper = f.let(f"shl <32 x i32> {z}, {_splat('i32', 32, 16)}")
        wide = f.let(f"bitcast <32 x i32> {upper} to <32 x float>")
        return _quarters(f, f.let(f"fpext <32 x float> {wide} to <32 x double>"))
    return _quarters(f, f.let(f"fpext <32 x float> {_load(f, '<32 x float>', fmt, prow, b)} to <32 x double>"))


def _x_columns(f: _Function, fmt: str, b: str) -> list[str]:
    """Column offsets of the four x vectors block ``b`` multiplies (fp4: even columns first, from
    ``even_odd``'s halves)."""
    if fmt != "fp4":
        base = f.let(f"mul i64 {b}, 32")
        return [f.let(f"add i64 {base}, {8 * q}") for q in range(4)]
    base = f.let(f"mul i64 {b}, 16")
    odd = f.let(f"add i64 {base}, %half")
    return [f.let(f"add i64 {base}, 0"), f.let(f"add i64 {base}, 8"), f.let(f"add i64 {odd}, 0"),
            f.let(f"add i64 {odd}, 8")]


def _at(f: _Function, ty: str, base: str, i: str, j: str) -> str:
    """&base[i + j] for elements of type ``ty``."""
    return f.let(f"getelementptr {ty}, ptr {base}, i64 {f.let(f'add i64 {i}, {j}')}")


def _tail_value(f: _Function, fmt: str, prow: str, j: str) -> str:
    if fmt == "bf16":
        bits = f.let(f"load i16, ptr {f.let(f'getelementptr i16, ptr {prow}, i64 {j}')}")
        wide = f.let(f"shl i32 {f.let(f'zext i16 {bits} to i32')}, 16")
        value = f.let(f"bitcast i32 {wide} to float")
    else:
        value = f.let(f"load float, ptr {f.let(f'getelementptr float, ptr {prow}, i64 {j}')}")
    return f.let(f"fpext float {value} to double")


def kernel_ir(fmt: str, rows: int, weight_rows: int, variant: str) -> str:
    """``void product(p, pstride, s, sstride, sdiv, x, xstride, out, ostride, k, r0, r1, xs)``:
    out[r, n] = sum_c x[r, c] w[n, c] for r < ``rows`` and n in [r0, r1), ``weight_rows`` at a time;
    weight row n at p + n pstride bytes, its scale codes at s + (n / sdiv) sstride; x [rows, xstride]
    FP64, out [rows, ostride] FP64; xs FP64 [rows, k] scratch (``prescaled``: x times the scales of
    the weight rows' block row, remade when the block row changes; a group of weight rows never
    straddles two)."""
    f = _Function()
    f.do("%blocks = udiv i64 %k, 32")
    f.do("%half = udiv i64 %k, 2")
    f.do("%whole = mul i64 %blocks, 32")
    acc = {(u, r, i): f.slot("<8 x double>", 64)
           for u in range(weight_rows) for r in range(rows) for i in (0, 1)}
    x_row = [f.let(f"mul i64 %xstride, {r}") for r in range(rows)]
    xs_row = [f.let(f"mul i64 %k, {r}") for r in range(rows)]
    made_for = f.slot("i64")          # the block row whose scales xs holds
    f.do(f"store i64 -1, ptr {made_for}")

    def prescale(srow: str) -> None:
        def block(b: str) -> None:
            scale = _broadcast(f, _scale(f, fmt, srow, b), 8)
            for r in range(rows):
                for c in _x_columns(f, fmt, b):
                    v = f.let(f"load <8 x double>, ptr {_at(f, 'double', '%x', c, x_row[r])}, align 8")
                    f.do(f"store <8 x double> {f.let(f'fmul <8 x double> {v}, {scale}')}, "
                         f"ptr {_at(f, 'double', '%xs', c, xs_row[r])}, align 8")
        f.loop("0", "%blocks", 1, block)

    def weight_group(n0: str) -> None:
        ns = [f.let(f"add i64 {n0}, {u}") for u in range(weight_rows)]
        prows = [f.let(f"getelementptr i8, ptr %p, i64 {f.let(f'mul i64 {n}, %pstride')}") for n in ns]
        block_rows = [f.let(f"udiv i64 {n}, %sdiv") for n in ns]
        srows = [f.let(f"getelementptr i8, ptr %s, i64 {f.let(f'mul i64 {r}, %sstride')}") for r in block_rows]
        for slot in acc.values():
            f.do(f"store <8 x double> zeroinitializer, ptr {slot}")
        if variant == "prescaled":
            stale = f.let(f"icmp ne i64 {block_rows[0]}, {f.let(f'load i64, ptr {made_for}')}")

            def remake() -> None:
                prescale(srows[0])
                f.do(f"store i64 {block_rows[0]}, ptr {made_for}")
            f.when(stale, remake)
        src, src_row = ("%xs", xs_row) if variant == "prescaled" else ("%x", x_row)
        # the rows _AHEAD on, fetched a block at a time while this group works: a column slice's rows
        # are short strided runs the hardware prefetcher does not follow (1.6x slower from memory)
        ahead = [f.let(f"getelementptr i8, ptr {p}, i64 {f.let(f'mul i64 %pstride, {_AHEAD}')}") for p in prows]

        def block(b: str) -> None:
            for p in ahead:
                f.do(f"call void @llvm.prefetch.p0(ptr {_block_at(f, fmt, p, b)}, i32 0, i32 3, i32 1)")
            ws = [_decode(f, fmt, variant, prows[u], srows[u], b) for u in range(weight_rows)]
            cols = _x_columns(f, fmt, b)
            for r in range(rows):
                xs = [f.let(f"load <8 x double>, ptr {_at(f, 'double', src, c, src_row[r])}, align 8") for c in cols]
                for u in range(weight_rows):
                    for q in range(4):
                        slot = acc[u, r, q % 2]
                        a = f.let(f"load <8 x double>, ptr {slot}")
                        y = f.let(f"call <8 x double> @llvm.fma.v8f64(<8 x double> {xs[q]}, <8 x double> {ws[u][q]}, "
                                  f"<8 x double> {a})")
                        f.do(f"store <8 x double> {y}, ptr {slot}")
        f.loop("0", "%blocks", 1, block)
        for u in range(weight_rows):
            for r in range(rows):
                a0 = f.let(f"load <8 x double>, ptr {acc[u, r, 0]}")
                v = f.let(f"fadd <8 x double> {a0}, {f.let(f'load <8 x double>, ptr {acc[u, r, 1]}')}")
                for width in (4, 2, 1):
                    lo = f.let(f"shufflevector <{2 * width} x double> {v}, <{2 * width} x double> poison, {_lanes(0, width)}")
                    hi = f.let(f"shufflevector <{2 * width} x double> {v}, <{2 * width} x double> poison, {_lanes(width, 2 * width)}")
                    v = f.let(f"fadd <{width} x double> {lo}, {hi}")
                total = f.slot("double")
                f.do(f"store double {f.let(f'extractelement <1 x double> {v}, i64 0')}, ptr {total}")
                if fmt in ("bf16", "f32"):
                    def column(j: str, u=u, r=r, total=total) -> None:
                        xv = f.let(f"load double, ptr {_at(f, 'double', '%x', j, x_row[r])}")
                        so_far = f.let(f"load double, ptr {total}")
                        s = f.let(f"call double @llvm.fma.f64(double {xv}, double {_tail_value(f, fmt, prows[u], j)}, "
                                  f"double {so_far})")
                        f.do(f"store double {s}, ptr {total}")
                    f.loop("%whole", "%k", 1, column)
                result = f.let(f"load double, ptr {total}")
                f.do(f"store double {result}, ptr {_at(f, 'double', '%out', ns[u], f.let(f'mul i64 %ostride, {r}'))}")
    f.loop("%r0", "%r1", weight_rows, weight_group)
    f.do("ret void")
    return f.text("define void @product(ptr noalias %p, i64 %pstride, ptr noalias %s, i64 %sstride, i64 %sdiv, "
                  "ptr noalias %x, i64 %xstride, ptr noalias %out, i64 %ostride, i64 %k, i64 %r0, i64 %r1, "
                  "ptr noalias %xs) {",
                  ["declare <8 x double> @llvm.fma.v8f64(<8 x double>, <8 x double>, <8 x double>)",
                   "declare double @llvm.fma.f64(double, double, double)",
                   "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
                   "declare <8 x double> @llvm.x86.avx512.vpermi2var.pd.512(<8 x double>, <8 x i64>, <8 x double>)"])


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


@cache
def has_permute() -> bool:
    """Whether this CPU has AVX-512's two-table permute (the FP4 table decode)."""
    return llvm.get_host_cpu_features().get("avx512f", False)


_compile_lock = threading.Lock()
_compiled: dict[tuple, tuple] = {}     # process-wide like numba's dispatchers: compiled code, no run state


def kernel(fmt: str, rows: int, weight_rows: int, variant: str, model: str | None = None):
    """The compiled kernel (a ctypes function; the call releases the GIL), compiled once per process
    (``model``: for that CPU model instead of this one)."""
    key = (fmt, rows, weight_rows, variant, model)
    found = _compiled.get(key)
    if found is None:
        with _compile_lock:
            found = _compiled.get(key) or _compiled.setdefault(key, _compile(*key))
    return found[0]


def _cache_dir() -> Path:
    return Path(os.environ.get("DSV41_KERNEL_CACHE") or Path(__file__).parent / "__pycache__" / "kernels")


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
    mod = llvm.parse_assembly(ir)
    mod.verify()
    tm = _machine(model)
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)     # the builder borrows it
    passes = llvm.create_pass_builder(tm, tuning)
    passes.getModulePassManager().run(mod, passes)
    code = tm.emit_object(mod)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(hashlib.sha256(code).digest() + code)
        os.replace(tmp, path)
    except OSError:
        pass        # a read-only tree compiles in every process instead
    return code


def _compile(fmt: str, rows: int, weight_rows: int, variant: str, model: str | None):
    """(the kernel's ctypes function, the engine that owns its code)."""
    if not llvm.get_host_cpu_features().get("f16c", False):
        raise RuntimeError("fused_product: this CPU has no F16C conversions, which the weight decode uses")
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _machine())
    engine.add_object_file(llvm.ObjectFileRef.from_data(
        _object_code(kernel_ir(fmt, rows, weight_rows, variant), model)))
    engine.finalize_object()
    return ctypes.CFUNCTYPE(None, *_ARGS)(engine.get_function_address("product")), engine


def _prescale_safe(x: np.ndarray) -> bool:
    """Whether x times any scale up to 2^127 and down to 2^-119 stays a normal FP64, so that x f times
    a value is the same real number as x times the value f (and FMA rounds it the same way)."""
    a = np.abs(x)
    if not a.size:
        return True
    big = a.max()
    if not np.isfinite(big) or big >= 2.0 ** 895:
        return False
    nonzero = a[a > 0]
    return not nonzero.size or nonzero.min() >= 2.0 ** -903


def pick_variant(fmt: str, x: np.ndarray, fp32_values: bool = False) -> str:
    """The fastest decode that gives the defined bits here (``fp32_values``: x holds FP32 values, whose
    range is always safe to prescale)."""
    if fmt == "fp8":
        return "prescaled" if fp32_values or _prescale_safe(x) else "shifts"
    if fmt == "fp4":
        return "table" if has_permute() else "shifts"
    return "widen"


def product(fmt: str, payload: np.ndarray, scale: np.ndarray | None, scale_div: int, x: np.ndarray,
            out: np.ndarray, r0: int, r1: int, variant: str | None = None, model: str | None = None) -> None:
    """out[:, n] = x @ w[n] for weight rows n in [r0, r1). payload [N, *]: each row's stored values,
    contiguous within the row (u8 E4M3 bytes, u8 packed E2M1 pairs, u16 BF16 bits or FP32); scale
    u8 [N / scale_div, K / 32] E8M0 codes, contiguous within a row (fp8 and fp4); x FP64 [M, K]
    C-contiguous (for fp4 ``even_odd`` of it); out FP64 [M, N] C-contiguous. ``variant``: one of
    ``VARIANTS[fmt]`` (None: ``pick_variant``); every variant gives the same bits. ``model``: run code
    compiled for that x86 CPU model (see ``_target``; not the table decode)."""
    m, k = x.shape
    if fmt in ("fp8", "fp4") and k % BLOCK:
        raise ValueError(f"fused_product: K must be a multiple of {BLOCK} for {fmt}, got {k}")
    variant = pick_variant(fmt, x) if variant is None else variant
    if variant not in VARIANTS[fmt] or (variant == "table" and (model is not None or not has_permute())):
        raise ValueError(f"fused_product: variant must be one of {VARIANTS[fmt]} for {fmt} "
                         f"(table needs AVX-512 on this CPU), got {variant!r}")
    # addresses read once per call (each .ctypes costs ~1.5 us; small products are many)
    weights = (payload.ctypes.data, payload.strides[0], None if scale is None else scale.ctypes.data,
               0 if scale is None else scale.strides[0], scale_div)
    x_at, out_at = x.ctypes.data, out.ctypes.data
    xs = np.empty((min(m, MAX_ROWS), k)) if variant == "prescaled" else None
    xs_at = None if xs is None else xs.ctypes.data
    for g in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - g)
        # weight rows a group at a time, from a multiple of the group (so never across a 32-row block)
        per = WEIGHT_ROWS[rows]
        a = min(r1, -(-r0 // per) * per)
        b = a + (r1 - a) // per * per
        for lo, hi, group in ((r0, a, 1), (a, b, per), (b, r1, 1)):
            if hi > lo:
                kernel(fmt, rows, group, variant, model)(
                    *weights, x_at + g * x.strides[0], k, out_at + g * out.strides[0],
                    out.strides[0] // out.itemsize, k, lo, hi, xs_at)


def even_odd(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the FP4 kernel reads it: columns 0, 2, 4, ... then 1, 3, 5, ... (contiguous loads
    for the two nibbles of each byte)."""
    return np.ascontiguousarray(np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1))
