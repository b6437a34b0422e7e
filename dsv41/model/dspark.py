"""DSpark, the model's own drafter: ``n_mtp_layers`` stages stored under ``mtp.S.*``, fed by the
backbone's streams, proposing ``dspark_block_size`` tokens per step.

- **Taps**: the lane mean of the stream entering each of ``dspark_target_layer_ids`` (after its
  Engram, before its attention), concatenated in that order -> ``main_hidden`` [T, n*D]; stage 0's
  ``main_proj`` (MXFP8 linear) and ``main_norm`` map it to ``main_x`` [T, D].
- **Seeding**: every stage projects ``main_x`` with its own ``wkv``/``kv_norm``, RoPE (plain profile)
  at the main token's position, into its window ring (FP8 window-cache format) at ``pos % window``.
  ``DSpark.seed`` returns those rows; ``DSparkWindow.published`` writes them into a new window, so
  a caller publishes only accepted positions (a rejected position's row is simply dropped).
- **Drafting** at main position ``pos``: the block [last sampled token, noise, ...] is embedded with
  the shared embedding on all lanes (identity pre mix), RoPE'd at ``pos+1 .. pos+block``; each stage
  attends the window's ``min(window, pos+1)`` slots (ring order) and then all the block's own FP8
  KV rows (no causal mask), with the sink, the grouped output projection, and its MoE (own router,
  top ``dspark_n_activated_experts``). The last stage collapses with the last pre mix, applies its
  own norm and the shared LM head, then adds the Markov bias position by position: position i's
  bias comes from the token drawn at i-1 (the last sampled token for i = 0), drawn by the caller's
  ``sample_fn``. The confidence head scores [collapsed hidden, Markov embedding] per position.

Rounding follows the backbone's goldens (``ops``): BF16 at the official bf16 points, FP64
accumulation rounded once to FP32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dsv41.config import ModelConfig
from dsv41.model.attention import projection_tensors
from dsv41.model.embedding import Embedding
from dsv41.model.finite import ATTN, FFN, ensure_finite
from dsv41.model.head import Head, vocab_logits
from dsv41.model.hyper import SITES, HyperSite
from dsv41.model.moe import MoE
from dsv41.ops import kv_cache
from dsv41.ops.attention import sparse_attention
from dsv41.ops.mhc import hc_pre, initial_pre, lane_mean
from dsv41.ops.norm import rms_norm
from dsv41.ops.o_proj import o_proj_partial, reduce_partials
from dsv41.ops.packed import matrix
from dsv41.ops.projections import kv_proj, matmul_t, mx_linear, q_proj
from dsv41.ops.quant import round_bf16
from dsv41.ops.rope import PLAIN, gather_rope_rows
from dsv41.ops.sampling import RequestGenerator, SamplingParams, apply_penalties, filtered_probs

WINDOW_FORMAT = kv_cache.FORMATS[kv_cache.WINDOW]
# sample_fn(logits [B, vocab] FP32 with the Markov bias, draft position i) -> token ids [B]
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]


DRAFT_STREAM = 0x5D5A_7E11      # a sampling request's drafts: a generator stream apart from its tokens'


def stage_prefix(stage: int) -> str:
    return f"mtp.{stage}."


def block_prefix(cfg: ModelConfig, layer: int) -> str:
    """The weight-name prefix of layer id ``layer``: a backbone block's, or past the backbone (the
    official ids 40, 41, 42 on FLASH) a DSpark stage's."""
    n = cfg.num_hidden_layers
    return f"layers.{layer}." if layer < n else stage_prefix(layer - n)


def ring_order(window_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Columns of a request's window positions (ascending, -1 = none, filled first) in the order of
    its ring's slots (``pos % window``): the order the official forward lists the window in."""
    key = torch.where(window_positions >= 0, window_positions % window, window + torch.arange(window_positions.shape[-1]))
    return torch.argsort(key, dim=-1, stable=True)


def block_inputs(cfg: ModelConfig, last_tokens: torch.Tensor, main_positions: torch.Tensor):
    """(ids [B*block]: each request's last sampled token then noise tokens, positions [B*block]:
    main position + 1 .. + block)."""
    k = cfg.dspark_block_size
    last = last_tokens.long().reshape(-1)
    ids = torch.full((last.numel(), k), cfg.dspark_noise_token_id, dtype=torch.long)
    ids[:, 0] = last
    pos = main_positions.long().reshape(-1, 1) + 1 + torch.arange(k)
    return ids.reshape(-1), pos.reshape(-1)


def seeded_sampler(requests: list[tuple[SamplingParams, int, int]], dists: dict):
    """The draw of each draft position: greedy requests the argmax, sampling ones a draw from the
    filtered draft distribution with a generator of the request's seed (on a stream apart from its
    tokens') at the draft's absolute position, so every layout draws the same; ``requests``: per
    row of the block batch (params, seed, the block's first position); ``dists``: row -> the
    distributions drawn from, appended per position."""
    def sample(logits, pos):
        out = torch.empty(len(requests), dtype=torch.long)
        for b, (p, seed, first) in enumerate(requests):
            if p.greedy:
                out[b] = int(torch.argmax(logits[b]))
                continue
            q = filtered_probs(apply_penalties(logits[b], p, (), ()), p)
            s = RequestGenerator.draw_seed(seed ^ DRAFT_STREAM, first + pos)
            out[b] = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(s)))
            dists.setdefault(b, []).append(q)
        return out
    return sample


def greedy_sample(logits: torch.Tensor, i: int) -> torch.Tensor:
    """Greedy drafting: the lowest id of the largest logit."""
    return torch.argmax(logits, dim=-1)


class DSparkWindow:
    """One request's DSpark window caches: per stage a ring of ``sliding_window`` KV rows in the
    window-cache format (FP8 E4M3 + E8M0 per 32). Immutable: ``published`` returns a new window, so
    a step can build the next one and keep or drop it whole. ``length`` is one past the last
    position published (the next draft's main position is ``length - 1``)."""

    def __init__(self, cfg: ModelConfig, payload: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 length: int = 0):
        rows = cfg.n_mtp_layers * cfg.sliding_window
        if payload is None:
            payload, scale = WINDOW_FORMAT.empty(rows, cfg.head_dim)
        self.cfg, self.payload, self.scale, self.length = cfg, payload, scale, length

    def published(self, rows: torch.Tensor, positions: torch.Tensor) -> "DSparkWindow":
        """A new window with ``rows`` [stages, T, head_dim] (``DSpark.seed``) written at consecutive
        ``positions`` [T]; of a span longer than the window only its last ``window`` rows land."""
        cfg, w = self.cfg, self.cfg.sliding_window
        pos = positions.long().reshape(-1)
        if rows.shape != (cfg.n_mtp_layers, pos.numel(), cfg.head_dim):
            raise ValueError(f"rows: must be [{cfg.n_mtp_layers}, {pos.numel()}, {cfg.head_dim}] "
                             f"(stages, positions, head_dim), got {list(rows.shape)}")
        if pos.numel() == 0:
            return self
        first, last = int(pos[0]), int(pos[-1])
        if first < 0 or not torch.equal(pos, torch.arange(first, first + pos.numel())):
            raise ValueError(f"positions: must be consecutive and >= 0, got {pos.tolist()}")
        if first > self.length and pos.numel() < w:
            raise ValueError(f"positions: must continue the window (next position {self.length}) or span "
                             f"at least the window ({w}), got {first}..{last}")
        if last + 1 < self.length:   # its slots hold newer positions' rows now
            raise ValueError(f"positions: must reach the window's end (next position {self.length}), "
                             f"got {first}..{last}")
        keep = slice(max(0, pos.numel() - w), None)
        slots = (pos[keep] % w).unsqueeze(0) + (torch.arange(cfg.n_mtp_layers) * w).unsqueeze(1)
        payload, scale = self.payload.clone(), self.scale.clone()
        kv_cache.publish(payload, scale, WINDOW_FORMAT, slots.reshape(-1), rows[:, keep].reshape(-1, cfg.head_dim))
        return DSparkWindow(cfg, payload, scale, max(self.length, last + 1))

    def keys(self, stage: int) -> tuple[torch.Tensor, int]:
        """(decoded ring [window, head_dim] BF16 values of one stage in slot order, slots filled:
        min(window, length))."""
        w = self.cfg.sliding_window
        rows = torch.arange(stage * w, (stage + 1) * w)
        return kv_cache.read(self.payload, self.scale, WINDOW_FORMAT, rows), min(w, self.length)


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor       # [B, block] i64: the drafted ids, position i drawn from logits[:, i]
    logits: torch.Tensor       # [B, block, vocab] FP32, the Markov bias included (the draft distribution's)
    confidence: torch.Tensor   # [B, block] FP32: the confidence head's score per position


class DSparkStage:
    """One stage: hyper-connection sites, window-only attention fed by ``main_x``, its own MoE."""

    def __init__(self, cfg: ModelConfig, stage: int, weights):
        self.cfg, self.stage, self.weights = cfg, stage, weights
        self.prefix = stage_prefix(stage)
        self.layer = cfg.num_hidden_layers + stage     # the official layer id (40, 41, 42 on FLASH)
        self.sites = {s: HyperSite(cfg, self.layer, s, weights, self.prefix) for s in SITES}
        self.moe = MoE(cfg, self.layer, weights, self.prefix)

    @staticmethod
    def tensors(cfg: ModelConfig, stage: int):
        """(name, logical shape, format, std, mean) of the stage's checkpoint tensors, in drawing order."""
        p, d = stage_prefix(stage), cfg.hidden_size
        layer = cfg.num_hidden_layers + stage
        for site in SITES:
            yield from HyperSite.tensors(cfg, layer, site, p)
        for site in SITES:
            yield f"{p}{site}_norm.weight", (d,), "bf16", 0.05, 1.0
        yield from projection_tensors(cfg, p + "attn.")
        yield from MoE.tensors(cfg, layer, p)
        if stage == 0:
            n = len(cfg.dspark_target_layer_ids) * d
            yield p + "main_proj", (d, n), "fp8", n ** -0.5, 0.0
            yield p + "main_norm.weight", (d,), "bf16", 0.05, 1.0
        if stage == cfg.n_mtp_layers - 1:
            r, v = cfg.dspark_markov_rank, cfg.vocab_size
            yield p + "norm.weight", (d,), "bf16", 0.05, 1.0
            yield p + "markov_head.embed.weight", (v, r), "bf16", 1.0, 0.0
            yield p + "markov_head.head.weight", (v, r), "bf16", r ** -0.5, 0.0
            yield p + "confidence_head.proj.weight", (1, d + r), "bf16", (d + r) ** -0.5, 0.0

    def w(self, name: str) -> torch.Tensor:
        return self.weights[self.prefix + name]

    def linear(self, name: str):
        """A matrix the stage multiplies by, in its checkpoint format (decoded inside the product, as
        the backbone's: never whole)."""
        return matrix(self.weights, self.prefix + name)

    def norm(self, name: str, x) -> torch.Tensor:
        return rms_norm(x, self.w(f"{name}.weight"), self.cfg.rms_norm_eps)

    def kv_rows(self, x, cos, sin) -> torch.Tensor:
        """RoPE(kv_norm(bf16(x wkv))) [T, head_dim] BF16, before the window format's FP8 rounding."""
        return kv_proj(x, self.linear("attn.wkv"), self.w("attn.kv_norm.weight"), cos, sin, self.cfg.rms_norm_eps)

    def attend(self, x, rings: list[tuple[torch.Tensor, int]], cos, sin) -> torch.Tensor:
        """The block's attention -> BF16 [B*block, D]: each request's rows attend its ring's filled
        slots, then all of its block's FP8-rounded KV rows; rings[b] = (ring [window, hd], filled)."""
        return reduce_partials([self.attend_partial(x, rings, cos, sin)])

    def attend_partial(self, x, rings: list[tuple[torch.Tensor, int]], cos, sin, heads: int | None = None):
        """``attend``'s FP32 output-projection partial over ``heads`` heads (a card's under TP: its
        weights are that shard); the TP partials meet in a reduction."""
        cfg, hd = self.cfg, self.cfg.head_dim
        k, w = cfg.dspark_block_size, cfg.sliding_window
        _, q = q_proj(x, self.linear("attn.wq_a"), self.w("attn.q_norm.weight"), self.linear("attn.wq_b"), cos, sin,
                      cfg.rms_norm_eps, heads or cfg.num_attention_heads, hd)
        own = WINDOW_FORMAT.decode(*WINDOW_FORMAT.encode(self.kv_rows(x, cos, sin)))
        keys = torch.zeros(len(rings), w + k, hd)
        valid = torch.zeros(len(rings), w + k, dtype=torch.bool)
        for b, (ring, filled) in enumerate(rings):     # the official list: filled slots, then the block rows
            keys[b, :filled] = ring[:filled]
            keys[b, filled:filled + k] = own[b * k:(b + 1) * k]
            valid[b, :filled + k] = True
        out = sparse_attention(q, keys.repeat_interleave(k, 0), valid.repeat_interleave(k, 0),
                               self.w("attn.attn_sink"), hd ** -0.5)
        return o_proj_partial(out, cos, sin, self.linear("attn.wo_a"), self.linear("attn.wo_b"))

    def forward(self, x, pre, rings, cos, sin):
        """(stream after the stage, its FFN site's pre mix), as a backbone block without Engram."""
        a, f = self.sites["attn"], self.sites["ffn"]
        a_pre, a_post, a_comb = a.mixes(x)
        h = a.post(self.attend(self.norm("attn_norm", a.pre(x, pre)), rings, cos, sin), x, a_post, a_comb)
        ensure_finite(h, self.layer, ATTN, self.cfg.num_hidden_layers)
        f_pre, f_post, f_comb = f.mixes(h)
        x = f.post(self.moe.forward(self.norm("ffn_norm", f.pre(h, a_pre))), h, f_post, f_comb)
        return ensure_finite(x, self.layer, FFN, self.cfg.num_hidden_layers), f_pre


class DSpark:
    """The drafter: its stages, stage 0's input map, the last stage's heads; embedding and LM head
    are the backbone's."""

    def __init__(self, cfg: ModelConfig, weights):
        if not cfg.dspark:
            raise ValueError(f"{cfg.name}: has no DSpark stages (n_mtp_layers 0)")
        self.cfg, self.weights = cfg, weights
        self.stages = [DSparkStage(cfg, s, weights) for s in range(cfg.n_mtp_layers)]
        self.first, self.last = self.stages[0], self.stages[-1]
        self.embed = Embedding(cfg, weights)

    @staticmethod
    def tensors(cfg: ModelConfig):
        for s in range(cfg.n_mtp_layers):
            yield from DSparkStage.tensors(cfg, s)

    # ---- taps and seeding -------------------------------------------------------------------------
    @staticmethod
    def tap(x_hc) -> torch.Tensor:
        """A target layer's tap: the lane mean of the stream entering it, BF16 [T, D]."""
        return lane_mean(x_hc)

    def main_hidden(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """[T, n*D]: the taps of ``dspark_target_layer_ids`` concatenated in that order."""
        missing = [i for i in self.cfg.dspark_target_layer_ids if i not in taps]
        if missing:
            raise ValueError(f"taps: must hold every DSpark target layer {list(self.cfg.dspark_target_layer_ids)}, "
                             f"missing {missing}")
        return torch.cat([taps[i] for i in self.cfg.dspark_target_layer_ids], dim=-1)

    def main_x(self, main_hidden) -> torch.Tensor:
        """main_norm(bf16(main_hidden main_proj)) -> BF16 [T, D]."""
        return self.first.norm("main_norm", round_bf16(mx_linear(main_hidden, self.first.linear("main_proj"))))

    def seed(self, taps: dict[int, torch.Tensor], positions: torch.Tensor, tables: dict) -> torch.Tensor:
        """Window rows [stages, T, head_dim] of main tokens at ``positions`` [T] from their taps (rows
        in the same order), for ``DSparkWindow.published``; ``tables``: the RoPE tables by profile."""
        cos, sin = gather_rope_rows(*tables[PLAIN], positions)
        return self.seed_rows(self.main_hidden(taps), cos, sin)

    def seed_rows(self, main_hidden, cos, sin) -> torch.Tensor:
        """[stages, T, head_dim]: each stage's window rows of main tokens from their ``main_hidden``
        and RoPE rows."""
        x = self.main_x(main_hidden)
        return torch.stack([s.kv_rows(x, cos, sin) for s in self.stages])

    # ---- drafting ---------------------------------------------------------------------------------
    def draft(self, last_tokens: torch.Tensor, windows: list[DSparkWindow], tables: dict,
              sample_fn: SampleFn = greedy_sample) -> Draft:
        """One block per request: request b's main position is ``windows[b].length - 1`` (seeded
        through it) and ``last_tokens[b]`` the token sampled there."""
        cfg = self.cfg
        last = last_tokens.long().reshape(-1)
        if last.numel() != len(windows):
            raise ValueError(f"last_tokens: must hold one token per window ({len(windows)}), got {last.numel()}")
        if any(w.length < 1 for w in windows):
            raise ValueError("windows: each must be seeded through its main position (length >= 1), got an empty one")
        ids, pos = block_inputs(cfg, last, torch.tensor([w.length - 1 for w in windows]))
        cos, sin = gather_rope_rows(*tables[PLAIN], pos)
        x = self.embed.forward(ids)
        pre = initial_pre(x.shape[0], cfg.hc_mult)
        for stage in self.stages:
            x, pre = stage.forward(x, pre, [w.keys(stage.stage) for w in windows], cos, sin)
        return self.heads(hc_pre(x, pre), last, sample_fn)

    def heads(self, hidden, last_tokens, sample_fn: SampleFn) -> Draft:
        """From the collapsed BF16 hidden [B*block, D]: LM head logits with the Markov bias drawn
        position by position, the drafted tokens and the confidence scores."""
        return self.markov(self.head_logits(hidden), hidden, last_tokens, sample_fn)

    def head_logits(self, hidden) -> torch.Tensor:
        """FP32 [rows, vocab rows held]: the shared LM head over the last stage's norm (a card's
        vocabulary shard of it under TP)."""
        return vocab_logits(self.weights, Head.HEAD, self.last.norm("norm", hidden))

    def markov(self, logits, hidden, last_tokens, sample_fn: SampleFn) -> Draft:
        """From the full LM-head rows [B*block, vocab] and the collapsed hidden: the Markov bias
        added position by position around the draws, then the confidence scores."""
        b, k = last_tokens.numel(), self.cfg.dspark_block_size
        logits = logits.reshape(b, k, -1).clone()
        table = self.last.w("markov_head.embed.weight")
        prev, tokens, embeds = last_tokens, [], []
        for i in range(k):
            e = table[prev].float()
            logits[:, i] += vocab_logits(self.weights, self.last.prefix + "markov_head.head.weight", e)
            prev = sample_fn(logits[:, i], i).long().reshape(b)
            tokens.append(prev)
            embeds.append(e)
        feats = torch.cat([hidden.reshape(b, k, -1), torch.stack(embeds, 1)], -1)
        conf = matmul_t(feats.reshape(b * k, -1), self.last.linear("confidence_head.proj.weight")).reshape(b, k)
        return Draft(torch.stack(tokens, 1), logits, conf)
