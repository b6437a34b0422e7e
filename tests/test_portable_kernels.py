"""The portable kernels (``cpu.dispatch``: ``DSV41_KERNELS=portable``, or a CPU without AVX2, FMA or
F16C) give the x86 kernels' bits: the weight products for every format, decode, shape, K tail and
pass of rows; the same IR compiled for the x86-64 baseline (no AVX, F16C or FMA) run here; the IR
holds no x86 instruction and LLVM lowers it for ARM; the numba passes hold none either; a CPU
without the features (the feature query patched) chooses them and runs the TINY default run to the
default sha; the default run and a speculative run with them forced give the x86 kernels' tokens and
bits. Oracle: the x86 kernels on this CPU (themselves held to the independent defined sum in
``tests/test_packed.py``)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import llvmlite.binding as llvm
import numba
import numpy as np
import pytest
import torch

from dsv41.config import TINY
from dsv41.cpu import dispatch, fused_product, key_kernels, mix_kernels, quant_kernels
from dsv41.engine.reference import ReferenceEngine
from dsv41.ops.packed import PackedMatrix
from dsv41.run import main
from test_packed import _fp8_every_byte, _g, _matrices, _over_k_tiles, _through_product

DEFAULT_SHA = "cd29ef4fe38a3c3a857cb15353df2c4c1f1b977ccec76ec480f30cde63e762c0"
X86 = llvm.get_process_triple().startswith("x86_64")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_both(monkeypatch, f):
    """(f() with the kernels this CPU chooses, f() with the portable ones)."""
    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    here = f()
    monkeypatch.setenv("DSV41_KERNELS", "portable")
    try:
        return here, f()
    finally:
        monkeypatch.delenv("DSV41_KERNELS")


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.fixture
def no_x86_features(monkeypatch):
    """This process as one on a CPU the feature query finds without AVX2, FMA and F16C."""
    monkeypatch.setattr(dispatch, "host_features", lambda: {"sse2": True, "avx": True})
    dispatch.host_lanes.cache_clear()
    yield
    monkeypatch.undo()
    dispatch.host_lanes.cache_clear()


@pytest.mark.portable
def test_every_fp8_and_fp4_code_at_every_scale_decodes_to_the_x86_bits(monkeypatch):
    """x = I reads back each decoded value: every E4M3 byte (subnormals, both zeros) and every E2M1
    pair at scale codes from 0 to 252, the scales mixed within rows."""
    payload, scale = _fp8_every_byte([0, 1, 20, 100, 127, 128, 200, 246])
    finite = payload.view(torch.uint8).clone()
    finite[(finite & 0x7F) == 0x7F] = 0x7E          # NaN bytes send a matrix to the tables
    fp8 = PackedMatrix("fp8", finite.view(torch.float8_e4m3fn), scale)
    codes = torch.tensor([0, 1, 60, 127, 128, 200, 246, 252], dtype=torch.uint8)[:, None].repeat(1, 16)
    codes[:, 1::2] = codes[:, 1::2].flip(0)
    fp4 = PackedMatrix("fp4", torch.arange(256, dtype=torch.uint8).repeat(8, 1).view(torch.int8), codes)
    for m in (fp8, fp4):
        assert not m._exact_tables
        here, portable = _in_both(monkeypatch, lambda m=m: _through_product(m))
        assert torch.equal(here.view(torch.int64), portable.view(torch.int64)), m.fmt


@pytest.mark.portable
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9])
def test_portable_products_are_the_x86_bits_for_every_format_decode_and_row_range(rows, monkeypatch):
    """Every format and decode, 1-9 rows (passes of 1-8 rows on AVX-512, 1-3 on AVX2 and portable),
    weight-row ranges that start and end inside a group and a 32-row block, on this CPU and compiled
    for the x86-64 baseline; each row's bits also alone."""
    x = torch.randn(rows, 256, generator=_g(100 + rows)).to(torch.bfloat16).float()
    for fmt, m in _matrices(96, 256, 101).items():
        for r0, r1 in ((0, 96), (3, 70), (29, 35), (61, 62)):
            want = m.sums(x, r0, r1, None)
            for variant in fused_product.VARIANTS[fmt]:
                if variant == "table":
                    continue
                here, portable = _in_both(monkeypatch, lambda: m.sums(x, r0, r1, variant))
                assert _same(here, want) and _same(portable, want), (fmt, variant, r0, r1)
                if X86:
                    assert _same(m.sums(x, r0, r1, variant, model="x86-64"), want), (fmt, variant, r0, r1)
            monkeypatch.setenv("DSV41_KERNELS", "portable")
            alone = np.concatenate([m.sums(x[i:i + 1], r0, r1, None) for i in range(rows)])
            monkeypatch.delenv("DSV41_KERNELS")
            assert _same(alone, want), (fmt, r0, r1)


@pytest.mark.portable
@pytest.mark.parametrize("rows", [2, 9])
def test_portable_products_over_k_tiles_and_tails_are_the_x86_bits(rows, monkeypatch):
    """K over two whole K tiles and part of a third, bf16 and f32 with 5 columns past the last
    block, weight rows in chunks of 32 (several passes of rows), whole products split over threads."""
    monkeypatch.setattr(fused_product, "CHUNK_BYTES", 1)
    x, ms = _over_k_tiles(rows, 110)
    for name, m in ms.items():
        xk = x[:, :m.shape[1]]
        here, portable = _in_both(monkeypatch, lambda: (m.sums(xk, 3, 70, None), m.matmul_t(xk)))
        assert _same(here[0], portable[0]) and torch.equal(here[1], portable[1]), name
        if X86:
            assert _same(m.sums(xk, 3, 70, None, model="x86-64"), here[0]), name


def test_portable_ir_holds_no_x86_instruction_and_compiles_for_arm():
    """Every portable kernel's IR (each format and decode, one row and a tiled pass of three) names
    no x86 intrinsic and no FP16 type, and LLVM emits it as an AArch64 object."""
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    arm = llvm.Target.from_triple("aarch64-unknown-linux-gnu").create_target_machine(cpu="generic", opt=2)
    for fmt, variants in fused_product.VARIANTS.items():
        for variant in variants:
            if variant == "table":
                continue
            for rows, tile in ((1, 0), (3, fused_product.TILE)):
                ir = fused_product.kernel_ir(fmt, rows, 1, variant, 0, tile)
                assert "llvm.x86" not in ir and "half" not in ir, (fmt, variant)
                mod = llvm.parse_assembly(ir)
                mod.triple = arm.triple
                assert len(arm.emit_object(mod)) > 1000, (fmt, variant, rows)
    assert "llvm.x86" in fused_product.kernel_ir("fp4", 1, 1, "table", 16)     # the check can fail


def _numba_kernels():
    return [(mod.__name__, name, d) for mod in (key_kernels, quant_kernels, mix_kernels)
            for name, d in vars(mod).items() if isinstance(d, numba.core.registry.CPUDispatcher)]


def _numba_ir(d) -> str:
    """The LLVM IR numba writes for a dispatcher's compiled signatures, compiled afresh, before LLVM
    optimises it for this CPU (which may bring in its own instructions, as for any other)."""
    fresh = numba.njit(nogil=True, error_model=d.targetoptions.get("error_model", "python"))(d.py_func)
    out = io.StringIO()
    numba.core.config.DUMP_LLVM = True
    try:
        with contextlib.redirect_stdout(out):
            for sig in d.signatures:
                fresh.compile(sig)
    finally:
        numba.core.config.DUMP_LLVM = False
    assert "define" in out.getvalue()
    return out.getvalue()


def test_a_cpu_without_the_x86_features_runs_the_portable_kernels(no_x86_features, monkeypatch, capsys):
    """The feature query finds no AVX2, FMA or F16C: the portable kernels are chosen, nothing refuses
    to start, and the TINY default run on the reference prints the default sha; every numba pass it
    ran is written as IR without an x86 intrinsic. DSV41_KERNELS=compiled fails in one line naming
    what is missing; an unknown value in one line naming the allowed ones."""
    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    assert dispatch.lanes() == 0 and fused_product.permute_width() == 0
    assert main(["--json", "--executor", "reference"]) == 0
    assert json.loads(capsys.readouterr().out)["last_logits_sha256"] == DEFAULT_SHA
    ran = [(m, n, d) for m, n, d in _numba_kernels() if d.signatures]
    assert {m for m, _, _ in ran} == {key_kernels.__name__, quant_kernels.__name__, mix_kernels.__name__}
    for m, n, d in ran:
        assert "llvm.x86" not in _numba_ir(d), (m, n)
    monkeypatch.setenv("DSV41_KERNELS", "compiled")
    with pytest.raises(RuntimeError, match=r"^DSV41_KERNELS=compiled: this CPU \(.*\) lacks AVX2, FMA, F16C, "):
        dispatch.lanes()
    with pytest.raises(SystemExit) as refused:     # before any work, as a usage error
        main(["--executor", "reference"])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and "\n" not in err
    assert err.startswith("python -m dsv41.run: error: DSV41_KERNELS=compiled: this CPU") and "AVX2, FMA, F16C" in err
    monkeypatch.setenv("DSV41_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"^DSV41_KERNELS must be one of auto, compiled, portable, got 'fast'$"):
        dispatch.lanes()
    with pytest.raises(SystemExit) as refused:
        main([])
    assert refused.value.code == 2 and capsys.readouterr().err == (
        "python -m dsv41.run: error: DSV41_KERNELS must be one of auto, compiled, portable, got 'fast'\n")


@pytest.mark.skipif(not X86, reason="the x86 kernels run on x86 only")
def test_compiled_forced_on_this_cpu_is_its_own_choice(monkeypatch):
    monkeypatch.setenv("DSV41_KERNELS", "compiled")
    assert dispatch.lanes() == dispatch.host_lanes()


@pytest.mark.timeout(900)
def test_default_run_with_portable_kernels_prints_the_default_sha():
    """``DSV41_KERNELS=portable python -m dsv41.run`` (TINY, TP2/DP2/EP4, threads): the default sha."""
    env = {**os.environ, "DSV41_KERNELS": "portable", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "dsv41.run", "--json"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=850, check=True)
    assert json.loads(out.stdout)["last_logits_sha256"] == DEFAULT_SHA


def test_speculative_steps_with_portable_kernels_equal_plain_generation_with_x86_ones(monkeypatch):
    """Oracle drafts accepted in prefixes of every length, greedy and seeded sampling, on the
    reference with the portable kernels: the tokens and logits bytes of plain generation with the
    kernels this CPU chooses (``tests/test_speculative.py``'s check)."""
    from test_speculative import CTX, SAMPLED, check_layout, generate

    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    ref = ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX)
    plain = generate(ref), generate(ref, sampling=SAMPLED)
    monkeypatch.setenv("DSV41_KERNELS", "portable")
    check_layout(ReferenceEngine(TINY, seed=0, max_batch=4, max_context=CTX), False, plain)
