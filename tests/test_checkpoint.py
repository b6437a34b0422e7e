"""Checkpoint layout (spec 03 §8, corrected storage dtypes of 04 §2.6) of the drawn weights.

Folders on disk: tests/test_checkpoint_serving.py and tests/test_checkpoint_damage.py.
"""
import pytest
import torch

from dsv41.config import FULL, TINY
from dsv41.ops.engram import engram_table_rows
from dsv41.weights import decode_checkpoint, init_checkpoint
from _spec_ref import fp4_value_ref

E8M0, E4M3 = torch.float8_e8m0fnu, torch.float8_e4m3fn
CFG = TINY


@pytest.fixture(scope="module")
def ck():
    return init_checkpoint(CFG, seed=0)


def _tensor_bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_tensor_names_dtypes_and_shapes(ck):
    d, ql, hd, h = CFG.hidden_size, CFG.q_lora_rank, CFG.head_dim, CFG.num_attention_heads
    inter, og, orank = CFG.moe_intermediate_size, CFG.o_groups, CFG.o_lora_rank

    def fp8(name, n, k):
        assert ck[f"{name}.weight"].dtype == E4M3 and ck[f"{name}.weight"].shape == (n, k), name
        assert ck[f"{name}.scale"].dtype == E8M0 and ck[f"{name}.scale"].shape == (n // 32, k // 32), name

    def fp4(name, n, k):
        assert ck[f"{name}.weight"].dtype == torch.int8 and ck[f"{name}.weight"].shape == (n, k // 2), name
        assert ck[f"{name}.scale"].dtype == E8M0 and ck[f"{name}.scale"].shape == (n, k // 32), name

    def dense(name, dtype, shape):
        assert ck[name].dtype == dtype and tuple(ck[name].shape) == shape, name

    dense("embed.weight", torch.bfloat16, (CFG.vocab_size, d))
    dense("head.weight", torch.bfloat16, (CFG.vocab_size, d))
    dense("norm.weight", torch.bfloat16, (d,))
    a = "layers.0.attn."
    fp8(a + "wq_a", ql, d)
    fp8(a + "wq_b", h * hd, ql)
    fp8(a + "wkv", hd, d)
    fp8(a + "wo_a", og * orank, h * hd // og)
    fp8(a + "wo_b", d, og * orank)
    dense(a + "q_norm.weight", torch.bfloat16, (ql,))
    dense(a + "kv_norm.weight", torch.bfloat16, (hd,))
    dense(a + "attn_sink", torch.float32, (h,))
    for site in ("attn", "ffn"):
        dense(f"layers.0.hc_{site}_fn", torch.float32, (CFG.mix_hc, CFG.hc_dim))
        dense(f"layers.0.hc_{site}_scale", torch.float32, (3,))
        dense(f"layers.0.hc_{site}_base", torch.float32, (CFG.mix_hc,))
    dense("layers.0.attn_norm.weight", torch.bfloat16, (d,))
    dense("layers.0.ffn_norm.weight", torch.bfloat16, (d,))
    f = "layers.0.ffn."
    dense(f + "gate.weight", torch.bfloat16, (CFG.n_routed_experts, d))
    dense(f + "gate.bias", torch.float32, (CFG.n_routed_experts,))
    for e in (0, CFG.n_routed_experts - 1):
        fp4(f"{f}experts.{e}.w1", inter, d)
        fp4(f"{f}experts.{e}.w3", inter, d)
        fp4(f"{f}experts.{e}.w2", d, inter)
    fp8(f + "shared_experts.w1", inter, d)
    fp8(f + "shared_experts.w3", inter, d)
    fp8(f + "shared_experts.w2", d, inter)


def test_per_mode_tensors(ck):
    d, hd, ih = CFG.hidden_size, CFG.head_dim, CFG.index_head_dim
    for spec in CFG.layers:
        a = f"layers.{spec.layer}.attn."
        has_comp = f"{a}compressor.wkv.weight" in ck
        assert has_comp == (spec.mode == FULL), spec.layer
        assert (f"{a}compressor.wgate.weight" in ck) == (spec.mode == FULL and spec.ratio == 2), spec.layer
        assert (f"{a}indexer.wk.weight" in ck) == (spec.mode == FULL), spec.layer
        assert (f"{a}indexer.wq_b.weight" in ck) == (spec.layer in CFG.index_source_layer_ids), spec.layer
        assert (f"{a}indexer.weights_proj.weight" in ck) == (spec.layer in CFG.index_source_layer_ids)
        if spec.mode == FULL:
            assert ck[f"{a}compressor.wkv.weight"].dtype == torch.bfloat16
            assert ck[f"{a}compressor.wkv.weight"].shape == (hd, d)
            assert ck[f"{a}indexer.wk.weight"].shape == (ih, hd) and ck[f"{a}indexer.wk.weight"].dtype == torch.bfloat16
            assert ck[f"{a}indexer.k_norm.weight"].shape == (ih,)
        if spec.layer in CFG.index_source_layer_ids:
            assert ck[f"{a}indexer.wq_b.weight"].dtype == E4M3
            assert ck[f"{a}indexer.wq_b.weight"].shape == (CFG.index_n_heads * ih, CFG.q_lora_rank)
            assert ck[f"{a}indexer.weights_proj.weight"].shape == (CFG.index_n_heads, d)
    assert not any("tid2eid" in k or "hc_head" in k for k in ck)


def test_engram_tensors(ck):
    hc, d = CFG.hc_mult, CFG.hidden_size
    for layer in range(CFG.num_hidden_layers):
        e = f"layers.{layer}.engram."
        assert (e + "wkv.weight" in ck) == (layer in CFG.engram_layer_ids)
    for layer in CFG.engram_layer_ids:
        e = f"layers.{layer}.engram."
        rows = engram_table_rows(CFG, layer)
        assert ck[e + "embed.weight"].dtype == E4M3 and ck[e + "embed.weight"].shape == (rows, CFG.engram_head_dim)
        assert ck[e + "embed.scale"].dtype == E8M0 and ck[e + "embed.scale"].shape == (rows, CFG.engram_head_dim // 32)
        assert ck[e + "wkv.weight"].shape == ((hc + 1) * d, CFG.engram_lookup_dim)
        assert ck[e + "q_weight"].shape == (hc, d) and ck[e + "k_weight"].shape == (hc, d)


def test_decode_checkpoint_values(ck):
    w = decode_checkpoint(CFG, ck)
    # MXFP8 32x32 blocks: W[n, k] = e4m3(P[n, k]) * 2^(S[n//32, k//32] - 127)
    name = "layers.3.attn.wq_a"
    p, s = ck[name + ".weight"].double(), ck[name + ".scale"].view(torch.uint8).long()
    want = p * torch.pow(2.0, (s - 127).double()).repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(w[name].double(), want)
    # MXFP4 expert: byte [n, j] holds k = 2j low, 2j+1 high; scale per (n, k // 32)
    name = "layers.5.ffn.experts.7.w2"
    packed, sc = ck[name + ".weight"].view(torch.uint8), ck[name + ".scale"].view(torch.uint8)
    n, kh = packed.shape
    want = torch.empty(n, 2 * kh, dtype=torch.float64)
    for r in range(0, n, 7):
        for c in range(2 * kh):
            byte = int(packed[r, c // 2])
            nib = byte & 0xF if c % 2 == 0 else byte >> 4
            want[r, c] = fp4_value_ref(nib) * 2.0 ** (int(sc[r, c // 32]) - 127)
    assert torch.equal(w[name].double()[::7], want[::7])
    # wo_a becomes [groups, o_lora, group_in]
    wo = w["layers.0.attn.wo_a"]
    assert wo.shape == (CFG.o_groups, CFG.o_lora_rank, CFG.o_group_in)
    name = "layers.0.attn.wo_a"
    p, s = ck[name + ".weight"].double(), ck[name + ".scale"].view(torch.uint8).long()
    flat = p * torch.pow(2.0, (s - 127).double()).repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(wo.double().reshape(flat.shape), flat)
    # engram rows: FP8 payload x E8M0 per 32 columns
    name = "layers.1.engram.embed"
    p, s = ck[name + ".weight"][:50].double(), ck[name + ".scale"][:50].view(torch.uint8).long()
    want = p * torch.pow(2.0, (s - 127).double()).repeat_interleave(32, 1)
    assert torch.equal(w[name][:50].double(), want)
    # dense tensors keep their values
    assert torch.equal(w["layers.0.attn.attn_sink"].double(), ck["layers.0.attn.attn_sink"].double())
    assert torch.equal(w["norm.weight"].double(), ck["norm.weight"].double())
    assert not any(k.endswith(".scale") and not k.endswith("_scale") for k in w)


def test_init_is_deterministic_per_seed(ck):
    other = init_checkpoint(CFG, seed=0)
    assert all(_tensor_bytes_equal(ck[k], other[k]) for k in ("embed.weight", "layers.39.ffn.experts.15.w1.weight",
                                                             "layers.20.attn.indexer.wk.weight"))
