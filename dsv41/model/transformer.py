"""The whole model on one process: embedding, 40 blocks, head. ``Transformer.forward`` is the
reference forward (prefill, decode and verify steps alike: rows are packed per request, causal). The
DSpark stages' tensors are declared (drawn) after the backbone's, so they leave its draws unchanged."""
from __future__ import annotations

from functools import cached_property

import torch

from dsv41.config import LayerSpec, ModelConfig
from dsv41.model.attention import Attention
from dsv41.model.dspark import DSpark
from dsv41.model.embedding import Embedding, Engram
from dsv41.model.finite import ATTN, FFN, ensure_finite
from dsv41.model.head import Head
from dsv41.model.hyper import SITES, HyperSite
from dsv41.model.moe import MoE
from dsv41.model.options import BOUNDED_REPLAY, Options
from dsv41.ops.metadata import ForwardMetadata, replay_rows
from dsv41.ops.norm import rms_norm
from dsv41.ops.rope import COMPRESSED, PLAIN, gather_rope_rows


class Block:
    """One layer: [Engram], hyper-connection site + attention, hyper-connection site + MoE."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, weights):
        L = spec.layer
        self.cfg, self.spec, self.layer, self.weights = cfg, spec, L, weights
        self.engram = Engram(cfg, L, weights) if L in cfg.engram_layer_ids else None
        self.sites = {s: HyperSite(cfg, L, s, weights) for s in SITES}
        self.attn = Attention(cfg, spec, weights)
        self.moe = MoE(cfg, L, weights)

    @staticmethod
    def norm_key(layer: int, site: str) -> str:
        return f"layers.{layer}.{site}_norm.weight"

    @staticmethod
    def tensors(cfg: ModelConfig, spec: LayerSpec):
        L, d = spec.layer, cfg.hidden_size
        for site in SITES:
            yield from HyperSite.tensors(cfg, L, site)
        for site in SITES:
            yield Block.norm_key(L, site), (d,), "bf16", 0.05, 1.0
        yield from Attention.tensors(cfg, spec)
        yield from MoE.tensors(cfg, L)
        if L in cfg.engram_layer_ids:
            yield from Engram.tensors(cfg, L)

    def norm(self, site: str, x) -> torch.Tensor:
        """The RMSNorm before the site's sub-layer."""
        return rms_norm(x, self.weights[self.norm_key(self.layer, site)], self.cfg.rms_norm_eps)

    def forward(self, x, pre, caches, md, rope, selections: dict, hash_ids, opts: Options, taps: dict | None = None):
        """(stream after the layer, its FFN site's pre mix: the next collapse's); NonFiniteError when
        either site hands on NaN/Inf. ``taps``: where a DSpark target layer records its tap."""
        if self.engram is not None:
            x = self.engram.forward(x, hash_ids[self.layer])
        if taps is not None and self.layer in self.cfg.dspark_target_layer_ids:
            taps[self.layer] = DSpark.tap(x)
        a, f = self.sites["attn"], self.sites["ffn"]
        a_pre, a_post, a_comb = a.mixes(x)
        h = a.post(self.attn.forward(caches, md, self.norm("attn", a.pre(x, pre)), rope, selections, opts),
                   x, a_post, a_comb)
        ensure_finite(h, self.layer, ATTN)
        f_pre, f_post, f_comb = f.mixes(h)
        x = f.post(self.moe.forward(self.norm("ffn", f.pre(h, a_pre))), h, f_post, f_comb)
        return ensure_finite(x, self.layer, FFN), f_pre


class Transformer:
    def __init__(self, cfg: ModelConfig, weights):
        self.cfg, self.weights = cfg, weights
        self.embed = Embedding(cfg, weights)
        self.blocks = [Block(cfg, spec, weights) for spec in cfg.layers]
        self.head = Head(cfg, weights)

    @cached_property
    def dspark(self) -> DSpark:
        """The DSpark stages over the same weights (made when first asked: a checkpoint may lack them)."""
        return DSpark(self.cfg, self.weights)

    def block(self, layer: int):
        """The block of a layer id: a backbone block, or past the backbone a DSpark stage (its
        ``sites`` and ``moe`` are a block's)."""
        n = self.cfg.num_hidden_layers
        return self.blocks[layer] if layer < n else self.dspark.stages[layer - n]

    @staticmethod
    def tensors(cfg: ModelConfig):
        """Every checkpoint tensor as (name, logical shape, format, std, mean), in drawing order."""
        yield from Embedding.tensors(cfg)
        yield from Head.tensors(cfg)
        for spec in cfg.layers:
            yield from Block.tensors(cfg, spec)
        yield from DSpark.tensors(cfg)

    def forward(self, caches, tables: dict, step, opts: Options = Options(), taps: dict | None = None) -> torch.Tensor:
        """FP32 logits [R, vocab] of the step's logit rows (each request's last row, every row of a
        draft block); cache writes are staged in ``caches``. ``taps``, when given, receives each DSpark
        target layer's tap (``DSpark.tap``: [rows, D] of the rows that layer ran, all of the step's rows
        unless bounded replay cut them) by layer id."""
        cfg, md = self.cfg, step.md
        rope = rope_rows(tables, md, cfg)
        x = self.embed.forward(step.input_ids)
        pre = HyperSite.initial_pre(md.num_tokens, cfg.hc_mult)
        selections: dict = {}
        replay = opts.prefill_mode == BOUNDED_REPLAY and step.phase == "prefill"
        for block in self.blocks:
            if replay and block.layer == cfg.candidate_source_layer_id + 1:
                md, rows = replay_rows(md, cfg.sliding_window)
                x, pre = x[rows], pre[rows]
                rope = {k: (c[rows], s[rows]) for k, (c, s) in rope.items()}
                selections = {k: v[rows] for k, v in selections.items()}
            x, pre = block.forward(x, pre, caches, md, rope, selections, step.hash_ids, opts, taps)
        hidden = self.head.norm(HyperSite.head(x, pre))
        # a replayed prefill re-lowers md (and its last rows); a verify step's rows are the step's own
        return self.head.logits(hidden, step.logit_rows if step.verifies else md.logit_row_indices)


def rope_rows(tables: dict, md: ForwardMetadata, cfg: ModelConfig) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """One pair of row buffers per distinct (profile, position vector), shared by all layers using it."""
    rows = {(PLAIN, "token"): gather_rope_rows(*tables[PLAIN], md.position_ids),
            (COMPRESSED, "token"): gather_rope_rows(*tables[COMPRESSED], md.position_ids)}
    for s in cfg.kv_source_layer_ids:
        rows[(COMPRESSED, s)] = gather_rope_rows(*tables[COMPRESSED], md.compressed_rope_position_ids[s])
    return rows
