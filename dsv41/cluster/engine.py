"""GraphEngine: requests -> per-DP-group metadata -> graph -> plan -> dask -> logits.

Inputs are validated (tokens, capacity, topology) before any node runs. A step is atomic: cache
writes are staged on every card and only ``cache.commit`` applies them; if anything fails the
engine aborts the step on every card (waiting for its running submissions, undoing a commit that
already happened) and the host request tables are left as they were.

Every engine has an id; its cards' States and hooks live under that id (``cluster/registry.py``),
here or on the dask workers, so engines and runs sharing a process or a scheduler stay apart. A
step that finds a card's State missing or stale (``StateLost``) is recovered (``cluster/recovery.py``)
and retried. Its requests' host state (per DP group tables, routing) is its ``host``
(``engine/host.py``): the engine runs the planned step's ``StepInputs``; whoever watches the steps
(tracing) registers as an observer (``cluster/observers.py``).
"""
from __future__ import annotations

import logging
import math
import time
import uuid
import weakref
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import replace
from functools import partial

import torch

from dsv41.cluster import registry
from dsv41.cluster.connect import quiet_abandoned_start
from dsv41.cluster.executors import CardUnavailable, DistributedRunner, run_local
from dsv41.cluster.observers import StepObserver
from dsv41.cluster.plan import Plan, make_plan
from dsv41.cluster.recovery import recover
from dsv41.cluster.registry import StateLost
from dsv41.cluster.runtime import NodeError
from dsv41.cluster.settings import EngineConfig
from dsv41.checkpoint.shards import card_bytes, return_freed_memory
from dsv41.cluster.state import build_states, renew
from dsv41.config import ModelConfig, Topology
from dsv41.capacity import capacity_of
from dsv41.engine.context import fill_caches
from dsv41.engine.host import HostState
from dsv41.engine.layout import Part
from dsv41.engine.protocol import Engine, Ran, StepCounter, StepOutput
from dsv41.graph.build import build, commit_key, dspark_key, feed, head_key, shape, step_outputs
from dsv41.kernels.device_time import node_sim_us
from dsv41.model.finite import NonFiniteError
from dsv41.names import LOCAL_EXECUTORS
from dsv41.weights import site_tensors

MAX_RECOVERIES = 2           # per step; a third loss in one step is raised
log = logging.getLogger(__name__)


class GraphEngine(Engine):
    def __init__(self, cfg: ModelConfig, topo: Topology, settings: EngineConfig = EngineConfig(), checkpoint=None):
        """settings: how it runs (``cluster.settings``); checkpoint: an opened checkpoint holding cfg
        (weights and Engram token map), the source each card reads its own slices from; None draws
        random weights from the settings' seed. Under distributed it travels to the workers, which
        open its files themselves."""
        if settings.backend == "pypto-npu":
            from dsv41.kernels.pypto.backend import check_npu
            check_npu()
        topo.check(cfg)
        if checkpoint is not None and checkpoint.cfg != cfg:
            raise ValueError(f"checkpoint: holds config {checkpoint.cfg.name!r}, not {cfg.name!r}")
        self.cfg, self.topo, self.settings = cfg, topo, settings
        seed, options, cache_tokens, prefix_caching = settings.seed, settings.options, settings.cache_tokens, \
            settings.prefix_caching
        self._graphs: OrderedDict = OrderedDict()   # step shape -> planned graph, least recent first
        self.capacity = capacity = settings.capacity or capacity_of(cfg, checkpoint)
        max_batch = settings.max_batch or capacity.max_batch_per_dp * topo.dp
        per_group = math.ceil(max_batch / topo.dp)
        if per_group > capacity.max_batch_per_dp:
            raise ValueError(f"max_batch: {max_batch} over dp={topo.dp} exceeds {capacity.max_batch_per_dp} requests "
                             f"per DP group (max_batch_per_dp, the capacity contract)")
        max_context = settings.max_context or min(cfg.max_position_embeddings, 1024)
        token_map = None if checkpoint is None else checkpoint.token_map
        self.host = HostState(cfg, capacity, topo.dp, per_group, max_context, token_map, cache_tokens, prefix_caching)
        self.seed = seed
        self.step_id = 0
        self.generation = 0                  # steps committed on every card
        self.last_request_ids: list[int] = []
        self.last_stats: dict = {}
        self.last_graph = None
        self.dspark = False                  # steps draft DSpark blocks in the graph (``engine.dspark``)
        self._steps = StepCounter()          # numbers the steps StepOutput.logits may ask about
        self._heads: dict[int, int] = {}     # DP group of the last step -> the card holding its logits
        self.recoveries: list[dict] = []     # one record per recovery, oldest first
        self._recovered: list[dict] = []     # the records of the step running
        self.runner = None
        self.observers: list[StepObserver] = []
        self.id = uuid.uuid4().hex[:8]
        self.builds: dict[int, str] = {}      # card -> build id of the State this engine expects
        self._state_args = (seed, per_group, max_context, options, checkpoint, cache_tokens,
                            capacity.prefill_max_tokens)
        if settings.executor not in LOCAL_EXECUTORS:
            self.runner = DistributedRunner(topo.ep, settings.address, settings.dashboard, settings.startup)
        self._finalizer = weakref.finalize(self, _free_everywhere, self.id, self.runner)
        self._finalizer.atexit = False       # a process that exits frees its own States
        try:
            self._install(list(topo.cards))
            self.cards = sorted((r for rs in self._on_every_process(_card_bytes, self.id).values() for r in rs),
                                key=lambda r: r["card"])   # resident bytes per card, measured once
        except BaseException as e:           # e.g. a bad checkpoint value found as a card read it
            if isinstance(e, KeyboardInterrupt) and self.runner is not None:
                quiet_abandoned_start()      # Ctrl-C / SIGTERM while the States install
            self._finalizer()
            raise

    # ---- State ownership ----------------------------------------------------------------------------
    def _install(self, cards: list[int]):
        """Fresh States (same seed, empty caches, a new build id) for these cards, at this generation."""
        seed, per_group, max_context, options, source, cache_tokens, step_rows = self._state_args
        build_id = uuid.uuid4().hex[:8]
        args = (self.cfg, self.topo, seed, per_group, max_context, options, source, self.id, build_id,
                self.generation, self.settings.backend, cache_tokens, step_rows)
        if self.runner is None:
            _install_here(*args, cards=cards)
        else:
            try:
                self.runner.run_on_cards(_install_on_worker, *args, cards=cards)
            except OSError as e:             # the worker went away again
                raise StateLost(cards, f"worker unreachable while installing State: {e}") from e
            for observer in self.observers:
                observer.attach(cards)
        self.builds.update(dict.fromkeys(cards, build_id))

    def _renew(self, cards: list[int]):
        """Empty caches as a new build on cards that kept their State (weights stay)."""
        if not cards:
            return
        build_id = uuid.uuid4().hex[:8]
        if self.runner is None:
            _renew_here(self.id, cards, build_id, self.generation)
        else:
            self.runner.run_on_cards(_renew_here, self.id, cards, build_id, self.generation, cards=cards)
        self.builds.update(dict.fromkeys(cards, build_id))

    def _recover(self, err: StateLost, failed_step_ms: float):
        record = recover(self, err, failed_step_ms)
        self.recoveries.append(record)
        log.warning("dsv41 engine %s: recovered card(s) %s (%s): rebuilt DP group(s) %s, replayed %d token(s) of "
                    "%d request(s) in %d prefill step(s), %.0f ms", self.id, record["lost_cards"], err.reason,
                    record["dp_groups"], record["replayed_tokens"], record["replayed_requests"],
                    record["replay_steps"], record["ms"])

    # ---- steps -------------------------------------------------------------------------------------
    def run(self, parts: list[Part], phase: str) -> StepOutput:
        """``Engine.run``, retried after recovering lost cards (at most MAX_RECOVERIES times a step)."""
        self._check_open()
        first = len(self.recoveries)         # this step's recoveries are the records from here on
        lost = None                          # (StateLost, ms the failed attempt ran) to recover first
        for attempt in range(MAX_RECOVERIES + 1):
            t0 = time.perf_counter()
            try:
                if lost is not None:
                    self._recover(*lost)
                self._recovered = self.recoveries[first:]
                return super().run(parts, phase)
            except StateLost as e:           # in the step, or a second loss during the recovery
                if attempt == MAX_RECOVERIES:
                    raise
                lost = (e, (time.perf_counter() - t0) * 1e3)
            except NonFiniteError as e:      # the cards found NaN/Inf: the step is aborted; say which step
                raise e.at(self._steps.latest + 1, phase, site_tensors(self.cfg, e.layer, e.site)) from None

    def execute(self, inputs: dict, phase: str) -> Ran:
        """Build (or reuse), plan and run the step's graph over these DP groups' inputs; each group's
        head card keeps its logits (``fetch``)."""
        t0 = time.perf_counter()
        values, graph, plan = self._execute(inputs, phase)
        self.last_graph = graph
        self.last_stats = {"nodes": len(graph.nodes), "submissions": plan.dask_tasks,
                           "dask_tasks": plan.dask_tasks + len(graph.literals),
                           "wall_ms": (time.perf_counter() - t0) * 1e3, "cards": self.cards,
                           "host_ms": self._host_ms, "graph_reused": self._reused}
        if self._recovered:
            self.last_stats["recovered"] = self._recovered
        if self.settings.backend != "torch":
            self.last_stats.update(self._device_summary())
        self._heads = {g: self.topo.group_cards(g)[0] for g in inputs}
        heads = {g: values[head_key(g)] for g in inputs}
        step = self.step_id
        drafted = {g: self._drafts(values[dspark_key(g)]) for g in inputs} if self.dspark else None
        return Ran({g: h.tokens for g, h in heads.items()}, lambda: self._logits(step),
                   {g: h.logprobs for g, h in heads.items()}, drafted)

    def _check_open(self):
        if not self._finalizer.alive:
            raise RuntimeError(f"engine {self.id} is closed")

    @staticmethod
    def _drafts(made) -> list[tuple]:
        """A group's DSpark head value as (tokens, confidences, distributions or None) per request."""
        probs = made.probs or [None] * made.tokens.shape[0]
        return [(made.tokens[b], made.confidence[b], probs[b]) for b in range(made.tokens.shape[0])]

    def _logits(self, step: int) -> dict:
        """DP group -> the logit rows of a step, from the cards that made them."""
        held = {}
        for found in self._on_every_process(_held_logits, self.id, step, self._heads).values():
            held.update(found)
        return held

    def _execute(self, steps: dict, phase: str):
        """Plan and run one step over these DP groups' inputs; abort everywhere if it fails."""
        self.step_id += 1
        t0 = time.perf_counter()
        plan, reused = self._plan(steps, phase)
        self._host_ms, self._reused = (time.perf_counter() - t0) * 1e3, reused
        if self.settings.backend != "torch":
            self._on_every_process(_clear_sim_log, self.id)
        try:
            with ExitStack() as observed:
                for observer in self.observers:
                    observed.enter_context(observer.step(plan))
                values = self._run(plan)
        except BaseException:
            self._abort()
            raise
        self.generation += 1
        return values, plan.graph, plan

    def _plan(self, steps: dict, phase: str) -> tuple[Plan, bool]:
        """This step's plan: the built, validated and planned graph of its shape (cached), fed this
        step's inputs, with submissions stamped with this engine, step and expected States."""
        wiring, granularity = self.settings.wiring, self.settings.granularity
        key = (phase, wiring, granularity, self.dspark, shape(self.cfg, steps))
        template = self._graphs.get(key)
        reused = template is not None
        if reused:
            self._graphs.move_to_end(key)
            feed(template.graph, self.topo, steps)
        else:
            graph = build(self.cfg, self.topo, steps, wiring, phase, self.dspark)
            template = make_plan(graph, self.topo, granularity, step_outputs(self.topo, steps, self.dspark))
            if self.settings.graph_cache:
                self._graphs[key] = template
                while len(self._graphs) > self.settings.graph_cache:
                    self._graphs.popitem(last=False)
        for key in [commit_key(c) for c in self.topo.cards] + [head_key(g) for g in steps] + \
                ([dspark_key(g) for g in steps] if self.dspark else []):
            template.graph.nodes[key].attrs["step"] = self.step_id
        subs = {k: replace(sub, step=self.step_id, engine=self.id, expect=(self.builds[sub.card], self.generation))
                for k, sub in template.submissions.items()}
        return Plan(template.graph, subs, template.owner, template.outputs), reused

    def _run(self, plan):
        if self.runner is None:
            return run_local(plan, self.settings.executor)
        return self.runner.run(plan)

    def _on_every_process(self, fn, *args):
        """Run fn here (sync/threads) or on every card's worker (distributed); results by process."""
        if self.runner is None:
            return {"local": fn(*args)}
        return self.runner.run_on_cards(fn, *args)

    def _device_summary(self) -> dict:
        """Per step: the busiest card's summed simulated µs (cards run concurrently) and which node
        kernels had a pypto form."""
        per_card: dict[int, float] = {}
        kernels = set()
        for log_ in self._on_every_process(_sim_log, self.id).values():
            for card, kernel, us in log_.values():
                per_card[card] = per_card.get(card, 0.0) + us
                kernels.add(kernel)
        return {"device_sim_us": max(per_card.values(), default=0.0), "pypto_kernels": sorted(kernels)}

    def _abort(self):
        """Abort the current step on every card; a worker that is gone has nothing left to abort."""
        args = (self.id, self.step_id, self.generation)
        if self.runner is None:
            registry.abort(*args)
            return
        self.runner.refresh()
        for result in self.runner.run_on_cards(registry.abort, *args, on_error="return").values():
            if isinstance(result, Exception) and not isinstance(result, OSError):
                raise result

    def start_at_context(self, rids: list[int], context: int, groups: dict[int, int] | None = None) -> list[int]:
        """Requests placed as a prefill places them (``groups``, else the least loaded DP group);
        every card of a group fills its replica of the group's caches with the same drawn rows."""
        self._check_open()
        return super().start_at_context(rids, context, groups)

    def fill(self, fills: dict):
        self._on_every_process(_fill_here, self.id, self.cfg, self.seed, fills)

    # ---- tools ------------------------------------------------------------------------------------------
    def observe(self, observer: StepObserver):
        """Tell observer about every following step (``cluster/observers.py``) until ``unobserve``."""
        self.observers.append(observer)

    def unobserve(self, observer: StepObserver):
        self.observers.remove(observer)

    def inject_failure(self, node_key: str | None):
        """Make the node with this key raise the next time it runs (once; tests)."""
        self._on_every_process(_set_fail_at, self.id, node_key)

    def states(self) -> dict:
        """card -> this engine's State (sync/threads: the States live in this process)."""
        if self.runner is not None:
            raise ValueError("states: only sync and threads engines hold their States in this process")
        return registry.owned(self.id).states

    def check_nodes(self, checker):
        """Call ``checker(state, node, args, value)`` after every node of the following steps (None
        stops). The check runs in this process, so only the sync and threads executors have it."""
        if self.runner is not None:
            raise ValueError("--check: runs in this process; needs --executor sync or threads")
        registry.owned(self.id).hooks.check = checker

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
        """Free this engine's States and hooks everywhere (its workers too) and leave the cluster."""
        self._finalizer()
        self.runner = None


def _free_everywhere(engine: str, runner):
    if runner is None:
        registry.free(engine)
        return
    try:
        if runner.cluster is None:    # a scheduler we joined: its workers outlive the run
            runner.run_on_cards(registry.free, engine, on_error="ignore")
    finally:
        runner.close()


def _fill_here(engine: str, cfg, seed: int, fills: dict):
    """Fill each DP group's drawn requests into the caches of its cards in this process."""
    states = registry.owned(engine).states
    for grp, requests in fills.items():
        targets = [st.caches for c, st in states.items() if st.topo.dp_group(c) == grp]
        if targets:
            fill_caches(cfg, seed, targets, requests)


def _card_bytes(engine: str):
    return [card_bytes(st) for st in registry.owned(engine).states.values()]


def _install_here(cfg, topo, seed, per_group, max_context, options, source, engine, build_id, generation, backend,
                  cache_tokens, step_rows, cards):
    device_time = None if backend == "torch" else partial(node_sim_us, backend=backend)
    registry.install(engine, build_states(cfg, topo, seed, cards, per_group, max_context, options, source, build_id,
                                          generation, cache_tokens, step_rows), device_time)
    return_freed_memory()


def _renew_here(engine: str, cards, build_id: str, generation: int):
    states = registry.owned(engine).states
    for c in cards:
        if c in states:
            renew(states[c], build_id, generation)


def _install_on_worker(*args, dask_worker=None):
    """client.run target: the State of the card this worker is named for."""
    card = int(dask_worker.name)
    _install_here(*args, cards=[card])
    return card


def _held_logits(engine: str, step: int, heads: dict[int, int]) -> dict:
    """DP group -> its logits of this step, from the head cards in this process."""
    states = registry.owned(engine).states
    out = {}
    for grp, card in heads.items():
        if card in states:
            made, logits = states[card].logits.get(grp, (None, None))
            if made != step:
                raise RuntimeError(f"logits: card {card} holds step {made}'s logits, not step {step}'s")
            out[grp] = logits
    return out


def _set_fail_at(engine: str, key):
    registry.owned(engine).hooks.fail_at = key


def _clear_sim_log(engine: str):
    registry.owned(engine).hooks.sim_log = {}


def _sim_log(engine: str):
    return dict(registry.owned(engine).hooks.sim_log)


__all__ = ["GraphEngine", "NodeError", "StateLost", "CardUnavailable"]
