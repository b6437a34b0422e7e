"""Per-node golden check (``python -m dsv41.run --check``): every node's value against the Torch
golden recomputed on that node's actual inputs.

With the Torch backend the value is the kernel's own and every node must pass exactly. With
``--backend pypto-sim`` (``pypto-npu``) the nodes that have a node-level pypto form (``PYPTO_FORMS``)
take their checked value from pypto's pass-verify calculator (the device) on the same inputs; the
run itself continues with the Torch values, as a pypto-sim run does. Float tensors pass within
the seed's per-row bounds (RMS(err) <= 1e-6 + 0.01 RMS(ref), max|err| <= 1e-5 + 0.05 RMS(ref));
integer, boolean and other values must be equal, the router's expert choice up to swaps among
equal scores. The first failing node is saved under ``traces/`` with its inputs and card State so
``python -m dsv41.replay`` reruns it alone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41.kernels.ties import tie_mismatch_rows
from dsv41.kernels.torch_backend import KERNELS
from dsv41.ops import moe
from dsv41.ops.lm_head import select_rows

EFFECTS = ("attn.publish", "cache.commit")   # write caches: running them again would stage twice
RMS_BOUND, MAX_BOUND = 0.01, 0.05
# the pypto worker mode whose values stand for a backend's (its timing mode: pypto.sim.BACKEND_MODES)
VALUE_MODES = {"pypto-sim": "verify", "pypto-npu": "npu"}


# ---- comparing values -------------------------------------------------------------------------------

@dataclass
class Verdict:
    ok: bool = True
    exact: bool = True
    rms_ratio: float = 0.0      # worst row RMS(err) / RMS(ref)
    max_ratio: float = 0.0      # worst row max|err| / RMS(ref)
    why: str = ""

    def merge(self, other: "Verdict", where: str) -> None:
        if not other.ok and self.ok:
            self.why = f"{where}: {other.why}"
        self.ok &= other.ok
        self.exact &= other.exact
        self.rms_ratio = max(self.rms_ratio, other.rms_ratio)
        self.max_ratio = max(self.max_ratio, other.max_ratio)


def rows_verdict(actual: torch.Tensor, ref: torch.Tensor) -> Verdict:
    """The seed's per-row bounds on a float tensor (rows = leading dim)."""
    if actual.shape != ref.shape:
        return Verdict(False, False, why=f"shape {tuple(actual.shape)} != {tuple(ref.shape)}")
    if torch.equal(actual, ref):
        return Verdict()
    a = actual.double().reshape(max(1, ref.shape[0]) if ref.dim() else 1, -1)
    r = ref.double().reshape(a.shape)
    if not torch.isfinite(a).all():
        return Verdict(False, False, float("inf"), float("inf"), "non-finite values")
    err = a - r
    rms_ref = r.pow(2).mean(-1).sqrt()
    rms_err, peak = err.pow(2).mean(-1).sqrt(), err.abs().amax(-1)
    bad = (rms_err > 1e-6 + RMS_BOUND * rms_ref) | (peak > 1e-5 + MAX_BOUND * rms_ref)
    scale = rms_ref.clamp_min(1e-30)
    v = Verdict(not bool(bad.any()), False, float((rms_err / scale).max()), float((peak / scale).max()))
    if not v.ok:
        row = int(torch.nonzero(bad)[0])
        v.why = (f"row {row}: RMS(err)/RMS(ref) = {float(rms_err[row] / scale[row]):.3g}, "
                 f"max|err|/RMS(ref) = {float(peak[row] / scale[row]):.3g}")
    return v


def compare(actual, ref) -> Verdict:
    """Walk two node values of the same structure."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return Verdict(False, False, why=f"{type(actual).__name__} where a tensor was expected")
        if ref.is_floating_point():
            return rows_verdict(actual.float() if actual.dtype != ref.dtype else actual, ref)
        same = actual.shape == ref.shape and torch.equal(actual, ref)
        return Verdict(same, same, why="" if same else "integer/boolean values differ")
    if isinstance(ref, (tuple, list)):
        v = Verdict()
        if not isinstance(actual, (tuple, list)) or len(actual) != len(ref):
            return Verdict(False, False, why="structure differs")
        for i, (a, r) in enumerate(zip(actual, ref)):
            v.merge(compare(a, r), f"[{i}]")
        return v
    if isinstance(ref, dict):
        if not isinstance(actual, dict) or set(actual) != set(ref):
            return Verdict(False, False, why="keys differ")
        v = Verdict()
        for k in ref:
            v.merge(compare(actual[k], ref[k]), f"[{k!r}]")
        return v
    if dataclasses.is_dataclass(ref) and not isinstance(ref, type):
        if type(actual) is not type(ref):
            return Verdict(False, False, why="type differs")
        return compare(vars(actual), vars(ref))
    try:
        same = actual is ref or bool(actual == ref)
    except (RuntimeError, TypeError, ValueError):   # objects holding tensors: not a node value to compare
        same = actual is ref
    return Verdict(bool(same), bool(same), why="" if same else "values differ")


def compare_node(st, node, actual, golden) -> Verdict:
    """compare(), with the router's expert choice tie-aware (selected biased scores may tie)."""
    if node.kernel != "moe.gate":
        return compare(actual, golden)
    x, idx, w = golden
    v = compare(actual[0], x)
    f = f"layers.{node.layer}.ffn.gate."
    biased = moe.router_scores(x, st.weights[f + "weight"]) + st.weights[f + "bias"].float()
    bad = tie_mismatch_rows(actual[1], idx, biased)
    if bad:
        v.merge(Verdict(False, False, why=f"rows {bad[:4]} choose other experts beyond ties"), "[1]")
    same = (actual[1] == idx).all(1)                    # weights align where no tie was swapped
    v.merge(compare(actual[2][same], w[same]), "[2]")
    v.exact &= torch.equal(actual[1], idx)
    return v


# ---- pypto values for nodes that have a node-level pypto form -----------------------------------------

def _norm(st, node, x):
    return "norm.rms", {"x": x, "w": st.weights[node.attrs["weight"]]}, {"eps": st.cfg.rms_norm_eps}, {}, \
        lambda o: o["y"].float()


def _pre(st, node, x, *mixes):
    from dsv41.ops.mhc import initial_pre
    pre = initial_pre(x.shape[0], st.cfg.hc_mult) if node.attrs.get("initial") else mixes[0][0]
    return "hc.pre", {"x_hc": x, "pre": pre}, {}, {}, lambda o: o["y"].float()


def _post(st, node, sub, x, mixes):
    return "hc.post", {"sub": sub, "x_hc": x, "post": mixes[1], "comb": mixes[2]}, {}, {}, \
        lambda o: o["out"].float().reshape(x.shape)


def _gate(st, node, normed):
    x = normed[node.attrs["rows"]]
    return "moe.gate", {"x": x, "w": st.weights[f"layers.{node.layer}.ffn.gate.weight"]}, {}, {}, \
        lambda o: (x, *moe.pick_experts(o["scores"].float(), st.weights[f"layers.{node.layer}.ffn.gate.bias"],
                                         st.cfg.num_experts_per_tok, st.cfg.routed_scaling_factor))


def _head(st, node, hidden, step):
    x = select_rows(hidden, step.md.logit_row_indices)
    return "lm_head.shard", {"x": x, "w": st.weights["head.weight"]}, {}, {"out": "fp32"}, lambda o: o["y"].float()


def _rope_rows(st, node, step):
    md = step.md
    pos = md.position_ids if node.attrs["vector"] == "token" else md.compressed_rope_position_ids[node.attrs["vector"]]
    cos_t, sin_t = st.rope_tables[node.attrs["profile"]]
    return "rope.rows", {"cos_table": cos_t, "sin_table": sin_t, "pos": pos.reshape(-1, 1)}, {}, {}, \
        lambda o: (o["cos"].float(), o["sin"].float())


# node kernel -> (state, node, *args) -> (pypto kernel, inputs, extra shapes, dtypes, outputs -> node value)
PYPTO_FORMS = {"norm.rms": _norm, "norm.final": _norm, "hc.pre": _pre, "hc.head": _pre,
               "hc.post": _post, "moe.gate": _gate, "lm_head.shard": _head, "rope.rows": _rope_rows}
# pypto kernels with no node-level form: MX (FP8/FP4) linears are simulated as BF16 matmuls (pypto 0.2.0
# has no FP8 matmul), and the attention leaf is a chain of per-tile kernels
NO_NODE_FORM = {"attn.q_proj": "MX linears simulated as BF16", "attn.kv_proj": "MX linears simulated as BF16",
                "attn.o_proj": "MX linears simulated as BF16", "moe.experts": "FP4 experts simulated as BF16",
                "moe.shared": "MX linears simulated as BF16", "attn.leaf.*": "per-tile kernels (qk, softmax, pv)"}


def pypto_value(mode: str, st, node, args, memo: dict | None = None):
    """The node's value computed by pypto (mode "verify": the calculator; "npu": the device)."""
    from dsv41.kernels.pypto.sim import worker
    from dsv41.kernels.pypto.specs import PYPTO_KERNELS

    kernel, inputs, extra, dtypes, to_value = PYPTO_FORMS[node.kernel](st, node, *args)
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
    goldens: dict = field(default_factory=lambda: dict(KERNELS))   # snapshot: the reference arithmetic
    rows: dict = field(default_factory=dict)
    first_failure: dict | None = None
    _memo: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pypto_mode(self) -> str | None:
        return VALUE_MODES.get(self.backend)

    def __call__(self, st, node, args, value):
        if node.kernel in EFFECTS:
            return
        source = "torch"
        if self.pypto_mode and node.kernel in PYPTO_FORMS:
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
            for k, why in NO_NODE_FORM.items():
                lines.append(f"{k:<22} torch  (no node-level pypto form: {why})")
        if self.first_failure:
            f = self.first_failure
            lines.append(f"first failure: {f['node']} ({f['kernel']}): {f['why']}")
            lines.append(f"  replay: python -m dsv41.replay {f['trace']}")
        else:
            lines.append("every node passed")
        return "\n".join(lines)

    def summary(self) -> dict:
        return {"kernels": {k: vars(r) for k, r in sorted(self.rows.items())}, "first_failure": self.first_failure}
