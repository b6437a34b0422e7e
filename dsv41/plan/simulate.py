"""A serving run on a simulated clock: the engine's own ``Scheduler`` drives an executor that computes
nothing and advances the clock by the priced step of the layout it was given.

``SimulatedEngine`` is an ``Engine`` whose host state is the real one (``engine.host``: admission,
chunking, prefix caching and preemption happen in the same block managers a run uses) and whose
``execute`` makes no logits: each request makes one token, or in a verify step its drafts accepted
one after another with chance ``acceptance`` each and one token after them (DSpark's acceptance,
drawn from ``seed``). The step lasts what the ``price`` callable says for its layout: per DP group,
(rows, context after the step) per request. ``PlanPricer`` prices a layout from a few planned steps
of the deployment (``plan.step.run_plan``): rows interpolated between planned row counts, the
context through the rows x context product (what the indexer and the attention leaves scale with).

``simulate`` replays a ``bench serve`` workload against it: requests arrive at ``request_rate``
(Poisson; ``inf``: all at once), at most ``max_concurrency`` in flight, each sent when it arrives
and a slot is free; what it reports uses ``bench serve``'s definitions and result keys (TTFT from
the send to the first token; TPOT the rest of the request's time over its other tokens; ITL the
gaps between the steps that deliver its tokens).
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch

from dsv41.engine.drafters import Drafter
from dsv41.engine.host import HostState
from dsv41.engine.protocol import Engine, Ran, StepCounter
from dsv41.engine.request import Request
from dsv41.engine.requests import StepInputs
from dsv41.engine.scheduler import Scheduler
from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops

# per DP group: (rows, context after the step) per request
Layout = dict[int, list[tuple[int, int]]]


@dataclass
class SimStep:
    """One step the simulated executor ran."""
    phase: str
    ids: list[int]
    rows: list[int]
    start_us: float
    us: float


class SimulatedEngine(Engine):
    """Computes nothing; the real host state; a clock advanced by ``price(phase, layout)`` µs a step."""

    def __init__(self, cfg, capacity, price: Callable[[str, Layout], float], dp: int = 1,
                 max_batch: int | None = None, max_context: int | None = None, cache_tokens: int | None = None,
                 prefix_caching: bool = False, acceptance: float = 0.0, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"--acceptance: must be in [0, 1] (a probability per draft), got {acceptance:g}")
        self.cfg, self.capacity, self.seed, self.price = cfg, capacity, seed, price
        self.host = HostState(cfg, capacity, dp, max_batch or capacity.max_batch_per_dp,
                              max_context or cfg.max_position_embeddings, None, cache_tokens, prefix_caching)
        for table in self.host.tables:
            # the tables still plan, reserve and commit every step's blocks; only the device inputs
            # (metadata tensors, Engram hash ids: most of a step's host time) are not built
            table._inputs = _layout_only
        self.acceptance = acceptance
        self.draws = random.Random(seed)
        self.clock_us = 0.0
        self.steps: list[SimStep] = []
        self.last_request_ids: list[int] = []
        self.last_stats: dict = {}
        self._steps = StepCounter()

    def execute(self, inputs, phase: str) -> Ran:
        layout: Layout = {}
        tokens: dict[int, list[list[int]]] = {}
        for g, step in sorted(inputs.items()):
            lay = step.layout
            layout[g] = [(rows, kv + rows) for rows, kv in zip(lay.rows, step.md.kv_seq_lens.tolist())]
            tokens[g] = [self._made(drafts) for drafts in lay.drafts]
        us = float(self.price(phase, layout))
        ids = [i for g in sorted(inputs) for i in inputs[g].layout.ids]
        rows = [r for g in sorted(inputs) for r in inputs[g].layout.rows]
        self.steps.append(SimStep(phase, ids, rows, self.clock_us, us))
        self.clock_us += us
        return Ran(tokens, lambda: {g: None for g in inputs}, {g: None for g in inputs})

    def _made(self, drafts: list[int]) -> list[int]:
        """The drafts accepted in order while each draw succeeds, then the model's own token."""
        kept = 0
        while kept < len(drafts) and self.draws.random() < self.acceptance:
            kept += 1
        return list(drafts[:kept]) + [self.draws.randrange(self.cfg.vocab_size)]

    def fill(self, fills):
        """Drawn histories hold no values here: their blocks are all the simulation needs."""


def _layout_only(seqs, parts, layout, phase: str) -> StepInputs:
    """A step's inputs as the simulated executor reads them: the layout and each request's cache length."""
    kv = torch.tensor([s.kv_len for s in seqs], dtype=torch.int32)
    return StepInputs(layout, None, SimpleNamespace(kv_seq_lens=kv), {}, phase, None)


class PlaceholderDrafter(Drafter):
    """Proposes ``k`` drafts a decode step (token 0; the simulated executor accepts them by chance)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, job, room: int) -> list[int]:
        return [0] * min(self.k, room)


# ---- pricing a layout from planned steps ------------------------------------------------------------

@dataclass
class PlanPricer:
    """A layout's step µs from planned steps of one deployment: per phase, steps planned at a few row
    counts per DP group (decode: requests of ``1 + drafts`` rows; prefill: one request's chunk) at
    context ``context``, interpolated linearly in rows, plus the context's share from one more plan
    at twice the context (its extra µs per row x context token). The DP groups run in step (the MoE
    all-to-all joins them), so a step costs its most expensive group."""
    cfg: object
    topo: object
    device: str
    context: int
    drafts: int = 0
    budget: int = 512
    max_batch: int = 32
    dispatch: str = "graph"
    scheme: str = "all_to_all"
    anchors: dict = field(default_factory=dict)     # (phase, rows per request, requests, context) -> report

    def plan(self, phase: str, requests: int, rows: int, context: int) -> dict:
        key = (phase, rows, requests, context)
        if key not in self.anchors:
            from dsv41.capacity import capacity_of
            from dsv41.plan.step import run_plan
            cap = dataclasses.replace(capacity_of(self.cfg), decode_rows_per_request=rows if phase == "decode" else 1,
                                      prefill_max_tokens=max(requests * rows, 1),
                                      max_batch_per_dp=max(requests, capacity_of(self.cfg).max_batch_per_dp))
            self.anchors[key] = run_plan(self.cfg, self.topo, requests, max(context, rows), phase, device=self.device,
                                         dispatch=self.dispatch, scheme=self.scheme, capacity=cap)[0]
        return self.anchors[key]

    def grid(self, phase: str) -> list[tuple[int, int]]:
        """(requests, rows per request) of the planned row counts of a phase."""
        if phase == "decode":
            counts = sorted({1, min(4, self.max_batch), min(16, self.max_batch), self.max_batch})
            return [(n, 1 + self.drafts) for n in counts]
        counts = sorted({min(16, self.budget), min(128, self.budget), self.budget})
        return [(1, n) for n in counts]

    def at(self, phase: str, rows: float) -> float:
        """µs of a step of ``rows`` rows per group at the reference context (linear between plans)."""
        pts = [(n * r, self.plan(phase, n, r, self.context)["predicted_step_us"]) for n, r in self.grid(phase)]
        xs = [x for x, _ in pts]
        i = min(max(bisect.bisect_left(xs, rows), 1), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0) if x1 != x0 else y0

    def per_row_context(self, phase: str) -> float:
        """Extra µs per row x context token: one plan's rows at twice the reference context."""
        n, r = self.grid(phase)[0]
        base = self.plan(phase, n, r, self.context)["predicted_step_us"]
        far = self.plan(phase, n, r, 2 * self.context)["predicted_step_us"]
        return max(0.0, (far - base) / (n * r * self.context))

    def nearest(self, phase: str, rows: int) -> dict:
        """The planned step of a phase whose rows per group are nearest ``rows`` (its report)."""
        n, r = min(self.grid(phase), key=lambda nr: abs(nr[0] * nr[1] - rows))
        return self.plan(phase, n, r, self.context)

    def __call__(self, phase: str, layout: Layout) -> float:
        # a step that feeds prompt chunks is planned as a prefill (its decode rows beside them, as rows)
        kind = "decode" if phase == "decode" else "prefill"
        out = 0.0
        for parts in layout.values():
            rows = sum(r for r, _ in parts)
            extra = sum(r * (c - self.context) for r, c in parts)
            out = max(out, self.at(kind, rows) + self.per_row_context(kind) * extra)
        return out


# ---- a bench-serve workload ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """``vllm bench serve``'s random dataset: prompts of ``input_len`` random tokens after a shared
    ``prefix_len``-token prefix, ``output_len`` tokens each (EOS ignored), arriving at ``request_rate``
    per second (Poisson; inf: all at t = 0), at most ``max_concurrency`` in flight (None: no limit)."""
    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float = math.inf
    max_concurrency: int | None = None
    prefix_len: int = 0
    seed: int = 0

    def check(self):
        rules = [("--num-prompts", self.num_prompts >= 1, ">= 1", self.num_prompts),
                 ("--random-input-len", self.input_len >= 1, ">= 1", self.input_len),
                 ("--random-output-len", self.output_len >= 1, ">= 1", self.output_len),
                 ("--request-rate", self.request_rate > 0, "> 0 requests/s (inf: all at once)", self.request_rate),
                 ("--max-concurrency", self.max_concurrency is None or self.max_concurrency >= 1, ">= 1",
                  self.max_concurrency),
                 ("--random-prefix-len", self.prefix_len >= 0, ">= 0", self.prefix_len)]
        for flag, ok, rule, got in rules:
            if not ok:
                raise ValueError(f"{flag}: must be {rule}, got {got}")

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        prefix = [rng.randrange(vocab) for _ in range(self.prefix_len)]
        return [prefix + [rng.randrange(vocab) for _ in range(self.input_len)] for _ in range(self.num_prompts)]

    def arrivals_us(self) -> list[float]:
        if math.isinf(self.request_rate):
            return [0.0] * self.num_prompts
        rng = random.Random(self.seed + 1)
        t, out = 0.0, []
        for _ in range(self.num_prompts):
            out.append(t)
            t += rng.expovariate(self.request_rate) * 1e6
        return out


class TimedRequest(Request):
    """A request that notes when each of its token deliveries happens on the simulated clock."""
    clock: Callable[[], float]

    def emit(self, kind: str, **fields):
        if kind == "token" and fields.get("kept", True):
            now = self.clock()
            if self.deliveries and self.deliveries[-1][0] == now:
                self.deliveries[-1][1] += 1
            else:
                self.deliveries.append([now, 1])


def simulate(engine: SimulatedEngine, workload: Workload, drafter: Drafter | None = None,
             budget: int | None = None) -> tuple[dict, list]:
    """Run the workload through the engine's own scheduler on the simulated clock: (``bench serve``
    metrics, the requests with their send time and token deliveries)."""
    workload.check()
    sched = Scheduler(engine, drafter, budget=budget)
    prompts = workload.prompts(engine.cfg.vocab_size)
    arrivals = workload.arrivals_us()
    limit = workload.max_concurrency or workload.num_prompts
    reqs = []
    for p in prompts:
        params = SamplingParams(max_tokens=workload.output_len)
        r = TimedRequest(p, params, Stops(params, workload.output_len, None, None))
        r.clock, r.deliveries, r.sent_us = (lambda: engine.clock_us), [], None
        reqs.append(r)
    queued: collections.deque = collections.deque()
    state = {"inflight": 0}

    def send(r, at: float):
        r.sent_us = at
        state["inflight"] += 1
        sched.add(r)

    def finished(r, reason):
        state["inflight"] -= 1
        if queued:
            send(queued.popleft(), engine.clock_us)

    sched.on_finish = finished
    i = 0
    try:
        while i < len(reqs) or queued or sched.busy:
            while i < len(reqs) and arrivals[i] <= engine.clock_us:
                if state["inflight"] < limit:
                    send(reqs[i], arrivals[i])
                else:
                    queued.append(reqs[i])
                i += 1
            if not sched.busy:
                engine.clock_us = max(engine.clock_us, arrivals[i])     # idle until the next arrival
                continue
            sched.step()
    finally:
        sched.release_all()
    return metrics(reqs, workload), reqs


def metrics(reqs, workload: Workload) -> dict:
    """``bench serve``'s result: TTFT, TPOT, ITL (mean, median, p99 in ms; std as it prints) and throughput."""
    ttft, tpot, itl, e2el = [], [], [], []
    out_tokens = 0
    for r in reqs:
        times = [t for t, _ in r.deliveries]
        n = sum(k for _, k in r.deliveries)
        out_tokens += n
        ttft.append((times[0] - r.sent_us) / 1e3)
        e2el.append((times[-1] - r.sent_us) / 1e3)
        if n > 1:
            tpot.append((times[-1] - times[0]) / 1e3 / (n - 1))
        itl += [(b - a) / 1e3 for a, b in zip(times, times[1:])]
    duration = max(t for r in reqs for t, _ in r.deliveries) / 1e6
    out = {"completed": len(reqs), "duration": duration,
           "total_input_tokens": len(reqs) * (workload.input_len + workload.prefix_len),
           "total_output_tokens": out_tokens, "request_throughput": len(reqs) / duration,
           "output_throughput": out_tokens / duration,
           "total_token_throughput": (out_tokens + len(reqs) * (workload.input_len + workload.prefix_len)) / duration}
    for name, xs in (("ttft", ttft), ("tpot", tpot or [0.0]), ("itl", itl or [0.0]), ("e2el", e2el)):
        out[f"mean_{name}_ms"] = float(np.mean(xs))
        out[f"median_{name}_ms"] = float(np.median(xs))
        out[f"std_{name}_ms"] = float(np.std(xs))
        out[f"p99_{name}_ms"] = float(np.percentile(xs, 99))
    return out


def report_lines(m: dict) -> list[str]:
    """The result as ``bench serve`` prints it."""
    rows = [("Successful requests:", m["completed"]), ("Benchmark duration (s):", f"{m['duration']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]), ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")]
    out = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result (simulated) ", n=50, c="=")]
    out += [f"{k:<40}{v:<10}" for k, v in rows]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency")):
        out.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        label = name.upper()
        out += [f"{'Mean ' + label + ' (ms):':<40}{m[f'mean_{name}_ms']:<10.2f}",
                f"{'Median ' + label + ' (ms):':<40}{m[f'median_{name}_ms']:<10.2f}",
                f"{'P99 ' + label + ' (ms):':<40}{m[f'p99_{name}_ms']:<10.2f}"]
    out.append("=" * 50)
    return out
