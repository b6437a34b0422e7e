"""The tiled product (``cpu.tiled_product``: a prefill chunk's rows, each weight row decoded once into
a panel) gives the defined sum's bits, the fused passes' bits, for every format, row count (1 to
4,096 rows: below ``MIN_ROWS`` the fused passes run), count of rows that is not a whole number of
sweeps, weight-row range that starts and ends inside a panel and a sweep's group, K over several K
tiles with columns past the last block, CPU model (this one, AVX2, the x86-64 baseline's portable
build) and split over threads; its scratch is made once per shape. Oracle: ``_fp32_sum.defined_sum``
(written independently of the kernels) and the fused kernels, themselves held to it in
``tests/test_packed.py``."""
from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
import pytest
import torch

from dsv41.cpu import cores, fused_product, tiled_product
from dsv41.ops import packed
from dsv41.ops.packed import PackedMatrix
from _fp32_sum import defined_sum
from test_packed import _fp8_every_byte, _g, _matrices, _over_k_tiles

X86 = llvm.get_process_triple().startswith("x86_64")
MODELS = (None, "haswell", "x86-64") if X86 else (None,)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.int32)


def _fused(m: PackedMatrix, x: torch.Tensor, r0: int, r1: int) -> np.ndarray:
    """The fused passes' results, whatever the row count."""
    out = torch.full((x.shape[0], m.shape[0]), torch.nan)
    fused_product.product(m.fmt, m.stored, x.float().contiguous(), out, r0, r1, None, None, m.codes)
    return out.numpy()[:, r0:r1]


@pytest.mark.portable
@pytest.mark.parametrize("rows", [16, 17, 18, 19, 50])
def test_tiled_products_over_k_tiles_and_tails_are_the_defined_sum(rows):
    """Rows a whole number of sweeps and 1 or 2 past one, K over two whole K tiles and part of a
    third, bf16 and f32 with 5 columns past the last block, weight-row ranges inside a panel and a
    group: the defined sum, on this CPU, compiled for AVX2 and for the x86-64 baseline (portable)."""
    x, ms = _over_k_tiles(rows, 90)
    assert rows >= tiled_product.MIN_ROWS
    for name, m in ms.items():
        xk = x[:, :m.shape[1]]
        d = m.dense().float()
        for r0, r1 in ((0, 96), (3, 70), (29, 35), (61, 62), (15, 33)):
            want = _bits(defined_sum(xk, d[r0:r1]))
            for model in MODELS:
                assert np.array_equal(_bits(m.sums(xk, r0, r1, None, model)), want), (name, r0, r1, model)


@pytest.mark.portable
@pytest.mark.parametrize("rows", [1, 15, 16, 31, 257, 4096])
def test_one_to_4096_rows_give_the_fused_passes_bits_in_every_format(rows):
    """matmul_t of 1 to 4,096 rows (tiled from ``MIN_ROWS`` on) is the defined sum, and the fused
    passes over the same rows give the same bits."""
    x = torch.randn(rows, 256, generator=_g(300 + rows)).to(torch.bfloat16).float()
    for fmt, m in _matrices(96, 256, 301).items():
        got = m.matmul_t(x)
        assert np.array_equal(_bits(got), _bits(_fused(m, x, 0, 96))), fmt
        if rows <= 257:
            assert torch.equal(got, defined_sum(x, m.dense().float())), fmt


@pytest.mark.portable
def test_every_fp8_and_fp4_code_at_every_scale_tiled_is_the_fused_decode():
    """x = I (256 rows: tiled) reads back each decoded value: every E4M3 byte at scale codes 0-246 and
    every E2M1 pair at codes 0-252, the same bits as the fused passes' decode."""
    payload, scale = _fp8_every_byte([0, 1, 20, 100, 127, 128, 200, 246])
    finite = payload.view(torch.uint8).clone()
    finite[(finite & 0x7F) == 0x7F] = 0x7E
    fp8 = PackedMatrix("fp8", finite.view(torch.float8_e4m3fn), scale)
    codes = torch.tensor([0, 1, 60, 127, 128, 200, 246, 252], dtype=torch.uint8)[:, None].repeat(1, 16)
    codes[:, 1::2] = codes[:, 1::2].flip(0)
    fp4 = PackedMatrix("fp4", torch.arange(256, dtype=torch.uint8).repeat(8, 1).view(torch.int8), codes)
    eye = torch.eye(256)
    for m in (fp8, fp4):
        n = m.shape[0]
        for model in MODELS:
            assert np.array_equal(_bits(m.sums(eye, 0, n, None, model)), _bits(_fused(m, eye, 0, n))), (m.fmt, model)


def test_a_tiled_product_split_over_threads_gives_the_bits_of_one(monkeypatch):
    x = torch.randn(40, 256, generator=_g(310))
    whole = {fmt: m.matmul_t(x) for fmt, m in _matrices(96, 256, 311).items()}
    monkeypatch.setattr(packed, "_SPLIT_VALUES", 1)
    monkeypatch.setattr(cores, "cores", lambda: 3)
    for fmt, m in _matrices(96, 256, 311).items():
        assert torch.equal(m.matmul_t(x), whole[fmt]), fmt


def test_scratch_is_made_once_per_shape_and_a_smaller_k_between_changes_no_bit():
    """A product after one of a larger K reuses the thread's panel and state (no allocation), and
    the rows the last panel leaves unwritten (stale values of the larger K) change no result."""
    small, large = _matrices(64, 256, 320)["fp8"], _matrices(96, 2048, 321)["fp4"]
    xs, xl = torch.randn(20, 256, generator=_g(322)), torch.randn(20, 2048, generator=_g(323))
    first = small.matmul_t(xs)
    large.matmul_t(xl)
    held = (tiled_product._scratch.panel.data_ptr(), tiled_product._scratch.state.data_ptr())
    assert torch.equal(small.matmul_t(xs), first)
    large.matmul_t(xl)
    assert (tiled_product._scratch.panel.data_ptr(), tiled_product._scratch.state.data_ptr()) == held


def test_bad_k_is_refused_in_one_line():
    m = _matrices(32, 64, 324)["fp8"]
    with pytest.raises(ValueError, match="K must be a multiple of 32 for fp8"):
        tiled_product.product("fp8", m.stored, torch.zeros(20, 48), torch.zeros(20, 32), 0, 32)


def test_portable_tiled_ir_holds_no_x86_instruction_and_compiles_for_arm():
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    arm = llvm.Target.from_triple("aarch64-unknown-linux-gnu").create_target_machine(cpu="generic", opt=2)
    for fmt in fused_product.VARIANTS:
        for rest in (0, 2):
            ir = tiled_product.kernel_ir(fmt, 0, rest)
            assert "llvm.x86" not in ir and "half" not in ir, fmt
            mod = llvm.parse_assembly(ir)
            mod.triple = arm.triple
            assert len(arm.emit_object(mod)) > 1000, (fmt, rest)
