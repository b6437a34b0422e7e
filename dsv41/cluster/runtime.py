"""What a dask task runs: a submission's nodes, in order, against its card's State.

A submission names its engine and the State it expects (build id, generation); the State is looked
up in this process's registry under that engine, and a missing or different one raises
``StateLost`` before any node runs, so a restarted worker's empty caches are never computed through.
Node failures are re-raised as NodeError naming the node, so a failed step says where it broke.
"""
from __future__ import annotations

import logging

from dsv41.cluster import registry
from dsv41.cluster.registry import StateLost
from dsv41.kernels.kinds import KINDS
from dsv41.model.finite import ConstantLogitsError, NonFiniteError


class NodeError(RuntimeError):
    pass


class _QuietNonFinite(logging.Filter):
    """dask's worker logs every task that raises, traceback and all, at ERROR; a NonFiniteError is
    the step's answer (the engine names the step and the command line prints one line), not a fault
    of the worker."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f"{kind.__name__}(" in message for kind in (NonFiniteError, ConstantLogitsError))


logging.getLogger("distributed.worker").addFilter(_QuietNonFinite())


def card_state(sub):
    """The State this submission expects, or StateLost."""
    entry = registry.find(sub.engine)
    st = None if entry is None else entry.states.get(sub.card)
    if st is None:
        raise StateLost([sub.card], f"no State of engine {sub.engine} in this process")
    if (st.build, st.generation) != sub.expect:
        raise StateLost([sub.card], f"State is build {st.build} at generation {st.generation}, the step expects "
                                    f"build {sub.expect[0]} at generation {sub.expect[1]}")
    return entry, st


def run_node(st, hooks, node, values: dict):
    args = [values[i] for i in node.inputs]
    try:
        if hooks.fail_at == node.key:
            hooks.fail_at = None
            raise RuntimeError("injected failure")
        sim_us = None
        if hooks.device_time is not None:  # asked before the kernel so its cost stays outside the span
            sim_us = hooks.device_time(st, node, args)
            if sim_us is not None:
                hooks.sim_log[node.key] = (node.card, node.kernel, sim_us)
        if hooks.tracer is not None:
            value = hooks.tracer.run(st, node, KINDS[node.kernel].run, args, sim_us)
        else:
            value = KINDS[node.kernel].run(st, node, *args)
        if hooks.check is not None:
            hooks.check(st, node, args, value)
        return value
    except (NodeError, NonFiniteError):   # a NaN/Inf step names its own place (the engine adds the step)
        raise
    except Exception as e:
        raise NodeError(f"node {node.key} (kernel {node.kernel}, card {node.card}) failed: {e}") from e


def run_submission(sub, *dep_values):
    """dep_values align with sub.deps: dicts of exported values (submissions) or literal values."""
    entry, st = card_state(sub)
    entry.enter(sub.step)
    try:
        values = {}
        for dep, v in zip(sub.deps, dep_values):
            if dep in sub.literals:
                values[dep] = v
            else:
                values.update(v)
        hooks = entry.hooks
        if hooks.tracer is not None:
            hooks.tracer.begin_submission(sub, st)
        try:
            for node in sub.nodes:
                values[node.key] = run_node(st, hooks, node, values)
        finally:
            if hooks.tracer is not None:
                hooks.tracer.end_submission(sub)
        return {k: values[k] for k in sub.exports}
    finally:
        entry.leave()
