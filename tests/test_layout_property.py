"""Property: for any prompts, lengths, layout, wiring and executor, the graph's logits are the
reference's logits byte for byte (every contraction and every size-sensitive pointwise function is
partition-invariant, docs/numerics.md). A handful of examples by default; `pytest -m slow` runs more."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.engine.reference import ReferenceEngine

MAX_BATCH, MAX_CONTEXT = 3, 96
# TINY: window 16, Top-K 8, 3 candidate blocks of 4; 64 tokens pass all of them
LENGTHS = st.one_of(st.integers(1, 16), st.integers(17, 64))
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


@pytest.fixture(scope="module")
def reference():
    return ReferenceEngine(TINY, seed=0, max_batch=MAX_BATCH, max_context=MAX_CONTEXT)


def _run(model, prompts, steps):
    logits = [model.prefill(prompts).logits]
    rids = list(model.last_request_ids)
    try:
        for _ in range(steps):
            logits.append(model.decode(torch.argmax(logits[-1], -1).tolist(), rids).logits)
    finally:
        for rid in rids:
            model.release(rid)
    return logits


cases = st.fixed_dictionaries({
    "seed": st.integers(0, 2 ** 16),
    "lengths": st.lists(LENGTHS, min_size=1, max_size=MAX_BATCH),
    "layout": st.sampled_from(LAYOUTS),
    "wiring": st.sampled_from(["sharded", "replicated"]),
    "executor": st.sampled_from(["sync", "threads"]),
    "steps": st.integers(1, 2),
})


def _check(reference, case):
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in case["lengths"]]
    tp, dp = case["layout"]
    engine = GraphEngine(TINY, Topology(tp, dp, tp * dp), EngineConfig(seed=0, executor=case["executor"],
                                                                       wiring=case["wiring"],
                                                                       max_batch=MAX_BATCH * dp,
                                                                       max_context=MAX_CONTEXT))
    got = _run(engine, prompts, case["steps"])
    want = _run(reference, prompts, case["steps"])
    for step, (a, r) in enumerate(zip(got, want)):
        assert a.numpy().tobytes() == r.numpy().tobytes(), f"step {step}: logits differ for {case}"


@pytest.mark.timeout(300)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_graph_logits_bytes_equal_reference(reference, case):
    _check(reference, case)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_graph_logits_bytes_equal_reference_many(reference, case):
    _check(reference, case)
