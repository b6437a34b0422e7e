"""Weight products of many activation rows (a prefill chunk): each weight row is decoded once per
product into an FP32 panel and reused by every row, where ``cpu.fused_product``'s passes decode it
again for every three (AVX2) or eight (AVX-512) rows. The sums are that module's defined ones, so
the bits are its bits (``docs/numerics.md``, "The linears' order").

Why it keeps the order: an output's sum is 32 independent FMA chains, chain ``j`` over column ``j``
of every 32-column block in block order, then a fixed tree over the 32 chains, then the columns past
the last block one by one. Nothing in that order ties chain ``j`` to chain ``j + 1``, so a kernel may
run a group of ``LANES`` chains over the blocks, then the next group, and keep each output's
chains in any registers it likes; only each chain's own block order and the tree are fixed. The
decoded values are the ones the fused decodes multiply by (the same IR, ``fused_product._decode``,
in a decode that gives them in column order), so every FMA has the same operands.

The work, for each panel of ``PANEL`` weight rows: the panel's rows decoded to FP32 (each row's
chain groups one after the other, so that a group's values over the blocks are one contiguous run),
then for each tile of ``ROWS`` activation rows and each K tile of ``K_TILE`` blocks, every
``WEIGHT_ROWS`` weight rows of the panel swept group by group: ``ROWS x WEIGHT_ROWS`` vector
accumulators in registers, their chains kept between K tiles in ``state``. x's K tile (``ROWS``
rows of ``K_TILE`` blocks: 16 KB) stays in L1 while the panel's tile streams from L2, and the panel
stays in L2 while x's rows stream by. The decode, once per product, costs a weight value what the
fused pass costs it once per three rows; a panel's FMAs are ``ROWS x WEIGHT_ROWS`` per ``ROWS +
WEIGHT_ROWS`` loads.

x86 and portable alike: the sweeps are generic LLVM vector operations (``llvm.fma`` on ``<LANES x
float>``), the decode the fused kernels' for the lanes at hand (the portable one with 0). Code is
compiled once per (format, decode lanes, remainder rows) and process, and cached beside
``fused_product``'s.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from dsv41.cpu import fused_product as fused
from dsv41.cpu.ir_text import Function, lanes

# activation rows from which a product is tiled: below, the fused passes' decode is shared by few
# enough rows that a panel's decode and stores cost more than they save
MIN_ROWS = 16
PANEL = 16          # weight rows decoded at once: 16 x K FP32 (320 KB at K = 5,120) held in L2
K_TILE = 32         # blocks of a K tile: x's tile for ``ROWS`` rows is 16 KB, in L1
# (activation rows, weight rows) of a sweep by the decode's lanes: their product in vector
# accumulators, beside one vector of each activation row and one of the weights, fits the registers
# (16 with AVX2 and the portable build, 32 with AVX-512)
SHAPES = {16: (4, 4), 8: (3, 4), 0: (3, 4)}
LANES = {16: 16, 8: 8, 0: 8}
# the decode each format's panel takes: one that gives a block's values in column order
_PANEL_VARIANT = {"fp8": "shifts", "fp4": "shifts", "bf16": "widen", "f32": "widen"}
_ARGS = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)


def shape(width: int) -> tuple[int, int]:
    return SHAPES[width]


def _row_at(f: Function, base: str, i: str, stride) -> str:
    """&base[i * stride] for FP32 elements."""
    return f.let(f"getelementptr float, ptr {base}, i64 {f.let(f'mul i64 {i}, {stride}')}")


def padded_panel(width: int) -> int:
    """Weight rows of a panel's layout: ``PANEL`` rounded up to whole groups of a sweep's weight rows."""
    per = shape(width)[1]
    return -(-PANEL // per) * per


def panel_floats(width: int, k: int) -> int:
    """FP32s of a panel for K = k: every K tile whole, then 32 columns a row past the last block."""
    return padded_panel(width) * (-(-(k // 32) // K_TILE) * K_TILE * 32 + 32)


def _layout(width: int) -> tuple[int, int, int]:
    """(FP32s of a row's run of one chain group over a K tile, of a chain group over a K tile for
    every row, of a K tile): a panel is K tile by K tile, each tile group by group, each group row by
    row, so that a sweep's weights over a tile are one run and a tile's are one block of memory (rows
    a power of two apart shared L1's sets and evicted each other)."""
    n_lanes = LANES[width]
    run = K_TILE * n_lanes
    group = padded_panel(width) * run
    return run, group, group * (32 // n_lanes)


def _decode_ir(fmt: str, width: int) -> str:
    """``void decode(p, pstride, s, sstride, sdiv, k, r0, r1, panel)``: weight rows [r0, r1) as FP32
    in ``panel`` (``_layout``; the columns past the last block after every tile, 32 a row)."""
    f = Function()
    n_lanes, variant = LANES[width], _PANEL_VARIANT[fmt]
    run, group, tile = _layout(width)
    f.do("%blocks = udiv i64 %k, 32")
    f.do("%whole = mul i64 %blocks, 32")
    tiles = f.let(f"udiv i64 {f.let(f'add i64 %blocks, {K_TILE - 1}')}, {K_TILE}")
    tails = f.let(f"getelementptr float, ptr %panel, i64 {f.let(f'mul i64 {tiles}, {tile}')}")

    def row(n: str) -> None:
        prow = f.let(f"getelementptr i8, ptr %p, i64 {f.let(f'mul i64 {n}, %pstride')}")
        block_row = f.let(f"udiv i64 {n}, %sdiv")
        srow = f.let(f"getelementptr i8, ptr %s, i64 {f.let(f'mul i64 {block_row}, %sstride')}")
        j = f.let(f"sub i64 {n}, %r0")
        dst = _row_at(f, "%panel", j, run)

        def block(b: str) -> None:
            h0, h1 = fused._decode(f, fmt, variant, prow, srow, b, width)
            v = f.let(f"shufflevector <16 x float> {h0}, <16 x float> {h1}, {lanes(0, 32)}")
            t = f.let(f"udiv i64 {b}, {K_TILE}")
            within = f.let(f"mul i64 {f.let(f'urem i64 {b}, {K_TILE}')}, {n_lanes}")
            at0 = f.let(f"add i64 {f.let(f'mul i64 {t}, {tile}')}, {within}")
            for g in range(32 // n_lanes):
                part = f.let(f"shufflevector <32 x float> {v}, <32 x float> poison, {lanes(g * n_lanes, (g + 1) * n_lanes)}")
                at = f.let(f"add i64 {at0}, {g * group}")
                f.do(f"store <{n_lanes} x float> {part}, ptr {f.let(f'getelementptr float, ptr {dst}, i64 {at}')}, align 4")
        f.loop("0", "%blocks", 1, block)
        if fmt in ("bf16", "f32"):
            mine = _row_at(f, tails, j, 32)
            f.loop("%whole", "%k", 1, lambda c: f.do(
                f"store float {fused._tail_value(f, fmt, prow, c)}, "
                f"ptr {f.let(f'getelementptr float, ptr {mine}, i64 {_sub(f, c)}')}"))
    f.loop("%r0", "%r1", 1, row)
    f.do("ret void")
    return f.text("define internal void @decode(ptr noalias %p, i64 %pstride, ptr noalias %s, i64 %sstride, "
                  "i64 %sdiv, i64 %k, i64 %r0, i64 %r1, ptr noalias %panel) {", [])


def _sweep_ir(name: str, rows: int, weight_rows: int, width: int, tails: bool) -> str:
    """``void NAME(panel, np, x, xstride, m, out, ostride, k, state)``: out[r, j] = the defined sum of
    x row r and panel row j for r < m (a multiple of ``rows``) and j < np (rows of the panel past np
    up to a whole weight group are swept, never stored); ``state``: FP32 [np rounded up, rows, 32],
    each output's chains between K tiles."""
    f = Function()
    n_lanes = LANES[width]
    run, group, tile = _layout(width)
    v = f"<{n_lanes} x float>"
    f.do("%blocks = udiv i64 %k, 32")
    f.do("%whole = mul i64 %blocks, 32")
    groups_up = f.let(f"udiv i64 {f.let(f'add i64 %np, {weight_rows - 1}')}, {weight_rows}")
    f.do(f"%npad = mul i64 {groups_up}, {weight_rows}")
    f.do(f"%tiles = udiv i64 {f.let(f'add i64 %blocks, {K_TILE - 1}')}, {K_TILE}")
    tail_base = f.let(f"getelementptr float, ptr %panel, i64 {f.let(f'mul i64 %tiles, {tile}')}")
    acc = {(r, u): f.slot(v, 64) for r in range(rows) for u in range(weight_rows)}

    def chains(j: str, r: int) -> str:
        """&state[j, r, 0]: output (r, j)'s 32 chains."""
        at = f.let(f"add i64 {f.let(f'mul i64 {j}, {rows * 32}')}, {r * 32}")
        return f.let(f"getelementptr float, ptr %state, i64 {at}")

    def row_tile(m0: str) -> None:
        xrows = [_row_at(f, "%x", f.let(f"add i64 {m0}, {r}"), "%xstride") for r in range(rows)]
        f.loop("0", f.let(f"mul i64 %npad, {rows * 32}"), 1, lambda i: f.do(
            f"store float 0.0, ptr {f.let(f'getelementptr float, ptr %state, i64 {i}')}"))

        def k_tile(t: str) -> None:
            b0 = f.let(f"mul i64 {t}, {K_TILE}")
            left = f.let(f"sub i64 %blocks, {b0}")
            count = f.let(f"select i1 {f.let(f'icmp ult i64 {left}, {K_TILE}')}, i64 {left}, i64 {K_TILE}")
            tbase = f.let(f"getelementptr float, ptr %panel, i64 {f.let(f'mul i64 {t}, {tile}')}")
            xts = [f.let(f"getelementptr float, ptr {xr}, i64 {f.let(f'mul i64 {b0}, 32')}") for xr in xrows]
            for g in range(32 // n_lanes):
                gbase = f.let(f"getelementptr float, ptr {tbase}, i64 {g * group}")

                def weight_group(n0: str, g=g, gbase=gbase) -> None:
                    wrows = [_row_at(f, gbase, f.let(f"add i64 {n0}, {u}"), run) for u in range(weight_rows)]
                    saved = {(r, u): f.let(f"getelementptr float, ptr {chains(f.let(f'add i64 {n0}, {u}'), r)}, "
                                           f"i64 {g * n_lanes}") for r in range(rows) for u in range(weight_rows)}
                    for key, slot in acc.items():
                        f.do(f"store {v} {f.let(f'load {v}, ptr {saved[key]}, align 4')}, ptr {slot}")

                    def block(b: str) -> None:
                        if g < 2:
                            # x's next K tile, a line of each block for each of the first two groups
                            # (then L1 holds it when its sweeps start: its first reads came from L3)
                            ahead = f.let(f"add i64 {f.let(f'mul i64 {b}, 32')}, {K_TILE * 32 + 16 * g}")
                            for xt in xts:
                                f.do(f"call void @llvm.prefetch.p0(ptr {f.let(f'getelementptr float, ptr {xt}, i64 {ahead}')}, "
                                     "i32 0, i32 3, i32 1)")
                        xc = f.let(f"add i64 {f.let(f'mul i64 {b}, 32')}, {g * n_lanes}")
                        xs = [f.let(f"load {v}, ptr {f.let(f'getelementptr float, ptr {xt}, i64 {xc}')}, align 4")
                              for xt in xts]
                        wc = f.let(f"mul i64 {b}, {n_lanes}")
                        for u in range(weight_rows):
                            w = f.let(f"load {v}, ptr {f.let(f'getelementptr float, ptr {wrows[u]}, i64 {wc}')}, align 4")
                            for r in range(rows):
                                a = f.let(f"load {v}, ptr {acc[r, u]}")
                                y = f.let(f"call {v} @llvm.fma.v{n_lanes}f32({v} {xs[r]}, {v} {w}, {v} {a})")
                                f.do(f"store {v} {y}, ptr {acc[r, u]}")
                    f.loop("0", count, 1, block)
                    for key, slot in acc.items():
                        f.do(f"store {v} {f.let(f'load {v}, ptr {slot}')}, ptr {saved[key]}, align 4")
                f.loop("0", "%npad", weight_rows, weight_group)
        f.loop("0", "%tiles", 1, k_tile)

        def finish(j: str) -> None:
            tail = _row_at(f, tail_base, j, 32)
            for r in range(rows):
                a = f.let(f"load <32 x float>, ptr {chains(j, r)}, align 4")
                lo, hi = f.halves("float", a)
                s = f.let(f"fadd <16 x float> {lo}, {hi}")
                for n in (8, 4, 2, 1):
                    s_lo = f.let(f"shufflevector <{2 * n} x float> {s}, <{2 * n} x float> poison, {lanes(0, n)}")
                    s_hi = f.let(f"shufflevector <{2 * n} x float> {s}, <{2 * n} x float> poison, {lanes(n, 2 * n)}")
                    s = f.let(f"fadd <{n} x float> {s_lo}, {s_hi}")
                total = f.slot("float", 4)
                f.do(f"store float {f.let(f'extractelement <1 x float> {s}, i64 0')}, ptr {total}")
                if tails:
                    def column(c: str, r=r, total=total) -> None:
                        xv = f.let(f"load float, ptr {f.let(f'getelementptr float, ptr {xrows[r]}, i64 {c}')}")
                        wv = f.let(f"load float, ptr {f.let(f'getelementptr float, ptr {tail}, i64 {_sub(f, c)}')}")
                        so_far = f.let(f"load float, ptr {total}")
                        f.do(f"store float {f.let(f'call float @llvm.fma.f32(float {xv}, float {wv}, float {so_far})')}, "
                             f"ptr {total}")
                    f.loop("%whole", "%k", 1, column)
                dst = f.let(f"getelementptr float, ptr {_row_at(f, '%out', f.let(f'add i64 {m0}, {r}'), '%ostride')}, i64 {j}")
                f.do(f"store float {f.let(f'load float, ptr {total}')}, ptr {dst}")
        f.loop("0", "%np", 1, finish)
    f.loop("0", "%m", rows, row_tile)
    f.do("ret void")
    return f.text(f"define internal void @{name}(ptr noalias %panel, i64 %np, ptr noalias %x, i64 %xstride, i64 %m, "
                  "ptr noalias %out, i64 %ostride, i64 %k, ptr noalias %state) {", [])


def _sub(f: Function, c: str) -> str:
    """Column c's place among the columns past the last block."""
    return f.let(f"sub i64 {c}, %whole")


def kernel_ir(fmt: str, width: int, rest: int) -> str:
    """``void product(p, pstride, s, sstride, sdiv, x, xstride, m, out, ostride, k, r0, r1, panel,
    state)``: out[r, n] = the defined sum of x row r and weight row n for r < m, n in [r0, r1) (out
    [m, ostride] FP32, its column n at n); the weights as ``fused_product.product`` takes them; ``rest``:
    m modulo the sweeps' activation rows (those last rows swept by a kernel of their own); ``panel``:
    FP32 [``panel_floats``], ``state`` FP32 [``padded_panel``, rows, 32]."""
    rows, weight_rows = shape(width)
    n_lanes, tails = LANES[width], fmt in ("bf16", "f32")
    f = Function()
    f.do(f"%main = sub i64 %m, {rest}")

    def panel(n0: str) -> None:
        end = f.let(f"add i64 {n0}, {PANEL}")
        n1 = f.let(f"select i1 {f.let(f'icmp ult i64 %r1, {end}')}, i64 %r1, i64 {end}")
        f.do(f"call void @decode(ptr %p, i64 %pstride, ptr %s, i64 %sstride, i64 %sdiv, i64 %k, i64 {n0}, i64 {n1}, "
             "ptr %panel)")
        count = f.let(f"sub i64 {n1}, {n0}")
        out = f.let(f"getelementptr float, ptr %out, i64 {n0}")
        f.do(f"call void @sweep(ptr %panel, i64 {count}, ptr %x, i64 %xstride, i64 %main, ptr {out}, i64 %ostride, "
             "i64 %k, ptr %state)")
        if rest:
            x_rest = f.let(f"getelementptr float, ptr %x, i64 {f.let('mul i64 %main, %xstride')}")
            out_rest = f.let(f"getelementptr float, ptr {out}, i64 {f.let('mul i64 %main, %ostride')}")
            f.do(f"call void @rest(ptr %panel, i64 {count}, ptr {x_rest}, i64 %xstride, i64 {rest}, ptr {out_rest}, "
                 "i64 %ostride, i64 %k, ptr %state)")
    f.loop("%r0", "%r1", PANEL, panel)
    f.do("ret void")
    parts = [_decode_ir(fmt, width), _sweep_ir("sweep", rows, weight_rows, width, tails)]
    if rest:
        parts.append(_sweep_ir("rest", rest, weight_rows, width, tails))
    return f.text("define void @product(ptr noalias %p, i64 %pstride, ptr noalias %s, i64 %sstride, i64 %sdiv, "
                  "ptr noalias %x, i64 %xstride, i64 %m, ptr noalias %out, i64 %ostride, i64 %k, i64 %r0, i64 %r1, "
                  "ptr noalias %panel, ptr noalias %state) {",
                  [*parts, f"declare <{n_lanes} x float> @llvm.fma.v{n_lanes}f32(<{n_lanes} x float>, "
                   f"<{n_lanes} x float>, <{n_lanes} x float>)",
                   "declare float @llvm.fma.f32(float, float, float)",
                   "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"])


_compile_lock = threading.Lock()
_compiled: dict[tuple, tuple] = {}


def kernel(fmt: str, width: int, rest: int, model: str | None = None):
    """The compiled product (a ctypes function; the call releases the GIL), once per process."""
    key = (fmt, width, rest, model)
    found = _compiled.get(key)
    if found is None:
        with _compile_lock:
            found = _compiled.get(key) or _compiled.setdefault(key, fused.compile_ir(kernel_ir(fmt, width, rest), model, _ARGS))
    return found[0]


class _Scratch(threading.local):
    """This thread's panel and chain state, grown to the largest K and row tile it has met and reused
    after: a product allocates nothing once a shape has been seen."""

    def __init__(self):
        self.panel = torch.empty(0)
        self.state = torch.empty(0)

    def take(self, panel: int, state: int) -> tuple[int, int]:
        if self.panel.numel() < panel:
            self.panel = torch.zeros(panel)
        if self.state.numel() < state:
            self.state = torch.zeros(state)
        return self.panel.data_ptr(), self.state.data_ptr()


_scratch = _Scratch()


def product(fmt: str, weights: tuple, x: torch.Tensor, out: torch.Tensor, r0: int, r1: int,
            model: str | None = None) -> None:
    """out[:, n] = x @ w[n] for weight rows n in [r0, r1), as ``fused_product.product`` (the same
    arguments and bits), by panels."""
    m, k = x.shape
    if fmt in ("fp8", "fp4") and k % fused.BLOCK:
        raise ValueError(f"tiled_product: K must be a multiple of {fused.BLOCK} for {fmt}, got {k}")
    width = fused.permute_width(model)
    rows, weight_rows = shape(width)
    panel, state = _scratch.take(panel_floats(width, k), rows * padded_panel(width) * 32)
    kernel(fmt, width, m % rows, model)(*weights, x.data_ptr(), x.stride(0), m, out.data_ptr(), out.stride(0), k,
                                        r0, r1, panel, state)
