"""What a dask task runs: a submission's nodes, in order, against its card's State.

Failures are re-raised as NodeError naming the node, so a failed step says where it broke.
"""
from __future__ import annotations

from dsv41.cluster import state as card_state
from dsv41.kernels.torch_backend import KERNELS


class NodeError(RuntimeError):
    pass


class Hooks:
    """Process-wide run hooks: fault injection for tests, span recording for traces, simulated
    device time per node (``--backend pypto-sim``), logged per node key for the step summary."""
    fail_at: str | None = None
    tracer = None
    device_time = None                       # (state, node, args) -> µs or None
    sim_log: dict[str, tuple[int, str, float]] = {}   # node key -> (card, kernel, µs)
    check = None                             # (state, node, args, value) -> None, after each node (--check)


def run_node(node, values: dict):
    st = card_state.STATES[node.card]
    args = [values[i] for i in node.inputs]
    try:
        if Hooks.fail_at == node.key:
            raise RuntimeError("injected failure")
        sim_us = None
        if Hooks.device_time is not None:  # asked before the kernel so its cost stays outside the span
            sim_us = Hooks.device_time(st, node, args)
            if sim_us is not None:
                Hooks.sim_log[node.key] = (node.card, node.kernel, sim_us)
        if Hooks.tracer is not None:
            value = Hooks.tracer.run(st, node, KERNELS[node.kernel], args, sim_us)
        else:
            value = KERNELS[node.kernel](st, node, *args)
        if Hooks.check is not None:
            Hooks.check(st, node, args, value)
        return value
    except NodeError:
        raise
    except Exception as e:
        raise NodeError(f"node {node.key} (kernel {node.kernel}, card {node.card}) failed: {e}") from e


def run_one(node, *input_values):
    """One node as a plain dask task (``Graph.to_dask(run_one)``)."""
    return run_node(node, dict(zip(node.inputs, input_values)))


def run_submission(sub, *dep_values):
    """dep_values align with sub.deps: dicts of exported values (submissions) or literal values."""
    values = {}
    for dep, v in zip(sub.deps, dep_values):
        if dep in sub.literals:
            values[dep] = v
        else:
            values.update(v)
    if Hooks.tracer is not None:
        Hooks.tracer.begin_submission(sub)
    try:
        for node in sub.nodes:
            values[node.key] = run_node(node, values)
    finally:
        if Hooks.tracer is not None:
            Hooks.tracer.end_submission(sub)
    return {k: values[k] for k in sub.exports}
