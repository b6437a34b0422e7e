"""Model config (spec 01 §1): FLASH fields, the derived 40-layer schedule, validation, Topology."""
from dataclasses import fields, replace

import pytest

from dsv41.config import FLASH, FULL, PRESETS, REINDEX, REUSE, SMALL, SWA, TINY, ConfigError, ModelConfig, Topology
from dsv41.capacity import CAPACITIES, LIMITS, Capacity, capacity_of

# Spec 01 §1 layer table, typed in: layer ratio mode kv_src idx_src
SCHEDULE = """
0 0 SWA - -
1 0 SWA - -
2 2 FULL 2 2
3 2 REUSE 2 2
4 2 REUSE 2 2
5 2 REUSE 2 2
6 2 REUSE 2 2
7 2 REUSE 2 2
8 2 FULL 8 8
9 2 REUSE 8 8
10 2 REUSE 8 8
11 2 REUSE 8 8
12 2 REUSE 8 8
13 2 REUSE 8 8
14 2 FULL 14 14
15 2 REUSE 14 14
16 2 REUSE 14 14
17 2 REUSE 14 14
18 2 REUSE 14 14
19 2 REUSE 14 14
20 1 FULL 20 20
21 1 REUSE 20 20
22 1 REUSE 20 20
23 1 REUSE 20 20
24 1 REINDEX 20 24
25 1 REUSE 20 24
26 1 REUSE 20 24
27 1 REUSE 20 24
28 1 REINDEX 20 28
29 1 REUSE 20 28
30 1 REUSE 20 28
31 1 REUSE 20 28
32 1 REINDEX 20 32
33 1 REUSE 20 32
34 1 REUSE 20 32
35 1 REUSE 20 32
36 1 REINDEX 20 36
37 1 REUSE 20 36
38 1 REUSE 20 36
39 1 REUSE 20 36
"""


def _table():
    rows = []
    for line in SCHEDULE.strip().splitlines():
        layer, ratio, mode, kv, idx = line.split()
        rows.append((int(layer), int(ratio), mode, None if kv == "-" else int(kv), None if idx == "-" else int(idx)))
    return rows


def test_flash_fields():
    want = dict(vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=40,
                num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024,
                o_groups=8, sliding_window=128, rms_norm_eps=1e-20, max_position_embeddings=1048576,
                rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, beta_fast=32, beta_slow=1,
                original_max_position_embeddings=65536, n_routed_experts=384, n_shared_experts=1,
                num_experts_per_tok=6, routed_scaling_factor=1.5, swiglu_limit=10.0, index_n_heads=32,
                index_head_dim=128, index_topk=512, candidate_source_layer_id=20, candidate_topk_blocks=2048,
                candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=(1, 14),
                engram_max_ngram_size=4, engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256,
                engram_pad_token_id=2, engram_compressed_vocab_size=99092, kv_source_layer_ids=(2, 8, 14, 20),
                index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36), block_size=128, state_capacity=4, mx_group=32)
    for k, v in want.items():
        assert getattr(FLASH, k) == v, k
    assert FLASH.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert (FLASH.nope_head_dim, FLASH.hc_dim, FLASH.mix_hc, FLASH.o_group_in) == (448, 20480, 24, 4096)
    assert PRESETS == {"tiny": TINY, "small": SMALL, "flash": FLASH}


def test_the_capacity_contract_is_the_deployments_not_the_models():
    """The seed's limits per DP group live in ``Capacity``, one per preset; the model has none of them."""
    names = {f.name for f in fields(ModelConfig)}
    assert not names & {"max_batch_per_dp", "decode_rows_per_request", "prefill_max_tokens", "decode_max_tokens"}
    assert not hasattr(FLASH, "decode_max_tokens")
    flash = CAPACITIES["flash"]
    assert (flash.max_batch_per_dp, flash.decode_rows_per_request, flash.prefill_max_tokens) == (32, 6, 4096)
    assert flash.decode_max_tokens == 192 and flash.max_drafts == 5      # 32 requests x (1 target + 5 drafts)
    assert (CAPACITIES["tiny"].max_batch_per_dp, CAPACITIES["tiny"].prefill_max_tokens) == (8, 512)
    assert (CAPACITIES["small"].max_batch_per_dp, CAPACITIES["small"].prefill_max_tokens) == (16, 2048)
    assert set(CAPACITIES) == set(PRESETS)
    # a reduction runs with its preset's limits; a model of no preset with FLASH's
    assert capacity_of(FLASH.reduced(layers=4, experts=8)) is CAPACITIES["flash"]
    assert capacity_of(TINY.reduced(layers=3)) is CAPACITIES["tiny"]
    assert capacity_of(replace(TINY, name="mine")) is CAPACITIES["flash"]


@pytest.mark.parametrize("name, top", sorted(LIMITS.items()))
def test_capacity_fields_have_a_range_naming_the_field(name, top):
    for bad in (0, top + 1, True):
        with pytest.raises(ConfigError) as e:
            replace(Capacity(), **{name: bad}).validate()
        assert e.value.field == name and str(e.value) == f"capacity.{name}: must be in [1, {top}], got {bad}"
    assert getattr(replace(Capacity(), **{name: top}).validate(), name) == top


@pytest.mark.parametrize("cfg", [FLASH, TINY, SMALL], ids=["flash", "tiny", "small"])
def test_schedule_matches_spec_table(cfg):
    assert len(cfg.layers) == 40
    for (layer, ratio, mode, kv, idx), spec in zip(_table(), cfg.layers):
        assert (spec.layer, spec.ratio, spec.mode, spec.kv_source, spec.index_source) == \
            (layer, ratio, mode, kv, idx), layer
        assert spec.candidate_source == (20 if mode == REINDEX else None), layer


def test_schedule_named_layers_and_kinds():
    L = FLASH.layers
    assert [L[i].mode for i in (0, 1, 2, 3, 8, 14, 20, 21, 24, 39)] == \
        [SWA, SWA, FULL, REUSE, FULL, FULL, FULL, REUSE, REINDEX, REUSE]
    assert {s.kind for s in L} == {"swa", "c2a_full", "c2a_reuse", "c1a_full", "c1a_reindex", "c1a_reuse"}
    assert [s.layer for s in L if s.mode == REINDEX] == [24, 28, 32, 36]
    counts = {m: sum(s.mode == m for s in L) for m in (SWA, FULL, REINDEX, REUSE)}
    assert counts == {SWA: 2, FULL: 4, REINDEX: 4, REUSE: 30}


def test_schedule_derives_from_tuples():
    # a different schedule is derived, not typed in: sources resolve to the largest id <= layer
    cfg = replace(TINY, kv_source_layer_ids=(2, 10, 20), index_source_layer_ids=(2, 5, 10, 20, 30)).validate()
    assert cfg.layers[5].mode == REINDEX and cfg.layers[5].kv_source == 2 and cfg.layers[5].index_source == 5
    assert cfg.layers[5].candidate_source is None                  # ratio 2 has no candidate stage
    assert cfg.layers[9].index_source == 5 and cfg.layers[12].kv_source == 10
    assert cfg.layers[30].mode == REINDEX and cfg.layers[30].candidate_source == 20
    assert cfg.layers[35].index_source == 30


INVALID = [
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_attention_heads=0), "num_attention_heads"),
    (dict(index_topk=0), "index_topk"),
    (dict(block_size=0), "block_size"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(hidden_size=100), "hidden_size"),
    (dict(moe_intermediate_size=48), "moe_intermediate_size"),
    (dict(o_groups=3), "o_groups"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(head_dim=32, qk_rope_head_dim=32), "head_dim"),
    (dict(qk_rope_head_dim=48), "index_head_dim"),
    (dict(num_experts_per_tok=17), "num_experts_per_tok"),
    (dict(state_capacity=1), "state_capacity"),
    (dict(compress_ratios=(0,) * 39), "compress_ratios"),
    (dict(compress_ratios=(0, 0) + (3,) * 18 + (1,) * 20), "compress_ratios"),
    (dict(kv_source_layer_ids=(2, 8, 14, 40)), "kv_source_layer_ids"),
    (dict(kv_source_layer_ids=(0, 2, 8, 14, 20)), "kv_source_layer_ids"),
    (dict(index_source_layer_ids=(1, 2, 8, 14, 20)), "index_source_layer_ids"),
    (dict(engram_layer_ids=(1, 40)), "engram_layer_ids"),
    (dict(kv_source_layer_ids=(8, 14, 20)), "source"),            # layers 2..7 have no KV source
    (dict(index_source_layer_ids=(2, 8, 14, 24)), "source"),     # layers 20..23 have no index source
    (dict(candidate_source_layer_id=24), "candidate_source_layer_id"),
    (dict(engram_max_ngram_size=1), "engram_max_ngram_size"),
]


@pytest.mark.parametrize("over,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_config_names_the_field(over, field):
    with pytest.raises(ValueError) as e:
        replace(TINY, **over).validate()
    assert field in str(e.value), str(e.value)


def test_presets_validate():
    for cfg in (FLASH, TINY, SMALL):
        assert cfg.validate() is cfg


def test_tiny_truncates_every_stage_at_64_tokens():
    # the model-level tests rely on these: a 64-token prompt exceeds the window, Top-K and candidates
    assert TINY.sliding_window == 16 and TINY.index_topk == 8
    assert TINY.candidate_topk_blocks * TINY.candidate_block_size == 12
    assert TINY.block_size == 16


# ---- Topology ----------------------------------------------------------------------------------

def test_topology_valid_and_rank_mapping():
    topo = Topology(tp=4, dp=2, ep=8).check(FLASH)
    assert list(topo.cards) == list(range(8))
    assert [topo.tp_rank(c) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [topo.dp_group(c) for c in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.group_cards(1) == [4, 5, 6, 7]
    Topology().check(TINY)


@pytest.mark.parametrize("kw,rule", [
    (dict(tp=2, dp=2, ep=2), "Topology.ep"),
    (dict(tp=1, dp=1, ep=2), "Topology.ep"),
    (dict(tp=3, dp=1, ep=3), "Topology.tp"),
    (dict(tp=16, dp=1, ep=16), "Topology.tp"),
    (dict(tp=0, dp=1, ep=0), "Topology.tp"),
    (dict(tp=1, dp=0, ep=0), "Topology.dp"),
])
def test_topology_construction_rules(kw, rule):
    with pytest.raises(ValueError) as e:
        Topology(**kw)
    assert rule in str(e.value), str(e.value)


def test_topology_check_rules():
    heads12 = replace(TINY, num_attention_heads=12).validate()
    with pytest.raises(ValueError, match="num_attention_heads"):
        Topology(tp=8, dp=1, ep=8).check(heads12)
    with pytest.raises(ValueError, match="o_groups"):
        Topology(tp=8, dp=1, ep=8).check(TINY)                      # 8 heads but 4 output groups
    with pytest.raises(ValueError, match="n_routed_experts"):
        Topology(tp=1, dp=3, ep=3).check(TINY)                      # 16 experts over 3 cards
    with pytest.raises(ValueError, match="Topology.ep"):
        Topology(tp=1, dp=5, ep=5).check(FLASH)                     # 384 % 5


# ---- reductions: what memory forces smaller, every per-layer dimension kept ----------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 20, 21, 25, 40])
def test_a_layer_prefix_keeps_the_schedule_of_its_layers(n):
    cfg = FLASH.reduced(layers=n)
    assert cfg.layers == FLASH.layers[:n]              # every layer's mode and sources as in the whole model
    assert cfg.engram_layer_ids == tuple(i for i in FLASH.engram_layer_ids if i < n)
    assert cfg.name == f"flash-L{n}"
    # DSpark taps the last layers kept (layer 0 repeated when fewer than its three): stage 0 keeps its shape
    assert cfg.dspark_target_layer_ids == tuple(max(0, i - (40 - n)) for i in (37, 38, 39))
    assert (cfg.hidden_size, cfg.head_dim, cfg.index_topk, cfg.candidate_topk_blocks) == \
        (FLASH.hidden_size, FLASH.head_dim, FLASH.index_topk, FLASH.candidate_topk_blocks)


def test_experts_and_engram_rows_reduce_only_themselves():
    cfg = FLASH.reduced(experts=8, engram_rows=4099)
    assert cfg.name == "flash-E8-R4099"
    assert cfg.dspark_n_routed_experts == 8 and cfg.dspark_n_activated_experts == 3   # the drafter's MoE too
    assert replace(cfg, name=FLASH.name, n_routed_experts=384, engram_vocab_size=16000000,
                   dspark_n_routed_experts=128) == FLASH
    from dsv41.ops.engram import engram_primes
    primes = [p for ps in engram_primes(cfg).values() for p in ps]
    assert min(primes) == 4099 and len(set(primes)) == len(primes)    # 4099 is prime
    assert FLASH.reduced() is FLASH


@pytest.mark.parametrize("kw,flag", [(dict(layers=0), "--layers"), (dict(layers=41), "--layers"),
                                     (dict(experts=5), "--experts"), (dict(experts=385), "--experts"),
                                     (dict(engram_rows=1), "--engram-rows"),
                                     (dict(engram_rows=16000001), "--engram-rows")])
def test_bad_reductions_name_their_option(kw, flag):
    with pytest.raises(ValueError, match=f"^{flag}: must be in"):
        FLASH.reduced(**kw)


def test_a_prefix_that_would_cut_a_source_from_its_reader_is_refused():
    """This schedule's sources are never later than their readers; one whose were is refused."""
    late = replace(TINY, kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24))
    object.__setattr__(late, "layers", tuple(replace(s, index_source=24) if s.layer == 22 else s
                                             for s in late.layers))
    with pytest.raises(ValueError, match="^--layers: must keep every cache source.*layer 22 reads the index"):
        late.reduced(layers=23)
