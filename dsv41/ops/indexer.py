"""Hierarchical sparse indexer: index query, scores, Top-K, layer-20 candidate blocks.

Scores use the official recipe for every index source: bf16 dot per head, ReLU, bf16 product with
the head weight, FP32 sum over heads, bf16 total. Positions at or beyond a token's causal
compressed length (and outside the candidate mask on REINDEX layers) score -inf and are never
selected.
"""
from __future__ import annotations

import functools
import math

import torch

from dsv41.cpu import cores
from dsv41.cpu.key_kernels import (decode_index_rows, exact_rows, index_key_tables, index_score_epilogue,
                                   query_bounds)
from dsv41.ops import kv_cache
from dsv41.ops.projections import dense_linear, mx_linear
from dsv41.ops.quant import mxfp4_qdq, round_bf16
from dsv41.ops.rope import apply_rope

NEG_INF = float("-inf")
KEY_BLOCK = 2048      # index keys scored at once: a row's [heads, block] dots stay in cache
POSITION_LIMIT = (1 << 30) - 1   # positions a Top-K row may hold: (33-bit score key, position) fits an i64


def index_query(qr, x, wq_b, weights_proj, cos, sin, n_heads: int, head_dim: int, fp4_query: bool = True):
    """qI [T, nh, ihd] (RoPE'd, FP4 fake-quantized when fp4_query) and head weights wI [T, nh].

    fp4_query=True follows the official code; False is the pypto C2A kernel's variant.
    wI = bf16(bf16(x weights_proj) * (ihd^-1/2 * nh^-1/2)): the official code multiplies the BF16
    projection by the scalar and keeps a BF16 result. On FLASH the factor is exactly 2^-6 and the
    second rounding changes nothing; on other shapes (TINY: 2^-3.5) it does.
    """
    t = qr.shape[0]
    q = round_bf16(mx_linear(qr, wq_b)).reshape(t, n_heads, head_dim)
    q = apply_rope(q, cos, sin)
    if fp4_query:
        q = round_bf16(mxfp4_qdq(q.reshape(t, -1))).reshape(t, n_heads, head_dim)
    w = round_bf16(round_bf16(dense_linear(x, weights_proj)) * (head_dim ** -0.5 * n_heads ** -0.5))
    return q, w


def index_scores(q, w, payload, scale, rows) -> torch.Tensor:
    """S[t, j] = bf16(sum_h bf16(relu(bf16(q_h . k)) * w_h)) for the index key k at cache row rows[t, j];
    -inf where rows[t, j] < 0 (not visible).

    q [T, nh, d], w [T, nh], (payload, scale) the index cache's parts, rows i64 [T, P]. A block of
    ``KEY_BLOCK`` keys at a time, each key read once: decoded from its cache bytes straight to FP32
    (``cpu.key_kernels``), dotted with every head in one product, and the rest of its score (roundings,
    ReLU, head weights, the head sum) in one compiled pass while the block is in cache. The dot is
    exact (rounded to FP32 once, then to BF16) and the head sum accumulates in FP64, so that a row's
    score does not depend on how many rows or heads are batched together: a query row's dots with a
    block are an FP32 product where ``_exact_rows`` proves each one exact in FP32 (the usual case), else
    the FP64 product of before (exact in practice), with its bits. Where no row sees every
    position (REINDEX rows see only their candidate blocks), each row's visible keys are packed to
    the front first, so only they are read and scored.
    """
    t, _, d = q.shape
    p = rows.shape[1]
    rows = rows.long()
    visible = rows >= 0
    counts = visible.sum(1)
    width = int(counts.max()) if t and p else 0
    if width == p:
        return _scores(q, w, payload, scale, rows)
    row_of, at = visible.nonzero(as_tuple=True)                          # row-major: ascending positions
    rank = torch.arange(row_of.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    packed = torch.full((t, width), -1, dtype=torch.long)
    packed[row_of, rank] = rows[row_of, at]
    out = torch.full((t, p), NEG_INF)
    out[row_of, at] = _scores(q, w, payload, scale, packed)[row_of, rank]
    return out


@functools.cache
def _key_tables():
    return index_key_tables(kv_cache.value_table(kv_cache.INDEX).numpy())


def _exact_rows(q_bounds, low, size) -> torch.Tensor:
    """bool [T]: whether every dot of query row t with the block's keys (Lk low, sizes ``size`` [T, n])
    is exact in an FP32 product in any order. A dot of a head (Lq, SA) and a key (Lk, BM) sums products
    that are integer multiples of 2^(Lq+Lk) of total magnitude at most SA*BM units; below 2^24 units,
    with the unit no finer than FP32's least subnormal and 2^24 units below its overflow, every partial
    sum is an FP32 value. Taken over the row's heads and the block's keys at once: max SA * max BM,
    min Lq + min Lk, max Lq + max Lk. The FP64 product is exact then too: the same value."""
    out = torch.empty(low.shape[0], dtype=torch.bool)
    exact_rows(*(b.numpy() for b in q_bounds), low.numpy(), size.numpy(), out.numpy())
    return out


def _epilogue(q, keys, w, rows, wide: bool, out) -> None:
    """Scores of these rows from their dots: an FP32 product, or (wide) the FP64 product of before, whose
    bits rows not proven exact keep."""
    dots = torch.einsum("thd,tpd->thp", q.double(), keys.double()) if wide else torch.bmm(q, keys.mT)
    index_score_epilogue(dots.numpy(), w.numpy(), rows.numpy(), out.numpy())


def _scores(q, w, payload, scale, rows) -> torch.Tensor:
    """``index_scores`` over rows as given, ``KEY_BLOCK`` positions at a time."""
    t, _, d = q.shape
    p = rows.shape[1]
    out = torch.empty(t, p, dtype=torch.float32)
    qf, wf = q.float().contiguous(), w.float().contiguous()
    q_bounds = (torch.empty(t, dtype=torch.long), torch.empty(t, dtype=torch.long),
                torch.empty(t, dtype=torch.float64))
    query_bounds(qf.numpy(), *(b.numpy() for b in q_bounds))
    # below "highest" oneDNN may take an FP32 product in BF16 or TF32 steps: then no row is proven exact
    fp32 = torch.get_float32_matmul_precision() == "highest"
    parts = (payload.contiguous().numpy(), scale.contiguous().numpy())
    tables, group = _key_tables(), kv_cache.FORMATS[kv_cache.INDEX].group

    def blocks(first: int, last: int) -> None:
        for a in range(first * KEY_BLOCK, min(p, last * KEY_BLOCK), KEY_BLOCK):
            r = rows[:, a:a + KEY_BLOCK].contiguous()
            n = r.shape[1]
            keys = torch.empty(t, n, d, dtype=torch.float32)
            low, size = torch.empty(t, n, dtype=torch.long), torch.empty(t, n, dtype=torch.float64)
            decode_index_rows(*parts, r.numpy(), *tables, group, keys.numpy(), low.numpy(), size.numpy())
            exact = _exact_rows(q_bounds, low, size) if fp32 else torch.zeros(t, dtype=torch.bool)
            block = torch.empty(t, n, dtype=torch.float32)
            for take, wide in ((exact, False), (~exact, True)):
                i = take.nonzero().squeeze(1)
                if i.numel() == t:                          # every row alike (the usual case): no copies
                    _epilogue(qf, keys, wf, r, wide, block)
                elif i.numel():
                    part = torch.empty(i.numel(), n, dtype=torch.float32)
                    _epilogue(qf[i], keys[i], wf[i], r[i], wide, part)
                    block[i] = part
            out[:, a:a + KEY_BLOCK] = block
    n = -(-p // KEY_BLOCK)
    shares = min(cores.cores(), n) if t * p * q.shape[1] * d >= cores.SPLIT_MULTIPLIES else 1
    cores.run_shares(blocks, cores.bounds(n, shares))     # key blocks are independent: the same bits
    return out


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k finite positions per row, ascending, -1 padded -> i64 [T, k].

    Ties at the cutoff go to the lowest positions: the k largest (score, -position) pairs, as a stable
    descending sort would pick them (NaN above everything, -0.0 tied with 0.0), found by one partial
    selection over a key that orders the pairs (a full sort of a 1M-context row costs ~15x more).
    """
    t, p = scores.shape
    if p > POSITION_LIMIT:
        raise ValueError(f"scores: at most {POSITION_LIMIT} positions a row, got {p}")
    bits = (scores.float() + 0.0).view(torch.int32).long() & 0xFFFFFFFF     # + 0.0: -0.0 becomes 0.0
    key = torch.where(bits >= 1 << 31, 0xFFFFFFFF - bits, bits + (1 << 31))  # the floats' order, as integers
    key = torch.where(torch.isnan(scores), 1 << 32, key)
    pair = key * (POSITION_LIMIT + 1) + (POSITION_LIMIT - torch.arange(p))
    order = torch.topk(pair, min(k, p), dim=1).indices
    picked = torch.gather(scores, 1, order)
    order = torch.where(torch.isfinite(picked), order, torch.full_like(order, p))
    order = torch.sort(order, dim=1).values
    out = torch.where(order < p, order, torch.full_like(order, -1))
    if out.shape[1] < k:
        out = torch.cat([out, torch.full((t, k - out.shape[1]), -1, dtype=out.dtype)], 1)
    return out


def candidate_mask(scores: torch.Tensor, lens: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
    """Layer-20 level one: keep the best n_blocks blocks of `block` positions (bool [T, P]).

    Block score = max over its positions; the block holding position len-1 is pinned (+inf);
    only blocks with a finite (or pinned) score are kept.
    """
    t, p = scores.shape
    nb = math.ceil(p / block)
    padded = torch.full((t, nb * block), NEG_INF)
    padded[:, :p] = scores
    bscore = padded.reshape(t, nb, block).amax(-1)
    newest = ((lens.long() - 1) // block).clamp_min(0)
    pin = (lens > 0).unsqueeze(1) & (torch.arange(nb).unsqueeze(0) == newest.unsqueeze(1))
    bscore = torch.where(pin, torch.full_like(bscore, float("inf")), bscore)
    kb = min(n_blocks, nb)
    top = torch.sort(bscore, dim=1, descending=True, stable=True).indices[:, :kb]
    keep = torch.zeros(t, nb, dtype=torch.bool)
    keep.scatter_(1, top, torch.gather(bscore, 1, top) > NEG_INF)
    return keep.repeat_interleave(block, 1)[:, :p]


def score_chunks(rows: int, width: int, budget_bytes: int, leaf: int) -> list[tuple[int, int]]:
    """Query-row chunks [start, end) whose FP32 score buffer (width padded to the leaf) fits the budget."""
    padded = max(1, math.ceil(width / leaf)) * leaf
    step = max(1, budget_bytes // (4 * padded))
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


def physical_rows(positions: torch.Tensor, req: torch.Tensor, table: torch.Tensor, block_size: int):
    """Request-local compressed positions -> physical cache rows (-1 stays -1)."""
    pos = positions.long()
    ok = pos >= 0
    p = pos.clamp_min(0)
    r = req.long().reshape(-1, *([1] * (pos.dim() - 1))).expand_as(pos)
    phys = table.long()[r, p // block_size] * block_size + p % block_size
    return torch.where(ok, phys, torch.full_like(phys, -1))
