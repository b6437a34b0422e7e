"""The serving simulation (``dsv41.plan.simulate``): the engine's own scheduler over an executor that
computes nothing makes the real engine's decisions, and its bench-serve metrics on hand-worked
workloads are the hand-computed ones."""
from __future__ import annotations

import math

import pytest

from dsv41.capacity import CAPACITIES
from dsv41.config import TINY
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler
from dsv41.telemetry.simulated import record_simulated
from dsv41.plan.simulate import (PlaceholderDrafter, SimulatedEngine, Workload, report_lines,
                                   simulate)
from dsv41.telemetry.export import write_perfetto

CAP = CAPACITIES["tiny"]


class Recorded(ReferenceEngine):
    """The real engine, noting each step it executes as the simulated one does."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps = []

    def execute(self, inputs, phase):
        self.steps.append((phase, [i for g in sorted(inputs) for i in inputs[g].layout.ids],
                           [r for g in sorted(inputs) for r in inputs[g].layout.rows]))
        return super().execute(inputs, phase)


def _decisions(steps, victims, reqs):
    """Steps as (phase, request positions, rows) and preemptions as request positions: ids are drawn
    process-wide, so each run's own requests are numbered by their place in the workload."""
    pos = {r.id: i for i, r in enumerate(reqs)}
    return [(p, [pos[i] for i in ids], rows) for p, ids, rows in steps], [pos[r.id] for r, _ in victims]


def test_simulated_executor_makes_the_real_engines_scheduling_decisions():
    # a cache of 64 tokens for 4 running requests of 40 prompt + 10 new tokens: a preemption; a shared
    # 32-token prefix: prefix-cache hits; a 32-row budget: chunked prompts
    work = Workload(4, 8, 10, prefix_len=32)
    prompts = work.prompts(TINY.vocab_size)
    kw = dict(max_batch=4, max_context=256, cache_tokens=64, prefix_caching=True)
    real = Recorded(TINY, **kw)
    real_reqs = requests_for(prompts, None, 10, None)
    real_sched = Scheduler(real, budget=32)
    real_sched.run(real_reqs)
    sim = SimulatedEngine(TINY, CAP, lambda phase, layout: 1.0, **kw)
    sim_reqs = requests_for(prompts, None, 10, None)
    sim_sched = Scheduler(sim, budget=32)
    sim_sched.run(sim_reqs)
    real_steps, real_victims = _decisions(real.steps, real_sched.victims, real_reqs)
    sim_steps, sim_victims = _decisions([(s.phase, s.ids, s.rows) for s in sim.steps], sim_sched.victims, sim_reqs)
    assert sim_steps == real_steps
    assert sim_victims == real_victims
    assert len(real_victims) > 0 and real_sched.prefix_hits > 0          # the case exercises both
    assert any(p == "prefill" and sum(rows) == 32 for p, _, rows in real_steps)   # a chunk filled the budget
    assert sim_sched.prefix_hits == real_sched.prefix_hits
    assert [len(r.made) for r in sim_reqs] == [len(r.made) for r in real_reqs] == [10] * 4


def _linear(phase, layout):
    """1 ms a step plus 0.1 ms a row of its largest DP group."""
    return 1000.0 + 100.0 * max(sum(r for r, _ in parts) for parts in layout.values())


def test_hand_worked_workload_with_a_concurrency_limit():
    # 4 requests of 16 prompt tokens and 3 new ones, 2 in flight at most, all arriving at t = 0:
    # r0, r1 prefill together (32 rows: 4.2 ms, first tokens at 4.2), decode twice (2 rows: 1.2 ms
    # each, ending at 5.4 and 6.6, where they finish); r2, r3 are sent at 6.6, prefill to 10.8,
    # decode to 12.0 and 13.2
    eng = SimulatedEngine(TINY, CAP, _linear, max_context=256)
    m, reqs = simulate(eng, Workload(4, 16, 3, max_concurrency=2))
    assert [r.sent_us for r in reqs] == pytest.approx([0, 0, 6600, 6600])
    assert [s.us for s in eng.steps] == pytest.approx([4200, 1200, 1200, 4200, 1200, 1200])
    assert m["mean_ttft_ms"] == pytest.approx(4.2) and m["p99_ttft_ms"] == pytest.approx(4.2)
    assert m["median_tpot_ms"] == pytest.approx(1.2) and m["mean_itl_ms"] == pytest.approx(1.2)
    assert m["duration"] == pytest.approx(13.2e-3)
    assert m["output_throughput"] == pytest.approx(12 / 13.2e-3)
    assert m["total_output_tokens"] == 12 and m["completed"] == 4


def test_hand_worked_arrivals_and_idle_time():
    # one request a second (Poisson draws replaced by the workload's own arrival times): each finds the
    # engine idle, so its TTFT is its prefill (16 rows: 2.6 ms) and its TPOT one decode row (1.1 ms)
    work = Workload(3, 16, 4, request_rate=1.0, seed=3)
    eng = SimulatedEngine(TINY, CAP, _linear, max_context=256)
    m, reqs = simulate(eng, work)
    assert [r.sent_us for r in reqs] == pytest.approx(work.arrivals_us())
    assert all(b - a > 5000 for a, b in zip(work.arrivals_us(), work.arrivals_us()[1:]))
    assert m["median_ttft_ms"] == pytest.approx(2.6) and m["mean_tpot_ms"] == pytest.approx(1.1)
    end = work.arrivals_us()[-1] + 2600 + 3 * 1100
    assert m["duration"] == pytest.approx(end / 1e6)


@pytest.mark.parametrize("acceptance, steps, tpot_ms", [(1.0, 2, 2 * 1.3 / 6), (0.0, 6, 1.1)])
def test_hand_worked_drafts_at_a_given_acceptance(acceptance, steps, tpot_ms):
    # one request, 7 tokens, 2 drafts a step. Accepted always: the prompt's step makes token 1 (2.6 ms),
    # each verify step of 3 rows (1.3 ms) makes 3 tokens, so 2 steps end it. Never accepted: the drafts
    # still cost their rows (3 rows, 1.3 ms) while the room allows 2, then 1 row with no room left
    eng = SimulatedEngine(TINY, CAP, _linear, max_context=256, acceptance=acceptance)
    m, _ = simulate(eng, Workload(1, 16, 7), PlaceholderDrafter(2))
    decode = [s for s in eng.steps if s.phase == "decode"]
    assert len(decode) == steps
    assert m["mean_ttft_ms"] == pytest.approx(2.6)
    if acceptance == 1.0:
        assert m["mean_tpot_ms"] == pytest.approx(tpot_ms) and m["mean_itl_ms"] == pytest.approx(1.3)
        assert [s.rows for s in decode] == [[3], [3]]
    else:
        # rooms: 7 - 1 - 1 = 5 .. down to 0: drafts 2, 2, 2, 2, 1, 0 -> rows 3, 3, 3, 3, 2, 1
        assert [s.rows[0] for s in decode] == [3, 3, 3, 3, 2, 1]
        assert m["mean_tpot_ms"] == pytest.approx((4 * 1.3 + 1.2 + 1.1) / 6)


def test_acceptance_is_drawn_at_its_rate():
    eng = SimulatedEngine(TINY, CAP, _linear, max_context=1024, acceptance=0.5, seed=1)
    simulate(eng, Workload(1, 16, 300), PlaceholderDrafter(1))
    decode = [s for s in eng.steps if s.phase == "decode"]
    # 299 tokens after the first, in steps of 1 + Bernoulli(0.5) tokens: 299 / 1.5 steps expected (sd ~7)
    assert len(decode) == pytest.approx(299 / 1.5, rel=0.1)


def test_report_prints_bench_serve_lines_and_keys():
    eng = SimulatedEngine(TINY, CAP, _linear, max_context=256)
    m, _ = simulate(eng, Workload(2, 16, 3))
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "output_throughput"):
        assert math.isfinite(m[key])
    text = "\n".join(report_lines(m))
    for label in ("Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "Output token throughput (tok/s):"):
        assert label in text


@pytest.mark.parametrize("field, value, flag", [("num_prompts", 0, "--num-prompts"),
                                                ("request_rate", 0.0, "--request-rate"),
                                                ("max_concurrency", 0, "--max-concurrency"),
                                                ("prefix_len", -1, "--random-prefix-len")])
def test_bad_workload_is_refused_naming_the_flag(field, value, flag):
    kw = {"num_prompts": 2, "input_len": 4, "output_len": 2, field: value}
    with pytest.raises(ValueError, match=f"^{flag}: must be"):
        Workload(**kw).check()


class _Nearest:
    """A pricer's planned step, as ``record_simulated`` reads it."""
    device = "a5"

    def nearest(self, phase, rows):
        return {"critical_path_us_by_kernel": {"moe.experts": 3.0, "attn.q_proj": 1.0},
                "cards": [{"card": 0, "total_bytes": 10, "weights_bytes": 7, "cache_bytes": 2}]}


def test_the_simulated_run_is_written_as_step_and_node_spans(tmp_path):
    eng = SimulatedEngine(TINY, CAP, _linear, max_context=256)
    simulate(eng, Workload(2, 16, 3))
    records = record_simulated(eng, _Nearest(), {"service.name": "dsv41"})
    steps = [r for r in records if r["attributes"]["dsv41.span"] == "step"]
    nodes = [r for r in records if r["attributes"]["dsv41.span"] == "node"]
    assert [(r["end_ns"] - r["start_ns"]) / 1e3 for r in steps] == pytest.approx([s.us for s in eng.steps])
    assert [r["attributes"]["dsv41.rows"] for r in steps] == [sum(s.rows) for s in eng.steps]
    assert all(r["attributes"]["dsv41.simulated"] for r in records)
    first = [r for r in nodes if r["attributes"]["dsv41.step"] == 1]
    # the step's time split 3:1 between the planned step's kinds on its critical path, with its HBM
    assert [r["attributes"]["dsv41.device.sim_us"] for r in first] == pytest.approx([0.75 * eng.steps[0].us,
                                                                                      0.25 * eng.steps[0].us])
    assert {(r["attributes"]["dsv41.hbm.live_bytes"], r["attributes"]["dsv41.hbm.peak_bytes"]) for r in nodes} \
        == {(9, 10)}
    assert len(write_perfetto(records, tmp_path / "sim.perfetto.json").read_text()) > 0     # opens as a run's
    assert (steps[1]["start_ns"] - steps[0]["start_ns"]) / 1e3 == pytest.approx(eng.steps[1].start_us)
