"""Token embedding (vocabulary-parallel shards) and the Engram memory of layers 1 and 14."""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.ops.embed import embed_shard, pack_lanes, pack_x_hc, shard_rows
from dsv41.ops.engram import engram, engram_apply, engram_table_rows, sum_shares
from dsv41.ops.packed import matrix


class Embedding:
    KEY = "embed.weight"

    def __init__(self, cfg: ModelConfig, weights):
        self.cfg, self.weights = cfg, weights

    @staticmethod
    def tensors(cfg: ModelConfig):
        yield Embedding.KEY, (cfg.vocab_size, cfg.hidden_size), "bf16", 1.0, 0.0

    def forward(self, input_ids) -> torch.Tensor:
        """[T, hc, D]: each row's embedding on every lane."""
        return pack_x_hc(input_ids, self.weights[self.KEY], self.cfg.hc_mult)

    def shard(self, input_ids) -> torch.Tensor:
        """This card's vocabulary shard's share of every row (-0.0 outside the shard)."""
        table = self.weights[self.KEY]
        return embed_shard(input_ids, table, table.first, self.cfg.vocab_size)

    def pack(self, rows) -> torch.Tensor:
        return pack_lanes(rows, self.cfg.hc_mult)


class Engram:
    def __init__(self, cfg: ModelConfig, layer: int, weights):
        self.cfg, self.layer, self.weights = cfg, layer, weights

    @staticmethod
    def key(layer: int, name: str) -> str:
        return f"layers.{layer}.engram.{name}"

    def w(self, name: str) -> torch.Tensor:
        return self.weights[self.key(self.layer, name)]

    @staticmethod
    def tensors(cfg: ModelConfig, layer: int):
        d, hc, k = cfg.hidden_size, cfg.hc_mult, lambda n: Engram.key(layer, n)
        yield k("embed"), (engram_table_rows(cfg, layer), cfg.engram_head_dim), "rows8", 1.0, 0.0
        yield k("wkv"), ((hc + 1) * d, cfg.engram_lookup_dim), "fp8", cfg.engram_lookup_dim ** -0.5, 0.0
        yield k("q_weight"), (hc, d), "bf16", 0.05, 1.0
        yield k("k_weight"), (hc, d), "bf16", 0.05, 1.0

    def wkv(self):
        """The value/key projection in its checkpoint format (decoded inside the product)."""
        return matrix(self.weights, self.key(self.layer, "wkv"))

    def forward(self, x_hc, ids) -> torch.Tensor:
        return engram(x_hc, ids, self.w("embed"), self.wkv(), self.w("q_weight"), self.w("k_weight"),
                      self.cfg.rms_norm_eps)

    def lookup_share(self, ids) -> torch.Tensor:
        """This card's table slab's share of the looked-up rows (-0.0 outside the slab)."""
        table = self.w("embed")
        return shard_rows(ids, table, table.first)

    def apply(self, x_hc, shares: list) -> torch.Tensor:
        """The update from every slab's share of the rows (summed in card order: exact)."""
        return engram_apply(x_hc, sum_shares(shares), self.wkv(), self.w("q_weight"), self.w("k_weight"),
                            self.cfg.rms_norm_eps)
