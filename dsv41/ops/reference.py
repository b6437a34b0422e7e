"""The monolithic reference forward of DeepSeek-V4.1-Flash (prefill + decode with paged caches).

Prefill is the official full forward: all 40 layers on every row with full causal windows; decode
is the same code on one row per request. Every stage is one of the ``ops`` goldens; the helpers in
this module (``attention``, ``moe_layer`` and the cache stages) are what the graph kernels call
too, so the graph and the reference share one definition of the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.checkpoint.reader import read_all
from dsv41.config import FULL, REINDEX, SWA, LayerSpec, ModelConfig
from dsv41.ops import kv_cache, mhc
from dsv41.ops.attention import slot_list, sparse_attention
from dsv41.ops.compressor import compress_ratio1, compress_ratio2, index_key
from dsv41.ops.embed import pack_x_hc
from dsv41.ops.engram import engram
from dsv41.ops.indexer import (candidate_mask, index_query, index_scores, physical_rows, score_chunks,
                               topk_positions)
from dsv41.ops.lm_head import logits_shard, select_rows
from dsv41.ops.metadata import ForwardMetadata, replay_rows, window_list_width
from dsv41.ops.moe import combine, dispatch_rows, expert, route
from dsv41.ops.norm import rms_norm
from dsv41.ops.o_proj import o_proj_partial, reduce_partials
from dsv41.ops.projections import kv_proj, q_proj
from dsv41.ops.rope import COMPRESSED, PLAIN, apply_rope, gather_rope_rows, precompute_rope_tables, profile_for
from dsv41.ops.staged import StagedTensors
from dsv41.serving import RequestTable, StepInputs, StepModel
from dsv41.weights import decode_checkpoint, init_checkpoint


@dataclass(frozen=True)
class Options:
    """Named alternatives for points the sources leave open (defaults follow the official code)."""
    fp4_index_query: bool = True   # False: the pypto C2A kernel's unquantized index query
    # "full": the official forward, every layer on every row with full causal windows.
    # "bounded_replay": the tech report's approximate SWA bounded replay for fresh prompts: layers up
    # to the candidate source (20) run on all rows (20 keeps full windows and publishes its
    # compressed/index caches for every row, the vLLM rule); layers 21-39 run only on each
    # request's last min(len, window) rows with windows cut to those rows. Exact for prompts no
    # longer than the window; approximate beyond.
    prefill_mode: str = "full"

    def __post_init__(self):
        if self.prefill_mode not in ("full", "bounded_replay"):
            raise ValueError(f"prefill_mode: must be 'full' or 'bounded_replay', got {self.prefill_mode!r}")


# ---- caches -------------------------------------------------------------------------------------

def cache_names(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """name -> (format kind, width, ratio); rows come from the request table's pools."""
    names = {f"window.{s.layer}": (kv_cache.WINDOW, cfg.head_dim, 1) for s in cfg.layers}
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        names[f"compressed.{s}"] = (kv_cache.COMPRESSED, cfg.head_dim, r)
        names[f"index.{s}"] = (kv_cache.INDEX, cfg.index_head_dim, r)
    return names


def empty_caches(cfg: ModelConfig, table: RequestTable, device="cpu") -> dict[str, tuple[torch.Tensor, ...]]:
    bs = cfg.block_size
    out = {}
    for name, (kind, width, ratio) in cache_names(cfg).items():
        blocks = table.window_blocks if kind == kv_cache.WINDOW else table.compressed_blocks[ratio]
        out[name] = kv_cache.FORMATS[kind].empty(blocks * bs, width, device)
    for s in cfg.kv_source_layer_ids:
        if cfg.compress_ratios[s] == 2:
            out[f"ring.{s}"] = (torch.zeros(table.state_blocks * cfg.state_capacity, 2 * cfg.head_dim, device=device),)
    return out


def publish(caches: StagedTensors, name: str, slots: torch.Tensor, values: torch.Tensor):
    kind = name.split(".")[0]
    payload, scale = caches.write(name)
    kv_cache.publish(payload, scale, kv_cache.FORMATS[kind], slots, values)


def read(caches: StagedTensors, name: str, rows: torch.Tensor) -> torch.Tensor:
    payload, scale = caches.read(name)
    return kv_cache.read(payload, scale, kv_cache.FORMATS[name.split(".")[0]], rows)


# ---- RoPE rows ------------------------------------------------------------------------------------

def rope_rows(tables: dict, md: ForwardMetadata, cfg: ModelConfig) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """One pair of row buffers per distinct (profile, position vector), shared by all layers using it."""
    rows = {(PLAIN, "token"): gather_rope_rows(*tables[PLAIN], md.position_ids),
            (COMPRESSED, "token"): gather_rope_rows(*tables[COMPRESSED], md.position_ids)}
    for s in cfg.kv_source_layer_ids:
        rows[(COMPRESSED, s)] = gather_rope_rows(*tables[COMPRESSED], md.compressed_rope_position_ids[s])
    return rows


# ---- attention stages -------------------------------------------------------------------------------

def compress(cfg, w, spec: LayerSpec, caches: StagedTensors, md, x):
    """FULL layers: the compressor of the layer's ratio (ratio 2 reads the committed/staged ring)."""
    p, s, eps = f"layers.{spec.layer}.attn.", spec.layer, cfg.rms_norm_eps
    if spec.ratio == 2:
        (ring,) = caches.read(f"ring.{s}")
        return compress_ratio2(x, w[p + "compressor.wkv.weight"], w[p + "compressor.wgate.weight"],
                               w[p + "compressor.norm.weight"], eps, md, ring, md.state_block_tables[s],
                               cfg.state_capacity)
    return compress_ratio1(x, w[p + "compressor.wkv.weight"], w[p + "compressor.norm.weight"], eps, md)


def publish_compressed(cfg, w, spec: LayerSpec, caches: StagedTensors, md, comp, cmp_rope):
    """Stage the ring writes, then publish compressed KV (RoPE'd latent) and index keys."""
    p, s, eps = f"layers.{spec.layer}.attn.", spec.layer, cfg.rms_norm_eps
    if comp.ring_slots.numel():
        (ring_w,) = caches.write(f"ring.{s}")
        ring_w[comp.ring_slots] = comp.ring_rows
    cos, sin = cmp_rope
    key = apply_rope(index_key(comp.latent, w[p + "indexer.wk.weight"], w[p + "indexer.k_norm.weight"], eps), cos, sin)
    slots = torch.where(comp.closes, md.compressed_slots[s], torch.full_like(md.compressed_slots[s], -1))
    publish(caches, f"compressed.{s}", slots, apply_rope(comp.latent, cos, sin))
    publish(caches, f"index.{s}", slots, key)


def index_chunk(cfg, w, spec: LayerSpec, caches: StagedTensors, md, qr, x, rope, rows: slice, cand=None,
                opts: Options = Options()):
    """Index scores, Top-K physical rows and (candidate source) the candidate mask for query rows."""
    p = f"layers.{spec.layer}.attn."
    src = spec.kv_source
    req = md.token_to_req_indices[rows].long()
    lens = md.compressed_lens[src][rows]
    width = int(md.compressed_lens[src].max())
    pos = torch.arange(width).expand(req.shape[0], width)
    visible = pos < lens.unsqueeze(1).long()
    table = md.compressed_block_tables[src]
    keys = read(caches, f"index.{src}", physical_rows(torch.where(visible, pos, -1), req, table, cfg.block_size))
    cos, sin = rope
    q, wts = index_query(qr[rows], x[rows], w[p + "indexer.wq_b"], w[p + "indexer.weights_proj.weight"],
                         cos[rows], sin[rows], cfg.index_n_heads, cfg.index_head_dim, opts.fp4_index_query)
    if cand is not None:
        visible = visible & cand[rows]
    scores = index_scores(q, wts, keys, visible)
    top = physical_rows(topk_positions(scores, cfg.index_topk), req, table, cfg.block_size)
    mask = None
    if spec.layer == cfg.candidate_source_layer_id:
        mask = candidate_mask(scores, lens, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    return top, mask


def index_select(cfg, w, spec, caches, md, qr, x, rope, cand=None, opts: Options = Options()):
    """Run index_chunk over the score-budget chunks and concatenate (equals the unchunked result)."""
    width = int(md.compressed_lens[spec.kv_source].max()) if md.num_tokens else 0
    tops, masks = [], []
    for a, b in score_chunks(md.num_tokens, width, cfg.index_score_budget_bytes, cfg.index_score_leaf):
        top, mask = index_chunk(cfg, w, spec, caches, md, qr, x, rope, slice(a, b), cand, opts)
        tops.append(top)
        masks.append(mask)
    top = torch.cat(tops) if tops else torch.zeros(0, cfg.index_topk, dtype=torch.long)
    mask = torch.cat(masks) if masks and masks[0] is not None else None
    return top, mask


def attend(cfg, w, spec, caches, md, q, topk_rows):
    """Sparse attention over this layer's window rows and the selected compressed rows."""
    keys = read(caches, f"window.{spec.layer}", md.window_indices)
    valid = md.window_indices >= 0
    if spec.mode != SWA:
        keys, valid = slot_list(keys, valid, read(caches, f"compressed.{spec.kv_source}", topk_rows),
                                topk_rows >= 0, window_list_width(md))
    sink = w[f"layers.{spec.layer}.attn.attn_sink"]  # this card's heads when w is a TP shard
    return sparse_attention(q, keys, valid, sink, cfg.head_dim ** -0.5)


def attention(cfg, w, spec: LayerSpec, caches, md, x, rope, selections: dict,
              opts: Options = Options()) -> torch.Tensor:
    """One attention sub-layer (all heads, TP=1) -> BF16 [T, D]; updates selections in place."""
    p, eps = f"layers.{spec.layer}.attn.", cfg.rms_norm_eps
    cos, sin = rope[(profile_for(spec.ratio), "token")]
    qr, q = q_proj(x, w[p + "wq_a"], w[p + "q_norm.weight"], w[p + "wq_b"], cos, sin, eps,
                   cfg.num_attention_heads, cfg.head_dim)
    kv = kv_proj(x, w[p + "wkv"], w[p + "kv_norm.weight"], cos, sin, eps)
    publish(caches, f"window.{spec.layer}", md.window_slots, kv)
    if spec.mode == FULL:
        comp = compress(cfg, w, spec, caches, md, x)
        publish_compressed(cfg, w, spec, caches, md, comp, rope[(COMPRESSED, spec.layer)])
    if spec.mode in (FULL, REINDEX):
        cand = selections.get("candidates") if spec.mode == REINDEX else None
        top, mask = index_select(cfg, w, spec, caches, md, qr, x, (cos, sin), cand, opts)
        selections[spec.layer] = top
        if mask is not None:
            selections["candidates"] = mask
    topk = selections.get(spec.index_source)
    out = attend(cfg, w, spec, caches, md, q, topk)
    return reduce_partials([o_proj_partial(out, cos, sin, w[p + "wo_a"], w[p + "wo_b"])])


# ---- MoE -----------------------------------------------------------------------------------------

def routed_experts(cfg, w, layer: int, x, indices, weights, expert_ids) -> dict:
    """Outputs of the given experts for their dispatched rows: expert id -> (rows, BF16 [n, D])."""
    f = f"layers.{layer}.ffn.experts."
    out = {}
    for e, (rows, slots) in dispatch_rows(indices, expert_ids).items():
        out[e] = (rows, expert(x[rows], w[f"{f}{e}.w1"], w[f"{f}{e}.w2"], w[f"{f}{e}.w3"], cfg.swiglu_limit,
                               weights[rows, slots]))
    return out


def shared_expert(cfg, w, layer: int, x):
    f = f"layers.{layer}.ffn.shared_experts."
    return expert(x, w[f + "w1"], w[f + "w2"], w[f + "w3"], cfg.swiglu_limit)


def gate(cfg, w, layer: int, x):
    f = f"layers.{layer}.ffn."
    return route(x, w[f + "gate.weight"], w[f + "gate.bias"], cfg.num_experts_per_tok, cfg.routed_scaling_factor)


def moe_layer(cfg, w, layer: int, x) -> torch.Tensor:
    indices, weights = gate(cfg, w, layer, x)
    routed = routed_experts(cfg, w, layer, x, indices, weights, range(cfg.n_routed_experts))
    return combine(routed, shared_expert(cfg, w, layer, x))


# ---- the forward ---------------------------------------------------------------------------------------

def mixes(cfg, w, layer: int, site: str, x_hc):
    p = f"layers.{layer}.hc_{site}_"
    return mhc.hc_mixes(x_hc, w[p + "fn"], w[p + "scale"], w[p + "base"], cfg.rms_norm_eps, cfg.hc_eps,
                        cfg.hc_sinkhorn_iters)


def engram_update(cfg, w, layer: int, x_hc, ids):
    e = f"layers.{layer}.engram."
    return engram(x_hc, ids, w[e + "embed"], w[e + "wkv"], w[e + "q_weight"], w[e + "k_weight"], cfg.rms_norm_eps)


def forward(cfg: ModelConfig, w: dict, caches: StagedTensors, tables: dict, step: StepInputs,
            opts: Options = Options()) -> torch.Tensor:
    """Last-row logits [B, vocab] FP32 of one packed step; cache writes are staged in `caches`."""
    md = step.md
    rope = rope_rows(tables, md, cfg)
    x = pack_x_hc(step.input_ids, w["embed.weight"], cfg.hc_mult)
    pre = mhc.initial_pre(md.num_tokens, cfg.hc_mult)
    selections: dict = {}
    replay = opts.prefill_mode == "bounded_replay" and step.phase == "prefill"
    for spec in cfg.layers:
        if replay and spec.layer == cfg.candidate_source_layer_id + 1:
            md, rows = replay_rows(md, cfg.sliding_window)
            x, pre = x[rows], pre[rows]
            rope = {k: (c[rows], s_[rows]) for k, (c, s_) in rope.items()}
            selections = {k: v[rows] for k, v in selections.items()}
        if spec.layer in cfg.engram_layer_ids:
            x = engram_update(cfg, w, spec.layer, x, step.hash_ids[spec.layer])
        a_pre, a_post, a_comb = mixes(cfg, w, spec.layer, "attn", x)
        a = rms_norm(mhc.hc_pre(x, pre), w[f"layers.{spec.layer}.attn_norm.weight"], cfg.rms_norm_eps)
        h = mhc.hc_post(attention(cfg, w, spec, caches, md, a, rope, selections, opts), x, a_post, a_comb)
        f_pre, f_post, f_comb = mixes(cfg, w, spec.layer, "ffn", h)
        f = rms_norm(mhc.hc_pre(h, a_pre), w[f"layers.{spec.layer}.ffn_norm.weight"], cfg.rms_norm_eps)
        x = mhc.hc_post(moe_layer(cfg, w, spec.layer, f), h, f_post, f_comb)
        pre = f_pre
    hidden = rms_norm(mhc.hc_head(x, pre), w["norm.weight"], cfg.rms_norm_eps)
    return logits_shard(select_rows(hidden, md.logit_row_indices), w["head.weight"])



class ReferenceModel(StepModel):
    """Deterministic random (or loaded) weights, paged caches, continuous batching, greedy decode."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, max_batch: int | None = None,
                 max_context: int | None = None, checkpoint=None, options: Options = Options()):
        """checkpoint: an opened checkpoint (``dsv41.checkpoint.reader``) holding cfg; read whole here."""
        self.cfg = cfg
        self.options = options
        self.seed = seed
        if checkpoint is None:
            self.weights = decode_checkpoint(cfg, init_checkpoint(cfg, seed))
        else:
            if checkpoint.cfg != cfg:
                raise ValueError(f"checkpoint: holds config {checkpoint.cfg.name!r}, not {cfg.name!r}")
            self.weights = decode_checkpoint(cfg, read_all(checkpoint))
        self.table = RequestTable(cfg, max_batch or cfg.max_batch_per_dp,
                                  max_context or min(cfg.max_position_embeddings, 1024),
                                  None if checkpoint is None else checkpoint.token_map)
        self.caches = StagedTensors(empty_caches(cfg, self.table))
        capacity = self.table.max_context
        self.rope_tables = {p: precompute_rope_tables(cfg, capacity, p) for p in (PLAIN, COMPRESSED)}
        self.last_request_ids: list[int] = []

    @property
    def active(self) -> list[int]:
        return list(self.table.requests)

    def step(self, batch: list[tuple[int | None, list[int]]], phase: str) -> torch.Tensor:
        step = self.table.plan(batch, phase)
        try:
            logits = forward(self.cfg, self.weights, self.caches, self.rope_tables, step, self.options)
        except BaseException:
            self.caches.abort()
            raise
        self.caches.commit()
        self.table.commit(step)
        self.last_request_ids = step.rids
        return logits

    def release(self, rid: int):
        self.table.release(rid)
