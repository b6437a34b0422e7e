"""Which weight kernels this process runs: the x86 ones (AVX-512 or AVX2 decodes, each with FMA and
F16C) where the CPU has what they need, else the portable ones (``cpu.fused_product`` with 0 lanes:
generic LLVM vector operations that LLVM lowers for any CPU it targets, NEON or SVE on ARM). Both
compute the same defined order, so the same bits (``tests/test_portable_kernels.py``).

``DSV41_KERNELS`` overrides the choice: ``auto`` (the default), ``compiled`` (the x86 kernels; a CPU
without them fails in one line) or ``portable``. It is read at each product, so a process and its
workers follow their environment. The numba passes (``cpu.key_kernels``, ``cpu.quant_kernels``,
``cpu.mix_kernels``) are generic already: numba compiles them for the CPU at hand, on any
architecture it supports, with no x86 intrinsic, so they need no second form.
"""
from __future__ import annotations

import os
from functools import cache

import llvmlite.binding as llvm

KERNELS = ("auto", "compiled", "portable")     # DSV41_KERNELS's values
_NEEDS = ("avx2", "fma", "f16c")               # the x86 kernels' (the FP8 and FP4 decodes convert FP16)


def lanes() -> int:
    """16 (AVX-512) or 8 (AVX2) for the x86 kernels, 0 for the portable ones, as ``DSV41_KERNELS``
    and the CPU choose."""
    choice = os.environ.get("DSV41_KERNELS") or "auto"
    if choice not in KERNELS:
        raise ValueError(f"DSV41_KERNELS must be one of {', '.join(KERNELS)}, got {choice!r}")
    if choice == "portable":
        return 0
    found = host_lanes()
    if choice == "compiled" and not found:
        raise RuntimeError(f"DSV41_KERNELS=compiled: this CPU ({llvm.get_host_cpu_name()}) lacks "
                           f"{missing_features()}, which the x86 kernels need; DSV41_KERNELS=portable runs here")
    return found


def host_features() -> dict[str, bool]:
    """The CPU's features as LLVM names them, none on another architecture than x86-64 (the query the
    tests patch to play another CPU)."""
    return dict(llvm.get_host_cpu_features()) if llvm.get_process_triple().startswith("x86_64") else {}


def missing_features() -> str:
    """What the x86 kernels need and this CPU lacks."""
    features = host_features()
    return ", ".join(n.upper() for n in _NEEDS if not features.get(n, False)) or "nothing"


@cache
def host_lanes() -> int:
    """The x86 kernels' lanes on this CPU (16 with AVX-512, 8 with AVX2), 0 where it lacks any of
    ``_NEEDS``; asked once (~0.2 ms a query)."""
    features = host_features()
    if not all(features.get(n, False) for n in _NEEDS):
        return 0
    return 16 if features.get("avx512f", False) else 8
