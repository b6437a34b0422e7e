"""A card's weight shard: the slices it reads, their resident bytes, and per-use decoding."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41.checkpoint.reader import open_checkpoint
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.checkpoint.shards import DrawnCheckpoint, RowLookup, card_index, read_card, read_cards
from dsv41.config import SMALL, TINY, Topology
from dsv41.ops.embed import embed_rows, embed_shard, shard_rows
from dsv41.ops.engram import engram_primes, sum_shares
from dsv41.ops.moe import expert
from dsv41.ops.o_proj import o_proj_partial, reduce_partials
from dsv41.ops.projections import q_proj
from dsv41.plan.sizing import weights_by_kind
from dsv41.weights import checkpoint_specs, decode_checkpoint, init_checkpoint

TOPOS = [Topology(1, 1, 1), Topology(2, 2, 4)]


@pytest.fixture(scope="module")
def drawn():
    return DrawnCheckpoint(TINY, 0)


def _engram_slab(cfg, topo, card, layer) -> tuple[int, int]:
    """Rows [first, end) of a layer's Engram table on a card, by hand: contiguous ceil(rows/EP) slabs."""
    rows = sum(engram_primes(cfg)[layer])
    width = -(-rows // topo.ep)
    return min(card * width, rows), min((card + 1) * width, rows)


def _expected_bytes(cfg, topo, card) -> int:
    """Bytes this card holds, from the checkpoint specs and the sharding policy written out by hand."""
    held = 0
    for name, (shape, dtype) in checkpoint_specs(cfg).items():
        n = math.prod(shape) * dtype.itemsize
        per = (cfg.dspark_n_routed_experts if name.startswith("mtp.") else cfg.n_routed_experts) // topo.ep
        if ".ffn.experts." in name:
            held += n if int(name.split(".")[4]) // per == card else 0
        elif any(s in name for s in (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".attn.attn_sink")) \
                or name in ("head.weight", "embed.weight"):
            held += n // topo.tp
        elif ".engram.embed." in name:
            first, end = _engram_slab(cfg, topo, card, int(name.split(".")[1]))
            held += n // shape[0] * (end - first)
        else:
            held += n
    return held


def _check_resident(source, topo):
    for card in topo.cards:
        resident = read_card(source, topo, card).nbytes()
        plan = sum(weights_by_kind(source.cfg, topo, card).values())
        assert resident == _expected_bytes(source.cfg, topo, card)
        assert abs(resident - plan) <= 0.03 * plan, (card, resident, plan)


@pytest.mark.parametrize("topo", TOPOS, ids=["tp1", "tp2dp2"])
def test_resident_bytes_tiny(drawn, topo):
    _check_resident(drawn, topo)


@pytest.mark.parametrize("topo", TOPOS, ids=["tp1", "tp2dp2"])
def test_resident_bytes_small(topo):
    _check_resident(DrawnCheckpoint(SMALL, 0), topo)


def test_engine_reports_measured_card_bytes(drawn):
    topo = Topology(2, 2, 4)
    engine = GraphEngine(TINY, topo, EngineConfig(executor="sync", max_batch=2, max_context=24), checkpoint=drawn)
    try:
        cards = engine.cards
        assert [c["card"] for c in cards] == list(topo.cards)
        assert [c["weights_bytes"] for c in cards] == [read_card(drawn, topo, c).nbytes() for c in topo.cards]
        states = engine.states()
        for c in cards:
            committed = states[c["card"]].caches.committed
            assert c["cache_bytes"] == sum(t.numel() * t.element_size() for ts in committed.values() for t in ts) > 0
    finally:
        engine.close()


# ---- values: decoded per use == the previous whole-model FP64 decode, == an independent decode ----------

def _old_shard(cfg, topo, card, w):
    """The previous path: decode the whole model, then view this card's runtime slices."""
    r, tp = topo.tp_rank(card), topo.tp
    hl, gl = cfg.num_attention_heads // tp, cfg.o_groups // tp
    v = cfg.vocab_size // tp
    out = {}
    for k, t in w.items():
        per = (cfg.dspark_n_routed_experts if k.startswith("mtp.") else cfg.n_routed_experts) // topo.ep
        if ".ffn.experts." in k:
            if int(k.split(".")[4]) // per == card:
                out[k] = t
        elif k.endswith(".attn.wq_b"):
            out[k] = t[r * hl * cfg.head_dim:(r + 1) * hl * cfg.head_dim]
        elif k.endswith(".attn.attn_sink"):
            out[k] = t[r * hl:(r + 1) * hl]
        elif k.endswith(".attn.wo_a"):
            out[k] = t[r * gl:(r + 1) * gl]
        elif k.endswith(".attn.wo_b"):
            out[k] = t[:, r * gl * cfg.o_lora_rank:(r + 1) * gl * cfg.o_lora_rank]
        elif k in ("head.weight", "embed.weight"):
            out[k] = t[r * v:(r + 1) * v]
        elif k.endswith(".engram.embed"):
            first, end = _engram_slab(cfg, topo, card, int(k.split(".")[1]))
            out[k] = t[first:end]
        else:
            out[k] = t
    return out


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _by_hand(payload, codes, fp4: bool):
    """Independent decode: FP8 values or E2M1 nibbles (low nibble first) times 2^(code-127),
    scales expanded to 32x32 blocks (FP8) or 32-wide row groups (FP4)."""
    codes = codes.view(torch.uint8).to(torch.int64)
    if fp4:
        p = payload.view(torch.uint8).to(torch.int64)
        nib = torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)
        v = torch.tensor(_E2M1)[nib & 7] * (1 - 2 * (nib >> 3))
        s = torch.pow(2.0, (codes - 127).double()).repeat_interleave(32, 1)
    else:
        v = payload.float()
        s = torch.pow(2.0, (codes - 127).double()).repeat_interleave(32, 0).repeat_interleave(32, 1)
    return (v.double() * s).float().double()


@pytest.mark.parametrize("card", [0, 3])
def test_decoded_per_use_equals_whole_decode_and_hand_decode(drawn, card):
    cfg, topo = TINY, Topology(2, 2, 4)
    mine = read_card(drawn, topo, card)
    old = _old_shard(cfg, topo, card, decode_checkpoint(cfg, init_checkpoint(cfg, 0)))
    assert set(mine) == set(old)
    ids = torch.tensor([[0, 5, 2], [7, 7, 1]])
    for k in old:
        got = mine[k]
        if isinstance(got, RowLookup):   # lookup tables decode only the rows looked up (shard rows)
            first = (card % topo.tp) * (cfg.vocab_size // topo.tp) if k == "embed.weight" else \
                0 if k.endswith("markov_head.embed.weight") else \
                _engram_slab(cfg, topo, card, int(k.split(".")[1]))[0]     # DSpark's Markov table: whole
            assert got.first == first, k
            assert got.shape == old[k].shape and torch.equal(got[ids], old[k][ids]), k
            assert got[ids[:0]].shape == (0, 3, old[k].shape[1])   # an empty slab looks up nothing
            got = got[torch.arange(got.shape[0])]
        assert got.dtype == old[k].dtype and torch.equal(got, old[k]), k
    ck = {n: drawn.get(n, card_index(cfg, topo, card, n)) for n in drawn.names()
          if card_index(cfg, topo, card, n) is not None}
    a = "layers.3.attn."
    wq_b = _by_hand(ck[a + "wq_b.weight"], ck[a + "wq_b.scale"], False)
    assert torch.equal(mine[a + "wq_b"], wq_b)
    e = min(int(n.split(".")[4]) for n in ck if n.startswith("layers.3.ffn.experts."))
    f = f"layers.3.ffn.experts.{e}."
    assert torch.equal(mine[f + "w2"], _by_hand(ck[f + "w2.weight"], ck[f + "w2.scale"], True))

    # kernels on the per-use decode give the previous path's bits
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, cfg.hidden_size, generator=g)).to(torch.bfloat16).float()
    cos, sin = torch.ones(5, cfg.qk_rope_head_dim // 2), torch.zeros(5, cfg.qk_rope_head_dim // 2)
    heads = cfg.num_attention_heads // topo.tp
    args = (cos, sin, cfg.rms_norm_eps, heads, cfg.head_dim)
    def run(w):
        q = q_proj(x, w[a + "wq_a"], w[a + "q_norm.weight"], w[a + "wq_b"], *args)[1]
        o = o_proj_partial(q.to(torch.bfloat16).float(), cos, sin, w[a + "wo_a"], w[a + "wo_b"])
        return q, o, expert(x, w[f + "w1"], w[f + "w2"], w[f + "w3"], cfg.swiglu_limit)

    assert all(torch.equal(m, o) for m, o in zip(run(mine), run(old)))


# ---- sharded lookups: the cards' shares add up to the whole table's lookup ---------------------------

def test_lookup_shares_sum_to_the_whole_lookup(drawn):
    cfg, topo = TINY, Topology(2, 2, 4)
    whole = decode_checkpoint(cfg, init_checkpoint(cfg, 0))
    cards = [read_card(drawn, topo, c) for c in topo.cards]
    ids = torch.tensor([[-1, 0, 3], [cfg.vocab_size - 1, cfg.vocab_size + 5, 17]])
    for grp in range(topo.dp):   # embed: the TP ranks of a group, summed by the group's transport
        shares = [embed_shard(ids, cards[c]["embed.weight"], cards[c]["embed.weight"].first, cfg.vocab_size)
                  for c in topo.group_cards(grp)]
        assert all((s != 0).any(-1).sum() < ids.numel() for s in shares)   # each share holds only some rows
        assert torch.equal(reduce_partials(shares), embed_rows(ids, whole["embed.weight"]))
    for layer in cfg.engram_layer_ids:
        key = f"layers.{layer}.engram.embed"
        rows = whole[key].shape[0]
        ids = torch.randint(0, rows, (9, cfg.engram_ids_per_token), generator=torch.Generator().manual_seed(layer))
        ids[0, 0], ids[0, 1] = 0, rows - 1
        shares = [shard_rows(ids, w[key], w[key].first) for w in cards]
        assert torch.equal(sum_shares(shares), whole[key][ids])


def test_shares_keep_negative_zero_and_every_value():
    """-0.0 fills the rows a shard does not hold, so a looked-up -0.0 (or +0.0) survives the sum."""
    table = torch.tensor([[-0.0, 0.0], [1.5, -2.0], [0.0, -0.0], [3.0, 4.0]])
    ids = torch.tensor([[0, 2], [3, 1]])
    shares = [shard_rows(ids, table[a:a + 1], a) for a in range(4)]
    for got in (sum_shares(shares), reduce_partials(shares)):   # card-order fold, the TP transport's tree
        assert torch.equal(got, table[ids]) and torch.equal(torch.signbit(got), torch.signbit(table[ids]))


# ---- slices read from a checkpoint folder ---------------------------------------------------------------

def test_slices_read_from_a_folder_equal_slices_of_the_whole(tiny_checkpoint):
    folder = open_checkpoint(tiny_checkpoint)
    drawn = DrawnCheckpoint(folder.cfg, 0)      # the writer draws seed 0 of the folder's config
    whole = init_checkpoint(folder.cfg, 0)
    topo = Topology(2, 2, 4)
    for card in (1, 2):
        got = read_card(folder, topo, card)
        for name, t in got.held.items():
            want = whole[name][card_index(folder.cfg, topo, card, name)]
            assert t.dtype == want.dtype and t.shape == want.shape, name
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               want.view(torch.uint8) if want.element_size() == 1 else want), name
        assert got.nbytes() == read_card(drawn, topo, card).nbytes()


def test_cards_read_together_share_each_slice_and_hold_what_one_card_reads():
    """One pass over the draw for all cards: DP replicas of a TP slice (and replicated tensors) are one
    storage; each card holds exactly the slices it reads alone."""
    topo = Topology(2, 2, 4)
    together = read_cards(DrawnCheckpoint(TINY, 0), topo, list(topo.cards))
    for card in topo.cards:
        alone = read_card(DrawnCheckpoint(TINY, 0), topo, card)
        assert together[card].held.keys() == alone.held.keys()
        for name, t in alone.held.items():
            assert torch.equal(together[card].held[name].view(torch.uint8),
                               t.contiguous().view(torch.uint8)), name
        assert together[card].nbytes() == alone.nbytes()
    a, b = together[0].held, together[2].held          # TP rank 0 of DP groups 0 and 1
    assert a["layers.3.attn.wq_b.weight"].data_ptr() == b["layers.3.attn.wq_b.weight"].data_ptr()
    assert a["layers.3.attn.wq_b.weight"].data_ptr() != together[1].held["layers.3.attn.wq_b.weight"].data_ptr()
