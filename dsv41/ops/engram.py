"""Engram (layers 1 and 14): hashed n-gram memory added to the residual stream before the layer.

Hashing follows the official host code: compressed token ids, per-layer odd multipliers from
numpy's default_rng(10007 * layer), a running XOR over the lookback tokens, one prime per
(n-gram size, head), per-layer offsets. The tokenizer's token map is an input (identity by
default: tests use a stub tokenizer).
"""
from __future__ import annotations

import numpy as np
import torch

from dsv41.ops.pointwise import sigmoid
from dsv41.ops.projections import mx_linear
from dsv41.ops.quant import round_bf16


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def engram_primes(cfg) -> dict[int, list[int]]:
    """Per engram layer, its primes in (n-gram size, head) order: the smallest primes >= vocab size."""
    need = cfg.engram_ids_per_token * len(cfg.engram_layer_ids)
    primes, n = [], cfg.engram_vocab_size
    while len(primes) < need:
        if _is_prime(n):
            primes.append(n)
        n += 1
    per = cfg.engram_ids_per_token
    return {layer: primes[i * per:(i + 1) * per] for i, layer in enumerate(cfg.engram_layer_ids)}


def engram_table_rows(cfg, layer: int) -> int:
    return sum(engram_primes(cfg)[layer])


def multipliers(cfg, layer: int) -> list[int]:
    bound = max(1, (2 ** 63 - 1) // cfg.engram_compressed_vocab_size // 2)
    vals = np.random.default_rng(10007 * layer).integers(0, bound, cfg.engram_max_ngram_size, dtype=np.int64)
    return [int(2 * v + 1) for v in vals]


def default_token_map(cfg) -> torch.Tensor:
    """Stub tokenizer map: token id mod the compressed vocabulary."""
    return torch.arange(cfg.vocab_size, dtype=torch.int64) % cfg.engram_compressed_vocab_size


def hash_ids(cfg, layer: int, history: list[int], new_positions: range, token_map: torch.Tensor) -> torch.Tensor:
    """Hash ids [len(new_positions), ids_per_token] for positions of one request's token history."""
    primes = engram_primes(cfg)[layer]
    offsets = np.concatenate([[0], np.cumsum(primes[:-1])]).astype(np.int64)
    mult = multipliers(cfg, layer)
    pad = int(token_map[cfg.engram_pad_token_id])
    comp = [int(token_map[t]) for t in history]
    heads = cfg.engram_n_heads
    out = np.zeros((len(new_positions), cfg.engram_ids_per_token), dtype=np.int64)
    with np.errstate(over="ignore"):
        for row, p in enumerate(new_positions):
            toks = [comp[p - s] if p - s >= 0 else pad for s in range(cfg.engram_max_ngram_size)]
            h = np.int64(toks[0]) * np.int64(mult[0])
            for s in range(1, cfg.engram_max_ngram_size):
                h = h ^ (np.int64(toks[s]) * np.int64(mult[s]))
                for head in range(heads):
                    col = (s - 1) * heads + head
                    out[row, col] = int(h) % primes[col] + offsets[col]
    return torch.from_numpy(out)


def engram(x_hc, ids, table, wkv, q_weight, k_weight, eps: float) -> torch.Tensor:
    """x_hc [T, hc, D] -> x_hc + gate * value per lane, rounded to BF16.

    table: dequantized embedding rows [N, head_dim] (BF16 values); wkv: [(hc+1)*D, lookup] MXFP8.
    gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), dot the per-lane normalised product.
    """
    t, hc, d = x_hc.shape
    lookup = round_bf16(table[ids.long()].reshape(t, ids.shape[1] * table.shape[1]))
    kv = round_bf16(mx_linear(lookup, wkv))
    key, value = kv[:, : hc * d].reshape(t, hc, d), kv[:, hc * d:]
    w = q_weight.float() * k_weight.float()
    x = x_hc.float()
    rx = torch.rsqrt(x.pow(2).mean(-1) + eps)
    rk = torch.rsqrt(key.pow(2).mean(-1) + eps)
    dot = (x * w * key).sum(-1) * rx * rk * d ** -0.5
    gate = sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp_min(1e-6)), dot))
    return round_bf16(x + gate.unsqueeze(-1) * value.unsqueeze(1))
