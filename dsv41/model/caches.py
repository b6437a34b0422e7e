"""The paged caches' names and formats, and staged publication into them.

Cache names read ``<kind>.<layer>``: ``window.L`` (every layer, and each DSpark stage at its layer id
past the backbone), ``compressed.S`` and ``index.S``
(KV source layers S, rows per ``ratio`` tokens), ``ring.S`` (the ratio-2 compressor's state ring).
The kind selects the ``ops.kv_cache`` format a name is encoded in.
"""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.ops import kv_cache
from dsv41.model.staged import StagedTensors


def window(layer: int) -> str:
    return f"window.{layer}"


def compressed(source: int) -> str:
    return f"compressed.{source}"


def index(source: int) -> str:
    return f"index.{source}"


def ring(source: int) -> str:
    return f"ring.{source}"


def compressor_writes(spec) -> tuple[str, ...]:
    """What a FULL layer's compressed publication writes (its state ring too at ratio 2)."""
    s = spec.layer
    return (compressed(s), index(s)) + ((ring(s),) if spec.ratio == 2 else ())


def cache_names(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """name -> (format kind, width, ratio); rows come from the request table's pools."""
    names = {window(s.layer): (kv_cache.WINDOW, cfg.head_dim, 1) for s in cfg.layers}
    # the DSpark stages' windows (layer ids past the backbone): main tokens' rows at their window slots
    names.update({window(cfg.num_hidden_layers + s): (kv_cache.WINDOW, cfg.head_dim, 1)
                  for s in range(cfg.n_mtp_layers)})
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        names[compressed(s)] = (kv_cache.COMPRESSED, cfg.head_dim, r)
        names[index(s)] = (kv_cache.INDEX, cfg.index_head_dim, r)
    return names


def empty_caches(cfg: ModelConfig, pools, device="cpu") -> dict[str, tuple[torch.Tensor, ...]]:
    """Zeroed caches for a request table's pools (``window_blocks``, ``compressed_blocks`` per
    ratio, ``state_blocks``)."""
    bs = cfg.block_size
    out = {}
    for name, (kind, width, ratio) in cache_names(cfg).items():
        blocks = pools.window_blocks if kind == kv_cache.WINDOW else pools.compressed_blocks[ratio]
        out[name] = kv_cache.FORMATS[kind].empty(blocks * bs, width, device)
    for s in cfg.kv_source_layer_ids:
        if cfg.compress_ratios[s] == 2:
            out[ring(s)] = (torch.zeros(pools.state_blocks * cfg.state_capacity, 2 * cfg.head_dim, device=device),)
    return out


def publish(caches: StagedTensors, name: str, slots: torch.Tensor, values: torch.Tensor):
    """Encode and stage the rows of values whose slot >= 0 (row i of values is the step's token row i)."""
    keep = slots >= 0
    if bool(keep.any()):
        caches.put(name, slots[keep], kv_cache.FORMATS[name.split(".")[0]].encode(values[keep]),
                   torch.nonzero(keep).flatten())


def read(caches: StagedTensors, name: str, rows: torch.Tensor) -> torch.Tensor:
    payload, scale = caches.read(name)
    return kv_cache.read(payload, scale, kv_cache.FORMATS[name.split(".")[0]], rows)
