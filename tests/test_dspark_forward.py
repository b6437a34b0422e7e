"""DSpark (``model/dspark.py``) against an independent DSpark forward written here from the issue's
description of the official forward, on TINY (DSpark enabled) and on a FLASH-width config.

The independent side imports nothing from ``dsv41.model`` or ``dsv41.ops``: it builds on the spec
forward's number formats and backbone stages (``spec_forward``) and writes DSpark's own parts: the
lane-mean taps, ``main_proj``/``main_norm``, the window rows seeded from ``main_x`` (the window
ring filled by position mod window, FP8 round trip), the block [last token, noise...] on every lane
with the identity pre mix, RoPE at the positions after the main one, attention over the ring's
filled slots then all of the block's FP8 KV rows (no causal mask) with the sink, the grouped output
projection, the stage's own MoE (its own expert count and top-k), the collapse with the last pre
mix, the stage's norm, the shared LM head, the Markov bias added position by position from the
previous drawn token, and the FP32 confidence head over [hidden, Markov embedding].

Each part of a stage (mHC mixes, collapse + norm, attention, expand, MoE) is fed the model's own
inputs (teacher forcing, as ``test_spec_forward``) and compared
within that test's per-row bounds: BF16 stages at most MAX_BF16_ULPS BF16 ulps of the row RMS
(elementwise FP32 work such as exp/sigmoid is evaluated differently on the two sides, which can
flip a BF16 rounding by one ulp), FP32 results (pre mixes, logits) within MAX_FP32_ULPS FP32 ulps
of the row RMS (each mHC site fed the model's own stream, the FFN site's included); the confidence
scores, one dot product each, within the error bound of the model's FP32 sum order against the
exact dot product of the model's own input (the input checked on its own); drafted tokens exactly,
and greedy drafts also end to end (the independent side from its own windows), where they may part
only at a decision within TIE of a tie. A wrong rounding point, position, slot list, source or
expert count moves whole rows far past these bounds.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest
import torch

import spec_forward as S
from dsv41.checkpoint.shards import CardWeights
from dsv41.config import FLASH, TINY
from dsv41.model.dspark import DSpark, DSparkStage, DSparkWindow
from dsv41.model.embedding import Embedding
from dsv41.model.head import Head
from dsv41.model.hyper import HyperSite
from dsv41.model.moe import MoE
from dsv41.ops.rope import PLAIN, precompute_rope_tables
from dsv41.weights import decode_checkpoint, draw, init_checkpoint

MAX_BF16_ULPS = 4.0
MAX_FP32_ULPS = 16.0
# a discrete decision (an expert's choice, a greedy draw) whose two candidates' scores differ by less
# than this, relative to them, is taken as a tie either side may break: one BF16 ulp, the precision of
# the stream the two sides carry from stage to stage
TIE = 2.0 ** -7


# ---- the independent DSpark forward -----------------------------------------------------------------

def spec_main_x(cfg, W, main_hidden):
    return S.rms_norm(S.bf16(S.mx_linear(main_hidden, W["mtp.0.main_proj"])), W["mtp.0.main_norm.weight"],
                      cfg.rms_norm_eps)


def spec_kv(cfg, W, stage, x, cos, sin):
    p = f"mtp.{stage}.attn."
    return S.rope(S.rms_norm(S.bf16(S.mx_linear(x, W[p + "wkv"])), W[p + "kv_norm.weight"], cfg.rms_norm_eps),
                  cos, sin)


def spec_ring(cfg, rows: dict[int, torch.Tensor]):
    """The window ring after seeding positions up to the last one in rows (position -> BF16 row): the
    FP8 round trip of each of the last ``window`` positions at position mod window -> (ring, filled)."""
    w, last = cfg.sliding_window, max(rows)
    ring = torch.zeros(w, cfg.head_dim)
    for p in range(max(0, last - w + 1), last + 1):
        ring[p % w] = S.bf16(S.act_quant(rows[p]))
    return ring, min(w, last + 1)


def spec_attention(cfg, W, stage, a, ring, filled, pos, table):
    """One request's block (rows a [K, D] at positions pos+1..pos+K) -> BF16 [K, D]."""
    p, eps, k = f"mtp.{stage}.attn.", cfg.rms_norm_eps, a.shape[0]
    h, hd = cfg.num_attention_heads, cfg.head_dim
    cos, sin = table[0][pos + 1:pos + 1 + k], table[1][pos + 1:pos + 1 + k]
    qr = S.rms_norm(S.bf16(S.mx_linear(a, W[p + "wq_a"])), W[p + "q_norm.weight"], eps)
    q = S.rope(S.bf16(S.mx_linear(qr, W[p + "wq_b"])).reshape(k, h, hd), cos, sin)
    own = S.bf16(S.act_quant(spec_kv(cfg, W, stage, a, cos, sin)))
    slots = torch.cat([ring[:filled], own]).unsqueeze(0).expand(k, -1, -1)
    att = S.sparse_attention(q, slots, torch.ones(k, slots.shape[1], dtype=torch.bool), W[p + "attn_sink"],
                             hd ** -0.5)
    att = S.rope(att, cos, sin, inverse=True)
    g = cfg.o_groups
    wo_a = W[p + "wo_a"].reshape(g, cfg.o_lora_rank, -1)
    z = S.bf16(torch.einsum("tgi,gri->tgr", att.reshape(k, g, -1).double(), wo_a.double()).float()).reshape(k, -1)
    return S.bf16(S.mx_linear(z, W[p + "wo_b"]))


def spec_moe(cfg, W, stage, x, routes=None):
    """The stage's MoE: sqrt-softplus router over its own experts, top dspark_n_activated_experts by
    biased score (lower id first at ties), routed outputs summed in ascending id, + shared. ``routes``:
    a list to append (each row's experts [T, k] ascending, each row's ``relative_gap``) to."""
    f = f"mtp.{stage}.ffn."
    z = S.mm(x, W[f + "gate.weight"])
    s = torch.sqrt(torch.clamp_min(z, 0) + torch.log1p(torch.exp(-z.abs())))
    biased = s + W[f + "gate.bias"]
    k = cfg.dspark_n_activated_experts
    idx = torch.tensor([sorted(range(biased.shape[1]), key=lambda e: (-float(biased[t, e]), e))[:k]
                        for t in range(x.shape[0])], dtype=torch.long)
    if routes is not None:
        routes.append((idx.sort(-1).values, relative_gap(biased, k)))
    picked = torch.gather(s, 1, idx)
    wts = cfg.routed_scaling_factor * picked / (picked.sum(-1, keepdim=True) + 1e-20)
    acc = torch.zeros_like(x)
    for e in range(cfg.dspark_n_routed_experts):
        t, j = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            acc[t] += S.swiglu(cfg, W, f"{f}experts.{e}.", x[t], wts[t, j])
    return S.bf16(acc + S.swiglu(cfg, W, f + "shared_experts.", x))


def relative_gap(scores, k: int) -> torch.Tensor:
    """Per row, how far its top-k choice is from a tie: (k-th largest - next) / |k-th largest|."""
    top = scores.double().sort(-1, descending=True).values
    return (top[:, k - 1] - top[:, k]) / top[:, k - 1].abs().clamp_min(1e-30)


def spec_stage(cfg, W, stage, x_hc, pre, rings, positions, table, routes=None):
    """One stage over B requests' blocks (rows request-major) -> (stream, FFN pre mix)."""
    p, eps, k = f"mtp.{stage}.", cfg.rms_norm_eps, cfg.dspark_block_size

    def mix(site, x):
        return S.mixes(x, W[f"{p}hc_{site}_fn"], W[f"{p}hc_{site}_scale"], W[f"{p}hc_{site}_base"], cfg)

    a_pre, a_post, a_comb = mix("attn", x_hc)
    a = S.rms_norm(S.collapse(x_hc, pre), W[p + "attn_norm.weight"], eps)
    att = torch.cat([spec_attention(cfg, W, stage, a[b * k:(b + 1) * k], *rings[b], positions[b], table)
                     for b in range(len(rings))])
    h = S.expand(att, x_hc, a_post, a_comb)
    f_pre, f_post, f_comb = mix("ffn", h)
    m = spec_moe(cfg, W, stage, S.rms_norm(S.collapse(h, a_pre), W[p + "ffn_norm.weight"], eps), routes)
    return S.expand(m, h, f_post, f_comb), f_pre


def spec_heads(cfg, W, x_hc, pre, last, pick):
    """(tokens [B, K], logits [B, K, V], confidence [B, K]); pick(logits [B, V], i) draws position i."""
    k = cfg.dspark_block_size
    b = last.numel()
    hid = S.collapse(x_hc, pre)
    logits, toks = spec_logits(cfg, W, hid, last, pick)
    return toks, logits, S.mm(spec_features(cfg, W, hid, last, toks), confidence_weight(cfg, W)).reshape(b, k)


def confidence_weight(cfg, W):
    return W[f"mtp.{cfg.n_mtp_layers - 1}.confidence_head.proj.weight"]


def spec_features(cfg, W, hid, last, toks):
    """The confidence head's input [B*K, D + r]: each position's hidden, then the Markov embedding of
    the token drawn before it."""
    b, k = toks.shape
    prev = torch.cat([last.reshape(b, 1), toks[:, :-1]], 1)
    embs = W[f"mtp.{cfg.n_mtp_layers - 1}.markov_head.embed.weight"][prev]
    return torch.cat([hid.reshape(b, k, -1), embs], -1).reshape(b * k, -1)


def spec_logits(cfg, W, hid, last, pick):
    """(logits [B, K, V] with the Markov bias, tokens [B, K]) from the collapsed hidden."""
    p, k = f"mtp.{cfg.n_mtp_layers - 1}.", cfg.dspark_block_size
    b = last.numel()
    logits = S.mm(S.rms_norm(hid, W[p + "norm.weight"], cfg.rms_norm_eps), W["head.weight"]).reshape(b, k, -1)
    prev, toks = last, []
    for i in range(k):
        logits[:, i] += S.mm(W[p + "markov_head.embed.weight"][prev], W[p + "markov_head.head.weight"])
        prev = pick(logits[:, i], i)
        toks.append(prev)
    return logits, torch.stack(toks, 1)


def spec_draft(cfg, W, last, rings, positions, table, pick, routes=None):
    """The whole draft: the block's embedding on every lane, the identity pre mix, the stages, the heads.
    rings[s][b]: stage s's (ring, filled) of request b; ``routes``: a list to append each stage's
    routing to (``spec_moe``)."""
    k = cfg.dspark_block_size
    ids = torch.full((last.numel(), k), cfg.dspark_noise_token_id, dtype=torch.long)
    ids[:, 0] = last
    x = W["embed.weight"][ids.reshape(-1)].unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    pre = torch.zeros(x.shape[0], cfg.hc_mult)
    pre[:, 0] = 1
    for s in range(cfg.n_mtp_layers):
        x, pre = spec_stage(cfg, W, s, x, pre, rings[s], positions, table, routes)
    return spec_heads(cfg, W, x, pre, last, pick)


# ---- bounds -------------------------------------------------------------------------------------------

def _ulps(mine, ref, mantissa: int) -> float:
    """Largest |mine - ref| in ulps of its row's RMS (the format's ulp at that magnitude)."""
    a, b = mine.reshape(-1, mine.shape[-1]).double(), ref.reshape(-1, ref.shape[-1]).double()
    rms = b.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(rms)) - mantissa)
    return float(((a - b).abs() / ulp).max())


def _close_bf16(what, mine, ref):
    worst = _ulps(mine, ref, 7)
    assert worst <= MAX_BF16_ULPS, f"{what}: {worst:.1f} BF16 ulps of the row RMS"


def _close_fp32(what, mine, ref):
    worst = _ulps(mine, ref, 23)
    assert worst <= MAX_FP32_ULPS, f"{what}: {worst:.1f} FP32 ulps of the row RMS"


def _within_sum_error(what, mine, feats, w):
    """An FP32 dot product per row against the exact one of the same inputs, within the error bound of
    the model's sum order (``cpu.fused_product``: 32 lane chains of K/32 fused multiply-adds, then a
    tree of 6 additions, one rounding each): gamma_n sum|a w| with n = K/32 + 6, gamma_n = n u / (1 - n u)
    and u = 2^-24. A score is one value, and a sum with cancellation can be far smaller than its
    terms, so ulps of the value itself say nothing about the arithmetic."""
    exact = feats.double() @ w.double().t()
    n = feats.shape[-1] // 32 + 6
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    bound = gamma * (feats.double().abs() @ w.double().abs().t())
    worst = float(((mine.reshape(exact.shape).double() - exact).abs() / bound.clamp_min(1e-300)).max())
    assert worst <= 1.0, f"{what}: {worst:.2f} of the FP32 sum's error bound"


def _recording(monkeypatch) -> list[dict]:
    """Wrap the stages, their mHC sites and the heads: each draft appends {stage: ((x, pre, rings),
    (x, pre)), 'mixes': [(block, site, stream in, (pre, post, comb))], 'heads': Draft}."""
    calls: list[dict] = []
    stage_forward, heads, mixes = DSparkStage.forward, DSpark.heads, HyperSite.mixes
    attend, moe, gate = DSparkStage.attend, MoE.forward, MoE.gate

    def on_stage(self, x, pre, rings, cos, sin):
        if self.stage == 0:
            calls.append({"mixes": []})
        result = stage_forward(self, x, pre, rings, cos, sin)
        calls[-1][self.stage] = ((x, pre, rings), result)
        return result

    def on_mixes(self, x):
        result = mixes(self, x)
        if self.block.startswith("mtp."):
            calls[-1]["mixes"].append((self.block, self.site, x, result))
        return result

    def on_attend(self, x, rings, cos, sin):
        result = attend(self, x, rings, cos, sin)
        calls[-1][("attn", self.stage)] = (x, result)
        return result

    def on_moe(self, x):
        result = moe(self, x)
        if self.prefix.startswith("mtp."):
            calls[-1][("moe", int(self.prefix.split(".")[1]))] = (x, result)
        return result

    def on_gate(self, x):
        result = gate(self, x)
        if self.prefix.startswith("mtp."):
            calls[-1][("route", int(self.prefix.split(".")[1]))] = result[0].sort(-1).values
        return result

    def on_heads(self, hidden, last, sample_fn):
        result = heads(self, hidden, last, sample_fn)
        calls[-1]["heads"] = (hidden, result)
        return result

    monkeypatch.setattr(DSparkStage, "forward", on_stage)
    monkeypatch.setattr(DSpark, "heads", on_heads)
    monkeypatch.setattr(HyperSite, "mixes", on_mixes)
    monkeypatch.setattr(DSparkStage, "attend", on_attend)
    monkeypatch.setattr(MoE, "forward", on_moe)
    monkeypatch.setattr(MoE, "gate", on_gate)
    return calls


class SpecWeights(Mapping):
    """The independent side's FP32 weights, decoded per use from the checkpoint tensors (at FLASH
    width never all at once)."""

    def __init__(self, ck):
        self.ck = ck
        self.keys_ = [n[: -len(".weight")] if n[: -len(".weight")] + ".scale" in ck else n
                      for n in ck if not (n.endswith(".scale") and not n.endswith("_scale"))]

    def __getitem__(self, key):
        names = [key + ".weight", key + ".scale"] if key + ".scale" in self.ck else [key]
        return S.decode_weights({n: self.ck[n] for n in names})[key]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self):
        return len(self.keys_)


# ---- the comparison -----------------------------------------------------------------------------------

class Run:
    """Requests' DSpark windows on both sides, seeded from random BF16 taps, and drafts compared."""

    def __init__(self, cfg, mine_w, spec_w, lengths, extra: int, monkeypatch, seed: int = 5):
        self.cfg, self.spec_w, self.lengths = cfg, spec_w, lengths
        self.g = torch.Generator().manual_seed(seed)
        self.model = DSpark(cfg, mine_w)
        cap = max(lengths) + extra + cfg.dspark_block_size + 1
        self.tables = {PLAIN: precompute_rope_tables(cfg, cap, PLAIN)}
        self.table = S.rope_table(cfg, cap, False)
        self.calls = _recording(monkeypatch)
        self.taps = [{i: S.bf16(torch.randn(n + extra, cfg.hidden_size, generator=self.g))
                      for i in cfg.dspark_target_layer_ids} for n in lengths]
        self.windows = [DSparkWindow(cfg) for _ in lengths]
        stages = range(cfg.n_mtp_layers)
        self.mine_rows = [[{} for _ in stages] for _ in lengths]   # the model's seeded rows (teacher forcing)
        self.own_rows = [[{} for _ in stages] for _ in lengths]    # the independent side's own

    def seed(self, b: int, a: int, e: int):
        """Seed request b's positions [a, e) on both sides and compare main_x and the rows."""
        cfg, pos = self.cfg, torch.arange(a, e)
        taps = {i: t[a:e] for i, t in self.taps[b].items()}
        mine = self.model.seed(taps, pos, self.tables)
        main_hidden = torch.cat([taps[i] for i in cfg.dspark_target_layer_ids], -1)
        x = spec_main_x(cfg, self.spec_w, main_hidden)
        _close_bf16("main_x", self.model.main_x(main_hidden), x)
        for s in range(cfg.n_mtp_layers):
            ref = spec_kv(cfg, self.spec_w, s, x, self.table[0][pos], self.table[1][pos])
            _close_bf16(f"stage {s} window rows", mine[s], ref)
            self.mine_rows[b][s].update({int(p): r for p, r in zip(pos, mine[s])})
            self.own_rows[b][s].update({int(p): r for p, r in zip(pos, ref)})
        self.windows[b] = self.windows[b].published(mine, pos)

    def rings(self, rows):
        return [[spec_ring(self.cfg, rows[b][s]) for b in range(len(self.lengths))]
                for s in range(self.cfg.n_mtp_layers)]

    def draft(self, last, pick, forced=None):
        cfg, W = self.cfg, self.spec_w
        out = self.model.draft(last, self.windows, self.tables, pick)
        rec = self.calls[-1]
        positions = [w.length - 1 for w in self.windows]
        rings = self.rings(self.mine_rows)
        assert len(rec["mixes"]) == 2 * cfg.n_mtp_layers
        for block, site, x, got in rec["mixes"]:   # each site fed the model's stream (the FFN site's is inside)
            ref = S.mixes(x, W[f"{block}hc_{site}_fn"], W[f"{block}hc_{site}_scale"], W[f"{block}hc_{site}_base"], cfg)
            for part, a, b in zip(("pre", "post", "comb"), got, ref):
                _close_fp32(f"{block}{site} {part} mix", a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))
        k, eps = cfg.dspark_block_size, cfg.rms_norm_eps
        for s in range(cfg.n_mtp_layers):   # each stage's parts fed the model's own inputs
            p = f"mtp.{s}."
            (x, pre, mine_rings), (x_out, _) = rec[s]
            for b, (ring, filled) in enumerate(rings[s]):
                assert mine_rings[b][1] == filled and torch.equal(mine_rings[b][0][:filled], ring[:filled]), \
                    f"stage {s} request {b}: the window ring"
            (_, _, _, a_mix), (_, _, h, f_mix) = rec["mixes"][2 * s:2 * s + 2]
            a, att = rec[("attn", s)]
            _close_bf16(f"stage {s} attention input", a, S.rms_norm(S.collapse(x, pre), W[p + "attn_norm.weight"], eps))
            _close_bf16(f"stage {s} attention", att, torch.cat([
                spec_attention(cfg, W, s, a[b * k:(b + 1) * k], *rings[s][b], positions[b], self.table)
                for b in range(len(positions))]))
            _close_bf16(f"stage {s} stream after attention", h, S.expand(att, x, a_mix[1], a_mix[2]))
            f, m = rec[("moe", s)]
            _close_bf16(f"stage {s} MoE input", f, S.rms_norm(S.collapse(h, a_mix[0]), W[p + "ffn_norm.weight"], eps))
            _close_bf16(f"stage {s} MoE", m, spec_moe(cfg, W, s, f))
            _close_bf16(f"stage {s} stream", x_out, S.expand(m, h, f_mix[1], f_mix[2]))
        x, pre = rec[cfg.n_mtp_layers - 1][1]
        hidden, _ = rec["heads"]
        _close_bf16("heads input", hidden, S.collapse(x, pre))
        logits, toks = spec_logits(cfg, W, S.collapse(x, pre), last, pick)
        assert torch.equal(out.tokens, toks), (out.tokens, toks)
        _close_fp32("logits", out.logits, logits)
        # the confidence from the model's own input (teacher forcing: the input is checked above)
        _within_sum_error("confidence", out.confidence, spec_features(cfg, W, hidden, last, toks),
                          confidence_weight(cfg, W))
        assert out.logits.shape == (last.numel(), cfg.dspark_block_size, cfg.vocab_size)
        if forced is not None:
            assert torch.equal(out.tokens, forced)
        else:
            self.end_to_end(out.tokens, last, positions, pick)
        return out


    def end_to_end(self, tokens, last, positions, pick):
        """The independent side's greedy draft from its own windows, through every stage, equals the
        model's; where a request's drafts differ, the first decision the two sides took differently
        (a row's experts in some stage, else a draw) was within TIE of a tie on the independent side:
        there the two sides' rounding (FP8 window rows, BF16 streams, FP32 against FP64 sums) may
        break it either way, and what follows is no longer the same computation."""
        cfg, k = self.cfg, self.cfg.dspark_block_size
        routes, draws = [], []

        def recorded(logits, i):
            draws.append(relative_gap(logits, 1))
            return pick(logits, i)
        e2e = spec_draft(cfg, self.spec_w, last, self.rings(self.own_rows), positions, self.table, recorded, routes)
        mine = self.calls[-1]
        for b in range(last.numel()):
            if torch.equal(e2e[0][b], tokens[b]):
                continue
            rows = slice(b * k, (b + 1) * k)
            differ = [(s, idx[rows], gap[rows], mine[("route", s)][rows]) for s, (idx, gap) in enumerate(routes)
                      if not torch.equal(idx[rows], mine[("route", s)][rows])]
            if differ:
                s, idx, gap, theirs = differ[0]
                flipped = (idx != theirs).any(-1)
                what, closest = f"stage {s} experts of rows {flipped.nonzero().flatten().tolist()}", float(gap[flipped].max())
            else:
                i = int((e2e[0][b] != tokens[b]).nonzero()[0])
                what, closest = f"the draw at position {i}", float(draws[i][b])
            assert closest <= TIE, (f"request {b}: drafts {e2e[0][b].tolist()} (independent) and {tokens[b].tolist()} "
                                    f"differ from {what}, which was {closest:.2e} from a tie (TIE {TIE})")


def _greedy(logits, i):
    return torch.argmax(logits, -1)


def test_tiny_dspark_matches_the_independent_forward(monkeypatch):
    """TINY: a 37-token prompt (past the window of 16: the ring wraps) and a 9-token one (a partly
    filled window) drafted together (greedy); then two decode steps, each seeding one more position
    and drafting with forced draws, whose Markov bias must follow the forced tokens."""
    ck = init_checkpoint(TINY, 0)
    lengths, steps = (37, 9), 2
    run = Run(TINY, decode_checkpoint(TINY, ck), S.decode_weights(ck), lengths, steps, monkeypatch)
    for b, n in enumerate(lengths):
        run.seed(b, 0, n)
    run.draft(torch.randint(0, TINY.vocab_size, (2,), generator=run.g), _greedy)
    for step in range(steps):
        for b, n in enumerate(lengths):
            run.seed(b, n + step, n + step + 1)
        forced = torch.randint(0, TINY.vocab_size, (2, TINY.dspark_block_size), generator=run.g)
        run.draft(torch.randint(0, TINY.vocab_size, (2,), generator=run.g), lambda lg, i: forced[:, i], forced)


def flash_width():
    """FLASH's widths and DSpark (3 stages, block 5, Markov rank 256, top-3), 8 experts per stage
    (``--experts 8``), a 4096-token vocabulary so the embedding and heads stay small."""
    return replace(FLASH.reduced(layers=3, experts=8), name="flash-dspark-test", vocab_size=4096,
                   dspark_noise_token_id=4000).validate()


@pytest.mark.slow
def test_flash_width_dspark_matches_the_independent_forward(monkeypatch):
    """FLASH width: a 130-token prompt (the 128-slot window wraps; 128 + 5 slots span three
    64-entry attention tiles) and a 3-token one, one greedy draft, then one decode step (forced)."""
    cfg = flash_width()
    tensors = [*Embedding.tensors(cfg), *Head.tensors(cfg), *DSpark.tensors(cfg)]
    ck = dict(draw(tensors, seed=0))
    lengths = (130, 3)
    run = Run(cfg, CardWeights(cfg, ck), SpecWeights(ck), lengths, 1, monkeypatch)
    for b, n in enumerate(lengths):
        run.seed(b, 0, n)
    run.draft(torch.randint(0, cfg.vocab_size, (2,), generator=run.g), _greedy)
    for b, n in enumerate(lengths):
        run.seed(b, n, n + 1)
    forced = torch.randint(0, cfg.vocab_size, (2, cfg.dspark_block_size), generator=run.g)
    run.draft(torch.randint(0, cfg.vocab_size, (2,), generator=run.g), lambda lg, i: forced[:, i], forced)


def test_the_reference_forward_hands_out_the_taps_and_its_logits_do_not_move(monkeypatch):
    """Taps asked of ``Transformer.forward``: for each target layer the lane mean (BF16) of the stream
    entering its attention site, every row of the step; the logits bit for bit those of a run without."""
    from dsv41.engine.reference import ReferenceEngine
    from dsv41.model.transformer import Transformer

    prompts = [[5, 9, 200, 31, 7, 7, 64], [1, 2, 3]]
    plain = ReferenceEngine(TINY, seed=0).prefill(prompts).logits
    taps, streams = [], {}
    forward, mixes = Transformer.forward, HyperSite.mixes

    def with_taps(self, caches, tables, step, opts, _taps=None):    # the engine asks for none: collect them
        taps.append({})
        return forward(self, caches, tables, step, opts, taps=taps[-1])

    def seen(self, x):
        if self.site == "attn" and self.layer in TINY.dspark_target_layer_ids:
            streams[self.layer] = x
        return mixes(self, x)

    monkeypatch.setattr(Transformer, "forward", with_taps)
    monkeypatch.setattr(HyperSite, "mixes", seen)
    tapped = ReferenceEngine(TINY, seed=0).prefill(prompts).logits
    assert torch.equal(tapped, plain)
    (got,) = taps
    assert sorted(got) == sorted(TINY.dspark_target_layer_ids)
    for layer, t in got.items():
        assert t.shape == (sum(map(len, prompts)), TINY.hidden_size)
        assert torch.equal(t, S.bf16(streams[layer].double().mean(1))), layer
