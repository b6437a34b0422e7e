"""Model presets, the 40-layer attention schedule, and the card topology.

The schedule is derived from three tuples (compress ratios, KV sources, index sources) by the rules
of the released checkpoint; nothing per layer is typed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

SWA, FULL, REINDEX, REUSE = "SWA", "FULL", "REINDEX", "REUSE"
# a dimension past this is a typo, not a model (Torch sizes and the byte counts here are 64-bit)
MAX_DIM = 2 ** 31 - 1
# Plausible ranges of the model's numeric constants: a value outside is a typo or an attack, never a model.
# Past them a step hangs (10^9 Sinkhorn iterations), or the math runs and serves garbage (an eps of
# 1e300 flattens every norm, a theta of 1e300 stops every rotation). Each range holds the released
# model's value (FLASH) with room of orders of magnitude.
RANGES = {
    "hc_sinkhorn_iters": (1, 1000), "hc_mult": (1, 64), "engram_max_ngram_size": (2, 16),
    "rms_norm_eps": (1e-30, 0.1), "hc_eps": (1e-30, 0.1), "rope_theta": (1.0, 1e9), "compress_rope_theta": (1.0, 1e9),
    "rope_factor": (1.0, 1e4), "routed_scaling_factor": (1e-3, 1e3), "swiglu_limit": (1e-3, 1e6),
    "beta_fast": (1, 1e4), "beta_slow": (1, 1e4),
}
# Counts that size a step's work or memory (tensors allocated per step, names enumerated at load) and are
# not pinned by a tensor's shape in the checkpoint: past these a load or a step asks for gigabytes or
# hangs enumerating names (sliding_window 10^9: an 8 GB cache; n_routed_experts 10^9: billions of
# expert tensor names). Each holds FLASH's value with at least an order of magnitude of room; a DSpark
# block is the drafts of one step (acceptance falls geometrically: past tens none are kept).
COUNTS = {
    "n_routed_experts": 65536, "sliding_window": 65536, "index_topk": 65536, "block_size": 65536,
    "candidate_topk_blocks": 1 << 20, "candidate_block_size": 65536, "index_score_leaf": 1 << 24,
}
DSPARK_COUNTS = {"dspark_block_size": 64, "dspark_markov_rank": MAX_DIM, "dspark_n_routed_experts": 65536}
MAX_MTP_LAYERS = 64


class ConfigError(ValueError):
    """A config field out of its range; ``field`` names it (config.json maps it to its key)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class LayerSpec:
    layer: int
    ratio: int
    mode: str
    kv_source: int | None
    index_source: int | None
    candidate_source: int | None  # set on REINDEX layers: they select inside its candidate mask

    @property
    def kind(self) -> str:
        """Attention leaf name, e.g. ``swa``, ``c2a_full``, ``c1a_reindex``."""
        if self.mode == SWA:
            return "swa"
        return f"c{self.ratio}a_{self.mode.lower()}"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    beta_fast: int
    beta_slow: int
    original_max_position_embeddings: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    engram_layer_ids: tuple[int, ...]
    engram_vocab_size: int
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    # DSpark, the model's own drafter: n_mtp_layers stages stored as mtp.0.. after the backbone (0: none)
    n_mtp_layers: int = 0
    dspark_block_size: int = 0            # draft rows per block: the last sampled token, then noise tokens
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()   # layers whose attention input (lane mean) feeds stage 0
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    # cache layout constants (serving ABI, not model math; a deployment's capacity: ``dsv41.capacity``)
    block_size: int = 128            # paged-cache rows per block
    state_capacity: int = 4          # ratio-2 compressor ring slots per request
    index_score_budget_bytes: int = 512 * 1024 * 1024
    index_score_leaf: int = 8192       # score rows are padded to a multiple of this width
    mx_group: int = 32
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def o_group_in(self) -> int:
        return self.num_attention_heads * self.head_dim // self.o_groups

    @property
    def dspark(self) -> bool:
        """Whether the config has DSpark draft stages."""
        return self.n_mtp_layers > 0

    def routed_experts_of(self, name: str) -> int:
        """Routed experts of the MoE a checkpoint tensor belongs to (DSpark stages have their own count)."""
        return self.dspark_n_routed_experts if name.startswith("mtp.") else self.n_routed_experts

    @property
    def engram_ids_per_token(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def engram_lookup_dim(self) -> int:
        return self.engram_ids_per_token * self.engram_head_dim

    # ---- schedule ------------------------------------------------------------------------
    @cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        return tuple(self._layer_spec(i) for i in range(self.num_hidden_layers))

    def _source(self, layer: int, sources: tuple[int, ...]) -> int | None:
        """The largest source id <= layer whose ratio equals the layer's ratio."""
        ratio = self.compress_ratios[layer]
        if ratio == 0:
            return None
        found = [s for s in sources if s <= layer and self.compress_ratios[s] == ratio]
        return max(found) if found else None

    def _layer_spec(self, i: int) -> LayerSpec:
        ratio = self.compress_ratios[i]
        if ratio == 0:
            mode = SWA
        elif i in self.kv_source_layer_ids:
            mode = FULL
        elif i in self.index_source_layer_ids:
            mode = REINDEX
        else:
            mode = REUSE
        cand = self.candidate_source_layer_id
        present = cand < self.num_hidden_layers       # a layer prefix may end before it (no readers then)
        candidate = cand if (present and mode == REINDEX and ratio == self.compress_ratios[cand] and i > cand) \
            else None
        return LayerSpec(i, ratio, mode, self._source(i, self.kv_source_layer_ids),
                         self._source(i, self.index_source_layer_ids), candidate)

    def validate(self) -> "ModelConfig":
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise ConfigError(f"{self.name}.{name}: {rule}", name)

        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "n_routed_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "index_n_heads", "index_head_dim",
                    "index_topk", "candidate_topk_blocks", "candidate_block_size", "hc_mult",
                    "hc_sinkhorn_iters", "block_size", "state_capacity", "max_position_embeddings"]
        for name in positive + ["engram_vocab_size", "engram_n_heads", "engram_head_dim",
                                "original_max_position_embeddings", "index_score_budget_bytes",
                                "index_score_leaf"]:
            top = COUNTS.get(name, MAX_DIM)
            need(0 < getattr(self, name) <= top, name, f"must be in [1, {top}], got {getattr(self, name)}")
        # a zero, negative or non-finite eps, theta or factor gives NaN/Inf on every step
        for name in ["rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor",
                     "routed_scaling_factor", "swiglu_limit"]:
            v = getattr(self, name)
            need(math.isfinite(v) and v > 0, name, f"must be a finite number > 0, got {v}")
        for name, (low, high) in RANGES.items():
            v = getattr(self, name)
            need(low <= v <= high, name, f"must be in [{low:g}, {high:g}], got {v}")
        need(0 < self.beta_slow < self.beta_fast, "beta_fast",
             f"YaRN needs 0 < beta_slow < beta_fast, got beta_slow={self.beta_slow}, beta_fast={self.beta_fast}")
        g = self.mx_group
        for name in ["hidden_size", "q_lora_rank", "o_lora_rank", "head_dim", "moe_intermediate_size",
                     "index_head_dim", "engram_head_dim"]:
            need(getattr(self, name) % g == 0, name, f"must be a multiple of the MX group {g}")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"must divide num_attention_heads={self.num_attention_heads}")
        need(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim > 0, "qk_rope_head_dim",
             "must be even and > 0")
        need(self.head_dim > self.qk_rope_head_dim, "head_dim", "must exceed qk_rope_head_dim")
        need(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim", "must be >= qk_rope_head_dim")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"must be in [1, n_routed_experts={self.n_routed_experts}]")
        need(self.state_capacity >= 2, "state_capacity", "must be >= 2 (a ratio-2 pair needs its predecessor)")
        need(len(self.compress_ratios) == self.num_hidden_layers, "compress_ratios",
             f"needs one ratio per layer ({self.num_hidden_layers})")
        need(set(self.compress_ratios) <= {0, 1, 2}, "compress_ratios", "ratios must be in {0, 1, 2}")
        for name in ["kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"]:
            ids = getattr(self, name)
            need(all(0 <= s < self.num_hidden_layers for s in ids), name,
                 f"layer ids must be in [0, {self.num_hidden_layers - 1}]")
        for name in ["kv_source_layer_ids", "index_source_layer_ids"]:
            need(all(self.compress_ratios[s] > 0 for s in getattr(self, name)), name,
                 "every source layer must have ratio > 0")
        for spec in self.layers:
            if spec.ratio > 0:
                need(spec.kv_source is not None and spec.index_source is not None, "compress_ratios",
                     f"compressed layer {spec.layer} needs a KV and an index source of its ratio")
        c = self.candidate_source_layer_id
        need(c >= self.num_hidden_layers or (c in self.kv_source_layer_ids and c in self.index_source_layer_ids),
             "candidate_source_layer_id", "must be both a KV and an index source (or past the last layer: none)")
        need(self.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
        need(0 <= self.n_mtp_layers <= MAX_MTP_LAYERS, "n_mtp_layers",
             f"must be in [0, {MAX_MTP_LAYERS}], got {self.n_mtp_layers}")
        if self.dspark:
            self._validate_dspark(need)
        return self

    def _validate_dspark(self, need):
        for name, top in DSPARK_COUNTS.items():
            need(0 < getattr(self, name) <= top, name, f"must be in [1, {top}], got {getattr(self, name)}")
        need(1 <= self.dspark_n_activated_experts <= self.dspark_n_routed_experts, "dspark_n_activated_experts",
             f"must be in [1, dspark_n_routed_experts={self.dspark_n_routed_experts}], "
             f"got {self.dspark_n_activated_experts}")
        need(0 <= self.dspark_noise_token_id < self.vocab_size, "dspark_noise_token_id",
             f"must be in [0, {self.vocab_size - 1}], got {self.dspark_noise_token_id}")
        ids = self.dspark_target_layer_ids
        need(len(ids) > 0 and all(0 <= i < self.num_hidden_layers for i in ids), "dspark_target_layer_ids",
             f"must be one or more layer ids in [0, {self.num_hidden_layers - 1}], got {list(ids)}")

    def reduced(self, layers: int | None = None, experts: int | None = None,
                engram_rows: int | None = None) -> "ModelConfig":
        """This model with only what memory forces made smaller, every per-layer dimension kept: the
        first ``layers`` of the schedule (the head after the last), ``experts`` routed experts (top-k
        kept; DSpark's stages as many, at most their own count), Engram tables of ``engram_rows`` rows
        (each table the smallest unused prime >= that); DSpark taps the prefix's last layers.
        The name says what was reduced (``flash-L40-E8-R4099``). A reduction that breaks the schedule
        raises ValueError naming the option (``--layers``, ``--experts``, ``--engram-rows``) and the rule."""
        changes, tags = {}, []
        if layers is not None:
            n = self.num_hidden_layers
            if not 1 <= layers <= n:
                raise ValueError(f"--layers: must be in [1, {n}] (a prefix of {self.name}'s {n}-layer schedule), "
                                 f"got {layers}")
            keep = lambda ids: tuple(i for i in ids if i < layers)
            changes.update(num_hidden_layers=layers, compress_ratios=self.compress_ratios[:layers],
                           kv_source_layer_ids=keep(self.kv_source_layer_ids),
                           index_source_layer_ids=keep(self.index_source_layer_ids),
                           engram_layer_ids=keep(self.engram_layer_ids))
            for spec in self.layers[:layers]:
                # a source is never later than its reader, so no prefix can cut one off; a schedule
                # whose rules picked a later source would be refused here
                for what, src in (("KV", spec.kv_source), ("index", spec.index_source),
                                  ("candidate", spec.candidate_source)):
                    if src is not None and src >= layers:
                        raise ValueError(f"--layers: must keep every cache source of the layers kept; layer "
                                         f"{spec.layer} reads the {what} cache of layer {src}, got {layers}")
            if self.dspark:
                # the drafter reads the last layers' streams: a prefix keeps the same count of the last
                # layers it has (repeating layer 0 when it has fewer), so the stage-0 shapes stay
                cut = n - layers
                changes["dspark_target_layer_ids"] = tuple(max(0, i - cut) for i in self.dspark_target_layer_ids)
            tags.append(f"L{layers}")
        if experts is not None:
            k, n = self.num_experts_per_tok, self.n_routed_experts
            if not k <= experts <= n:
                raise ValueError(f"--experts: must be in [{k}, {n}] (top-{k} routing keeps {k} experts per "
                                 f"token; at most {self.name}'s {n}), got {experts}")
            changes["n_routed_experts"] = experts
            if self.dspark:
                changes["dspark_n_routed_experts"] = max(self.dspark_n_activated_experts,
                                                         min(experts, self.dspark_n_routed_experts))
            tags.append(f"E{experts}")
        if engram_rows is not None:
            top = self.engram_vocab_size
            if not 2 <= engram_rows <= top:
                raise ValueError(f"--engram-rows: must be in [2, {top}] (each table takes the smallest unused "
                                 f"prime >= it as its hash modulus; at most {self.name}'s {top}), got {engram_rows}")
            changes["engram_vocab_size"] = engram_rows
            tags.append(f"R{engram_rows}")
        if not tags:
            return self
        return replace(self, name="-".join([self.name, *tags]), **changes).validate()


def _schedule(n_swa: int, n_r2: int, n_r1: int) -> tuple[int, ...]:
    return (0,) * n_swa + (2,) * n_r2 + (1,) * n_r1


_SCHEDULE = dict(
    num_hidden_layers=40,
    compress_ratios=_schedule(2, 18, 20),
    kv_source_layer_ids=(2, 8, 14, 20),
    index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer_id=20,
    engram_layer_ids=(1, 14),
)

FLASH = ModelConfig(
    name="flash", vocab_size=129280, hidden_size=5120, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8, sliding_window=128,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=2304,
    routed_scaling_factor=1.5, swiglu_limit=10.0, index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rms_norm_eps=1e-20, max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_factor=16.0, beta_fast=32, beta_slow=1, original_max_position_embeddings=65536,
    engram_vocab_size=16000000, engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
    engram_pad_token_id=2, engram_compressed_vocab_size=99092, n_mtp_layers=3, dspark_block_size=5,
    dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39), dspark_markov_rank=256,
    dspark_n_routed_experts=128, dspark_n_activated_experts=3, **_SCHEDULE,
).validate()

# Same 40-layer schedule and sources, small dims. Window 16, Top-K 8 and 3 candidate blocks of 4 are
# all truncated by a 64-token prompt (64 window rows, 32 ratio-2 rows, 16 ratio-1 blocks). DSpark as
# FLASH's (3 stages, block 5, target layers 37-39, top-3) with 16 experts, Markov rank 32, noise id 500.
TINY = replace(
    FLASH, name="tiny", vocab_size=512, hidden_size=64, num_attention_heads=8, head_dim=64,
    qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=4, sliding_window=16,
    n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=64, index_n_heads=4,
    index_head_dim=32, index_topk=8, candidate_topk_blocks=3, candidate_block_size=4,
    max_position_embeddings=4096, original_max_position_embeddings=256, engram_vocab_size=1000,
    engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=512, block_size=16,
    index_score_budget_bytes=4096, index_score_leaf=64,
    dspark_noise_token_id=500, dspark_markov_rank=32, dspark_n_routed_experts=16,
).validate()

SMALL = replace(
    FLASH, name="small", vocab_size=4096, hidden_size=256, num_attention_heads=8, head_dim=128,
    qk_rope_head_dim=32, q_lora_rank=128, o_lora_rank=64, o_groups=4, sliding_window=64,
    n_routed_experts=16, moe_intermediate_size=128, index_n_heads=8, index_head_dim=64, index_topk=64,
    candidate_topk_blocks=16, candidate_block_size=8, max_position_embeddings=16384,
    original_max_position_embeddings=4096, engram_vocab_size=5000, engram_n_heads=2, engram_head_dim=32,
    engram_compressed_vocab_size=4096, block_size=64,
    index_score_budget_bytes=1 << 20, index_score_leaf=512, n_mtp_layers=0,
).validate()

PRESETS = {"tiny": TINY, "small": SMALL, "flash": FLASH}


def slab(t: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of a TP rank's contiguous token rows; the physical width ceil(t/tp) is the same
    for every rank, so ranks past the active rows own none."""
    width = -(-t // tp) if t else 0
    first = min(rank * width, t)
    return first, max(0, min(width, t - first))


@dataclass(frozen=True)
class Topology:
    """Cards 0..ep-1; attention runs in dp groups of tp cards, experts are split ep ways."""
    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("tp", "dp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Topology.{name}: must be an integer >= 1, got {v!r}")
        if self.tp not in (1, 2, 4, 8):
            raise ValueError(f"Topology.tp: must be one of 1, 2, 4, 8, got {self.tp}")
        if self.ep != self.tp * self.dp:
            raise ValueError(f"Topology.ep: must equal tp*dp={self.tp * self.dp} (EP = TP·DP), got {self.ep}")

    @property
    def cards(self) -> range:
        return range(self.ep)

    def tp_rank(self, card: int) -> int:
        return card % self.tp

    def vocab_rows(self, cfg: "ModelConfig", card: int) -> range:
        """The vocabulary rows of embed and head this card's TP rank holds (vocab-parallel)."""
        per = cfg.vocab_size // self.tp
        return range(self.tp_rank(card) * per, (self.tp_rank(card) + 1) * per)

    def dp_group(self, card: int) -> int:
        return card // self.tp

    def group_cards(self, dp_group: int) -> list[int]:
        return [dp_group * self.tp + r for r in range(self.tp)]

    def check(self, cfg: ModelConfig) -> "Topology":
        """Raise ValueError naming the rule when cfg cannot be sharded this way."""
        rules = [
            (cfg.num_attention_heads % self.tp == 0, "tp", f"must divide num_attention_heads={cfg.num_attention_heads}"),
            (cfg.o_groups % self.tp == 0, "tp", f"must divide o_groups={cfg.o_groups}"),
            (cfg.n_routed_experts % self.ep == 0, "ep", f"must divide n_routed_experts={cfg.n_routed_experts}"),
            (not cfg.dspark or cfg.dspark_n_routed_experts % self.ep == 0, "ep",
             f"must divide dspark_n_routed_experts={cfg.dspark_n_routed_experts}"),
        ]
        for ok, name, rule in rules:
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"Topology.{name}={value}: {rule}")
        return self
