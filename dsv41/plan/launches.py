"""How many device kernels a serving stack launches for one node of the graph: a named assumption.

The graph has one node per step of the model (a projection, a norm, a collective); a real stack runs
each as several kernels, each paying the device's per-kernel gap. The counts follow one rule applied
to the decode path of vLLM's DeepSeek-V3.2 model (``vllm/model_executor/models/deepseek_v2.py``:
``DeepseekV2MLAAttention`` with the sparse ``Indexer``, ``DeepseekV2MoE`` on ``FusedMoE``), the
closest published stack to V4's node kinds: a quantised linear is two kernels (per-token-group FP8
or INT8 quantisation of the activation, then the GEMM); a norm, a RoPE, a cache write, a top-k and an
activation are one each (vLLM's fused ``fused_add_rms_norm``, ``rotary_embedding``,
``concat_and_cache_mla``, ``silu_and_mul`` custom ops); sparse attention decode is two (the
FlashMLA-style metadata kernel, then the attention kernel); a dispatch or combine is one kernel of the
all-to-all library (DeepEP low-latency) plus, for dispatch, its layout kernel. V4's mHC nodes (not in
V3.2) follow the same rule on the operations the seed spec gives them. Where a count is uncertain
it is the smaller one, so the launch term is a lower bound.
"""
from __future__ import annotations

# node kind -> (kernels per node, the operations counted)
KERNELS = {
    "embed": (1, "row gather"),
    "engram.lookup": (2, "hash, row gather"),
    "engram": (3, "quant + GEMM of the gated projection, gate"),
    "hc.pack": (1, "copy into the residual streams"),
    "hc.mixes": (3, "mix GEMM, Sinkhorn normalisation, split"),
    "hc.pre": (1, "weighted stream reduction"),
    "hc.post": (1, "weighted stream update"),
    "hc.head": (1, "weighted stream reduction"),
    "norm.rms": (1, "fused RMSNorm"),
    "norm.final": (1, "fused RMSNorm"),
    "rope.rows": (1, "cos/sin row gather"),
    "attn.q_proj": (5, "quant + GEMM wq_a, q_norm, quant + GEMM wq_b"),
    "attn.kv_proj": (4, "quant + GEMM wkv, kv_norm, RoPE"),
    "attn.compress": (3, "GEMM, norm, pooled write"),
    "attn.publish": (2, "cache write (KV rows), indexer key write"),
    "attn.index": (5, "quant + GEMM wq_b, weights_proj GEMM, RoPE, MQA logits"),
    "attn.topk": (1, "top-k"),
    "attn.leaf": (2, "sparse decode metadata, sparse attention"),
    "attn.o_proj": (4, "quant + GEMM wo_a, quant + GEMM wo_b"),
    "tp.all_gather": (1, "collective"),
    "tp.reduce_scatter": (1, "collective"),
    "tp.all_reduce": (1, "collective"),
    "moe.gate": (2, "router GEMM, grouped top-k"),
    "moe.dispatch": (2, "dispatch layout, quant of the rows sent"),
    "moe.experts": (4, "dispatch receive, grouped GEMM w1/w3, SiLU-and-mul + quant, grouped GEMM w2"),
    "moe.shared": (5, "quant + GEMM w1/w3, SiLU-and-mul, quant + GEMM w2"),
    "moe.combine": (2, "combine, weighted sum with the shared expert"),
    "lm_head.shard": (2, "quant + GEMM"),
    "lm_head.argmax": (2, "gather of the vocabulary shards, argmax"),
    "cache.commit": (1, "metadata update"),
}
SOURCE = __doc__


def kernels(kind: str) -> int:
    """Kernels a stack launches for a node of ``kind``; one for a kind the table does not name."""
    if kind.startswith("attn.leaf."):
        kind = "attn.leaf"
    return KERNELS.get(kind, (1, ""))[0]
