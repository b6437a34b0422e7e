"""The head: final RMSNorm, the LM head on the rows that produce a token, and the token itself."""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.ops.lm_head import greedy, logits_shard, select_rows
from dsv41.ops.norm import rms_norm


class Head:
    NORM, HEAD = "norm.weight", "head.weight"

    def __init__(self, cfg: ModelConfig, weights):
        self.cfg, self.weights = cfg, weights

    @staticmethod
    def tensors(cfg: ModelConfig):
        d = cfg.hidden_size
        yield Head.NORM, (d,), "bf16", 0.05, 1.0
        yield Head.HEAD, (cfg.vocab_size, d), "bf16", d ** -0.5, 0.0

    def norm(self, x) -> torch.Tensor:
        return rms_norm(x, self.weights[self.NORM], self.cfg.rms_norm_eps)

    def logits(self, hidden, logit_rows) -> torch.Tensor:
        """FP32 logits of the selected rows over this card's vocabulary rows (all of them at TP=1)."""
        return logits_shard(select_rows(hidden, logit_rows), self.weights[self.HEAD])

    @staticmethod
    def sample(logits) -> torch.Tensor:
        """The next token of each row: greedy (lowest id on ties)."""
        return greedy(logits)
