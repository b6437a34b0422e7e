"""The attention block of one layer: Q/KV projections, the compressor and indexer of its mode,
sparse attention over window + selected compressed rows, and the grouped output projection.

Modes (``config.LayerSpec``): SWA reads its window only; FULL layers compress their own KV, publish
compressed rows and index keys, and select Top-K by their own index scores; REINDEX layers select
inside the candidate source's mask; REUSE layers take another layer's selection.
"""
from __future__ import annotations

import torch

from dsv41.config import FULL, REINDEX, SWA, LayerSpec, ModelConfig
from dsv41.model import caches as cache
from dsv41.model.options import Options
from dsv41.ops.attention import slot_list, sparse_attention_cached
from dsv41.ops.compressor import compress_ratio1, compress_ratio2, index_key
from dsv41.ops.indexer import (candidate_mask, index_query, index_scores, physical_rows,
                               score_chunks, topk_positions)
from dsv41.ops.o_proj import o_proj_partial, reduce_partials
from dsv41.ops.packed import matrix
from dsv41.ops.projections import kv_proj, q_proj
from dsv41.ops.rope import COMPRESSED, apply_rope, profile_for


def projection_tensors(cfg: ModelConfig, prefix: str):
    """The Q/KV/output projections, norms and sinks every attention has (a DSpark stage's too)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    o_in = cfg.o_groups * cfg.o_lora_rank
    yield prefix + "wq_a", (cfg.q_lora_rank, d), "fp8", d ** -0.5, 0.0
    yield prefix + "wq_b", (cfg.num_attention_heads * hd, cfg.q_lora_rank), "fp8", cfg.q_lora_rank ** -0.5, 0.0
    yield prefix + "wkv", (hd, d), "fp8", d ** -0.5, 0.0
    yield prefix + "wo_a", (o_in, cfg.o_group_in), "fp8", cfg.o_group_in ** -0.5, 0.0
    yield prefix + "wo_b", (d, o_in), "fp8", o_in ** -0.5, 0.0
    yield prefix + "q_norm.weight", (cfg.q_lora_rank,), "bf16", 0.05, 1.0
    yield prefix + "kv_norm.weight", (hd,), "bf16", 0.05, 1.0
    yield prefix + "attn_sink", (cfg.num_attention_heads,), "f32", 1.0, 0.0


class Attention:
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, weights):
        self.cfg, self.spec, self.weights = cfg, spec, weights
        self.layer = spec.layer

    @staticmethod
    def key(layer: int, name: str) -> str:
        return f"layers.{layer}.attn.{name}"

    def w(self, name: str) -> torch.Tensor:
        return self.weights[self.key(self.layer, name)]

    def linear(self, name: str):
        """A matrix this block multiplies by, in its checkpoint format (decoded inside the product)."""
        return matrix(self.weights, self.key(self.layer, name))

    @staticmethod
    def tensors(cfg: ModelConfig, spec: LayerSpec):
        """(name, logical shape, format, std, mean) of the block's checkpoint tensors, in drawing order."""
        d, hd, k = cfg.hidden_size, cfg.head_dim, lambda n: Attention.key(spec.layer, n)
        yield from projection_tensors(cfg, Attention.key(spec.layer, ""))
        if spec.mode == FULL:
            yield k("compressor.wkv.weight"), (hd, d), "bf16", d ** -0.5, 0.0
            if spec.ratio == 2:
                yield k("compressor.wgate.weight"), (hd, d), "bf16", d ** -0.5, 0.0
            yield k("compressor.norm.weight"), (hd,), "bf16", 0.05, 1.0
            yield k("indexer.wk.weight"), (cfg.index_head_dim, hd), "bf16", hd ** -0.5, 0.0
            yield k("indexer.k_norm.weight"), (cfg.index_head_dim,), "bf16", 0.05, 1.0
        if spec.layer in cfg.index_source_layer_ids:
            yield (k("indexer.wq_b"), (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "fp8",
                   cfg.q_lora_rank ** -0.5, 0.0)
            yield k("indexer.weights_proj.weight"), (cfg.index_n_heads, d), "bf16", d ** -0.5, 0.0

    # ---- caches this layer writes and reads -----------------------------------------------------
    @property
    def window_cache(self) -> str:
        return cache.window(self.layer)

    @property
    def rope_profile(self) -> str:
        return profile_for(self.spec.ratio)

    # ---- stages ---------------------------------------------------------------------------------
    def q_proj(self, x, cos, sin, heads: int | None = None):
        """(q LoRA latent, RoPE'd query heads); ``heads``: this card's heads under TP."""
        cfg = self.cfg
        return q_proj(x, self.linear("wq_a"), self.w("q_norm.weight"), self.linear("wq_b"), cos, sin, cfg.rms_norm_eps,
                      heads or cfg.num_attention_heads, cfg.head_dim)

    def kv_proj(self, x, cos, sin):
        return kv_proj(x, self.linear("wkv"), self.w("kv_norm.weight"), cos, sin, self.cfg.rms_norm_eps)

    def publish_window(self, caches, md, kv):
        cache.publish(caches, self.window_cache, md.window_slots, kv)

    def compress(self, caches, md, x):
        """FULL layers: the compressor of the layer's ratio (ratio 2 reads the committed/staged ring)."""
        cfg, s, eps = self.cfg, self.layer, self.cfg.rms_norm_eps
        if self.spec.ratio == 2:
            (ring,) = caches.read(cache.ring(s))
            return compress_ratio2(x, self.linear("compressor.wkv.weight"), self.linear("compressor.wgate.weight"),
                                   self.w("compressor.norm.weight"), eps, md, ring, md.state_block_tables[s],
                                   cfg.state_capacity)
        return compress_ratio1(x, self.linear("compressor.wkv.weight"), self.w("compressor.norm.weight"), eps, md)

    def publish_compressed(self, caches, md, comp, cmp_rope):
        """Stage the ring writes, then publish compressed KV (RoPE'd latent) and index keys."""
        s = self.layer
        caches.put(cache.ring(s), comp.ring_slots, (comp.ring_rows,), comp.ring_token_rows)
        cos, sin = cmp_rope
        key = apply_rope(index_key(comp.latent, self.linear("indexer.wk.weight"), self.w("indexer.k_norm.weight"),
                                   self.cfg.rms_norm_eps), cos, sin)
        slots = torch.where(comp.closes, md.compressed_slots[s], torch.full_like(md.compressed_slots[s], -1))
        cache.publish(caches, cache.compressed(s), slots, apply_rope(comp.latent, cos, sin))
        cache.publish(caches, cache.index(s), slots, key)

    def index_chunk(self, caches, md, qr, x, rope, rows: slice, cand=None, opts: Options = Options()):
        """Index scores, Top-K physical rows and (candidate source) the candidate mask for query rows."""
        cfg, src = self.cfg, self.spec.kv_source
        req = md.token_to_req_indices[rows].long()
        lens = md.compressed_lens[src][rows]
        width = int(md.compressed_lens[src].max())
        pos = torch.arange(width).expand(req.shape[0], width)
        visible = pos < lens.unsqueeze(1).long()
        table = md.compressed_block_tables[src]
        cos, sin = rope
        q, wts = index_query(qr[rows], x[rows], self.linear("indexer.wq_b"), self.linear("indexer.weights_proj.weight"),
                             cos[rows], sin[rows], cfg.index_n_heads, cfg.index_head_dim, opts.fp4_index_query)
        if cand is not None:
            visible = visible & cand[rows]
        # one pass over the index keys: each decoded from the cache and scored while in cache
        rows_phys = physical_rows(torch.where(visible, pos, -1), req, table, cfg.block_size)
        scores = index_scores(q, wts, *caches.read(cache.index(src)), rows_phys)
        top = physical_rows(topk_positions(scores, cfg.index_topk), req, table, cfg.block_size)
        mask = None
        if self.layer == cfg.candidate_source_layer_id:
            mask = candidate_mask(scores, lens, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        return top, mask

    def index_chunks(self, md) -> list[tuple[int, int]]:
        """Query-row chunks whose score matrices fit the score budget (one graph node each)."""
        t = md.num_tokens
        width = int(md.compressed_lens[self.spec.kv_source].max()) if t else 0
        return score_chunks(t, width, self.cfg.index_score_budget_bytes, self.cfg.index_score_leaf)

    def select(self, chunks: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Concatenate the chunks' (Top-K rows, candidate mask): equals the unchunked result."""
        top = torch.cat([c[0] for c in chunks]) if chunks else torch.zeros(0, self.cfg.index_topk, dtype=torch.long)
        masks = [c[1] for c in chunks]
        return top, (torch.cat(masks) if masks and masks[0] is not None else None)

    def attend(self, caches, md, q, topk_rows):
        """Sparse attention over this layer's window rows and the selected compressed rows."""
        # the slot list as (cache row, from the compressed cache) pairs; the leaf reads each key's bytes once
        rows = torch.stack([md.window_indices.long(), torch.zeros_like(md.window_indices, dtype=torch.long)], -1)
        compressed = None
        if self.spec.mode != SWA:
            compressed = caches.read(cache.compressed(self.spec.kv_source))
            picked = torch.stack([topk_rows.long(), torch.ones_like(topk_rows, dtype=torch.long)], -1)
            rows, _ = slot_list(rows, rows[..., 0] >= 0, picked, topk_rows >= 0, md.window_list_widths)
        # this card's heads when the weights are a TP shard
        return sparse_attention_cached(q, caches.read(self.window_cache), compressed, rows[..., 0], rows[..., 1] == 1,
                                       self.w("attn_sink"), self.cfg.head_dim ** -0.5)

    def o_proj(self, attended, cos, sin):
        """This card's FP32 partial of the output projection (TP partials meet in a reduction)."""
        return o_proj_partial(attended, cos, sin, self.linear("wo_a"), self.linear("wo_b"))

    # ---- the whole block on one process -----------------------------------------------------------
    def forward(self, caches, md, x, rope, selections: dict, opts: Options = Options()) -> torch.Tensor:
        """All heads (TP=1) -> BF16 [T, D]; records this layer's selection in ``selections``."""
        spec = self.spec
        cos, sin = rope[(self.rope_profile, "token")]
        qr, q = self.q_proj(x, cos, sin)
        self.publish_window(caches, md, self.kv_proj(x, cos, sin))
        if spec.mode == FULL:
            self.publish_compressed(caches, md, self.compress(caches, md, x), rope[(COMPRESSED, self.layer)])
        if spec.mode in (FULL, REINDEX):
            cand = selections.get("candidates") if spec.mode == REINDEX else None
            top, mask = self.select([self.index_chunk(caches, md, qr, x, (cos, sin), slice(a, b), cand, opts)
                                     for a, b in self.index_chunks(md)])
            selections[self.layer] = top
            if mask is not None:
                selections["candidates"] = mask
        out = self.attend(caches, md, q, selections.get(spec.index_source))
        return reduce_partials([self.o_proj(out, cos, sin)])
