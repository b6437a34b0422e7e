"""The indexer's scores (``ops.indexer.index_scores``) with the dot as an FP32 product where the bounds
prove it exact against the FP64 product everywhere (Torch's ``float32_matmul_precision`` 'highest' and
'high': the indexer takes FP32 only at 'highest'), on a decode batch's shapes: ms a call, the best of
``--repeats`` runs alternated between the two, and whether the scores agree bit for bit.

    python bench/index_scores.py [--rows 8] [--keys 4096] [--repeats 7]

Shapes: FLASH's index heads (64 x 128), FP4 queries (as ``Options(fp4_index_query=True)`` gives
them), each row a different request's keys (cache rows of its own, in order), every key visible.
"""
from __future__ import annotations

import argparse

import torch

from cpu_rates import best                  # bench/cpu_rates.py, beside this script

from dsv41.ops import kv_cache
from dsv41.ops.indexer import index_scores
from dsv41.ops.quant import mxfp4_qdq, round_bf16

HEADS, DIM = 64, 128


def inputs(rows: int, keys: int, g: torch.Generator) -> tuple:
    fmt = kv_cache.FORMATS[kv_cache.INDEX]
    payload, scale = fmt.empty(keys * rows, DIM)
    kv_cache.publish(payload, scale, fmt, torch.arange(keys * rows), torch.randn(keys * rows, DIM, generator=g))
    q = round_bf16(mxfp4_qdq(torch.randn(rows, HEADS * DIM, generator=g))).reshape(rows, HEADS, DIM)
    w = round_bf16(torch.randn(rows, HEADS, generator=g) * 0.1)
    return q, w, payload, scale, torch.arange(keys * rows).reshape(rows, keys)


def scores(args: tuple, precision: str) -> torch.Tensor:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        return index_scores(*args)
    finally:
        torch.set_float32_matmul_precision(before)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--keys", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    args = inputs(a.rows, a.keys, torch.Generator().manual_seed(0))
    same = torch.equal(scores(args, "highest").view(torch.int32), scores(args, "high").view(torch.int32))
    times = {"highest": [], "high": []}
    for _ in range(a.repeats):              # alternated: this VM's speed drifts over minutes
        for precision, ts in times.items():
            ts.append(best(lambda precision=precision: scores(args, precision), 1) * 1e3)
    fp32, fp64 = min(times["highest"]), min(times["high"])
    print(f"index_scores, {a.rows} rows x {HEADS} heads x {DIM} x {a.keys} keys: FP32 dot where proven "
          f"{fp32:.1f} ms, FP64 dot {fp64:.1f} ms ({fp64 / fp32:.1f}x); same bits: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
