"""Executors: the Plan as an ordinary dask task dict, run by dask's sync, threaded or distributed
scheduler.

Under ``distributed`` there is one worker per card (named by card id); a step is one graph update
(its submissions in a layer per card, pinned to the card's worker, with the step literals embedded)
and one gather of the outputs. While a
step runs, the runner watches worker membership: a card's worker that leaves or is replaced (a new
worker process, even at the same address) ends the step with ``StateLost`` within ``POLL_S``
seconds instead of leaving its tasks waiting for a worker that will never come back.
"""
from __future__ import annotations

import time

import dask
import dask.threaded

from dsv41.cluster.connect import Startup, connect
from dsv41.cluster.plan import Plan
from dsv41.cluster.registry import StateLost
from dsv41.cluster.runtime import run_submission

POLL_S = 1.0                 # membership check interval while a distributed step runs


class CardUnavailable(RuntimeError):
    """No worker serves a card after the recovery timeout."""


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
    return _outputs(plan, get(dsk, keys))


def _outputs(plan: Plan, results) -> dict:
    """plan.outputs from the export dicts of the submissions that own them."""
    merged = {}
    for r in results:
        merged.update(r)
    return {k: merged[k] for k in plan.outputs}


def _members(dask_scheduler) -> dict:
    """address -> (worker name, server id): the id changes when a worker process is replaced."""
    return {addr: (ws.name, ws.server_id) for addr, ws in dask_scheduler.workers.items()}


class DistributedRunner:
    """A LocalCluster (or an existing scheduler) with one single-threaded worker per card."""

    def __init__(self, cards: int, address: str | None = None, dashboard: bool = False,
                 startup: Startup = Startup()):
        self.cards = cards
        self.cluster, self.client = connect(cards, address, dashboard, startup)
        self.refresh()

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    def refresh(self):
        """Which worker serves each card now (workers named by card id; others are ignored)."""
        self.members: dict[int, tuple[str, str]] = {}
        for addr, (name, server_id) in self.client.run_on_scheduler(_members).items():
            card = int(name) if str(name).isdigit() else None
            if card is not None and card < self.cards:
                self.members[card] = (addr, server_id)
        self.address_of = {c: a for c, (a, _) in self.members.items()}

    def wait_for_cards(self, cards, timeout: float):
        """Refresh until every card has a worker, or raise CardUnavailable naming the missing ones."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            missing = [c for c in cards if c not in self.members]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise CardUnavailable(f"card(s) {missing}: no worker named {missing[0]} served by the scheduler "
                                      f"after {timeout:g} s; start one (dask worker --name {missing[0]} "
                                      f"--nthreads 1) and retry")
            time.sleep(0.2)

    def vanished(self, members: dict) -> list[int]:
        now = self.client.run_on_scheduler(_members)
        return [c for c, (addr, sid) in members.items() if now.get(addr, (None, None))[1] != sid]

    def run(self, plan: Plan) -> dict:
        """The whole step as one graph update (a layer per card, pinned to its worker, step literals
        embedded), then one gather of the outputs."""
        from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
        from distributed import wait
        from distributed.scheduler import KilledWorker

        used = {sub.card for sub in plan.submissions.values()}
        members = {c: self.members[c] for c in used if c in self.members}
        if len(members) < len(used):
            raise StateLost(sorted(used - set(members)), "no worker serves the card")
        suffix = next(iter(plan.submissions.values())).task_suffix
        name = {k: k + suffix for k in [*plan.submissions, *plan.graph.literals]}
        tasks: dict[int, dict] = {c: {} for c in used}
        for k, (value, card) in plan.graph.literals.items():
            tasks[card][name[k]] = value
        for sub in plan.submissions.values():
            tasks[sub.card][name[sub.key]] = (run_submission, sub, *[name[d] for d in sub.deps])
        layers = {f"card{c}{suffix}": MaterializedLayer(t, annotations={"workers": [members[c][0]],
                                                                          "allow_other_workers": False})
                  for c, t in tasks.items()}
        keys = sorted({plan.owner[k] for k in plan.outputs})
        futures = self.client.get(HighLevelGraph(layers, dict.fromkeys(layers, set())), [name[k] for k in keys],
                                  sync=False)
        try:
            while True:     # the outputs end (an error ends them at once) or a card's worker goes
                try:
                    wait(futures, timeout=POLL_S)
                    break
                except TimeoutError:
                    if gone := self.vanished(members):
                        raise StateLost(gone, "worker left or was replaced mid-step") from None
            for f in futures:
                if f.status == "error":
                    try:
                        f.result()
                    except KilledWorker as e:
                        raise StateLost(sorted(used), f"a worker died running {f.key}") from e
                elif f.status == "cancelled":
                    raise StateLost(sorted(used), f"the scheduler dropped {f.key}")
            results = self.client.gather(futures)
        except BaseException:
            self.client.cancel(futures)
            raise
        return _outputs(plan, results)

    def run_on_cards(self, fn, *args, cards=None, on_error: str = "raise") -> dict:
        """fn(*args) on the workers serving these cards (default: all served cards); results by address."""
        cards = self.members if cards is None else cards
        addrs = [self.address_of[c] for c in cards if c in self.address_of]
        return self.client.run(fn, *args, workers=addrs, on_error=on_error) if addrs else {}

    def close(self):
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()
