"""Cost before commitment: refuse a run whose weights and caches cannot fit this machine's memory.

The figures are the plan's per card (``plan.sizing``: weight shards in checkpoint formats, cache
rows in their stored formats), times the cards this machine holds. The CPU runtime keeps matrices in
FP64 on top of that, so the figure is a floor: a run refused here could never fit.
"""
from __future__ import annotations

import psutil

from dsv41.cli.modes import DIST, PLAN, REFERENCE, max_context, mode, per_group, topology
from dsv41.plan.sizing import request_cache_bytes, weights_by_kind

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


def check_budget(a, cfg, available: int | None = None) -> str | None:
    cards = cards_here(a)
    if not cards:
        return None
    weights, caches = card_bytes(a, cfg)
    need = cards * (weights + caches)
    available = psutil.virtual_memory().available if available is None else available
    if need <= available:
        return None
    topo = "--tp 1 --dp 1" if mode(a) == REFERENCE else f"--tp {a.tp} --dp {a.dp}"
    model = f"--config {cfg.name}" if a.checkpoint is None else f"--checkpoint {a.checkpoint}"
    return (f"{cfg.name} needs at least {need / GB:.3g} GB for weights and caches ({cards} card(s) x "
            f"{(weights + caches) / GB:.2f} GB: weights {weights / GB:.2f}, caches {caches / GB:.3f}) and this "
            f"machine has {available / GB:.3g} GB available; see the per-card figures with "
            f"python -m dsv41.run --plan {model} {topo}")
