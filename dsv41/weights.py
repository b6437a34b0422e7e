"""Weights in the released checkpoint's names, dtypes and scale tensors, and their runtime form.

``init_checkpoint`` draws deterministic random weights already in checkpoint format (FP8 E4M3
payloads with E8M0 32x32 block scales, packed MXFP4 experts with per-row group-32 E8M0 scales,
BF16 dense tensors, FP32 mHC/sink/bias). ``decode_checkpoint`` turns any such dict (drawn here or
read from a checkpoint folder, ``dsv41.checkpoint``) into FP32 runtime tensors holding exactly the
quantized values. Scales keep activations O(1) through all 40 layers.

The tensors are the blocks' own (``model.Transformer.tensors``: name, logical shape, format, std,
mean). Formats: ``bf16`` / ``f32`` dense tensors (the name is the tensor's); ``fp8`` a 32x32-block
MXFP8 linear and ``fp4`` a packed MXFP4 routed-expert linear (the name is the base; ``.weight`` and
``.scale`` are stored); ``rows8`` the Engram table (row-wise MXFP8, group 32).
"""
from __future__ import annotations

import re

import torch

from dsv41.config import ModelConfig
from dsv41.model.dspark import block_prefix
from dsv41.model.head import Head
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import (block_mxfp8_decode64, block_mxfp8_encode, expert_mxfp4_decode64, expert_mxfp4_encode,
                             mxfp8_decode, mxfp8_encode)

E8M0 = torch.float8_e8m0fnu


def _as_e8m0(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(E8M0)


def _codes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == E8M0 else scale


def _encode(name: str, fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    if fmt == "f32":
        return {name: w}
    if fmt == "bf16":
        return {name: w.to(torch.bfloat16)}
    payload, scale = block_mxfp8_encode(w) if fmt == "fp8" else mxfp8_encode(w)     # fp4: _fp4_together
    return _scaled(name, payload, scale)


def _scaled(name: str, payload: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """A quantized matrix's checkpoint tensors: its payload and its E8M0 scales."""
    return {f"{name}.weight": payload, f"{name}.scale": _as_e8m0(scale)}


def _spec(name: str, fmt: str, shape: tuple[int, ...], g: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if fmt in ("f32", "bf16"):
        return {name: (shape, torch.float32 if fmt == "f32" else torch.bfloat16)}
    n, k = shape
    payload = ((n, k // 2), torch.int8) if fmt == "fp4" else ((n, k), torch.float8_e4m3fn)
    scale = (n // g, k // g) if fmt == "fp8" else (n, k // g)
    return {f"{name}.weight": payload, f"{name}.scale": (scale, E8M0)}


def draw_checkpoint(cfg: ModelConfig, seed: int = 0):
    """(name, tensor) of the checkpoint one by one, in drawing order: a consumer that keeps only what
    it needs never holds the whole draw (FLASH's 40 layers are ~9 GB even reduced)."""
    yield from draw(Transformer.tensors(cfg), seed)


# drawn FP4 matrices wait to be encoded together up to this many values (TINY's 2,064 expert matrices
# took ~1 s one by one, nearly all of it per-call overhead); FLASH's, each larger, go one at a time
_BATCHED_FP4_VALUES = 1 << 20


def draw(tensors, seed: int = 0):
    """(name, tensor) in checkpoint format of declared tensors ((name, shape, format, std, mean), as the
    blocks' ``tensors`` give them), drawn in order from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    waiting, held = [], 0        # FP4 matrices drawn, not yet encoded, and their values
    for name, shape, fmt, std, mean in tensors:
        # in place: the same bits as ``* std + mean`` without two more tensors of the draw's size,
        # whose first touch cost more than the arithmetic (a FLASH-width embedding is 2.6 GB)
        w = torch.randn(*shape, generator=g).mul_(std).add_(mean)
        if waiting and (fmt != "fp4" or held + w.numel() > _BATCHED_FP4_VALUES):
            yield from _fp4_together(waiting)
            waiting, held = [], 0
        if fmt == "fp4":
            waiting.append((name, w))
            held += w.numel()
        else:
            yield from _encode(name, fmt, w).items()
    yield from _fp4_together(waiting)


def _fp4_together(drawn: list[tuple[str, torch.Tensor]]):
    """The checkpoint tensors of FP4 matrices, in the given order, each width's rows encoded in one
    call: the format scales each row's groups of 32 alone, so a row's codes do not depend on its
    neighbours."""
    encoded = {}
    for k in {w.shape[1] for _, w in drawn}:
        same = [(name, w) for name, w in drawn if w.shape[1] == k]
        packed, scale = expert_mxfp4_encode(torch.cat([w for _, w in same]) if len(same) > 1 else same[0][1])
        counts = [w.shape[0] for _, w in same]
        for (name, _), p, sc in zip(same, packed.split(counts), scale.split(counts)):
            if len(same) > 1:       # each its own storage (a checkpoint file stores tensors that share none)
                p, sc = p.clone(), sc.clone()
            encoded[name] = _scaled(name, p.view(torch.int8), sc)
    for name, _ in drawn:
        yield from encoded[name].items()


def init_checkpoint(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    return dict(draw_checkpoint(cfg, seed))


def checkpoint_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor ``init_checkpoint`` draws, without drawing it: the FLASH
    checkpoint (~300 GB) can be sized but never allocated here."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, shape, fmt, _, _ in Transformer.tensors(cfg):
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
    the exact quantized numbers; matrices in FP64, as ``PackedMatrix.dense`` gives them (the values are
    FP32s, which matmul_t takes them as); wo_a as [groups, o_lora, group_in]."""
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
    return v.double() if v.dim() >= 2 and not key.endswith("embed.weight") else v   # lookups stay FP32


def decode_checkpoint(cfg: ModelConfig, ck: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime weights of a whole checkpoint, keyed by runtime key (no '.weight' suffix for
    quantized linears); see ``decode_tensor``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in ck.items():
        key = runtime_key(name, ck)
        if key is not None:
            out[key] = decode_tensor(cfg, key, t, ck.get(key + ".scale") if key != name else None)
    return out


# checkpoint-name prefixes of what feeds each site of a block ({P}: its prefix, a backbone layer's or a
# DSpark stage's; the head: its norm and matrix)
_FEEDS = {"attn": ("{P}hc_attn_", "{P}attn_norm.", "{P}attn.", "{P}engram."),
          "ffn": ("{P}hc_ffn_", "{P}ffn_norm.", "{P}ffn.")}


def site_tensors(cfg: ModelConfig, layer: int | None, site: str) -> list[str]:
    """Checkpoint tensors that feed one site (``model.finite``: attn, ffn, or the logits), the
    routed experts' names folded to ``experts.*``."""
    if site not in _FEEDS:
        return [Head.NORM, Head.HEAD]
    prefixes = tuple(p.format(P=block_prefix(cfg, layer)) for p in _FEEDS[site])
    names = (re.sub(r"\.experts\.\d+\.", ".experts.*.", n) for n in checkpoint_specs(cfg) if n.startswith(prefixes))
    return list(dict.fromkeys(names))
