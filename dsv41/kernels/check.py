"""Per-node golden check (``python -m dsv41.run --check``): every node's value against the Torch
golden recomputed on that node's actual inputs.

With the Torch backend the value is the kernel's own and every node must pass exactly. With
``--backend pypto-sim`` (``pypto-npu``) the nodes whose record has a node-level pypto form (``NodeKind.pypto``)
take their checked value from pypto's pass-verify calculator (the device) on the same inputs; the
run itself continues with the Torch values, as a pypto-sim run does. Float tensors pass within
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

# the pypto worker mode whose values stand for a backend's (its timing mode: pypto.sim.BACKEND_MODES)
VALUE_MODES = {"pypto-sim": "verify", "pypto-npu": "npu"}


def compare_node(st, node, actual, golden) -> Verdict:
    """compare(), or the node kind's own comparison where it has one."""
    own = KINDS[node.kernel].compare
    return compare(actual, golden) if own is None else own(st, node, actual, golden)


# ---- pypto values for nodes whose record has a node-level pypto form ----------------------------------

def pypto_value(mode: str, st, node, args, memo: dict | None = None):
    """The node's value computed by pypto (mode "verify": the calculator; "npu": the device)."""
    from dsv41.kernels.pypto.sim import worker
    from dsv41.kernels.pypto.specs import PYPTO_KERNELS

    kernel, inputs, extra, dtypes, to_value = KINDS[node.kernel].pypto(st, node, *args)
    spec = PYPTO_KERNELS[kernel]
    s, d = spec.normalize({**spec.infer(inputs), **extra}, dtypes)
    layout = spec.to_layout(inputs, s, d)
    key = (kernel, tuple(sorted(s.items())), tuple(sorted(d.items())),
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


@dataclass
class NodeCheck:
    """One run's check: called after every node (``GraphEngine.check_nodes``), thread-safe."""
    backend: str = "torch"
    trace_dir: Path = Path("traces")
    # a snapshot of the Torch kernels: the reference arithmetic, whatever a test swaps into KINDS later
    goldens: dict = field(default_factory=lambda: {k: r.run for k, r in KINDS.items()})
    rows: dict = field(default_factory=dict)
    first_failure: dict | None = None
    _memo: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pypto_mode(self) -> str | None:
        return VALUE_MODES.get(self.backend)

    def __call__(self, st, node, args, value):
        kind = KINDS[node.kernel]
        if kind.effects:
            return
        source = "torch"
        if self.pypto_mode and kind.pypto is not None:
            with self._lock:
                value = pypto_value(self.pypto_mode, st, node, args, self._memo)
            source = "pypto"
        golden = self.goldens[node.kernel](st, node, *args)
        verdict = compare_node(st, node, value, golden)
        with self._lock:
            row = self.rows.setdefault(node.kernel, KernelRow(source=source))
            row.nodes += 1
            row.exact += verdict.exact
            row.rms_ratio = max(row.rms_ratio, verdict.rms_ratio)
            row.max_ratio = max(row.max_ratio, verdict.max_ratio)
            if not verdict.ok:
                row.failures += 1
                if self.first_failure is None:
                    self.first_failure = {"node": node.key, "kernel": node.kernel, "why": verdict.why,
                                          "trace": str(self.save(st, node, args, value, source))}

    def save(self, st, node, args, value, source: str) -> Path:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"check-{re.sub(r'[^A-Za-z0-9_.-]+', '_', node.key)}.pt"
        caches = {name: tuple(t.clone() for t in st.caches.read(name)) for name in st.caches.committed}
        torch.save({"node": node, "args": args, "actual": value, "source": source, "backend": self.backend,
                    "state": {"cfg": st.cfg, "topo": st.topo, "card": st.card, "options": st.options,
                              "weights": st.weights, "caches": caches,
                              "rope_tables": st.rope_tables}}, path)
        return path

    def table(self) -> str:
        lines = [f"{'kernel':<22} {'values':<6} {'nodes':>6} {'exact':>6} {'worst RMS ratio':>16} "
                 f"{'worst max ratio':>16} {'failures':>8}"]
        for k in sorted(self.rows):
            r = self.rows[k]
            lines.append(f"{k:<22} {r.source:<6} {r.nodes:>6} {r.exact:>6} {r.rms_ratio:>16.3g} {r.max_ratio:>16.3g} "
                         f"{r.failures:>8}")
        if self.pypto_mode:
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
