"""The host's cores for the shares of one large op (a weight product's rows, the indexer's key blocks): the
caller's thread takes the first share and a per-process pool the rest (the kernels release the GIL).
Each share is computed exactly as it would be alone, so splitting never changes a bit."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import torch


def _same_threads(n: int) -> None:
    # a new thread starts with OpenMP's default team size, not the process's: without this, a Torch
    # product on a pool thread ran an OpenMP team of its own beside the caller's (9x slower here)
    torch.set_num_threads(n)


@cache
def _pool(pid: int, workers: int) -> ThreadPoolExecutor:
    """One pool per process (a forked child has none of its parent's threads)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="dsv41-share", initializer=_same_threads,
                              initargs=(torch.get_num_threads(),))


# multiply-adds below which an op stays on one core: handing a share to the pool costs ~40 us here
SPLIT_MULTIPLIES = 1 << 22


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def bounds(n: int, shares: int) -> list[int]:
    """[0, n) cut into ``shares`` near-equal runs: their n + 1 boundaries."""
    return [n * i // shares for i in range(shares + 1)]


def run_shares(fn, cuts: list[int]) -> None:
    """fn(lo, hi) for each run between consecutive ``cuts``, at once."""
    runs = list(zip(cuts[:-1], cuts[1:]))
    futures = [_pool(os.getpid(), len(runs) - 1).submit(fn, lo, hi) for lo, hi in runs[1:]]
    fn(*runs[0])
    for f in futures:
        f.result()
