"""Weights in the released checkpoint's names, dtypes and scale tensors, and their runtime form.

``init_checkpoint`` draws deterministic random weights already in checkpoint format (FP8 E4M3
payloads with E8M0 32x32 block scales, packed MXFP4 experts with per-row group-32 E8M0 scales,
BF16 dense tensors, FP32 mHC/sink/bias). ``decode_checkpoint`` turns any such dict (drawn here or
read from a checkpoint folder, ``dsv41.checkpoint``) into FP32 runtime tensors holding exactly the
quantized values. Scales keep activations O(1) through all 40 layers.
"""
from __future__ import annotations

import torch

from dsv41.config import FULL, ModelConfig
from dsv41.ops.engram import engram_table_rows
from dsv41.ops.quant import (block_mxfp8_decode64, block_mxfp8_encode, expert_mxfp4_decode64, expert_mxfp4_encode,
                             mxfp8_decode, mxfp8_encode)

E8M0 = torch.float8_e8m0fnu


def _as_e8m0(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(E8M0)


def _codes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == E8M0 else scale


def _layout(cfg: ModelConfig):
    """(name, logical shape, format, std, mean) of every checkpoint tensor, in drawing order.

    Formats: ``bf16`` / ``f32`` dense tensors (name is the tensor's); ``fp8`` a 32x32-block MXFP8
    linear and ``fp4`` a packed MXFP4 routed-expert linear (name is the base; ``.weight`` and
    ``.scale`` are stored); ``rows8`` the Engram table (row-wise MXFP8, group 32). The one walk
    serves drawing (``init_checkpoint``) and sizing (``checkpoint_specs``).
    """
    d, hd, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    yield "embed.weight", (cfg.vocab_size, d), "bf16", 1.0, 0.0
    yield "norm.weight", (d,), "bf16", 0.05, 1.0
    yield "head.weight", (cfg.vocab_size, d), "bf16", d ** -0.5, 0.0
    for spec in cfg.layers:
        p = f"layers.{spec.layer}."
        for site in ("attn", "ffn"):
            yield f"{p}hc_{site}_fn", (cfg.mix_hc, cfg.hc_dim), "f32", 0.5 * cfg.hc_dim ** -0.5, 0.0
            yield f"{p}hc_{site}_scale", (3,), "f32", 0.1, 1.0
            yield f"{p}hc_{site}_base", (cfg.mix_hc,), "f32", 0.5, 0.0
        yield f"{p}attn_norm.weight", (d,), "bf16", 0.05, 1.0
        yield f"{p}ffn_norm.weight", (d,), "bf16", 0.05, 1.0
        a = f"{p}attn."
        o_in = cfg.o_groups * cfg.o_lora_rank
        yield f"{a}wq_a", (cfg.q_lora_rank, d), "fp8", d ** -0.5, 0.0
        yield f"{a}wq_b", (cfg.num_attention_heads * hd, cfg.q_lora_rank), "fp8", cfg.q_lora_rank ** -0.5, 0.0
        yield f"{a}wkv", (hd, d), "fp8", d ** -0.5, 0.0
        yield f"{a}wo_a", (o_in, cfg.o_group_in), "fp8", cfg.o_group_in ** -0.5, 0.0
        yield f"{a}wo_b", (d, o_in), "fp8", o_in ** -0.5, 0.0
        yield f"{a}q_norm.weight", (cfg.q_lora_rank,), "bf16", 0.05, 1.0
        yield f"{a}kv_norm.weight", (hd,), "bf16", 0.05, 1.0
        yield f"{a}attn_sink", (cfg.num_attention_heads,), "f32", 1.0, 0.0
        if spec.mode == FULL:
            yield f"{a}compressor.wkv.weight", (hd, d), "bf16", d ** -0.5, 0.0
            if spec.ratio == 2:
                yield f"{a}compressor.wgate.weight", (hd, d), "bf16", d ** -0.5, 0.0
            yield f"{a}compressor.norm.weight", (hd,), "bf16", 0.05, 1.0
            yield f"{a}indexer.wk.weight", (cfg.index_head_dim, hd), "bf16", hd ** -0.5, 0.0
            yield f"{a}indexer.k_norm.weight", (cfg.index_head_dim,), "bf16", 0.05, 1.0
        if spec.layer in cfg.index_source_layer_ids:
            yield (f"{a}indexer.wq_b", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "fp8",
                   cfg.q_lora_rank ** -0.5, 0.0)
            yield f"{a}indexer.weights_proj.weight", (cfg.index_n_heads, d), "bf16", d ** -0.5, 0.0
        f = f"{p}ffn."
        yield f"{f}gate.weight", (cfg.n_routed_experts, d), "bf16", d ** -0.5, 0.0
        yield f"{f}gate.bias", (cfg.n_routed_experts,), "f32", 0.1, 0.0
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            yield f"{f}experts.{e}.w1", (inter, d), "fp4", d ** -0.5, 0.0
            yield f"{f}experts.{e}.w2", (d, inter), "fp4", inter ** -0.5, 0.0
            yield f"{f}experts.{e}.w3", (inter, d), "fp4", d ** -0.5, 0.0
        yield f"{f}shared_experts.w1", (inter, d), "fp8", d ** -0.5, 0.0
        yield f"{f}shared_experts.w2", (d, inter), "fp8", inter ** -0.5, 0.0
        yield f"{f}shared_experts.w3", (inter, d), "fp8", d ** -0.5, 0.0
        if spec.layer in cfg.engram_layer_ids:
            e = f"{p}engram."
            yield f"{e}embed", (engram_table_rows(cfg, spec.layer), cfg.engram_head_dim), "rows8", 1.0, 0.0
            yield f"{e}wkv", ((hc + 1) * d, cfg.engram_lookup_dim), "fp8", cfg.engram_lookup_dim ** -0.5, 0.0
            yield f"{e}q_weight", (hc, d), "bf16", 0.05, 1.0
            yield f"{e}k_weight", (hc, d), "bf16", 0.05, 1.0


def _encode(name: str, fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    if fmt == "f32":
        return {name: w}
    if fmt == "bf16":
        return {name: w.to(torch.bfloat16)}
    if fmt == "fp8":
        payload, scale = block_mxfp8_encode(w)
    elif fmt == "fp4":
        packed, scale = expert_mxfp4_encode(w)
        payload = packed.view(torch.int8)
    else:
        payload, scale = mxfp8_encode(w)
    return {f"{name}.weight": payload, f"{name}.scale": _as_e8m0(scale)}


def _spec(name: str, fmt: str, shape: tuple[int, ...], g: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if fmt in ("f32", "bf16"):
        return {name: (shape, torch.float32 if fmt == "f32" else torch.bfloat16)}
    n, k = shape
    payload = ((n, k // 2), torch.int8) if fmt == "fp4" else ((n, k), torch.float8_e4m3fn)
    scale = (n // g, k // g) if fmt == "fp8" else (n, k // g)
    return {f"{name}.weight": payload, f"{name}.scale": (scale, E8M0)}


def init_checkpoint(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ck: dict[str, torch.Tensor] = {}
    for name, shape, fmt, std, mean in _layout(cfg):
        ck.update(_encode(name, fmt, torch.randn(*shape, generator=g) * std + mean))
    return ck


def checkpoint_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor ``init_checkpoint`` draws, without drawing it: the FLASH
    checkpoint (~300 GB) can be sized but never allocated here."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, shape, fmt, _, _ in _layout(cfg):
        out.update(_spec(name, fmt, shape, cfg.mx_group))
    return out


def is_scaled(name: str, names) -> bool:
    """Whether ``name`` is a quantized payload (``X.weight`` with an ``X.scale`` partner)."""
    return name.endswith(".weight") and name[: -len(".weight")] + ".scale" in names


def runtime_key(name: str, names) -> str | None:
    """The runtime key a checkpoint tensor decodes to; None for a scale (it joins its payload)."""
    if name.endswith(".scale") and not name.endswith("_scale"):
        return None
    return name[: -len(".weight")] if is_scaled(name, names) else name


def decode_tensor(cfg: ModelConfig, key: str, t: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """One runtime weight from its checkpoint tensor(s), which may be a card's slice: FP32 values of
    the exact quantized numbers; matrices in FP64 so matmul_t accumulates without a per-call cast
    (values unchanged); wo_a as [groups, o_lora, group_in]."""
    if scale is None:
        v = t.float()
    elif key.endswith("engram.embed"):
        return mxfp8_decode(t, _codes(scale), t.shape[1] // scale.shape[1])
    elif t.dtype == torch.int8:
        v = expert_mxfp4_decode64(t, _codes(scale))
    else:
        v = block_mxfp8_decode64(t, _codes(scale))
    if key.endswith(".attn.wo_a"):
        v = v.reshape(-1, cfg.o_lora_rank, cfg.o_group_in)
    return v.double() if v.dim() >= 2 and key != "embed.weight" else v


def decode_checkpoint(cfg: ModelConfig, ck: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime weights of a whole checkpoint, keyed by runtime key (no '.weight' suffix for
    quantized linears); see ``decode_tensor``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in ck.items():
        key = runtime_key(name, ck)
        if key is not None:
            out[key] = decode_tensor(cfg, key, t, ck.get(key + ".scale") if key != name else None)
    return out

