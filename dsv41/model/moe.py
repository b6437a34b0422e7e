"""The MoE block of one layer: the router (gate), the shared expert, and the routed experts."""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.ops.moe import combine, dispatch_rows, expert, experts_grouped, route
from dsv41.ops.packed import matrix


class MoE:
    def __init__(self, cfg: ModelConfig, layer: int, weights, block: str | None = None):
        """block: the weight-name prefix of the block (``layers.L.`` unless given); a DSpark stage's
        (``mtp.S.``) routes to its own dspark_n_routed_experts, top dspark_n_activated_experts."""
        self.cfg, self.layer, self.weights = cfg, layer, weights
        self.prefix = f"{block}ffn." if block is not None else self.key(layer, "")
        self.n_experts = cfg.routed_experts_of(self.prefix)
        self.top_k = cfg.dspark_n_activated_experts if self.prefix.startswith("mtp.") else cfg.num_experts_per_tok

    @staticmethod
    def key(layer: int, name: str) -> str:
        return f"layers.{layer}.ffn.{name}"

    def w(self, name: str) -> torch.Tensor:
        return self.weights[self.prefix + name]

    def linear(self, name: str):
        """A matrix this block multiplies by, in its checkpoint format (decoded inside the product)."""
        return matrix(self.weights, self.prefix + name)

    def _expert(self, e: int, name: str):
        return self.linear(f"experts.{e}.{name}")

    @staticmethod
    def tensors(cfg: ModelConfig, layer: int, block: str | None = None):
        prefix = f"{block}ffn." if block is not None else MoE.key(layer, "")
        n = cfg.routed_experts_of(prefix)
        d, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, lambda name: prefix + name
        yield k("gate.weight"), (n, d), "bf16", d ** -0.5, 0.0
        yield k("gate.bias"), (n,), "f32", 0.1, 0.0
        for e in range(n):
            yield k(f"experts.{e}.w1"), (inter, d), "fp4", d ** -0.5, 0.0
            yield k(f"experts.{e}.w2"), (d, inter), "fp4", inter ** -0.5, 0.0
            yield k(f"experts.{e}.w3"), (inter, d), "fp4", d ** -0.5, 0.0
        yield k("shared_experts.w1"), (inter, d), "fp8", d ** -0.5, 0.0
        yield k("shared_experts.w2"), (d, inter), "fp8", inter ** -0.5, 0.0
        yield k("shared_experts.w3"), (inter, d), "fp8", d ** -0.5, 0.0

    def gate(self, x):
        """(expert indices [T, k], routing weights [T, k])."""
        cfg = self.cfg
        return route(x, self.linear("gate.weight"), self.w("gate.bias"), self.top_k, cfg.routed_scaling_factor)

    def shared(self, x):
        w = lambda n: self.linear(f"shared_experts.{n}")
        return expert(x, w("w1"), w("w2"), w("w3"), self.cfg.swiglu_limit)

    def routed(self, x, indices, weights, expert_ids) -> dict:
        """Outputs of the given experts for their dispatched rows: expert id -> (rows, BF16 [n, D]);
        every expert's rows in one grouped pass (a row's bits are those of its expert alone)."""
        hit = dispatch_rows(indices, expert_ids)
        if not hit:
            return {}
        rows = torch.cat([r for r, _ in hit.values()])
        w = torch.cat([weights[r, k] for r, k in hit.values()])
        counts = [len(r) for r, _ in hit.values()]
        y = self.grouped(x[rows], w, list(hit), counts)
        return {e: (r, part) for (e, (r, _)), part in zip(hit.items(), y.split(counts))}

    def grouped(self, x, weight, experts: list[int], counts: list[int]):
        """Rows sorted by expert (``counts`` per expert) through their experts in one pass."""
        return experts_grouped(x, weight, experts, counts,
                               self._expert,
                               self.cfg.swiglu_limit)

    def forward(self, x) -> torch.Tensor:
        indices, weights = self.gate(x)
        return combine(self.routed(x, indices, weights, range(self.n_experts)), self.shared(x))
