"""A weight matrix held in its checkpoint format and multiplied as it is decoded.

``PackedMatrix`` keeps the stored bytes (MXFP8 E4M3 with 32x32 E8M0 block scales, packed MXFP4 with
per-row group-32 E8M0 scales, BF16, FP32) and computes ``a @ w^T`` the way ``ops.projections.matmul_t``
defines it (FP32 fused multiply-adds in ``cpu.fused_product``'s fixed order) without ever writing a
decoded value to memory: the product decodes each weight in a register next to the multiply, so a
use reads each stored byte once. Decoding the whole matrix (or a tile of it) first wrote and read
back several bytes a value on every use; at FLASH widths that, not the arithmetic, was the step.

The fused decode is exact where ``quant``'s FP32 decoders are: a matrix with a scale code above
``_FAST_SCALE_MAX`` (where the largest value times its scale overflows FP32) or an E4M3 NaN byte is
multiplied through ``quant``'s tables instead, whole, in FP64. ``tests/test_packed.py`` holds every
byte at every scale to the formats' definitions.
"""
from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from dsv41.cpu import cores, fused_product as fused
from dsv41.ops.quant import block_mxfp8_decode64, expert_mxfp4_decode64

# largest E8M0 code for which the format's largest value times 2^(s-127) is a finite FP32 (448 for
# E4M3, 6 for E2M1): below it every decoded value is an FP32, which the fused decode gives exactly
_FAST_SCALE_MAX = {"fp8": 246, "fp4": 252}
_SPLIT_VALUES = 1 << 23       # work this large (weight values x row passes, ~0.3 ms) is shared over the cores


class PackedMatrix:
    """[N, K] weight in checkpoint format ``fmt`` ('fp8', 'fp4', 'bf16', 'f32'); see the module.
    ``exact_tables`` and ``codes`` are for slices of a checked matrix (None: check this one; its
    scale codes' range, which bounds a slice's)."""

    def __init__(self, fmt: str, payload: torch.Tensor, scale: torch.Tensor | None = None,
                 exact_tables: bool | None = None, codes: tuple[int, int] | None = None):
        if fmt not in ("fp8", "fp4", "bf16", "f32"):
            raise ValueError(f"PackedMatrix: fmt must be fp8, fp4, bf16 or f32, got {fmt!r}")
        self.fmt, self.payload, self.scale = fmt, payload, scale
        k = payload.shape[1] * (2 if fmt == "fp4" else 1)
        self.shape = torch.Size((payload.shape[0], k))
        if codes is not None:
            self.codes = codes
        self._exact_tables = self._needs_tables() if exact_tables is None else exact_tables

    def _needs_tables(self) -> bool:
        if self.fmt not in _FAST_SCALE_MAX:
            return False
        if self.scale.numel() and self.codes[1] > _FAST_SCALE_MAX[self.fmt]:
            return True
        # an E4M3 NaN is 0x7F or 0xFF: the largest byte read unsigned or signed (two reductions, ~40x
        # faster than masking every byte, which took 17 s of a FLASH-width test's 160)
        return self.fmt == "fp8" and self.payload.numel() > 0 and (
            int(self.payload.view(torch.uint8).max()) == 0xFF or int(self.payload.view(torch.int8).max()) == 0x7F)

    def rows(self, a: int, b: int) -> "PackedMatrix":
        """Rows [a, b) (whole 32-row blocks for fp8)."""
        scale = None if self.scale is None else self.scale[a // 32:b // 32] if self.fmt == "fp8" else self.scale[a:b]
        return PackedMatrix(self.fmt, self.payload[a:b], scale, self._exact_tables, self.codes)

    def cols(self, a: int, b: int) -> "PackedMatrix":
        """Columns [a, b) (whole 32-column groups for fp8 and fp4)."""
        if self.scale is None:
            return PackedMatrix(self.fmt, self.payload[:, a:b], None, False)
        half = 2 if self.fmt == "fp4" else 1
        return PackedMatrix(self.fmt, self.payload[:, a // half:b // half], self.scale[:, a // 32:b // 32],
                            self._exact_tables, self.codes)

    def dense(self) -> torch.Tensor:
        """The whole matrix decoded to FP64 by ``quant``'s tables (what ``weights.decode_tensor`` gives
        for it)."""
        if self.fmt == "fp8":
            return block_mxfp8_decode64(self.payload, self.scale.view(torch.uint8))
        if self.fmt == "fp4":
            return expert_mxfp4_decode64(self.payload, self.scale.view(torch.uint8))
        return self.payload.double()

    @cached_property
    def codes(self) -> tuple[int, int] | None:
        """The lowest and highest E8M0 scale codes (None without scales or values)."""
        if self.scale is None or not self.scale.numel():
            return None
        u = self.scale.view(torch.uint8)
        return int(u.min()), int(u.max())

    @cached_property
    def stored(self) -> tuple:
        """Where the kernel reads the stored tensors (``fused_product.product``'s ``weights``)."""
        p, s = self.payload, self.scale
        if p.numel() and p.stride(-1) != 1 or s is not None and s.numel() and s.stride(-1) != 1:
            raise ValueError("PackedMatrix: a stored row must be contiguous")
        rows = p.stride(0) * p.element_size()
        if s is None:
            return p.data_ptr(), rows, None, 0, 1
        return p.data_ptr(), rows, s.data_ptr(), s.stride(0) * s.element_size(), 32 if self.fmt == "fp8" else 1

    def sums(self, x: torch.Tensor, r0: int, r1: int, variant: str | None,
             model: str | None = None) -> np.ndarray:
        """The kernel's FP32 results x @ self[r0:r1]^T on this thread, with the given decode ``variant``
        (None: the fastest exact one) and code for CPU ``model`` (``fused_product.product``)."""
        out = torch.full((x.shape[0], self.shape[0]), torch.nan)
        fused.product(self.fmt, self.stored, _x32(x), out, r0, r1, variant, model, self.codes)
        return out.numpy()[:, r0:r1]

    def work(self, x: torch.Tensor) -> int:
        """Weight values times passes of x's rows: what a product with x costs."""
        return self.shape.numel() * -(-x.shape[0] // fused.pass_rows())

    def matmul_t(self, x: torch.Tensor, split: bool = True) -> torch.Tensor:
        """x [M, K] @ self^T -> FP32 [M, N] (x taken at FP32; see the module); ``split``: the weight rows
        shared over the cores when the product is large."""
        if self._exact_tables:
            return (x.double() @ self.dense().t()).float()
        m, n = x.shape[0], self.shape[0]
        x32 = _x32(x)
        out = torch.empty(m, n)
        args = (self.fmt, self.stored, x32, out)
        work = self.work(x)
        variant = fused.pick_variant(self.fmt, x32, self.codes, work)
        if not split or work < _SPLIT_VALUES:
            fused.product(*args, 0, n, variant)
        else:
            cores.run_shares(lambda lo, hi: fused.product(*args, lo, hi, variant), cores.bounds(n, min(cores.cores(), n)))
        return out


def products(pairs: list) -> list[torch.Tensor]:
    """x @ w^T for each (x, w) (w a ``PackedMatrix`` or dense), each product on one thread and the
    products in runs of about equal work over the cores: one hand-over per run instead of one per
    product (waking the other core costs about as much as a small product; measured in
    docs/flash-shapes.md). Each result has the bits of its ``matmul_t``."""
    mats = [(x, w if isinstance(w, PackedMatrix) else dense_f32(w)) for x, w in pairs]
    work = [w.work(x) for x, w in mats]
    shares = min(cores.cores(), len(mats))
    # small work stays on this core; where one product dominates, its own rows are split instead
    if shares < 2 or sum(work) < _SPLIT_VALUES or max(work) * shares > sum(work) * 2:
        return [w.matmul_t(x) for x, w in mats]
    done = np.cumsum([0] + work)
    cuts = [int(np.searchsorted(done, done[-1] * i / shares)) for i in range(shares)] + [len(mats)]
    outs: list = [None] * len(mats)

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            outs[i] = mats[i][1].matmul_t(mats[i][0], split=False)
    cores.run_shares(run, sorted(set(cuts)))
    return outs


def dense_f32(w: torch.Tensor) -> PackedMatrix:
    """A dense [N, K] weight as an FP32 ``PackedMatrix`` (its values taken at FP32), whose product has
    the bits of any format's product of the same values."""
    w = w.float()
    return PackedMatrix("f32", w if w.stride(-1) == 1 else w.contiguous())


def _x32(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: FP32, C-contiguous."""
    return x.float().contiguous()


def matrix(weights, key: str):
    """The weight ``key`` as a product takes it: in its checkpoint format where ``weights`` holds
    those (``CardWeights.matrix``), else the decoded tensor of a plain mapping
    (``weights.decode_checkpoint``, as the DSpark tests build their blocks)."""
    get = getattr(weights, "matrix", None)
    return get(key) if get is not None else weights[key]
