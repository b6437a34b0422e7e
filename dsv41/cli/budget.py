"""Cost before commitment: refuse a run whose weights and caches cannot fit this machine's memory.

The figures are the plan's (``plan.sizing``: weight shards in checkpoint formats, cache rows in
their stored formats). The cards this machine builds share every slice they hold alike (replicated
tensors, the DP replicas of a TP rank's slice: ``checkpoint.shards.read_cards``), so all of them
together hold each checkpoint tensor once; each card holds its group's caches. Matrices decoded per
use come on top, so the figure is a floor: a run refused here could never fit.
"""
from __future__ import annotations

import psutil

from dsv41.cli.modes import DIST, LOCAL, PLAN, REFERENCE, max_context, mode, per_group, topology
from dsv41.plan.sizing import checkpoint_bytes, request_cache_bytes, weights_by_kind

GB = 1e9


def cards_here(a) -> int:
    """Cards whose State this machine builds: all of them, unless the workers are at --address."""
    m = mode(a)
    if m == PLAN or (m in DIST and a.address is not None):
        return 0
    return 1 if m == REFERENCE else a.ep


def card_bytes(a, cfg) -> tuple[int, int]:
    """(weights, caches) of one card; every card holds the same under the sharding policy."""
    weights = sum(weights_by_kind(cfg, topology(a), 0).values())
    return weights, per_group(a) * sum(request_cache_bytes(cfg, max_context(a)).values())


def here_bytes(a, cfg) -> tuple[int, int]:
    """(weights, caches) this machine holds for the run: every tensor once in one process (sync,
    threads, reference), each worker's own shard otherwise; each card's caches."""
    cards = cards_here(a)
    if mode(a) in LOCAL or mode(a) == REFERENCE:
        weights = checkpoint_bytes(cfg)
    else:
        weights = cards * card_bytes(a, cfg)[0]
    return weights, cards * card_bytes(a, cfg)[1]


def check_budget(a, cfg, available: int | None = None) -> str | None:
    cards = cards_here(a)
    if not cards:
        return None
    weights, caches = here_bytes(a, cfg)
    need = weights + caches
    available = psutil.virtual_memory().available if available is None else available
    if need <= available:
        return None
    topo = "--tp 1 --dp 1" if mode(a) == REFERENCE else f"--tp {a.tp} --dp {a.dp}"
    model = f"--config {cfg.name}" if a.checkpoint is None else f"--checkpoint {a.checkpoint}"
    return (f"{cfg.name} needs at least {need / GB:.3g} GB for weights and caches ({cards} card(s): "
            f"weights {weights / GB:.2f} (each tensor once), caches {caches / GB:.3f}) and this "
            f"machine has {available / GB:.3g} GB available; see the per-card figures with "
            f"python -m dsv41.run --plan {model} {topo}")
