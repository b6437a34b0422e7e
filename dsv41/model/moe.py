"""The MoE block of one layer: the router (gate), the shared expert, and the routed experts."""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.ops.moe import combine, dispatch_rows, expert, experts_grouped, route


class MoE:
    def __init__(self, cfg: ModelConfig, layer: int, weights):
        self.cfg, self.layer, self.weights = cfg, layer, weights

    @staticmethod
    def key(layer: int, name: str) -> str:
        return f"layers.{layer}.ffn.{name}"

    @staticmethod
    def expert_key(layer: int, e: int, name: str) -> str:
        return MoE.key(layer, f"experts.{e}.{name}")

    def w(self, name: str) -> torch.Tensor:
        return self.weights[self.key(self.layer, name)]

    @staticmethod
    def tensors(cfg: ModelConfig, layer: int):
        d, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, lambda n: MoE.key(layer, n)
        yield k("gate.weight"), (cfg.n_routed_experts, d), "bf16", d ** -0.5, 0.0
        yield k("gate.bias"), (cfg.n_routed_experts,), "f32", 0.1, 0.0
        for e in range(cfg.n_routed_experts):
            yield MoE.expert_key(layer, e, "w1"), (inter, d), "fp4", d ** -0.5, 0.0
            yield MoE.expert_key(layer, e, "w2"), (d, inter), "fp4", inter ** -0.5, 0.0
            yield MoE.expert_key(layer, e, "w3"), (inter, d), "fp4", d ** -0.5, 0.0
        yield k("shared_experts.w1"), (inter, d), "fp8", d ** -0.5, 0.0
        yield k("shared_experts.w2"), (d, inter), "fp8", inter ** -0.5, 0.0
        yield k("shared_experts.w3"), (inter, d), "fp8", d ** -0.5, 0.0

    def gate(self, x):
        """(expert indices [T, k], routing weights [T, k])."""
        cfg = self.cfg
        return route(x, self.w("gate.weight"), self.w("gate.bias"), cfg.num_experts_per_tok, cfg.routed_scaling_factor)

    def shared(self, x):
        w = lambda n: self.w(f"shared_experts.{n}")
        return expert(x, w("w1"), w("w2"), w("w3"), self.cfg.swiglu_limit)

    def routed(self, x, indices, weights, expert_ids) -> dict:
        """Outputs of the given experts for their dispatched rows: expert id -> (rows, BF16 [n, D])."""
        w = lambda e, n: self.weights[self.expert_key(self.layer, e, n)]
        return {e: (rows, expert(x[rows], w(e, "w1"), w(e, "w2"), w(e, "w3"), self.cfg.swiglu_limit,
                                 weights[rows, slots]))
                for e, (rows, slots) in dispatch_rows(indices, expert_ids).items()}

    def grouped(self, x, weight, experts: list[int], counts: list[int]):
        """Rows sorted by expert (``counts`` per expert) through their experts in one pass."""
        return experts_grouped(x, weight, experts, counts,
                               lambda e, name: self.weights[self.expert_key(self.layer, e, name)],
                               self.cfg.swiglu_limit)

    def forward(self, x) -> torch.Tensor:
        indices, weights = self.gate(x)
        return combine(self.routed(x, indices, weights, range(self.cfg.n_routed_experts)), self.shared(x))
