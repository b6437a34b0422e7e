"""GraphEngine: requests -> per-DP-group metadata -> graph -> plan -> dask -> logits.

Inputs are validated (tokens, capacity, topology) before any node runs. A step is atomic: cache
writes are staged on every card and only ``cache.commit`` applies them; if anything fails the
engine aborts the step on every card (undoing a commit that already happened) and the host
request tables are left as they were.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from functools import partial

import torch

from dsv41.cluster import state as card_state
from dsv41.cluster.connect import Startup
from dsv41.cluster.executors import LOCAL, DistributedRunner, run_local
from dsv41.cluster.plan import make_plan
from dsv41.cluster.runtime import Hooks, NodeError
from dsv41.config import ModelConfig, Topology
from dsv41.graph.build import SHARDED, build
from dsv41.kernels.device_time import BACKENDS, node_sim_us
from dsv41.ops.reference import Options
from dsv41.serving import RequestTable, StepModel

EXECUTORS = ("sync", "threads", "distributed")


def _abort_all(step_id: int):
    for st in card_state.STATES.values():
        st.caches.abort(step_id)


class GraphEngine(StepModel):
    def __init__(self, cfg: ModelConfig, topo: Topology, seed: int = 0, executor: str = "threads",
                 granularity: str = "submission", wiring: str = SHARDED, max_batch: int | None = None,
                 max_context: int | None = None, address: str | None = None, dashboard: bool = False,
                 options: Options = Options(), backend: str = "torch", startup: Startup = Startup()):
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
        if backend == "pypto-npu":
            from dsv41.kernels.pypto_backend import check_npu
            check_npu()
        if executor not in EXECUTORS:
            raise ValueError(f"executor: must be one of {EXECUTORS}, got {executor!r}")
        if granularity not in ("submission", "node"):
            raise ValueError(f"granularity: must be 'submission' or 'node', got {granularity!r}")
        topo.check(cfg)
        self.cfg, self.topo, self.executor, self.granularity, self.wiring = cfg, topo, executor, granularity, wiring
        self.backend = backend
        max_batch = max_batch or cfg.max_batch_per_dp * topo.dp
        per_group = math.ceil(max_batch / topo.dp)
        if per_group > cfg.max_batch_per_dp:
            raise ValueError(f"max_batch: {max_batch} over dp={topo.dp} exceeds {cfg.max_batch_per_dp} requests "
                             f"per DP group (capacity contract)")
        max_context = max_context or min(cfg.max_position_embeddings, 1024)
        self.tables = [RequestTable(cfg, per_group, max_context) for _ in range(topo.dp)]
        self.where: dict[int, tuple[int, int]] = {}   # global request id -> (DP group, local id)
        self.next_rid = 0
        self.step_id = 0
        self.last_request_ids: list[int] = []
        self.last_stats: dict = {}
        self.last_graph = None
        self.runner = None
        self.trace = None            # a telemetry TraceSession while tracing
        if executor in LOCAL:
            card_state.STATES.clear()
            card_state.STATES.update(card_state.build_states(cfg, topo, seed, topo.cards, per_group, max_context,
                                                             options))
        else:
            from dsv41.cluster.worker_plugin import CardStatePlugin
            plugin = CardStatePlugin(cfg.name, topo, seed, per_group, max_context)
            self.runner = DistributedRunner(topo.ep, plugin, address, dashboard, startup)
        self._on_every_process(_set_device_time, backend)

    @property
    def active(self) -> list[int]:
        return list(self.where)

    # ---- steps -------------------------------------------------------------------------------------
    def step(self, batch: list[tuple[int | None, list[int]]], phase: str) -> torch.Tensor:
        per_group: dict[int, list] = {g: [] for g in range(self.topo.dp)}
        placed = []                          # (group, index within the group's batch) per request
        load = [len(t.requests) for t in self.tables]
        for rid, toks in batch:
            if rid is None:
                grp = min(range(self.topo.dp), key=lambda g: (load[g], g))
                load[grp] += 1
                local = None
            elif rid in self.where:
                grp, local = self.where[rid]
            else:
                raise ValueError(f"request_ids: unknown or released request {rid}")
            placed.append((grp, len(per_group[grp])))
            per_group[grp].append((local, toks))
        steps = {g: self.tables[g].plan(b, phase, self.topo.tp) for g, b in per_group.items() if b}

        graph = build(self.cfg, self.topo, steps, self.wiring, phase)
        outputs = [f"final/argmax@g{g}" for g in steps] + [f"cache.commit@c{c}" for c in self.topo.cards]
        plan = make_plan(graph, self.topo, self.granularity, outputs, step=self.step_id + 1)
        self.step_id += 1
        for n in graph.nodes.values():
            if n.kernel == "cache.commit":
                n.attrs["step"] = self.step_id
        t0 = time.perf_counter()
        self._on_every_process(_clear_sim_log)
        try:
            with self.trace.step(plan) if self.trace is not None else nullcontext():
                values = self._run(plan)
        except BaseException:
            self._abort()
            raise
        for g, s in steps.items():
            self.tables[g].commit(s)
        new_ids = []
        for (rid, _), (grp, idx) in zip(batch, placed):
            if rid is None:
                rid, self.next_rid = self.next_rid, self.next_rid + 1
                self.where[rid] = (grp, steps[grp].rids[idx])
            new_ids.append(rid)
        self.last_request_ids = new_ids
        self.last_graph = graph
        self.last_stats = {"nodes": len(graph.nodes), "submissions": plan.dask_tasks,
                           "dask_tasks": plan.dask_tasks + len(graph.literals), "wall_ms": (time.perf_counter() - t0) * 1e3}
        if self.backend != "torch":
            self.last_stats.update(self._device_summary())
        return torch.stack([values[f"final/argmax@g{grp}"][0][idx] for grp, idx in placed])

    def _run(self, plan):
        if self.runner is None:
            return run_local(plan, self.executor)
        return self.runner.run(plan)

    def _on_every_process(self, fn, *args):
        """Run fn here (sync/threads) or on every worker (distributed); results by process."""
        if self.runner is None:
            return {"local": fn(*args)}
        return self.runner.run_on_workers(fn, *args)

    def _device_summary(self) -> dict:
        """Per step: the busiest card's summed simulated µs (cards run concurrently) and which node
        kernels had a pypto form."""
        per_card: dict[int, float] = {}
        kernels = set()
        for log in self._on_every_process(_sim_log).values():
            for card, kernel, us in log.values():
                per_card[card] = per_card.get(card, 0.0) + us
                kernels.add(kernel)
        return {"device_sim_us": max(per_card.values(), default=0.0), "pypto_kernels": sorted(kernels)}

    def _abort(self):
        if self.runner is None:
            _abort_all(self.step_id)
        else:
            self.runner.run_on_workers(_abort_all, self.step_id)

    def release(self, rid: int):
        if rid not in self.where:
            raise ValueError(f"request_ids: unknown or released request {rid}")
        grp, local = self.where.pop(rid)
        self.tables[grp].release(local)

    # ---- tools ------------------------------------------------------------------------------------------
    def inject_failure(self, node_key: str | None):
        """Make the node with this key raise on its next run (tests)."""
        if self.runner is None:
            Hooks.fail_at = node_key
        else:
            self.runner.run_on_workers(_set_fail_at, node_key)

    def write_graph(self, path: str):
        from dsv41.graph.export import write_graph
        write_graph(self.last_graph, path)

    def hold_dashboard(self, seconds: float | None, say=print):
        if self.runner is None:
            raise ValueError("--dashboard: needs --executor distributed")
        say(f"  dashboard: {self.runner.dashboard_link}")
        if seconds is None:
            say("  press Enter to shut down")   # through say: with --json stdout holds only the result
            input()
        else:
            time.sleep(seconds)

    def close(self):
        if self.runner is not None:
            self.runner.close()
            self.runner = None


def _set_fail_at(key):
    Hooks.fail_at = key


def _set_device_time(backend: str):
    Hooks.device_time = None if backend == "torch" else partial(node_sim_us, backend=backend)
    Hooks.sim_log = {}


def _clear_sim_log():
    Hooks.sim_log = {}


def _sim_log():
    return dict(Hooks.sim_log)


__all__ = ["GraphEngine", "NodeError", "EXECUTORS"]
