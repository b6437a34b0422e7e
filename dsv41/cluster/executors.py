"""Executors: the Plan as an ordinary dask task dict, run by dask's sync, threaded or distributed
scheduler.

Under ``distributed`` there is one worker per card (named by card id); every submission is pinned
to its card's worker, and step literals are scattered once to the workers that need them.
"""
from __future__ import annotations

import dask
import dask.threaded

from dsv41.cluster.connect import Startup, connect
from dsv41.cluster.plan import Plan
from dsv41.cluster.runtime import run_submission

LOCAL = ("sync", "threads")


def to_dask(plan: Plan) -> dict:
    dsk = {k: v for k, (v, _) in plan.graph.literals.items()}
    for sub in plan.submissions.values():
        dsk[sub.key] = (run_submission, sub, *sub.deps)
    return dsk


def run_local(plan: Plan, scheduler: str) -> dict:
    """Values of plan.outputs, computed by dask.get (sync) or dask.threaded.get."""
    dsk = to_dask(plan)
    keys = sorted({plan.owner[k] for k in plan.outputs})
    get = dask.get if scheduler == "sync" else dask.threaded.get
    results = get(dsk, keys)
    merged = {}
    for r in results:
        merged.update(r)
    return {k: merged[k] for k in plan.outputs}


class DistributedRunner:
    """A LocalCluster (or an existing scheduler) with one single-threaded worker per card."""

    def __init__(self, cards: int, plugin, address: str | None = None, dashboard: bool = False,
                 startup: Startup = Startup()):
        self.cluster, self.client, self.address_of = connect(cards, address, dashboard, startup)
        self.client.register_plugin(plugin)

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    def run(self, plan: Plan) -> dict:
        futures = {}
        for key, (value, card) in plan.graph.literals.items():
            futures[key] = self.client.scatter(value, workers=[self.address_of[card]], broadcast=False)
        for sub in plan.submissions.values():  # insertion order is topological
            args = [futures[d] for d in sub.deps]
            futures[sub.key] = self.client.submit(run_submission, sub, *args, key=sub.key,
                                                  workers=[self.address_of[sub.card]], allow_other_workers=False,
                                                  pure=False)
        keys = sorted({plan.owner[k] for k in plan.outputs})
        results = self.client.gather([futures[k] for k in keys])
        merged = {}
        for r in results:
            merged.update(r)
        return {k: merged[k] for k in plan.outputs}

    def run_on_workers(self, fn, *args):
        return self.client.run(fn, *args)

    def close(self):
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()
