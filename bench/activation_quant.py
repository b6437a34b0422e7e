"""The MXFP8 activation fake-quantization a decode step runs before every FP8 and FP4 product
(``ops.quant.mxfp8_qdq``, one compiled pass a 32-value group) against the same rule as Torch ops
(``mxfp8_decode(mxfp8_encode(x))``), on a batch-8 step's shapes: ms a call, best of ``--repeats``
runs of 20 calls each, and whether the two agree bit for bit.

    python bench/activation_quant.py [--repeats 5]

Shapes: a batch-8 routed experts' input (8 tokens x 6 experts, 5120 wide) and hidden state (2304
wide), and one token row of each for batch 1.
"""
from __future__ import annotations

import argparse

import torch

from cpu_rates import best                  # bench/cpu_rates.py, beside this script

from dsv41.ops.quant import mxfp8_decode, mxfp8_encode, mxfp8_qdq

SHAPES = {"experts' x, batch 8": (48, 5120), "experts' h, batch 8": (48, 2304), "x, batch 1": (6, 5120),
          "h, batch 1": (6, 2304)}


def torch_ops(x: torch.Tensor) -> torch.Tensor:
    return mxfp8_decode(*mxfp8_encode(x))


def calls(f, x: torch.Tensor) -> None:
    for _ in range(20):     # each result dropped before the next call, as a step drops it
        f(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    for name, shape in SHAPES.items():
        x = (torch.randn(*shape, generator=g) * 0.3).to(torch.bfloat16).float()
        same = torch.equal(mxfp8_qdq(x), torch_ops(x))
        ms = [best(lambda f=f: calls(f, x), a.repeats) / 20 * 1e3 for f in (mxfp8_qdq, torch_ops)]
        print(f"{name:<20} {str(list(shape)):<11} compiled {ms[0]:.3f} ms, Torch ops {ms[1]:.3f} ms "
              f"({ms[1] / ms[0]:.1f}x); same bits: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
