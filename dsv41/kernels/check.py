"""Per-node golden check (``python -m dsv41.run --check``): every node's value against the Torch
golden recomputed on that node's actual inputs.

With the Torch backend the value is the kernel's own and every node must pass exactly. With
``--backend pypto-sim`` (``pypto-npu``) the nodes whose record has a node-level pypto form (``NodeKind.pypto``)
take their checked value from pypto's pass-verify calculator (the device) on the same inputs, for
the first ``pypto_per_shape`` nodes of each kernel and shape (all of them with 0); the run itself
continues with the Torch values, as a pypto-sim run does. Float tensors pass within
the seed's per-row bounds (RMS(err) <= 1e-6 + 0.01 RMS(ref), max|err| <= 1e-5 + 0.05 RMS(ref));
integer, boolean and other values must be equal, the router's expert choice up to swaps among
equal scores. The first failing node is saved under ``traces/`` with its inputs and card State so
``python -m dsv41.replay`` reruns it alone.
"""
from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41.kernels.kinds import KINDS
from dsv41.kernels.verdict import Verdict, compare
from dsv41.outputs import open_output

# the pypto worker mode whose values stand for a backend's (its timing mode: pypto.sim.BACKEND_MODES)
VALUE_MODES = {"pypto-sim": "verify", "pypto-npu": "npu"}


def compare_node(st, node, actual, golden) -> Verdict:
    """compare(), or the node kind's own comparison where it has one."""
    own = KINDS[node.kernel].compare
    return compare(actual, golden) if own is None else own(st, node, actual, golden)


# ---- pypto values for nodes whose record has a node-level pypto form ----------------------------------

def pypto_request(st, node, args) -> tuple:
    """(kernel, shapes, dtypes, layout, to_value): the node's pypto call, normalized."""
    from dsv41.kernels.pypto.specs import PYPTO_KERNELS

    kernel, inputs, extra, dtypes, to_value = KINDS[node.kernel].pypto(st, node, *args)
    spec = PYPTO_KERNELS[kernel]
    s, d = spec.normalize({**spec.infer(inputs), **extra}, dtypes)
    return kernel, s, d, spec.to_layout(inputs, s, d), to_value


def shape_key(kernel: str, shapes: dict, dtypes: dict) -> tuple:
    return kernel, tuple(sorted(shapes.items())), tuple(sorted(dtypes.items()))


def pypto_value(mode: str, st, node, args, memo: dict | None = None, request: tuple | None = None):
    """The node's value computed by pypto (mode "verify": the calculator; "npu": the device)."""
    from dsv41.kernels.pypto.sim import worker

    kernel, s, d, layout, to_value = request or pypto_request(st, node, args)
    key = (shape_key(kernel, s, d),
           hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in layout)).hexdigest())
    if memo is not None and key in memo:
        return to_value(memo[key])
    reply = worker(mode).run(kernel, s, d, layout)
    if not reply.get("ok"):
        raise RuntimeError(f"pypto {kernel} failed for node {node.key}: {reply.get('error')}")
    if memo is not None:
        memo[key] = reply["outputs"]
    return to_value(reply["outputs"])


# ---- the check --------------------------------------------------------------------------------------

@dataclass
class KernelRow:
    nodes: int = 0
    exact: int = 0
    failures: int = 0
    rms_ratio: float = 0.0
    max_ratio: float = 0.0
    source: str = "torch"
    pypto_nodes: int = 0   # nodes whose checked value pypto computed (the rest: their Torch value)


@dataclass
class NodeCheck:
    """One run's check: called after every node (``GraphEngine.check_nodes``), thread-safe."""
    backend: str = "torch"
    # pypto's value for the first N nodes of each (kernel, shapes, dtypes), the Torch value for the
    # rest; 0 = every node. A pass-verify call compiles the kernel (~1-2 s on this CPU): every node
    # of an 8-step TINY decode is ~9,000 calls, hours; its ~30 distinct shapes are a minute.
    pypto_per_shape: int = 2
    trace_dir: Path = Path("traces")
    # a snapshot of the Torch kernels: the reference arithmetic, whatever a test swaps into KINDS later
    goldens: dict = field(default_factory=lambda: {k: r.run for k, r in KINDS.items()})
    rows: dict = field(default_factory=dict)
    first_failure: dict | None = None
    _memo: dict = field(default_factory=dict)
    _shapes_seen: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pypto_mode(self) -> str | None:
        return VALUE_MODES.get(self.backend)

    def __call__(self, st, node, args, value):
        kind = KINDS[node.kernel]
        if kind.effects:
            return
        by_pypto = False
        if self.pypto_mode and kind.pypto is not None:
            with self._lock:
                request = pypto_request(st, node, args)
                shape = (node.kernel, shape_key(*request[:3]))   # node kinds may share a pypto kernel
                seen = self._shapes_seen.get(shape, 0)
                if by_pypto := (not self.pypto_per_shape or seen < self.pypto_per_shape):
                    self._shapes_seen[shape] = seen + 1
                    value = pypto_value(self.pypto_mode, st, node, args, self._memo, request)
        golden = self.goldens[node.kernel](st, node, *args)
        verdict = compare_node(st, node, value, golden)
        with self._lock:
            source = "pypto" if self.pypto_mode and kind.pypto is not None else "torch"
            row = self.rows.setdefault(node.kernel, KernelRow(source=source))
            row.nodes += 1
            row.pypto_nodes += by_pypto
            row.exact += verdict.exact
            row.rms_ratio = max(row.rms_ratio, verdict.rms_ratio)
            row.max_ratio = max(row.max_ratio, verdict.max_ratio)
            if not verdict.ok:
                row.failures += 1
                if self.first_failure is None:
                    source = "pypto" if by_pypto else "torch"
                    self.first_failure = {"node": node.key, "kernel": node.kernel, "why": verdict.why,
                                          "trace": str(self.save(st, node, args, value, source))}

    def save(self, st, node, args, value, source: str) -> Path:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"check-{re.sub(r'[^A-Za-z0-9_.-]+', '_', node.key)}.pt"
        caches = {name: tuple(t.clone() for t in st.caches.read(name)) for name in st.caches.committed}
        with open_output(path, binary=True) as f:
            torch.save({"node": node, "args": args, "actual": value, "source": source, "backend": self.backend,
                        "state": {"cfg": st.cfg, "topo": st.topo, "card": st.card, "options": st.options,
                                  "weights": st.weights, "caches": caches,
                                  "rope_tables": st.rope_tables}}, f)
        return path

    def table(self) -> str:
        lines = [f"{'kernel':<22} {'values':<6} {'nodes':>6} {'by pypto':>8} {'exact':>6} {'worst RMS ratio':>16} "
                 f"{'worst max ratio':>16} {'failures':>8}"]
        for k in sorted(self.rows):
            r = self.rows[k]
            lines.append(f"{k:<22} {r.source:<6} {r.nodes:>6} {r.pypto_nodes:>8} {r.exact:>6} {r.rms_ratio:>16.3g} "
                         f"{r.max_ratio:>16.3g} {r.failures:>8}")
        if self.pypto_mode:
            if self.pypto_per_shape:
                lines.append(f"pypto computed the first {self.pypto_per_shape} node(s) of each kernel and shape; "
                             "the rest were checked on their Torch values (--pypto-per-shape 0: every node)")
            for k, kind in KINDS.items():
                if kind.no_pypto:
                    lines.append(f"{k:<22} torch  (no node-level pypto form: {kind.no_pypto})")
        if self.first_failure:
            f = self.first_failure
            lines.append(f"first failure: {f['node']} ({f['kernel']}): {f['why']}")
            lines.append(f"  replay: python -m dsv41.replay {f['trace']}")
        else:
            lines.append("every node passed")
        return "\n".join(lines)

    def summary(self) -> dict:
        return {"kernels": {k: vars(r) for k, r in sorted(self.rows.items())}, "first_failure": self.first_failure}
