"""The head: final RMSNorm, the LM head on the rows that produce a token, and the token itself."""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.ops.lm_head import logits_shard, select_rows
from dsv41.ops.norm import rms_norm
from dsv41.ops.packed import matrix
from dsv41.ops.sampling import sample_rows
from dsv41.ops.verify import Accepted, accept, sampled_rule


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
        return vocab_logits(self.weights, self.HEAD, select_rows(hidden, logit_rows))

    @staticmethod
    def tokens(logits, step) -> Accepted:
        """The step's tokens from its logit rows: each row drawn with its request's settings
        (``ops.sampling.RowDraw``; draws None is greedy, the lowest id on ties), a verify step's
        drafts accepted while they equal the rows' tokens, or by the speculative-sampling rule when
        the drafter gave their distribution and the request samples (``ops.verify``)."""
        ids, logprobs = sample_rows(logits, step.draws)
        decided = None
        if step.draft_probs is not None:
            decided, logprobs = sampled_rule(logits, step.draws, step.layout, logprobs)
        return accept(ids, logprobs, step.layout, decided)


def vocab_logits(weights, key: str, rows) -> torch.Tensor:
    """FP32 rows x weights[key]^T over a vocabulary-row matrix (the LM head, DSpark's Markov head),
    decoded a tile of rows at a time inside the product (``ops.packed``): never whole."""
    return logits_shard(rows, matrix(weights, key))
