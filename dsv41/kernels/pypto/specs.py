"""The Torch side of each PyPTO kernel: argument layout, derived index tables, example inputs, golden.

A kernel's arguments are 1-D to 3-D tensors in the order the jit function takes them, lanes and heads
flattened into 2-D where the kernel works on rows; callers may pass the model's natural shapes
([T, hc, D], [T, H, dim], [D]) and ``to_layout`` reshapes them.
No pypto import here: the parent process builds keys, inputs and goldens without paying for it.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from dsv41.ops.mhc import hc_post, hc_pre
from dsv41.ops.norm import rms_norm
from dsv41.ops.projections import dense_linear
from dsv41.ops.quant import round_bf16
from dsv41.ops.rope import apply_rope, gather_rope_rows

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32,
                "int8": torch.int8}


@dataclass(frozen=True)
class Arg:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "in" (caller data), "const" (derived from shapes), "out"


@dataclass(frozen=True)
class KernelSpec:
    """Calling a spec is the kernel factory: ``spec(shapes, dtypes, run_mode)`` -> a pypto jit function."""
    name: str
    factory: str                                  # function name in pypto_kernels (imported lazily)
    shape_keys: tuple[str, ...]
    layout: Callable[[dict, dict], list[Arg]]
    golden: Callable[[dict, dict, dict], dict]    # (inputs in layout, shapes, dtypes) -> outputs, FP32
    example: dict                                 # small shapes for verification
    infer: Callable[[dict], dict]                 # shapes from natural-shaped inputs
    defaults: dict = field(default_factory=dict)  # optional shape keys (eps, ...)
    dtypes: dict = field(default_factory=dict)    # dtype knobs and their defaults
    consts: Callable[[dict], dict] = lambda s: {}
    # a batch dim whose whole call is too big to simulate in one worker (sim.sliced_time_us prices it
    # from two slices); "" for none. The spec then has a "group" shape key: the slices' tile choice.
    sliced: str = ""
    rev: int = 1  # bump when a layout here changes; pypto_kernels code changes re-key by themselves

    def __call__(self, shapes: dict, dtypes: dict | None = None, run_mode: str = "sim"):
        from dsv41.kernels.pypto import kernels as pypto_kernels
        s, d = self.normalize(shapes, dtypes)
        return getattr(pypto_kernels, self.factory)(s, d, run_mode)

    def normalize(self, shapes: dict, dtypes=None) -> tuple[dict, dict]:
        missing = [k for k in self.shape_keys if k not in shapes]
        unknown = set(shapes) - set(self.shape_keys) - set(self.defaults)
        if missing or unknown:
            raise ValueError(f"{self.name}: shapes need {list(self.shape_keys)} (optional "
                             f"{sorted(self.defaults)}); missing {missing}, unknown {sorted(unknown)}")
        s = {**self.defaults, **shapes}
        for k in self.shape_keys:
            if not isinstance(s[k], int) or s[k] < 1:
                raise ValueError(f"{self.name}: shapes[{k!r}] must be a positive int, got {s[k]!r}")
        if isinstance(dtypes, str):
            dtypes = {next(iter(self.dtypes)): dtypes} if self.dtypes else {}
        bad = set(dtypes or {}) - set(self.dtypes)
        if bad:
            raise ValueError(f"{self.name}: dtype knobs are {sorted(self.dtypes)}, got {sorted(bad)}")
        d = {**self.dtypes, **(dtypes or {})}
        for k, v in d.items():
            if v not in TORCH_DTYPES:
                raise ValueError(f"{self.name}: dtypes[{k!r}] must be one of {sorted(TORCH_DTYPES)}, got {v!r}")
        return s, d

    def args(self, shapes: dict, dtypes=None) -> list[Arg]:
        return self.layout(*self.normalize(shapes, dtypes))

    def to_layout(self, inputs: dict, shapes: dict, dtypes=None) -> list[torch.Tensor]:
        """All arguments in call order: caller inputs reshaped/cast, derived tables, zeroed outputs."""
        s, _ = self.normalize(shapes, dtypes)
        consts = self.consts(s)
        out = []
        for a in self.args(shapes, dtypes):
            if a.kind == "out":
                out.append(torch.zeros(a.shape, dtype=TORCH_DTYPES[a.dtype]))
            else:
                t = consts[a.name] if a.kind == "const" else inputs[a.name]
                out.append(t.reshape(a.shape).to(TORCH_DTYPES[a.dtype]).contiguous())
        return out

    def random_inputs(self, shapes: dict, dtypes=None, seed: int = 0) -> dict:
        g = torch.Generator().manual_seed(seed)
        s, _ = self.normalize(shapes, dtypes)
        out = {}
        for a in self.args(shapes, dtypes):
            if a.kind != "in":
                continue
            if a.name == "pos":  # valid rows, an identity row (-1) and the last table row
                p = torch.randint(0, s["C"], a.shape, generator=g, dtype=torch.int32)
                n = min(2, p.numel())
                p.view(-1)[:n] = torch.tensor([-1, s["C"] - 1], dtype=torch.int32)[:n]
                out[a.name] = p
            elif a.name in ("pre", "post", "comb", "weight", "probs"):
                out[a.name] = torch.rand(a.shape, generator=g)
            elif a.dtype == "int8":
                out[a.name] = torch.randint(-127, 128, a.shape, generator=g, dtype=torch.int8)
            elif a.name in ("s1", "s2", "s3"):  # per-channel weight scales, the size of absmax / 127
                out[a.name] = torch.rand(a.shape, generator=g) * 0.02 + 1e-3
            else:
                x = torch.randn(a.shape, generator=g)
                out[a.name] = x.to(TORCH_DTYPES[a.dtype]) if a.dtype != "fp32" else round_bf16(x)
        return out


def _out(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return t.to(TORCH_DTYPES[dtype]).float()


# ---- per-kernel layouts and goldens ------------------------------------------------------------

def _norm_layout(s, d):
    return [Arg("x", (s["T"], s["D"]), d["act"], "in"), Arg("w", (1, s["D"]), d["w"], "in"),
            Arg("y", (s["T"], s["D"]), d["act"], "out")]


def _norm_golden(i, s, d):
    return {"y": _out(rms_norm(i["x"], i["w"].view(-1), s["eps"]), d["act"])}


def _rows_layout(s, d):
    c, t, h = s["C"], s["T"], s["half"]
    return [Arg("cos_table", (c, h), "fp32", "in"), Arg("sin_table", (c, h), "fp32", "in"),
            Arg("pos", (t, 1), "int32", "in"), Arg("cos", (t, h), "fp32", "out"), Arg("sin", (t, h), "fp32", "out")]


def _rows_golden(i, s, d):
    cos, sin = gather_rope_rows(i["cos_table"], i["sin_table"], i["pos"].view(-1))
    return {"cos": cos, "sin": sin}


def _rope_layout(s, d):
    t, h, dim, half = s["T"], s["H"], s["dim"], s["half"]
    return [Arg("x", (t * h, dim), d["act"], "in"), Arg("cos", (t, half), "fp32", "in"),
            Arg("sin", (t, half), "fp32", "in"), Arg("row", (t * h,), "int32", "const"),
            Arg("rep", (2 * half,), "int32", "const"), Arg("swap", (2 * half,), "int32", "const"),
            Arg("sign", (1, 2 * half), "fp32", "const"), Arg("y", (t * h, dim), d["act"], "out")]


def _rope_consts(s):
    """Index tables that turn pair rotation into gathers: row t of each head, cos/sin column per lane,
    the (2i, 2i+1) swap and the -sin/+sin sign (+sin/-sin for the inverse rotation)."""
    half, w = s["half"], 2 * s["half"]
    first = 1.0 if s["inverse"] else -1.0
    return {"row": torch.arange(s["T"], dtype=torch.int32).repeat_interleave(s["H"]),
            "rep": torch.arange(half, dtype=torch.int32).repeat_interleave(2),
            "swap": torch.arange(w, dtype=torch.int32).view(half, 2).flip(-1).reshape(w),
            "sign": torch.tensor([first, -first]).repeat(half).view(1, w)}


def _rope_golden(i, s, d):
    x = i["x"].view(s["T"], s["H"], s["dim"])
    return {"y": _out(apply_rope(x.float(), i["cos"], i["sin"], inverse=bool(s["inverse"])), d["act"]).view(s["T"] * s["H"], s["dim"])}


def _hc_pre_layout(s, d):
    t, hc, dd = s["T"], s["hc"], s["D"]
    return [Arg("x_hc", (t, hc * dd), "fp32", "in"), Arg("pre", (t, hc), "fp32", "in"),
            Arg("y", (t, dd), d["act"], "out")]


def _hc_pre_golden(i, s, d):
    return {"y": _out(hc_pre(i["x_hc"].view(s["T"], s["hc"], s["D"]), i["pre"]), d["act"])}


def _hc_post_layout(s, d):
    t, hc, dd = s["T"], s["hc"], s["D"]
    return [Arg("sub", (t, dd), d["act"], "in"), Arg("x_hc", (t, hc * dd), "fp32", "in"),
            Arg("post", (t, hc), "fp32", "in"), Arg("comb", (t, hc * hc), "fp32", "in"),
            Arg("out", (t, hc * dd), "fp32", "out")]


def _hc_post_golden(i, s, d):
    t, hc, dd = s["T"], s["hc"], s["D"]
    y = hc_post(i["sub"].float(), i["x_hc"].view(t, hc, dd), i["post"], i["comb"].view(t, hc, hc))
    return {"out": y.reshape(t, hc * dd)}


def _mm_layout(s, d):
    return [Arg("x", (s["M"], s["K"]), d["act"], "in"), Arg("w", (s["N"], s["K"]), d["w"], "in"),
            Arg("y", (s["M"], s["N"]), d["out"], "out")]


def _mm_golden(i, s, d):
    return {"y": _out(dense_linear(i["x"], i["w"]), d["out"])}


def _gate_layout(s, d):
    return [Arg("x", (s["T"], s["D"]), d["act"], "in"), Arg("w", (s["E"], s["D"]), d["w"], "in"),
            Arg("scores", (s["T"], s["E"]), "fp32", "out")]


def _gate_golden(i, s, d):
    # the scoring line of dsv41.ops.moe.route; the top-k and bias stay in Torch
    return {"scores": torch.sqrt(F.softplus(i["x"].float() @ i["w"].float().t()))}


def _softmax_layout(s, d):
    return [Arg("scores", (s["R"], s["K"]), "fp32", "in"), Arg("probs", (s["R"], s["K"]), d["out"], "out")]


def _softmax_golden(i, s, d):
    return {"probs": _out(torch.softmax(i["scores"].float(), -1), d["out"])}


def _qk_layout(s, d):
    t, h, k, dd = s["T"], s["H"], s["K"], s["d"]
    return [Arg("q", (t, h, dd), d["act"], "in"), Arg("keys", (t, k, dd), d["act"], "in"),
            Arg("logits", (t, h, k), "fp32", "out")]


def _qk_golden(i, s, d):
    return {"logits": torch.einsum("thd,tkd->thk", i["q"].float(), i["keys"].float()) * s["scale"]}


def _pv_layout(s, d):
    t, h, k, dd = s["T"], s["H"], s["K"], s["d"]
    return [Arg("probs", (t, h, k), d["act"], "in"), Arg("values", (t, k, dd), d["act"], "in"),
            Arg("out", (t, h, dd), "fp32", "out")]


def _pv_golden(i, s, d):
    # the PV product of dsv41.ops.attention.sparse_attention for one tile (probabilities already BF16)
    return {"out": torch.einsum("thk,tkd->thd", i["probs"].float(), i["values"].float())}


def _experts_layout(s, d):
    g, t, dd, n, w = s["G"], s["T"], s["D"], s["I"], d["w"]
    scales = [Arg("s1", (g, 1, n), "fp32", "in"), Arg("s3", (g, 1, n), "fp32", "in"),
              Arg("s2", (g, 1, dd), "fp32", "in")] if w == "int8" else []
    return [Arg("x", (g, t, dd), d["act"], "in"), Arg("w1", (g, n, dd), w, "in"), Arg("w3", (g, n, dd), w, "in"),
            Arg("w2", (g, dd, n), w, "in"), *scales, Arg("weight", (g, t, 1), "fp32", "in"),
            Arg("y", (g, t, dd), d["act"], "out")]


def _quant_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 per row by absmax (round half to even), as the kernel's vector side does: (q as int64, scale)."""
    scale = v.abs().amax(-1, keepdim=True) * (1.0 / 127) + 1e-30
    return torch.round(v / scale).long(), scale


def _experts_golden(i, s, d):
    """dsv41.ops.moe.expert's SwiGLU with dense linears in place of the MX ones: BF16 weights, or W8A8
    (INT8 weights and per-channel scales, INT8 activations per row; exact integer products like the
    cube's INT32)."""
    lim = s["limit"]
    if d["w"] != "int8":
        x = i["x"].float()
        g = round_bf16(x @ i["w1"].float().transpose(1, 2)).clamp(max=lim)
        u = round_bf16(x @ i["w3"].float().transpose(1, 2)).clamp(-lim, lim)
        h = F.silu(g) * u * i["weight"]
        return {"y": _out(round_bf16(h) @ i["w2"].float().transpose(1, 2), d["act"])}
    xq, xs = _quant_rows(i["x"].float())
    g = (torch.matmul(xq, i["w1"].long().transpose(1, 2)).float() * xs * i["s1"]).clamp(max=lim)
    u = (torch.matmul(xq, i["w3"].long().transpose(1, 2)).float() * xs * i["s3"]).clamp(-lim, lim)
    h = g * torch.sigmoid(g) * u * i["weight"]
    hq, hs = _quant_rows(h)
    return {"y": _out(torch.matmul(hq, i["w2"].long().transpose(1, 2)).float() * hs * i["s2"], d["act"])}


def _experts_spec(name: str, weights: str) -> KernelSpec:
    return KernelSpec(name, "moe_experts", ("G", "T", "D", "I"), _experts_layout, _experts_golden,
                      dict(G=2, T=16, D=128, I=64),
                      lambda i: dict(G=i["x"].shape[0], T=i["x"].shape[1], D=i["x"].shape[2], I=i["w1"].shape[1]),
                      defaults={"limit": 10.0, "group": 0}, dtypes={"act": "bf16", "w": weights}, sliced="G", rev=2)


def _mm_spec(name: str, example: dict) -> KernelSpec:
    return KernelSpec(name, "matmul", ("M", "K", "N"), _mm_layout, _mm_golden, example,
                      lambda i: dict(M=i["x"].shape[0], K=i["x"].shape[1], N=i["w"].shape[0]),
                      dtypes={"act": "bf16", "w": "bf16", "out": "bf16"})


def _specs() -> dict[str, KernelSpec]:
    specs = [
        KernelSpec("norm.rms", "rms_norm", ("T", "D"), _norm_layout, _norm_golden, dict(T=48, D=256),
                   lambda i: dict(T=i["x"].shape[0], D=i["x"].shape[-1]),
                   defaults={"eps": 1e-20}, dtypes={"act": "bf16", "w": "bf16"}),
        KernelSpec("rope.rows", "rope_rows", ("T", "C", "half"), _rows_layout, _rows_golden,
                   dict(T=48, C=4096, half=8),
                   lambda i: dict(T=i["pos"].numel(), C=i["cos_table"].shape[0], half=i["cos_table"].shape[1])),
        KernelSpec("rope.apply", "rope_apply", ("T", "H", "dim", "half"), _rope_layout, _rope_golden,
                   dict(T=48, H=8, dim=64, half=8),
                   lambda i: dict(T=i["x"].shape[0], H=i["x"].shape[1], dim=i["x"].shape[2], half=i["cos"].shape[1]),
                   defaults={"inverse": 0}, dtypes={"act": "bf16"}, consts=_rope_consts),
        KernelSpec("hc.pre", "hc_pre", ("T", "hc", "D"), _hc_pre_layout, _hc_pre_golden, dict(T=48, hc=4, D=256),
                   lambda i: dict(T=i["x_hc"].shape[0], hc=i["x_hc"].shape[1], D=i["x_hc"].shape[2]),
                   dtypes={"act": "bf16"}),
        KernelSpec("hc.post", "hc_post", ("T", "hc", "D"), _hc_post_layout, _hc_post_golden,
                   dict(T=48, hc=4, D=256),
                   lambda i: dict(T=i["x_hc"].shape[0], hc=i["x_hc"].shape[1], D=i["x_hc"].shape[2]),
                   dtypes={"act": "bf16"}),
        KernelSpec("moe.gate", "router_scores", ("T", "D", "E"), _gate_layout, _gate_golden,
                   dict(T=48, D=256, E=64),
                   lambda i: dict(T=i["x"].shape[0], D=i["x"].shape[1], E=i["w"].shape[0]),
                   dtypes={"act": "bf16", "w": "bf16"}),
        KernelSpec("attn.softmax_tile", "softmax_tile", ("R", "K"), _softmax_layout, _softmax_golden,
                   dict(R=384, K=64), lambda i: dict(R=i["scores"].shape[0], K=i["scores"].shape[1]),
                   dtypes={"out": "bf16"}),
        KernelSpec("attn.qk_tile", "attn_qk_tile", ("T", "H", "K", "d"), _qk_layout, _qk_golden,
                   dict(T=8, H=8, K=64, d=64),
                   lambda i: dict(T=i["q"].shape[0], H=i["q"].shape[1], K=i["keys"].shape[1], d=i["q"].shape[2]),
                   defaults={"scale": 1.0}, dtypes={"act": "bf16"}),
        KernelSpec("attn.pv_tile", "attn_pv_tile", ("T", "H", "K", "d"), _pv_layout, _pv_golden,
                   dict(T=8, H=8, K=64, d=64),
                   lambda i: dict(T=i["probs"].shape[0], H=i["probs"].shape[1], K=i["probs"].shape[2],
                                  d=i["values"].shape[2]),
                   dtypes={"act": "bf16"}),
        _experts_spec("moe.experts", "int8"),   # W8A8: see kernels.moe_experts
        _experts_spec("moe.shared", "bf16"),
    ]
    mm_example = dict(M=48, K=256, N=128)
    for name in ("matmul", "attn.q_proj", "attn.kv_proj", "attn.o_proj", "lm_head.shard"):
        specs.append(_mm_spec(name, mm_example))
    return {s.name: s for s in specs}


PYPTO_KERNELS: dict[str, KernelSpec] = _specs()


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:]
    return tree


@functools.lru_cache(maxsize=None)
def kernel_digest(factory: str) -> str:
    """Hash of one factory's code plus kernels.py's shared code (helpers, tile constants) and
    the pypto version; comments and docstrings ignored.

    Read with ast, not imported (import pypto costs 3 s). A retiled kernel gets new cache keys; a
    comment edit or a newly added kernel keeps the others' keys.
    """
    tree = _strip_docstrings(ast.parse(Path(__file__).with_name("kernels.py").read_text()))
    factories = {sp.factory for sp in PYPTO_KERNELS.values()}
    shared = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name in factories)]
    own = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == factory]
    try:
        version = importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    text = "".join(ast.dump(n) for n in shared + own) + version
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def cache_key(kernel: str, shapes: dict, dtypes=None, mode: str = "sim") -> str:
    """Stable text key: normalized shapes and dtypes, run mode, spec revision and kernel-code digest."""
    spec = PYPTO_KERNELS[kernel]
    s, d = spec.normalize(shapes, dtypes)
    sk = ",".join(f"{k}={s[k]!r}" for k in sorted(s))
    dk = ",".join(f"{k}={d[k]}" for k in sorted(d))
    return f"{kernel}|{sk}|{dk}|{mode}|r{spec.rev}-{kernel_digest(spec.factory)}"
