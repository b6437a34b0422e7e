"""PyPTO backend: kernel registry, simulated device time, functional verification, NPU check.

Values always come from the Torch backend; pypto only contributes time (``sim_time_us``: SIM cost
model on CPU, measured on an NPU with ``mode="npu"``). Module map:
  specs   - per-kernel argument layouts, goldens (dsv41.ops), the registry PYPTO_KERNELS
  kernels - the @pypto.frontend.jit factories (imported only in a worker)
  worker  - the subprocess that runs pypto, its console sent to a log file
  sim     - the memory + disk cache and the worker client
  verify  - pypto values vs Torch goldens
  env     - run folder, python3 shim, calculator build, check_npu
"""
from __future__ import annotations

from dsv41.kernels.pypto.env import check_npu
from dsv41.kernels.pypto.sim import (BACKEND_MODES, SimCache, close_workers, default_cache, device_time_us,
                                     sim_time_us)
from dsv41.kernels.pypto.specs import PYPTO_KERNELS, KernelSpec, cache_key
from dsv41.kernels.pypto.verify import verify_kernel

__all__ = ["BACKEND_MODES", "PYPTO_KERNELS", "KernelSpec", "SimCache", "cache_key",
           "check_npu", "close_workers", "default_cache", "device_time_us", "node_parts", "node_time_us",
           "sim_time_us", "verify_kernel"]


def node_parts(cfg, rows: int, tp: int = 1, ep: int | None = None, keys: int | None = None
               ) -> dict[str, list[tuple[str, dict]]]:
    """The pypto kernel calls that stand for one graph node on one card, for ``rows`` tokens per DP group.

    Keyed by the graph's node kernel; a node's pypto time is the sum over its parts (``node_time_us``).
    MX (FP8) linears are simulated as BF16 matmuls: pypto 0.2.0 rejects FP8/FP4 matmul on its only
    platform (Ascend 910B). ``attn.leaf`` is one attention leaf over ``keys`` gathered keys per token
    (default: window plus index Top-K), scores, softmax and PV each in one call over all keys, every
    local head. ``moe.experts`` is a grouped GEMM over the rank's experts with the mean routed rows
    per expert (ep = tp * dp cards), padded to 16.
    """
    h, hd, half = cfg.num_attention_heads // tp, cfg.head_dim, cfg.qk_rope_head_dim // 2
    d, r, groups = cfg.hidden_size, cfg.q_lora_rank, cfg.o_groups // tp
    ep = ep or tp
    routed = rows * (ep // tp) * cfg.num_experts_per_tok
    per_expert = -(-max(1, -(-routed // cfg.n_routed_experts)) // 16) * 16
    rope = dict(T=rows, H=h, dim=hd, half=half)
    keys = keys or cfg.sliding_window + cfg.index_topk
    if not isinstance(keys, int) or keys < 1:
        raise ValueError(f"node_parts: keys must be a positive int, got {keys!r}")
    leaf = dict(T=rows, H=h, K=keys, d=hd)
    return {
        "norm.rms": [("norm.rms", dict(T=rows, D=d))],
        "norm.final": [("norm.rms", dict(T=rows, D=d))],
        "hc.head": [("hc.pre", dict(T=rows, hc=cfg.hc_mult, D=d))],
        "rope.rows": [("rope.rows", dict(T=rows, C=cfg.max_position_embeddings, half=half))],
        "hc.pre": [("hc.pre", dict(T=rows, hc=cfg.hc_mult, D=d))],
        "hc.post": [("hc.post", dict(T=rows, hc=cfg.hc_mult, D=d))],
        "attn.q_proj": [("attn.q_proj", dict(M=rows, K=d, N=r)), ("norm.rms", dict(T=rows, D=r)),
                        ("attn.q_proj", dict(M=rows, K=r, N=h * hd)), ("rope.apply", rope)],
        "attn.kv_proj": [("attn.kv_proj", dict(M=rows, K=d, N=hd)), ("norm.rms", dict(T=rows, D=hd)),
                         ("rope.apply", dict(rope, H=1))],
        "attn.softmax_tile": [("attn.softmax_tile", dict(R=rows * h, K=64))],
        "attn.leaf": [("attn.qk_tile", leaf), ("attn.softmax_tile", dict(R=rows * h, K=keys)),
                      ("attn.pv_tile", leaf)],
        "attn.o_proj": [("rope.apply", dict(rope, inverse=1))]
                       + [("attn.o_proj", dict(M=rows, K=cfg.o_group_in, N=cfg.o_lora_rank))] * groups
                       + [("attn.o_proj", dict(M=rows, K=groups * cfg.o_lora_rank, N=d))],
        "moe.gate": [("moe.gate", dict(T=rows, D=d, E=cfg.n_routed_experts))],
        "moe.experts": [("moe.experts", dict(G=cfg.n_routed_experts // ep, T=per_expert, D=d,
                                             I=cfg.moe_intermediate_size))],
        "moe.shared": [("moe.shared", dict(G=1, T=rows, D=d,
                                           I=cfg.moe_intermediate_size * cfg.n_shared_experts))],
        "lm_head.shard": [("lm_head.shard", dict(M=rows, K=d, N=cfg.vocab_size // tp))],
    }


def node_time_us(node_kernel: str, cfg, rows: int, tp: int = 1, ep: int | None = None, keys: int | None = None,
                 **kw) -> float | None:
    """Summed pypto µs of a graph node's parts; None if it has no pypto form or any part failed.

    kw go to ``sim_time_us`` (mode, cache, simulate).
    """
    parts = node_parts(cfg, rows, tp, ep, keys).get(node_kernel)
    if not parts:
        return None
    times = [sim_time_us(k, s, **kw) for k, s in parts]
    return None if any(t is None for t in times) else sum(times)
