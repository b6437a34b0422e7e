"""Model cards: the published shapes of the models measured deployments ran that the graph builder
does not size (it sizes DeepSeek-V4.1-Flash, ``dsv41.config.FLASH``, only).

A card holds what a decode step's first-principles cost needs of a model: the layer count and which
layers are dense, the attention's projections and what it reads of its cache per token, the MoE's
experts, the vocabulary, and the multi-token-prediction layer its drafts run. ``dsv41.plan.card_step``
turns a card into the kernels of one step and prices them with the plan's own primitives. Every
number is the model's published config.json (``source``).

The weights are grouped by the role that decides their bytes in a deployment: ``linear`` (the
checkpoint's quantised linears: FP8 with 128x128 block scales in DeepSeek's release, or a
deployment's INT8), ``expert`` (the routed experts, FP4 in some builds), ``bf16`` (what stacks keep
in BF16: the router, the vocabulary tables and, for MLA, the absorbed up-projections).
"""
from __future__ import annotations

from dataclasses import dataclass

# The published DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json;
# DeepSeek-R1 and R1-0528 ship the same shape), fields read from a copy of it in public code:
# hidden_size 7168, num_hidden_layers 61, first_k_dense_replace 3, intermediate_size 18432,
# moe_intermediate_size 2048, n_routed_experts 256, n_shared_experts 1, num_experts_per_tok 8,
# num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128, vocab_size 129280, num_nextn_predict_layers 1,
# quantization_config fp8 e4m3 with weight_block_size [128, 128]. The technical report (arXiv
# 2412.19437, section 4.2 and the abstract) gives 671B total and 37B activated parameters a token
# (plus 14B of the MTP module).
_V3_SOURCE = ("DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3; DeepSeek-R1 has the same "
              "shape): hidden 7168, 61 layers of which the first 3 dense (intermediate 18432), 256 routed "
              "experts of intermediate 2048, top-8, 1 shared, MLA with 128 heads, q_lora_rank 1536, "
              "kv_lora_rank 512, qk_nope 128 / rope 64 / v 128, vocabulary 129280, one MTP layer; FP8 e4m3 "
              "weights in 128x128 blocks. arXiv 2412.19437: 671B total, 37B activated")
# DeepSeek-V4-Flash as the public V4 code carries its config.json (hw-native-sys/pypto-lib,
# models/deepseek/v4-flash/config.py, FLASH: "Follows HuggingFace config.json"): hidden 4096, 43
# layers (compress ratios 0, 0, then 4 and 128 alternating, last 0), 64 heads of dim 512 (K = V) with
# rope 64, q_lora 1024, o_lora 1024 in 8 groups, window 128, 256 routed experts of 2048 top-6 (the
# first 3 layers hash-routed), 1 shared, indexer 64 heads of 128 keeping 512, mHC width 4, one MTP
# layer, FP8 linears with FP4 experts. Its model pages (openrouter.ai/deepseek/deepseek-v4-flash)
# give 284B total and 13B activated parameters.
_V4_FLASH_SOURCE = ("DeepSeek-V4-Flash config as hw-native-sys/pypto-lib models/deepseek/v4-flash/config.py "
                    "carries it (FLASH, 'follows HuggingFace config.json'): hidden 4096, 43 layers (compress "
                    "ratios 0, 0, 4/128 alternating, 0), 64 heads of 512 with rope 64, q_lora 1024, o_lora 1024 "
                    "in 8 groups, window 128, 256 routed experts of 2048 top-6, 1 shared, indexer 64 heads x "
                    "128 keeping 512, mHC width 4, one MTP layer, FP8 linears and FP4 experts. "
                    "openrouter.ai/deepseek/deepseek-v4-flash: 284B total, 13B activated")


@dataclass(frozen=True)
class ModelCard:
    name: str
    source: str
    attention: str              # "mla" (DeepSeek-V3) or "v4" (compressed and sparse, DeepSeek-V4)
    hidden: int
    layers: int
    dense_layers: int           # the first layers run a dense MLP instead of the MoE
    dense_inter: int
    vocab: int
    heads: int
    q_lora: int
    n_routed: int
    n_shared: int
    top_k: int
    moe_inter: int
    mtp_layers: int = 1         # the MTP stages a draft runs (one decoder layer each)
    # MLA
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    # V4
    head_dim: int = 0
    o_lora: int = 0
    o_groups: int = 0
    window: int = 0
    compress_ratios: tuple = ()
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    hc_mult: int = 1


V3 = ModelCard(
    name="v3", source=_V3_SOURCE, attention="mla", hidden=7168, layers=61, dense_layers=3, dense_inter=18432,
    vocab=129280, heads=128, q_lora=1536, n_routed=256, n_shared=1, top_k=8, moe_inter=2048,
    kv_lora=512, qk_nope=128, qk_rope=64, v_head=128)

V4_FLASH = ModelCard(
    name="v4-flash", source=_V4_FLASH_SOURCE, attention="v4", hidden=4096, layers=43, dense_layers=0,
    dense_inter=0, vocab=129280, heads=64, q_lora=1024, n_routed=256, n_shared=1, top_k=6, moe_inter=2048,
    qk_rope=64, head_dim=512, o_lora=1024, o_groups=8, window=128,
    compress_ratios=(0, 0) + (4, 128) * 20 + (0,), index_heads=64, index_dim=128, index_topk=512, hc_mult=4)

# "v41-flash" is planned on its graph (dsv41.plan.step.run_plan); the others on their card
CARDS = {"v41-flash": None, "v3": V3, "v4-flash": V4_FLASH}
