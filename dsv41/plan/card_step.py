"""A decode step of a model the graph builder does not size, from its card (``dsv41.plan.cards``):
the kernels one card runs, in order, each priced with the plan's own primitives.

Decode is a chain: each kernel waits on the one before it (unless the deployment overlaps its
all-to-all with compute, ``OVERLAPS``: then each MoE layer is priced by ``tbo_layer``), so the step on
the busiest card is the sum of its kernels, each ``launches`` device gaps, then its hand-off's fixed cost and bytes, then its
body, max(bytes / achievable bandwidth, FLOPs / achievable rate) by the kernel's latency class
(``latency.body_us``, the graph's own). Launch counts follow the rule of ``dsv41.kernels.record``
(counted there on vLLM's DeepSeek-V3.2 decode path, which is V3's MLA plus an indexer): a quantised
linear is two kernels (activation quantisation, GEMM), a norm, RoPE, cache write, top-k or
activation one, attention decode two (metadata, kernel), a dispatch two, the experts four, a combine
two, a collective one. The hand-offs are the deployment's ``scheme`` (``latency.SCHEMES``), priced by
``latency.all_reduce_call_us``, ``collective_call_us`` and ``a2a_call_us`` as the graph's are; the
routed experts' FLOPs and all-to-all bytes carry the busiest rank's load (``primitives.moe_imbalance``),
and the weights a card reads are its experts' expected share touched by the step's tokens (each picks
``top_k`` distinct of ``n_routed``; a card holds n_routed / ep experts, a fraction where EP does not
divide them: redundant replicas are not modelled). Host, graph replay or eager issue, and the sampled tokens' sync are
the profile's, as in ``latency.release_times``.

Rows: a DP group serves ``batch`` requests of ``1 + draft`` rows each. Under ``all_reduce`` every card
of the (single) TP group holds every row: attention heads, the shared expert and the dense MLP split
``tp`` ways, the experts' partial sums and the attention output all-reduced (with fewer EP ranks than TP, each
expert split TP / EP ways). Under ``all_to_all`` the
attention input is all-gathered over the TP group (when ``tp`` > 1) and its output reduce-scattered, and
each card's slab of rows is dispatched to the experts' cards and combined back (DP attention with an
all-to-all backend). A step with drafts then runs the model's MTP layer once per draft on one row a
request (a draft model's decode, as SGLang's EAGLE/NEXTN worker runs ``num_steps`` draft passes).

Bytes: weights at the deployment's ``precision`` (``PRECISION``), activations BF16 (a dispatch's in the
format the stack sends, ``A2A_FORMATS``), the MLA cache in ``KV_FORMATS`` (576 values a token a
layer; BF16, what vLLM and SGLang store by default, unless the deployment asks for FP8), V4's caches 1 byte a value with a
BF16 rope part (its FP8 cache). The weights are the only per-model numbers: every other constant is
the device profile's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from dsv41.plan.cards import ModelCard
from dsv41.plan.latency import DISPATCH, PARTS, SCHEMES, a2a_call_us, all_reduce_call_us, body_us, \
    collective_call_us
from dsv41.plan.primitives import moe_imbalance
from dsv41.plan.sizing import NodeCost

ACT = 2                       # bytes per activation value (BF16)
# bytes per weight value by role (dsv41.plan.cards): FP8 with one FP32 scale per 128x128 block
# (DeepSeek's release), INT8 W8A8 (per-channel scales, negligible), MXFP4 experts (E8M0 per 32),
# NVFP4 experts (ModelOpt's layout: an E4M3 scale per 16 values and one FP32 per tensor, the attention,
# shared expert and head left in the release's FP8, as the ModelOpt checkpoints' ignore list has it)
_FP8 = 1 + 4 / (128 * 128)
PRECISION = {
    "fp8": {"linear": _FP8, "expert": _FP8, "bf16": 2.0},
    "int8": {"linear": 1.0, "expert": 1.0, "bf16": 2.0},
    "fp4_experts": {"linear": _FP8, "expert": 0.5 + 1 / 32, "bf16": 2.0},
    "nvfp4_experts": {"linear": _FP8, "expert": 0.5 + 1 / 16, "bf16": 2.0},
}

# Bytes one dispatched (token, expert) message takes on the wire, by the format the stack sends:
# "bf16" the hidden row in BF16 plus its expert index and weight (what the graph counts); "fp8" DeepEP's
# low-latency dispatch message (deepseek-ai/DeepEP csrc/kernels/internode_ll.cu, num_bytes_per_msg: a
# 16-byte int4 header, the row in FP8, one FP32 scale per 128 channels); "int8" the row quantised to INT8
# before it is sent, with one FP32 scale (CloudMatrix-Infer's FusedDispatch "early quantization").
# A combine sends the experts' outputs in BF16 in every stack here (DeepEP's combine; DeepSeek's and
# RTP-LLM's reports say so of their services).
A2A_FORMATS = {
    "bf16": lambda h: h * ACT + 8,
    "fp8": lambda h: 16 + h + h / 128 * 4,
    "int8": lambda h: h + 4 + 8,
}
# How a step overlaps the all-to-all with compute: "none" (each kernel waits on the one before it), or
# "tbo": the MoE layers run as two micro-batches of half the requests, each one's dispatch and combine
# in flight while the other computes (DeepSeek's decode, its day-6 inference-system overview: attention
# split in two steps, a 5-stage pipeline; tbo_layer below).
OVERLAPS = ("none", "tbo")
# Bytes one value of MLA's latent cache takes: BF16 (what vLLM and SGLang store by default), or FP8
# where the stack's command asks for it (SGLang's --kv-cache-dtype fp8_e4m3: one byte a value, a
# per-tensor scale). V4's caches are FP8 already (V4_ROW).
KV_FORMATS = {"bf16": 2.0, "fp8": 1.0}


@dataclass(frozen=True)
class Kernel:
    """One kernel group on the card: ``weights`` role -> parameters it reads (routed experts: all of
    the card's, ``touched`` the expected fraction read), ``other_bytes`` activations and cache rows
    read and written, ``handoff``: what it receives first (kind, then its sizes)."""
    what: str
    klass: str                       # latency class: matmul, gather, vector
    launches: int
    weights: dict = field(default_factory=dict)
    other_bytes: float = 0.0
    flops: dict = field(default_factory=dict)
    routed: bool = False
    touched: float = 1.0
    handoff: tuple = ()              # ("all_reduce", bytes per rank, ranks) | ("collective", bytes) | ("a2a", bytes)
    stage: str = "a1"                # its block in a two-micro-batch overlap (OVERLAPS): a0, a1, mlp, shared

    def weight_bytes(self, precision: dict) -> float:
        return sum(n * precision[role] * (self.touched if role == "expert" else 1.0)
                   for role, n in self.weights.items())


@dataclass(frozen=True)
class Shape:
    """One deployment of a card: its layout, rows, context and hand-offs."""
    card: ModelCard
    tp: int
    dp: int
    ep: int
    batch: int                       # requests per DP group
    rows: int                        # rows per request (1 + drafts)
    context: int
    scheme: str
    a2a: str = "bf16"                # what a dispatch sends a token as (A2A_FORMATS); a combine sends BF16
    experts_per_rank: float = 0.0    # routed experts a rank holds, redundant replicas counted (0: n_routed / ep)
    kv: str = "bf16"                 # MLA's latent cache format (KV_FORMATS)

    @property
    def reduce(self) -> bool:
        return self.scheme == "all_reduce"

    @property
    def attn_rows(self) -> int:
        """Rows each card's attention runs (every row of its DP group: heads are what TP splits)."""
        return self.batch * self.rows

    @property
    def ffn_rows(self) -> float:
        """Rows a card runs its shared expert and gate on: all of them under all_reduce, its slab else."""
        return self.attn_rows if self.reduce else self.attn_rows / self.tp

    @property
    def tokens(self) -> int:
        """Rows routed to the experts in the EP world per layer."""
        return self.dp * self.attn_rows

    @property
    def expert_split(self) -> int:
        """How many ways each routed expert's weights are split: under all_reduce with fewer EP ranks
        than TP (SGLang's --ep-size 1 at TP8: every expert tensor-parallel), TP / EP; else 1."""
        return self.tp // self.ep if self.reduce else 1

    @property
    def split(self) -> int:
        """How many ways the shared expert and dense MLP weights are split (TP under all_reduce)."""
        return self.tp if self.reduce else 1


def _tp_handoffs(s: Shape, what: str, stage: str = "a1") -> list[Kernel]:
    """The hand-off after a TP-split block: an all-reduce (all_reduce), or under all_to_all the next
    block's all-gather and this one's reduce-scatter (when tp > 1)."""
    if s.tp == 1:
        return []
    rows = s.attn_rows * s.card.hidden * ACT
    if s.reduce:
        return [Kernel(f"{what} all-reduce", "vector", 1, other_bytes=2 * rows,
                       handoff=("all_reduce", rows / s.tp, s.tp), stage=stage)]
    part = rows * (s.tp - 1) / s.tp
    return [Kernel(f"{what} all-gather", "vector", 1, other_bytes=rows, handoff=("collective", part), stage=stage),
            Kernel(f"{what} reduce-scatter", "vector", 1, other_bytes=rows, handoff=("collective", part),
                   stage=stage)]


def _mla(s: Shape, rows: float, batch: float) -> list[Kernel]:
    """DeepSeek-V3's MLA, absorbed for decode (vLLM's and SGLang's decode path): the latent cache is
    read once a request by every TP card (one latent for all heads), the heads split over TP, the
    up-projections kv_b kept BF16 for the two absorbed batched GEMMs."""
    c, h, nh = s.card, s.card.hidden, s.card.heads / s.tp
    qk, latent = c.qk_nope + c.qk_rope, c.kv_lora + c.qk_rope
    a = c.q_lora + latent
    cache = batch * s.context * latent * KV_FORMATS[s.kv]
    return [
        Kernel("attn norm", "vector", 1, other_bytes=2 * rows * h * ACT, stage="a0"),
        Kernel("q_a + kv_a", "matmul", 2, {"linear": h * a}, rows * (h + a) * ACT, {"mx": 2 * rows * h * a},
               stage="a0"),
        Kernel("q/kv norms, RoPE, cache write", "vector", 4, other_bytes=rows * (2 * a + latent) * ACT, stage="a0"),
        Kernel("q_b", "matmul", 2, {"linear": c.q_lora * nh * qk}, rows * (c.q_lora + nh * qk) * ACT,
               {"mx": 2 * rows * c.q_lora * nh * qk}, stage="a0"),
        Kernel("absorbed W_UK", "matmul", 1, {"bf16": nh * c.qk_nope * c.kv_lora},
               rows * nh * (c.qk_nope + c.kv_lora) * ACT, {"dense": 2 * rows * nh * c.qk_nope * c.kv_lora},
               stage="a0"),
        Kernel("MLA decode", "matmul", 2, other_bytes=cache + rows * nh * (latent + c.kv_lora) * ACT,
               flops={"dense": 2 * rows * nh * s.context * (latent + c.kv_lora)}),
        Kernel("absorbed W_UV", "matmul", 1, {"bf16": nh * c.kv_lora * c.v_head},
               rows * nh * (c.kv_lora + c.v_head) * ACT, {"dense": 2 * rows * nh * c.kv_lora * c.v_head}),
        Kernel("o_proj", "matmul", 2, {"linear": nh * c.v_head * h}, rows * (nh * c.v_head + h) * ACT,
               {"mx": 2 * rows * nh * c.v_head * h}),
    ]


V4_ROW = 448 + 64 * 2         # bytes of one V4 cache row: FP8 values, the rope part BF16


def _v4(s: Shape, layer: int, rows: float, batch: float) -> list[Kernel]:
    """DeepSeek-V4's attention (the node kinds of the V4.1 graph, ``dsv41.kernels.nodes.attention``):
    each request reads its window rows and, on a ratio-4 layer, the indexer's keys of every
    compressed position and the top-k compressed rows they pick, on a ratio-128 layer every
    compressed row; heads split over TP, q/kv/compressor/indexer weights replicated."""
    c, h, nh = s.card, s.card.hidden, s.card.heads / s.tp
    ratio, d = c.compress_ratios[layer], c.head_dim
    kept = min(s.context, c.window)
    out = [Kernel("q_proj", "matmul", 5, {"linear": h * c.q_lora + c.q_lora * nh * d},
                  rows * (h + c.q_lora + nh * d) * ACT, {"mx": 2 * rows * (h * c.q_lora + c.q_lora * nh * d)},
                  stage="a0"),
           Kernel("kv_proj", "matmul", 4, {"linear": h * d}, rows * (h + d) * ACT, {"mx": 2 * rows * h * d},
                  stage="a0")]
    if ratio:
        out.append(Kernel("compressor", "matmul", 3, {"bf16": (2 if ratio == 4 else 1) * h * d},
                          rows * (h + d) * ACT, {"dense": 2 * rows * h * d * (2 if ratio == 4 else 1)}, stage="a0"))
    out.append(Kernel("cache writes", "vector", 2, other_bytes=rows * V4_ROW * 2, stage="a0"))
    if ratio == 4:
        n_keys = s.context // ratio
        ih, idim = c.index_heads, c.index_dim
        out += [Kernel("indexer", "matmul", 5, {"linear": c.q_lora * ih * idim, "bf16": h * ih + 2 * h * idim},
                       batch * n_keys * idim + rows * ih * idim * ACT,
                       {"mx": 2 * rows * (c.q_lora * ih * idim + ih * n_keys * idim)}, stage="a0"),
                Kernel("top-k", "vector", 1, other_bytes=rows * n_keys * 4, stage="a0")]
        kept += min(n_keys, c.index_topk)
    elif ratio:
        kept += s.context // ratio
    out += [Kernel("sparse attention", "gather", 2, other_bytes=batch * kept * V4_ROW + rows * nh * d * 2 * ACT,
                   flops={"dense": 4 * rows * nh * kept * d}),
            Kernel("o_proj", "matmul", 4, {"linear": nh * d * c.o_lora + c.o_groups * c.o_lora * h / s.tp},
                   rows * (nh * d + h) * ACT, {"mx": 2 * rows * (nh * d * c.o_lora + c.o_groups * c.o_lora * h / s.tp)})]
    return out


def _hc(s: Shape, rows: float, stage: str) -> list[Kernel]:
    """V4's mHC around a sublayer (the V4.1 graph's hc.mixes, hc.pre, hc.post): the mix GEMM over
    the ``hc_mult`` residual streams, their reduction, then their update."""
    c = s.card
    streams, mix = rows * c.hc_mult * c.hidden * ACT, (2 + c.hc_mult) * c.hc_mult
    return [Kernel("hc mixes", "vector", 3, {"bf16": mix * c.hc_mult * c.hidden}, streams,
                   {"vector": 2 * rows * mix * c.hc_mult * c.hidden}, stage=stage),
            Kernel("hc pre", "vector", 1, other_bytes=streams + rows * c.hidden * ACT, stage=stage),
            Kernel("hc post", "vector", 1, other_bytes=2 * streams, stage=stage)]


def _ffn(s: Shape, layer: int, rows: float) -> list[Kernel]:
    """The dense MLP (TP-split) or the MoE: gate, dispatch, the card's experts, shared expert, combine."""
    c, h = s.card, s.card.hidden
    norm = [Kernel("ffn norm", "vector", 1, other_bytes=2 * rows * h * ACT)]
    if layer < c.dense_layers:
        i = c.dense_inter / s.tp
        return norm + [Kernel("dense MLP", "matmul", 5, {"linear": 3 * h * i}, rows * (h + 3 * i) * ACT,
                              {"mx": 6 * rows * h * i}, stage="mlp")] + _tp_handoffs(s, "MLP", "mlp")
    slab, local = rows if s.reduce else rows / s.tp, s.experts_per_rank or c.n_routed / s.ep
    tokens = s.dp * rows
    pairs = tokens * c.top_k / s.ep
    touched = 1 - (1 - c.top_k / c.n_routed) ** tokens
    expert = 3 * h * c.moe_inter / s.expert_split
    shared = c.n_shared * expert / s.split
    remote_share = (s.ep - 1) / s.ep
    out = norm + [
        Kernel("gate", "matmul", 2, {"bf16": c.n_routed * h}, slab * h * ACT, {"dense": 2 * slab * h * c.n_routed}),
        Kernel("dispatch", "vector", 2, other_bytes=2 * slab * c.top_k * h * ACT),
        Kernel("experts", "matmul", 4, {"expert": local * expert}, pairs * (h * 4 + 20), {"mx": 2 * pairs * expert},
               routed=True, touched=touched,
               handoff=() if s.reduce else ("a2a", pairs * remote_share * A2A_FORMATS[s.a2a](h)), stage="mlp"),
        Kernel("shared expert", "matmul", 5, {"linear": shared}, slab * (h + 3 * c.moe_inter / s.split) * ACT,
               {"mx": 2 * slab * shared}, stage="shared"),
        Kernel("combine", "vector", 2, other_bytes=slab * (c.top_k + 2) * h * ACT,
               handoff=("all_reduce", rows * h * ACT / s.tp, s.tp) if s.reduce
               else ("a2a", slab * c.top_k * remote_share * (h * ACT + 4)), routed=not s.reduce, stage="mlp"),
    ]
    return out


def layer_kernels(s: Shape, layer: int, rows: float | None = None, batch: float | None = None) -> list[Kernel]:
    """One decoder layer's kernels on a card at ``rows`` per DP group (default: the step's)."""
    rows = s.attn_rows if rows is None else rows
    batch = s.batch if batch is None else batch
    if s.card.attention == "mla":
        attn = _mla(s, rows, batch)
    else:
        attn = _hc(s, rows, "a0") + [Kernel("attn norm", "vector", 1, other_bytes=2 * rows * s.card.hidden * ACT,
                                            stage="a0")] \
            + _v4(s, layer, rows, batch)
    ffn = _ffn(s, layer, rows)
    if s.card.attention == "v4":
        ffn = _hc(s, rows, "a1") + ffn
    return attn + _tp_handoffs(s, "attention") + ffn


def head_kernels(s: Shape, rows: float) -> list[Kernel]:
    """Embedding, final norm, the vocabulary head split over TP, the sampled token gathered."""
    c, v = s.card, s.card.vocab / s.tp
    gather = ("collective", rows * (s.tp - 1) * 8) if s.tp > 1 else ()
    return [Kernel("embed", "gather", 1, other_bytes=rows * c.hidden * 2 * ACT),
            Kernel("final norm", "vector", 1, other_bytes=2 * rows * c.hidden * ACT),
            Kernel("lm_head", "matmul", 2, {"bf16": v * c.hidden}, rows * (c.hidden + v) * ACT,
                   {"dense": 2 * rows * c.hidden * v}),
            Kernel("argmax", "vector", 2, other_bytes=rows * v * ACT, handoff=gather)]


def mtp_layer_kernels(s: Shape) -> list[Kernel]:
    """The MTP layer at one row a request: the embedding and the previous hidden state normed and
    projected (eh_proj, 2 hidden -> hidden), then one MoE decoder layer."""
    c, rows = s.card, s.batch
    return [Kernel("mtp norms", "vector", 2, other_bytes=4 * rows * c.hidden * ACT, stage="a0"),
            Kernel("mtp eh_proj", "matmul", 2, {"linear": 2 * c.hidden * c.hidden}, 3 * rows * c.hidden * ACT,
                   {"mx": 4 * rows * c.hidden * c.hidden}, stage="a0")] + layer_kernels(s, c.layers - 1, rows, rows)


def step_kernels(s: Shape) -> list[Kernel]:
    """Every kernel of one decode step on a card, in order: the backbone, the head, the drafts."""
    out = []
    for layer in range(s.card.layers):
        out += layer_kernels(s, layer)
    out += head_kernels(s, s.attn_rows)
    for _ in range(s.rows - 1):          # one draft pass each: the MTP layer, then the shared head
        out += mtp_layer_kernels(s) + head_kernels(s, s.batch)
    return out


def weight_params(card: ModelCard) -> dict[str, float]:
    """Role -> the backbone's parameters as the step's kernels hold them on one card serving the
    whole model (the embedding counted once, the head once; the MTP layer not)."""
    s = Shape(card, 1, 1, 1, 1, 1, 1, "all_to_all")
    out = {"linear": 0.0, "expert": 0.0, "bf16": float(card.vocab * card.hidden)}    # the embedding table
    for k in step_kernels(s):
        for role, n in k.weights.items():
            out[role] += n
    return out


def active_params(card: ModelCard) -> float:
    """Parameters one token uses: all but the embedding (a row lookup) and the routed experts it
    does not pick (top_k of n_routed)."""
    p = weight_params(card)
    return sum(p.values()) - card.vocab * card.hidden - p["expert"] * (1 - card.top_k / card.n_routed)


def cache_bytes(card: ModelCard, context: int, kv: str = "bf16") -> float:
    """One request's cache at ``context``: MLA's latent rows (in ``kv``, KV_FORMATS), or V4's window,
    compressed rows and index keys."""
    if card.attention == "mla":
        return context * card.layers * (card.kv_lora + card.qk_rope) * KV_FORMATS[kv]
    total = 0.0
    for ratio in card.compress_ratios:
        total += min(context, card.window) * V4_ROW
        if ratio:
            total += context // ratio * V4_ROW + (context // ratio * card.index_dim if ratio == 4 else 0)
    return total


def _handoff_us(k: Kernel, s: Shape, dev, load: float) -> tuple[float, float]:
    if not k.handoff:
        return 0.0, 0.0
    kind = k.handoff[0]
    if kind == "all_reduce":
        _, per_rank, ranks = k.handoff
        return all_reduce_call_us(ranks, ranks > dev.cards_per_node, per_rank, dev)
    if kind == "collective":
        return collective_call_us(1, s.tp > dev.cards_per_node, k.handoff[1], dev)
    if s.ep == 1:                        # the experts are all on the card: nothing is sent
        return 0.0, 0.0
    on_node = min(s.ep, dev.cards_per_node)
    return a2a_call_us(on_node - 1, s.ep - on_node, k.handoff[1] * load, dev)


def _price(k: Kernel, s: Shape, dev, prec: dict, imbalance: float) -> tuple:
    """One kernel's (launch, hand-off fixed cost, hand-off bytes, body, what bounds the body), µs."""
    sync, wire = _handoff_us(k, s, dev, imbalance if k.routed else 1.0)
    cost = NodeCost(int(k.weight_bytes(prec) + k.other_bytes), 0,
                    {f: n * (imbalance if k.routed and f == "mx" else 1.0) for f, n in k.flops.items()}, 0, 0)
    body, bound = body_us(cost, dev, k.klass)
    return dev.launch_us * k.launches, sync, wire, body, bound


def _span(parts) -> float:
    return sum(p[0] + p[1] + p[2] + p[3] for p in parts)


def tbo_layer(kernels: list[Kernel], price) -> list[tuple]:
    """The critical path of one MoE layer run as DeepSeek's decode runs it (its day-6 inference-system
    overview: two micro-batches, the attention split in two steps, a 5-stage pipeline; its profile-data
    README: the all-to-all holds no SMs in decode, the RDMA runs while the other micro-batch computes).
    ``kernels`` are one micro-batch's, ``price`` gives each one's parts. The compute lane runs, per layer,
    SHARED(0) ATTN-0(1) | MLP(0) | ATTN-1(1) | SHARED(1) ATTN-0(0) | MLP(1) | ATTN-1(0) (the decode
    figure's order), with ATTN-0 the projections before core attention and ATTN-1 core attention, the
    output projection and the gate; a micro-batch's dispatch is in flight under the block after its gate
    (SHARED + ATTN-0) and its combine under the block after its experts (ATTN-1). So each micro-batch
    adds MLP + max(SHARED + ATTN-0, dispatch) + max(ATTN-1, combine): whichever lane is longer is the
    critical path there; the experts wait on their dispatch and the next attention on the combine."""
    lanes = {"a0": [], "a1": [], "mlp": [], "shared": []}
    comm = {"dispatch": [], "combine": []}
    for k in kernels:
        launch, sync, wire, body, bound = price(k)
        if k.handoff and k.handoff[0] == "a2a":      # the wire on its own lane, the kernel on the compute lane
            comm["combine" if k.what == "combine" else "dispatch"].append((0.0, sync, wire, 0.0, bound))
            sync = wire = 0.0
        lanes[k.stage].append((launch, sync, wire, body, bound))

    def longer(a, b):
        return a if _span(a) >= _span(b) else b
    one = lanes["mlp"] + longer(lanes["shared"] + lanes["a0"], comm["dispatch"]) + longer(lanes["a1"], comm["combine"])
    return one + one


def _tbo_step(s: Shape, dev, prec: dict) -> tuple[list[tuple], int, int]:
    """The parts on the critical path of a step under ``tbo``, the kernels it launches and its kernel
    groups: the dense
    layers and the head un-split (nothing to hide; DeepSeek's decode trace runs its dense layers as one
    batch), every MoE layer (the MTP layer's too) as two micro-batches of half the requests, each
    reading the weights again and launching its own kernels, their MoE load that of half the tokens."""
    half = replace(s, batch=s.batch / 2)
    full_load = moe_imbalance(s.tokens * s.card.top_k, s.ep)
    half_load = moe_imbalance(half.tokens * s.card.top_k, s.ep)
    parts, launches, groups = [], 0, 0

    def serial(kernels):
        nonlocal launches, groups
        parts.extend(_price(k, s, dev, prec, full_load) for k in kernels)
        launches, groups = launches + sum(k.launches for k in kernels), groups + len(kernels)

    def split(kernels):
        nonlocal launches, groups
        parts.extend(tbo_layer(kernels, lambda k: _price(k, half, dev, prec, half_load)))
        launches, groups = launches + 2 * sum(k.launches for k in kernels), groups + 2 * len(kernels)
    for layer in range(s.card.layers):
        (serial(layer_kernels(s, layer)) if layer < s.card.dense_layers else split(layer_kernels(half, layer)))
    serial(head_kernels(s, s.attn_rows))
    for _ in range(s.rows - 1):
        split(mtp_layer_kernels(half))
        serial(head_kernels(s, s.batch))
    return parts, launches, groups


def plan_card(card: ModelCard, tp: int, dp: int, ep: int, batch: int, context: int, dev, draft: int = 0,
              dispatch: str = "graph", scheme: str = "all_to_all", precision: str = "fp8", a2a: str = "bf16",
              overlap: str = "none", experts_per_rank: float = 0.0, kv: str = "bf16") -> dict:
    """The first-principles step of ``card`` on profile ``dev``: its time and where it goes along the
    chain (the report keys ``dsv41.plan.calibration.features`` reads), per-card HBM, the layer count.
    ``a2a``: what a dispatch sends (``A2A_FORMATS``); ``overlap``: ``OVERLAPS``; ``experts_per_rank``:
    the routed experts a rank holds where the deployment states it (with redundant replicas), else 0."""
    if scheme not in SCHEMES or dispatch not in DISPATCH or precision not in PRECISION or a2a not in A2A_FORMATS \
            or overlap not in OVERLAPS:
        raise ValueError(f"plan_card: scheme in {list(SCHEMES)}, dispatch in {list(DISPATCH)}, precision in "
                         f"{list(PRECISION)}, a2a in {list(A2A_FORMATS)}, overlap in {list(OVERLAPS)}; got "
                         f"{scheme!r}, {dispatch!r}, {precision!r}, {a2a!r}, {overlap!r}")
    if (tp * dp != ep) if scheme == "all_to_all" else (dp != 1 or tp % ep):
        raise ValueError(f"plan_card: needs ep = tp x dp (all_to_all), or dp 1 and ep dividing tp (all_reduce), "
                         f"got {tp}/{dp}/{ep} under {scheme}")
    if experts_per_rank and (scheme != "all_to_all" or experts_per_rank < card.n_routed / ep):
        raise ValueError(f"plan_card: experts_per_rank is the routed experts an EP rank holds under all_to_all, at "
                         f"least n_routed / ep = {card.n_routed / ep:g}; got {experts_per_rank!r} under {scheme}")
    if overlap != "none" and (scheme != "all_to_all" or batch < 2):
        raise ValueError(f"plan_card: overlap {overlap!r} splits an all_to_all step's requests in two: needs scheme "
                         f"all_to_all and batch >= 2, got {scheme} and batch {batch}")
    if kv not in KV_FORMATS or (kv != "bf16" and card.attention != "mla"):
        raise ValueError(f"plan_card: kv in {list(KV_FORMATS)} (a format other than bf16 only for MLA's latent "
                         f"cache; V4's caches are FP8 already), got {kv!r} for a {card.attention} card")
    s = Shape(card, tp, dp, ep, batch, 1 + draft, context, scheme, a2a, experts_per_rank, kv)
    prec = PRECISION[precision]
    imbalance = moe_imbalance(s.tokens * card.top_k, ep)
    t = dev.host_step_us + (dev.graph_launch_us if dispatch == "graph" else 0.0)
    if overlap == "tbo":
        parts, launches, n_kernels = _tbo_step(s, dev, prec)
        t += _span(parts)
        if dispatch == "eager":          # the device cannot finish before the host has issued every kernel
            t = max(t, dev.host_step_us + dev.host_launch_us * launches)
    else:
        kernels = step_kernels(s)
        n_kernels = len(kernels)
        issued, parts = t, []
        for k in kernels:
            if dispatch == "eager":
                issued += dev.host_launch_us * k.launches
                if issued > t:           # the kernel waits for the host to issue it: the chain starts again
                    t, parts = issued, []
            part = _price(k, s, dev, prec, imbalance)
            parts.append(part)
            t += _span([part])
    breakdown = dict.fromkeys(PARTS, 0.0)
    breakdown["host"] = t - _span(parts)
    for launch, sync, wire, body, bound in parts:
        breakdown["launch"] += launch
        breakdown["sync"] += sync
        breakdown["collectives"] += wire
        breakdown[bound] += body
    breakdown["sync"] += dev.token_sync_us
    held = replace(s, rows=1)
    weights = sum(n * prec[role] for k in step_kernels(held) for role, n in k.weights.items())
    weights += card.vocab * card.hidden * ACT          # the embedding table
    if draft:
        weights += sum(n * prec[role] for k in mtp_layer_kernels(held) for role, n in k.weights.items())
    return {"predicted_step_us": t + dev.token_sync_us, "breakdown_us": breakdown,
            "moe_imbalance": imbalance, "layers": card.layers, "kernels": n_kernels,
            "weights_bytes": weights, "cache_bytes": batch * cache_bytes(card, context, kv)}
