"""An independent DeepSeek-V4.1 forward for the tests, written from ../shared/spec alone.

Nothing here comes from ``dsv41.ops``: the checkpoint dict (FP8/FP4/E8M0 payloads) is decoded here,
and every stage is plain dense tensors over one request's whole token history, recomputed from
position 0 at every step (no caches, no paging, no graph). Cache quantization is kept as what it is
in the model: a quantize-dequantize of the key rows. Elementwise work is FP32, contractions
accumulate in FP64 and round to FP32 once, and values are rounded to BF16 exactly at the rounding
points of spec 01 §8 / 02 / 03 §3.2 (04-cross-check wins where it corrects them):

- index head weights: bf16(bf16(x Wp) * ihd^-1/2 * nh^-1/2) (the official code's BF16 product);
- attention: one online softmax over the raw list [window slots | Top-K slots] (-1 entries kept in
  place), tiled 64 at a time, P rounded to BF16 before PV, sink added to the denominator at the end;
  the window part is min(prompt, window) slots wide for the prompt's rows (the official prefill
  lists), the whole window for decoded rows.

Each stage is a function of its inputs so a test can feed it the reference's inputs (teacher forcing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from _spec_ref import FP4_LEVELS

TILE = 64
NEG = -1e30


# ---- number formats ------------------------------------------------------------------------------

def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).float()


def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w^T, FP64 accumulation, one rounding to FP32."""
    return (a.double() @ w.double().t()).float()


def pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32))


def exact_ceil_log2(v: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(v.double())                 # v = m 2^e, m in [0.5, 1): a power of two has m = 0.5
    return torch.where(m == 0.5, e - 1, e)


def e8m0_value(codes: torch.Tensor) -> torch.Tensor:
    return pow2(codes.view(torch.uint8).to(torch.int32) - 127)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """RNE to E4M3 with saturation at 448 (a plain cast would overflow to NaN)."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def act_quant(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Dynamic MXFP8 quantize-dequantize per row and 32-group: s = 2^ceil(log2(max(amax,1e-4)*fp32(1/448)))."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    amax = g.abs().amax(-1).clamp_min(1e-4)
    s = pow2(exact_ceil_log2(amax * torch.tensor(1 / 448, dtype=torch.float32))).unsqueeze(-1)
    return (to_e4m3(g / s) * s).reshape(x.shape)


_LEVELS = torch.tensor(FP4_LEVELS)


def fp4_round(n: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 level of n in [-6, 6]; at a midpoint the even code wins; sign kept."""
    d = (n.abs().unsqueeze(-1) - _LEVELS).abs()
    best = d == d.amin(-1, keepdim=True)
    even = best & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), best.float().argmax(-1))
    return torch.where(torch.signbit(n), -_LEVELS[code], _LEVELS[code])


def fp4_qdq(x: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """FP4 quantize-dequantize: E8M0 scale 2^ceil(log2(max(amax, 6*2^-126)/6)) (index keys and
    query, group 32) or E4M3 scale e4m3(max(amax/6, 2^-9)) (compressed KV, group 16)."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    amax = g.abs().amax(-1)
    if scale == "e8m0":
        s = pow2(exact_ceil_log2(amax.clamp_min(6 * 2.0 ** -126) / 6))
    else:
        s = to_e4m3((amax / 6).clamp_min(2.0 ** -9))
    s = s.unsqueeze(-1)
    return (fp4_round((g / s).clamp(-6, 6)) * s).reshape(x.shape)


# ---- checkpoint ----------------------------------------------------------------------------------

def decode_weights(ck: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> FP32 values. Quantized linears lose their '.weight' suffix:
    FP8 payload x E8M0 per 32x32 block; packed E2M1 (low nibble = even k) x E8M0 per row and 32
    inputs; the Engram table FP8 rows x E8M0 per 32 columns."""
    out = {}
    for name, t in ck.items():
        if name.endswith(".scale") and not name.endswith("_scale"):
            continue
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        sc = ck.get(base + ".scale") if name.endswith(".weight") else None
        if sc is None:
            out[name] = t.float()
            continue
        s = e8m0_value(sc)
        if t.dtype == torch.int8:
            b = t.view(torch.uint8).to(torch.int64)
            codes = torch.stack([b & 15, b >> 4], -1).reshape(t.shape[0], -1)
            mag = _LEVELS[codes & 7]
            vals = torch.where(codes >= 8, -mag, mag)
            out[base] = (vals.reshape(t.shape[0], -1, 32) * s.unsqueeze(-1)).reshape(vals.shape)
        elif base.endswith("engram.embed"):
            g = t.shape[1] // s.shape[1]
            out[base] = (t.float().reshape(t.shape[0], -1, g) * s.unsqueeze(-1)).reshape(t.shape)
        else:
            n, k = t.shape
            out[base] = (t.float().reshape(n // 32, 32, k // 32, 32) * s[:, None, :, None]).reshape(n, k)
    return out


# ---- backbone stages -----------------------------------------------------------------------------

def rms_norm(x, w, eps):
    x = x.float()
    return bf16(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float())


def mx_linear(x, w):
    """MXFP8 weight, dynamic MXFP8 activation of the BF16-rounded input; FP32 result."""
    return mm(act_quant(bf16(x)), w)


def rope_table(cfg, n: int, compressed: bool):
    """cos, sin [n, rope/2] FP32: theta 1e4 (ratio-0 layers) or 1.6e5 with YaRN, no mscale."""
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if compressed:
        def corr(rot):
            return dim * math.log(cfg.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freq = freq / cfg.rope_factor * (1 - smooth) + freq * smooth
    ang = torch.arange(n, dtype=torch.float32).unsqueeze(1) * freq.unsqueeze(0)
    return torch.cos(ang), torch.sin(ang)


def rope(x, cos, sin, inverse=False):
    """Rotate adjacent pairs of the last 2*len(cos row) channels; rows of cos/sin match x's rows."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    keep, rot = x[..., :-2 * half], x[..., -2 * half:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    return bf16(torch.cat([keep, torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)], -1))


def mixes(x_hc, fn, scale, base, cfg):
    """(pre, post, comb) of one mHC site; comb[t, j, k] mixes residual lane j into output lane k."""
    t, hc, d = x_hc.shape
    f = x_hc.reshape(t, hc * d)
    m = mm(f, fn) * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = torch.softmax((m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(t, hc, hc), -1) + cfg.hc_eps
    c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(2, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def collapse(x_hc, pre):
    """Weighted lane sum in FP32, device order (x0 p0 + x1 p1) + (x2 p2 + x3 p3), then BF16."""
    y = [x_hc[:, i] * pre[:, i:i + 1] for i in range(x_hc.shape[1])]
    acc = (y[0] + y[1]) + (y[2] + y[3]) if len(y) == 4 else sum(y[1:], y[0])
    return bf16(acc)


def expand(sub, x_hc, post, comb):
    """out[k] = post[k] sub + sum_j comb[j, k] x_hc[j], then BF16."""
    mixed = (comb.double().unsqueeze(-1) * x_hc.double().unsqueeze(2)).sum(1).float()
    return bf16(post.unsqueeze(-1) * sub.unsqueeze(1) + mixed)


# ---- Engram --------------------------------------------------------------------------------------

def _primes_from(start: int, count: int) -> list[int]:
    out, n = [], start
    while len(out) < count:
        if n > 1 and all(n % f for f in range(2, int(n ** 0.5) + 1)):
            out.append(n)
        n += 1
    return out


def engram_hash(cfg, layer: int, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), (max_ngram-1)*heads] table row ids of every position (spec 04 §3).

    The token map is the stub tokenizer's (id mod compressed vocabulary); pad = map[pad id]."""
    heads, n = cfg.engram_n_heads, cfg.engram_max_ngram_size
    per = (n - 1) * heads
    primes_all = _primes_from(cfg.engram_vocab_size, per * len(cfg.engram_layer_ids))
    i = list(cfg.engram_layer_ids).index(layer)
    primes = primes_all[i * per:(i + 1) * per]
    offsets = [sum(primes[:c]) for c in range(per)]
    bound = max(1, (2 ** 63 - 1) // cfg.engram_compressed_vocab_size // 2)
    mult = [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, n, dtype=np.int64)]
    comp = [t % cfg.engram_compressed_vocab_size for t in tokens]
    pad = cfg.engram_pad_token_id % cfg.engram_compressed_vocab_size

    def wrap(v):  # int64 two's complement
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    out = torch.zeros(len(tokens), per, dtype=torch.int64)
    for p in range(len(tokens)):
        look = [comp[p - s] if p - s >= 0 else pad for s in range(n)]
        h = wrap(look[0] * mult[0])
        for s in range(1, n):
            h = wrap(h ^ wrap(look[s] * mult[s]))
            for head in range(heads):
                c = (s - 1) * heads + head
                out[p, c] = h % primes[c] + offsets[c]
    return out


def engram(cfg, W, layer, x_hc, ids):
    """x_hc + sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) * value per lane, then BF16."""
    e = f"layers.{layer}.engram."
    t, hc, d = x_hc.shape
    lookup = bf16(W[e + "embed"][ids].reshape(t, -1))
    kv = bf16(mx_linear(lookup, W[e + "wkv"]))
    key, value = kv[:, :hc * d].reshape(t, hc, d), kv[:, hc * d:]
    eps = cfg.rms_norm_eps
    dot = (x_hc * (W[e + "q_weight"] * W[e + "k_weight"]) * key).sum(-1)
    dot = dot * torch.rsqrt(x_hc.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) * d ** -0.5
    g = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return bf16(x_hc + g.unsqueeze(-1) * value.unsqueeze(1))


# ---- attention -----------------------------------------------------------------------------------

@dataclass
class Source:
    """A KV source's compressed rows of one request, by logical index j (group j covers positions
    j*r .. j*r+r-1): decoded compressed KV and index keys."""
    ratio: int
    kv: torch.Tensor      # [n_rows, hd]
    key: torch.Tensor     # [n_rows, ihd]


def compressor(cfg, W, layer, ratio, a) -> torch.Tensor:
    """Unrotated latents of every completed group of the request's positions."""
    p = f"layers.{layer}.attn.compressor."
    if ratio == 1:
        return rms_norm(bf16(mm(a, W[p + "wkv.weight"])), W[p + "norm.weight"], cfg.rms_norm_eps)
    g = a.shape[0] // 2
    kv = mm(a[:2 * g], W[p + "wkv.weight"]).reshape(g, 2, -1)
    sc = mm(a[:2 * g], W[p + "wgate.weight"]).reshape(g, 2, -1)
    m = sc.amax(1, keepdim=True)
    e = torch.exp(sc - m)
    pooled = bf16((e * kv).sum(1) / e.sum(1))
    return rms_norm(pooled, W[p + "norm.weight"], cfg.rms_norm_eps)


def build_source(cfg, W, layer, ratio, a, cos_c, sin_c) -> Source:
    """Compressed KV = FP4(E4M3, 16) of RoPE(latent); index key = FP4(E8M0, 32) of
    RoPE(RMSNorm(bf16(latent wk))), both at the group's first position j*r."""
    p = f"layers.{layer}.attn."
    lat = compressor(cfg, W, layer, ratio, a)
    first = torch.arange(lat.shape[0]) * ratio
    c, s = cos_c[first], sin_c[first]
    key = rms_norm(bf16(mm(lat, W[p + "indexer.wk.weight"])), W[p + "indexer.k_norm.weight"], cfg.rms_norm_eps)
    return Source(ratio, bf16(fp4_qdq(rope(lat, c, s), 16, "e4m3")), bf16(fp4_qdq(rope(key, c, s), 32, "e8m0")))


def index_scores(cfg, W, layer, a, qr, cos, sin, src: Source) -> torch.Tensor:
    """S[t, j] for all positions t and compressed rows j; -inf where j >= floor((t+1)/r)."""
    p = f"layers.{layer}.attn.indexer."
    n, nh, ihd = a.shape[0], cfg.index_n_heads, cfg.index_head_dim
    q = rope(bf16(mx_linear(qr, W[p + "wq_b"])).reshape(n, nh, ihd), cos, sin)
    q = bf16(fp4_qdq(q.reshape(n, -1), 32, "e8m0")).reshape(n, nh, ihd)
    wts = bf16(bf16(mm(a, W[p + "weights_proj.weight"])) * (ihd ** -0.5 * nh ** -0.5))
    dot = bf16(torch.einsum("thd,jd->thj", q.double(), src.key.double()).float())
    s = bf16((bf16(torch.relu(dot) * wts.unsqueeze(-1))).sum(1))
    lens = (torch.arange(n) + 1) // src.ratio
    return s.masked_fill(torch.arange(src.key.shape[0]).unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] ascending logical positions of the k best finite scores (-1 padded); at equal scores
    the lower position wins."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.long)
    for t in range(scores.shape[0]):
        ok = torch.nonzero(torch.isfinite(scores[t])).flatten().tolist()
        best = sorted(ok, key=lambda j: (-float(scores[t, j]), j))[:k]
        out[t, :len(best)] = torch.tensor(sorted(best), dtype=torch.long)
    return out


def candidates(cfg, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-20 block mask [T, P]: best `candidate_topk_blocks` blocks by max score, the block of
    the newest visible row pinned (+inf), only blocks with a finite score; and the block scores."""
    t, p = scores.shape
    b = cfg.candidate_block_size
    nb = -(-p // b)
    mask = torch.zeros(t, p, dtype=torch.bool)
    bscores = torch.full((t, nb), -math.inf)
    for i in range(t):
        n = int(torch.isfinite(scores[i]).sum())
        if n == 0:
            continue
        for blk in range(nb):
            bscores[i, blk] = math.inf if blk == (n - 1) // b else float(scores[i, blk * b:(blk + 1) * b].max())
        keep = sorted([(float(v), blk) for blk, v in enumerate(bscores[i]) if v > -math.inf],
                      key=lambda x: (-x[0], x[1]))
        for _, blk in keep[:cfg.candidate_topk_blocks]:
            mask[i, blk * b:(blk + 1) * b] = True
    return mask, bscores


def sparse_attention(q, slots_kv, slot_ok, sink, scale):
    """q [T, H, hd]; slots_kv [T, S, hd] (keys = values); slot_ok [T, S]; raw slot list tiled by 64."""
    t, h, d = q.shape
    m = torch.full((t, h), NEG)
    den = torch.zeros(t, h)
    num = torch.zeros(t, h, d)
    for s0 in range(0, slots_kv.shape[1], TILE):
        k = slots_kv[:, s0:s0 + TILE]
        ok = slot_ok[:, s0:s0 + TILE].unsqueeze(1)
        lg = (torch.einsum("thd,tkd->thk", q.double(), k.double()).float() * scale).masked_fill(~ok, NEG)
        m2 = torch.maximum(m, lg.amax(-1))
        c = torch.exp(m - m2)
        pr = torch.exp(lg - m2.unsqueeze(-1)) * ok
        den = den * c + pr.sum(-1)
        num = num * c.unsqueeze(-1) + torch.einsum("thk,tkd->thd", bf16(pr).double(), k.double()).float()
        m = m2
    out = num / (den + torch.exp(sink.unsqueeze(0) - m)).unsqueeze(-1)
    return bf16(torch.where(slot_ok.any(1).view(t, 1, 1), out, torch.zeros_like(out)))


@dataclass
class LayerState:
    """What later layers of the same forward read: sources by KV layer, Top-K by index layer, the
    candidate mask."""
    sources: dict
    topk: dict
    cand: torch.Tensor | None = None


def attention(cfg, W, spec, a, state: LayerState, prompt_len: int):
    """One attention sub-layer over all positions of one request -> (out [n, D] BF16, Top-K or None,
    index scores or None, (candidate mask, block scores) or None). a: the sub-layer input of every
    position 0..n-1, of which the first prompt_len were the prompt."""
    p, eps, n = f"layers.{spec.layer}.attn.", cfg.rms_norm_eps, a.shape[0]
    cos, sin = rope_table(cfg, n, spec.ratio > 0)
    H, hd = cfg.num_attention_heads, cfg.head_dim
    qr = rms_norm(bf16(mx_linear(a, W[p + "wq_a"])), W[p + "q_norm.weight"], eps)
    q = rope(bf16(mx_linear(qr, W[p + "wq_b"])).reshape(n, H, hd), cos, sin)
    kv = rope(rms_norm(bf16(mx_linear(a, W[p + "wkv"])), W[p + "kv_norm.weight"], eps), cos, sin)
    win_kv = bf16(act_quant(kv))                         # the window cache's MXFP8 round trip
    w = cfg.sliding_window
    pos = torch.arange(n)
    wl = torch.minimum(pos + 1, torch.tensor(w))
    col = torch.arange(w)
    wpos = pos.unsqueeze(1) - wl.unsqueeze(1) + 1 + col   # window list: positions ascending, then -1
    wok = col.unsqueeze(0) < wl.unsqueeze(1)
    slots_kv = win_kv[wpos.clamp(0, n - 1)] * wok.unsqueeze(-1)
    slot_ok = wok
    top = mask = sc = None
    if spec.ratio > 0:
        if spec.layer in cfg.kv_source_layer_ids:
            state.sources[spec.layer] = build_source(cfg, W, spec.layer, spec.ratio, a, cos, sin)
        src = state.sources[spec.kv_source]
        if spec.layer in cfg.index_source_layer_ids:
            sc = index_scores(cfg, W, spec.layer, a, qr, cos, sin, src)
            if spec.layer == cfg.candidate_source_layer_id:
                mask = candidates(cfg, sc)
                state.cand = mask[0]
            elif spec.candidate_source is not None:
                sc = sc.masked_fill(~state.cand, float("-inf"))
            top = top_k(sc, cfg.index_topk)
            state.topk[spec.layer] = top
        sel = state.topk[spec.index_source]
        cmp_kv, cmp_ok = src.kv[sel.clamp_min(0)] * (sel >= 0).unsqueeze(-1), sel >= 0
        # prompt rows list min(prompt, window) window slots, then the Top-K slots; the slots after
        # them are empty (no key, no effect on the tiles before)
        w1 = min(prompt_len, w)
        short = (pos < prompt_len).view(n, 1)
        long_kv, long_ok = torch.cat([slots_kv, cmp_kv], 1), torch.cat([slot_ok, cmp_ok], 1)
        short_kv = torch.cat([slots_kv[:, :w1], cmp_kv, torch.zeros_like(slots_kv[:, w1:])], 1)
        short_ok = torch.cat([slot_ok[:, :w1], cmp_ok, torch.zeros_like(slot_ok[:, w1:])], 1)
        slots_kv = torch.where(short.unsqueeze(-1), short_kv, long_kv)
        slot_ok = torch.where(short, short_ok, long_ok)
    att = sparse_attention(q, slots_kv, slot_ok, W[p + "attn_sink"], hd ** -0.5)
    att = rope(att, cos, sin, inverse=True)
    g = cfg.o_groups
    wo_a = W[p + "wo_a"].reshape(g, cfg.o_lora_rank, -1)
    z = bf16(torch.einsum("tgi,gri->tgr", att.reshape(n, g, -1).double(), wo_a.double()).float()).reshape(n, -1)
    return bf16(mx_linear(z, W[p + "wo_b"])), top, sc, mask


# ---- MoE -----------------------------------------------------------------------------------------

def router(cfg, W, layer, x):
    """(experts [T, k] in descending biased score, lower id first at ties; weights [T, k]; biased
    scores [T, n_experts])."""
    f = f"layers.{layer}.ffn.gate."
    z = mm(x, W[f + "weight"])
    s = torch.sqrt(torch.clamp_min(z, 0) + torch.log1p(torch.exp(-z.abs())))
    biased = s + W[f + "bias"]
    idx = torch.zeros(x.shape[0], cfg.num_experts_per_tok, dtype=torch.long)
    for t in range(x.shape[0]):
        order = sorted(range(biased.shape[1]), key=lambda e: (-float(biased[t, e]), e))
        idx[t] = torch.tensor(order[:cfg.num_experts_per_tok])
    picked = torch.gather(s, 1, idx)
    return idx, cfg.routed_scaling_factor * picked / (picked.sum(-1, keepdim=True) + 1e-20), biased


def swiglu(cfg, W, pre, x, weight=None):
    lim = cfg.swiglu_limit
    g = bf16(mx_linear(x, W[pre + "w1"])).clamp(max=lim)
    u = bf16(mx_linear(x, W[pre + "w3"])).clamp(-lim, lim)
    h = g * torch.sigmoid(g) * u
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    return bf16(mx_linear(bf16(h), W[pre + "w2"]))


def moe(cfg, W, layer, x):
    """-> (BF16 output, experts, weights, biased scores): routed outputs summed in ascending expert id, + shared."""
    idx, wts, biased = router(cfg, W, layer, x)
    f = f"layers.{layer}.ffn."
    acc = torch.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        t, k = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            acc[t] += swiglu(cfg, W, f"{f}experts.{e}.", x[t], wts[t, k])
    return bf16(acc + swiglu(cfg, W, f + "shared_experts.", x)), idx, wts, biased


# ---- head ----------------------------------------------------------------------------------------

def embed(W, ids, hc):
    return W["embed.weight"][ids].unsqueeze(1).expand(-1, hc, -1).contiguous()


def initial_pre(t, hc):
    p = torch.zeros(t, hc)
    p[:, 0] = 1
    return p


def head(cfg, W, x_hc, pre):
    return mm(rms_norm(collapse(x_hc, pre), W["norm.weight"], cfg.rms_norm_eps), W["head.weight"])

