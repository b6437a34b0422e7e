"""Every graph node kind, by kernel name: ``KINDS[node.kernel]`` is its ``record.NodeKind``.

A new node kind is one record in its subject's module under ``kernels/nodes/`` (plus its builder
call in ``graph/build.py``)."""
from __future__ import annotations

from dsv41.kernels.nodes import attention, boundary, dspark, head, hyper, moe, transport
from dsv41.kernels.record import NodeKind


def _index(*modules) -> dict[str, NodeKind]:
    kinds = {}
    for module in modules:
        for kind in module.RECORDS:
            if kind.name in kinds:
                raise ValueError(f"node kind {kind.name!r} has two records ({module.__name__} and another)")
            kinds[kind.name] = kind
    return kinds


KINDS: dict[str, NodeKind] = _index(boundary, hyper, transport, attention, moe, head, dspark)
