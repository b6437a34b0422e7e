"""Weights in the released checkpoint's names, dtypes and scale tensors, and their runtime form.

``init_checkpoint`` draws deterministic random weights already in checkpoint format (FP8 E4M3
payloads with E8M0 32x32 block scales, packed MXFP4 experts with per-row group-32 E8M0 scales,
BF16 dense tensors, FP32 mHC/sink/bias). ``decode_checkpoint`` turns any such dict (drawn here or
read from safetensors) into FP32 runtime tensors holding exactly the quantized values. Scales keep
activations O(1) through all 40 layers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dsv41.config import FULL, ModelConfig
from dsv41.ops.engram import engram_table_rows
from dsv41.ops.quant import (block_mxfp8_decode, block_mxfp8_encode, e8m0_decode, expert_mxfp4_decode,
                             expert_mxfp4_encode, mxfp8_encode)

E8M0 = torch.float8_e8m0fnu


def _as_e8m0(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(E8M0)


def _codes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == E8M0 else scale


class _Draw:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * std + mean


def _fp8(ck: dict, name: str, w: torch.Tensor):
    payload, scale = block_mxfp8_encode(w)
    ck[f"{name}.weight"], ck[f"{name}.scale"] = payload, _as_e8m0(scale)


def _fp4(ck: dict, name: str, w: torch.Tensor):
    packed, scale = expert_mxfp4_encode(w)
    ck[f"{name}.weight"], ck[f"{name}.scale"] = packed.view(torch.int8), _as_e8m0(scale)


def _bf16(ck: dict, name: str, w: torch.Tensor):
    ck[name] = w.to(torch.bfloat16)


def init_checkpoint(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    r = _Draw(seed)
    d, hd, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    ck: dict[str, torch.Tensor] = {}
    _bf16(ck, "embed.weight", r.normal(cfg.vocab_size, d))
    _bf16(ck, "norm.weight", r.normal(d, std=0.05, mean=1.0))
    _bf16(ck, "head.weight", r.normal(cfg.vocab_size, d, std=d ** -0.5))
    for spec in cfg.layers:
        p = f"layers.{spec.layer}."
        for site in ("attn", "ffn"):
            ck[f"{p}hc_{site}_fn"] = r.normal(cfg.mix_hc, cfg.hc_dim, std=0.5 * cfg.hc_dim ** -0.5)
            ck[f"{p}hc_{site}_scale"] = r.normal(3, std=0.1, mean=1.0)
            ck[f"{p}hc_{site}_base"] = r.normal(cfg.mix_hc, std=0.5)
        _bf16(ck, f"{p}attn_norm.weight", r.normal(d, std=0.05, mean=1.0))
        _bf16(ck, f"{p}ffn_norm.weight", r.normal(d, std=0.05, mean=1.0))
        a = f"{p}attn."
        _fp8(ck, f"{a}wq_a", r.normal(cfg.q_lora_rank, d, std=d ** -0.5))
        _fp8(ck, f"{a}wq_b", r.normal(cfg.num_attention_heads * hd, cfg.q_lora_rank, std=cfg.q_lora_rank ** -0.5))
        _fp8(ck, f"{a}wkv", r.normal(hd, d, std=d ** -0.5))
        _fp8(ck, f"{a}wo_a", r.normal(cfg.o_groups * cfg.o_lora_rank, cfg.o_group_in, std=cfg.o_group_in ** -0.5))
        _fp8(ck, f"{a}wo_b", r.normal(d, cfg.o_groups * cfg.o_lora_rank,
                                      std=(cfg.o_groups * cfg.o_lora_rank) ** -0.5))
        _bf16(ck, f"{a}q_norm.weight", r.normal(cfg.q_lora_rank, std=0.05, mean=1.0))
        _bf16(ck, f"{a}kv_norm.weight", r.normal(hd, std=0.05, mean=1.0))
        ck[f"{a}attn_sink"] = r.normal(cfg.num_attention_heads)
        if spec.mode == FULL:
            _bf16(ck, f"{a}compressor.wkv.weight", r.normal(hd, d, std=d ** -0.5))
            if spec.ratio == 2:
                _bf16(ck, f"{a}compressor.wgate.weight", r.normal(hd, d, std=d ** -0.5))
            _bf16(ck, f"{a}compressor.norm.weight", r.normal(hd, std=0.05, mean=1.0))
            ih = cfg.index_head_dim
            _bf16(ck, f"{a}indexer.wk.weight", r.normal(ih, hd, std=hd ** -0.5))
            _bf16(ck, f"{a}indexer.k_norm.weight", r.normal(ih, std=0.05, mean=1.0))
        if spec.layer in cfg.index_source_layer_ids:
            _fp8(ck, f"{a}indexer.wq_b", r.normal(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank,
                                                  std=cfg.q_lora_rank ** -0.5))
            _bf16(ck, f"{a}indexer.weights_proj.weight", r.normal(cfg.index_n_heads, d, std=d ** -0.5))
        f = f"{p}ffn."
        _bf16(ck, f"{f}gate.weight", r.normal(cfg.n_routed_experts, d, std=d ** -0.5))
        ck[f"{f}gate.bias"] = r.normal(cfg.n_routed_experts, std=0.1)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            _fp4(ck, f"{f}experts.{e}.w1", r.normal(inter, d, std=d ** -0.5))
            _fp4(ck, f"{f}experts.{e}.w2", r.normal(d, inter, std=inter ** -0.5))
            _fp4(ck, f"{f}experts.{e}.w3", r.normal(inter, d, std=d ** -0.5))
        _fp8(ck, f"{f}shared_experts.w1", r.normal(inter, d, std=d ** -0.5))
        _fp8(ck, f"{f}shared_experts.w2", r.normal(d, inter, std=inter ** -0.5))
        _fp8(ck, f"{f}shared_experts.w3", r.normal(inter, d, std=d ** -0.5))
        if spec.layer in cfg.engram_layer_ids:
            e = f"{p}engram."
            payload, scale = mxfp8_encode(r.normal(engram_table_rows(cfg, spec.layer), cfg.engram_head_dim))
            ck[f"{e}embed.weight"], ck[f"{e}embed.scale"] = payload, _as_e8m0(scale)
            _fp8(ck, f"{e}wkv", r.normal((hc + 1) * d, cfg.engram_lookup_dim, std=cfg.engram_lookup_dim ** -0.5))
            ck[f"{e}q_weight"] = r.normal(hc, d, std=0.05, mean=1.0).to(torch.bfloat16)
            ck[f"{e}k_weight"] = r.normal(hc, d, std=0.05, mean=1.0).to(torch.bfloat16)
    return ck


def checkpoint_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor ``init_checkpoint`` draws, without drawing it: the FLASH
    checkpoint (~300 GB) can be sized but never allocated here. Kept in step with init_checkpoint by
    a test that compares the two on TINY."""
    d, hd, hc, g = cfg.hidden_size, cfg.head_dim, cfg.hc_mult, cfg.mx_group
    f32, bf16 = torch.float32, torch.bfloat16
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def fp8(name, n, k):
        out[f"{name}.weight"], out[f"{name}.scale"] = ((n, k), torch.float8_e4m3fn), ((n // g, k // g), E8M0)

    def fp4(name, n, k):
        out[f"{name}.weight"], out[f"{name}.scale"] = ((n, k // 2), torch.int8), ((n, k // g), E8M0)

    out["embed.weight"], out["norm.weight"] = ((cfg.vocab_size, d), bf16), ((d,), bf16)
    out["head.weight"] = ((cfg.vocab_size, d), bf16)
    for spec in cfg.layers:
        p = f"layers.{spec.layer}."
        for site in ("attn", "ffn"):
            out[f"{p}hc_{site}_fn"] = ((cfg.mix_hc, cfg.hc_dim), f32)
            out[f"{p}hc_{site}_scale"], out[f"{p}hc_{site}_base"] = ((3,), f32), ((cfg.mix_hc,), f32)
        out[f"{p}attn_norm.weight"], out[f"{p}ffn_norm.weight"] = ((d,), bf16), ((d,), bf16)
        a = f"{p}attn."
        fp8(f"{a}wq_a", cfg.q_lora_rank, d)
        fp8(f"{a}wq_b", cfg.num_attention_heads * hd, cfg.q_lora_rank)
        fp8(f"{a}wkv", hd, d)
        fp8(f"{a}wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.o_group_in)
        fp8(f"{a}wo_b", d, cfg.o_groups * cfg.o_lora_rank)
        out[f"{a}q_norm.weight"], out[f"{a}kv_norm.weight"] = ((cfg.q_lora_rank,), bf16), ((hd,), bf16)
        out[f"{a}attn_sink"] = ((cfg.num_attention_heads,), f32)
        if spec.mode == FULL:
            out[f"{a}compressor.wkv.weight"] = ((hd, d), bf16)
            if spec.ratio == 2:
                out[f"{a}compressor.wgate.weight"] = ((hd, d), bf16)
            out[f"{a}compressor.norm.weight"] = ((hd,), bf16)
            out[f"{a}indexer.wk.weight"] = ((cfg.index_head_dim, hd), bf16)
            out[f"{a}indexer.k_norm.weight"] = ((cfg.index_head_dim,), bf16)
        if spec.layer in cfg.index_source_layer_ids:
            fp8(f"{a}indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            out[f"{a}indexer.weights_proj.weight"] = ((cfg.index_n_heads, d), bf16)
        f = f"{p}ffn."
        out[f"{f}gate.weight"], out[f"{f}gate.bias"] = ((cfg.n_routed_experts, d), bf16), ((cfg.n_routed_experts,), f32)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            fp4(f"{f}experts.{e}.w1", inter, d)
            fp4(f"{f}experts.{e}.w2", d, inter)
            fp4(f"{f}experts.{e}.w3", inter, d)
        fp8(f"{f}shared_experts.w1", inter, d)
        fp8(f"{f}shared_experts.w2", d, inter)
        fp8(f"{f}shared_experts.w3", inter, d)
        if spec.layer in cfg.engram_layer_ids:
            e, rows = f"{p}engram.", engram_table_rows(cfg, spec.layer)
            out[f"{e}embed.weight"] = ((rows, cfg.engram_head_dim), torch.float8_e4m3fn)
            out[f"{e}embed.scale"] = ((rows, cfg.engram_head_dim // g), E8M0)
            fp8(f"{e}wkv", (hc + 1) * d, cfg.engram_lookup_dim)
            out[f"{e}q_weight"], out[f"{e}k_weight"] = ((hc, d), bf16), ((hc, d), bf16)
    return out


def decode_checkpoint(cfg: ModelConfig, ck: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime weights: FP32 tensors of the exact quantized values, keyed by tensor name (no '.weight'
    suffix for quantized linears). wo_a becomes [groups, o_lora, group_in]."""
    out: dict[str, torch.Tensor] = {}
    for name, t in ck.items():
        if name.endswith(".scale") and not name.endswith("_scale"):
            continue
        scale = ck.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is None:
            out[name] = t.float()
            continue
        base = name[: -len(".weight")]
        codes = _codes(scale)
        if t.dtype == torch.int8:
            out[base] = expert_mxfp4_decode(t.view(torch.uint8), codes)
        elif base.endswith("engram.embed"):
            g = t.shape[1] // codes.shape[1]
            out[base] = (t.float().reshape(t.shape[0], -1, g) * e8m0_decode(codes).unsqueeze(-1)).reshape(t.shape)
        else:
            out[base] = block_mxfp8_decode(t, codes)
    for spec in cfg.layers:
        key = f"layers.{spec.layer}.attn.wo_a"
        out[key] = out[key].reshape(cfg.o_groups, cfg.o_lora_rank, cfg.o_group_in)
    # matrices are held in FP64 so matmul_t accumulates without a per-call cast (values unchanged)
    return {k: (v.double() if v.dim() >= 2 and not k.endswith("engram.embed") and k != "embed.weight" else v)
            for k, v in out.items()}


def save_checkpoint(cfg: ModelConfig, ck: dict[str, torch.Tensor], path: str | os.PathLike, shard_bytes: int = 1 << 28):
    """Write sharded safetensors plus model.safetensors.index.json and a config.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards, cur, size = [], {}, 0
    for name, t in ck.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t.contiguous()
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname))
        weight_map.update({n: fname for n in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(config_json(cfg), indent=1))


def config_json(cfg: ModelConfig) -> dict:
    return {"text_config": {
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
        "sliding_window": cfg.sliding_window, "vocab_size": cfg.vocab_size,
        "kv_source_layer_ids": list(cfg.kv_source_layer_ids),
        "index_source_layer_ids": list(cfg.index_source_layer_ids)},
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Read a checkpoint folder in the released layout; checks config.json against cfg when given."""
    from safetensors.torch import load_file

    path = Path(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    if cfg is not None and (path / "config.json").exists():
        text = json.loads((path / "config.json").read_text()).get("text_config", {})
        for key, want in config_json(cfg)["text_config"].items():
            if key in text and text[key] != want:
                raise ValueError(f"config.json text_config.{key}: checkpoint has {text[key]}, config {cfg.name} "
                                 f"expects {want}")
    ck = {}
    for fname in sorted(set(index["weight_map"].values())):
        ck.update(load_file(str(path / fname)))
    return ck
