"""The modes of ``python -m dsv41.run`` (``--plan`` or an ``--executor``) and the values that follow
from the mode: the cards, the DP groups, the context a request reaches."""
from __future__ import annotations

from dsv41.config import Topology
from dsv41.names import GRAPH_EXECUTORS, LOCAL_EXECUTORS, REFERENCE

PLAN = "plan"
EXECUTOR_ORDER = (REFERENCE,) + GRAPH_EXECUTORS          # the order messages list them in
GRAPH = frozenset(GRAPH_EXECUTORS)
LOCAL = frozenset(LOCAL_EXECUTORS)
RUN = GRAPH | {REFERENCE}
ALL = RUN | {PLAN}
DIST = GRAPH - LOCAL
GRAPH_OR_PLAN = GRAPH | {PLAN}


def mode(a) -> str:
    return PLAN if a.plan else a.executor


def mode_flag(m: str) -> str:
    return "--plan" if m == PLAN else f"--executor {m}"


def topology(a) -> Topology:
    """The cards of the run or plan; the reference is one card holding the whole model."""
    return Topology(1, 1, 1) if mode(a) == REFERENCE else Topology(a.tp, a.dp, a.ep)


def groups(a) -> int:
    """DP groups the run's requests are spread over (the reference is one group)."""
    return 1 if mode(a) == REFERENCE else a.dp


def per_group(a) -> int:
    return -(-a.batch // groups(a))


def max_context(a) -> int:
    """Tokens a request of the run reaches: its drawn context (--context), its prompt, the generated
    tokens and one spare row."""
    return (a.context or 0) + a.prompt_len + (a.new_tokens if a.graph == "decode" else 0) + 1
