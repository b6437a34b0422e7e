"""Validation before serving: one pass over the index and the safetensors headers, no tensor data.

Every tensor the config implies must be listed in ``model.safetensors.index.json``, present in
its shard's header with its exact shape and dtype, and lie inside the shard's bytes; nothing
unexpected may be listed. Tensors of parts this project does not serve (the image-token gate
bias, draft layers numbered past the backbone, the draft/vision modules, ``hc_head``) are
recognised and skipped. The first problem raises ``CheckpointError``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dsv41.checkpoint.errors import CheckpointError
from dsv41.config import ModelConfig
from dsv41.weights import checkpoint_specs

INDEX = "model.safetensors.index.json"
DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8"}
_OUT_OF_SCOPE_MODULES = ("mtp.", "vision.", "aligner.", "hc_head")


def fail(file, tensor: str | None, expected, found):
    where = f"{file}: tensor {tensor!r}" if tensor else f"{file}"
    raise CheckpointError(f"{where}: expected {expected}, found {found}")


def out_of_scope(name: str, cfg: ModelConfig) -> bool:
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer:
        return int(layer.group(1)) >= cfg.num_hidden_layers or name.endswith(".gate.bias_vl")
    return name.startswith(_OUT_OF_SCOPE_MODULES)


def read_index(folder: Path) -> dict[str, str]:
    path = folder / INDEX
    if not path.is_file():
        fail(path, None, "the checkpoint index", "no file")
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        fail(path, None, "a JSON object with a weight_map", f"unreadable JSON ({e})")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        fail(path, None, "weight_map: an object of tensor name -> shard file", type(weight_map).__name__)
    return weight_map


def read_header(path: Path) -> tuple[dict, int]:
    """(header entries, size of the data region) of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            fail(path.name, None, "a safetensors header inside the file", f"{size} bytes (truncated)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            fail(path.name, None, "a JSON safetensors header", f"unreadable header ({e})")
    if not isinstance(header, dict):
        fail(path.name, None, "a JSON object as the safetensors header", type(header).__name__)
    header.pop("__metadata__", None)
    return header, size - 8 - n


def check_headers(folder: Path, cfg: ModelConfig) -> dict[str, str]:
    """Tensor name -> shard file of every tensor served, in layout order, after checking them all."""
    weight_map = read_index(folder)
    specs = checkpoint_specs(cfg)
    for name in specs:
        if name not in weight_map:
            fail(INDEX, name, "listed (the config implies it)", "missing")
    served = {n: weight_map[n] for n in specs}
    for name in weight_map:
        if name not in specs and not out_of_scope(name, cfg):
            fail(weight_map[name], name, "no such tensor (the config does not imply it)", "an unexpected tensor")
    by_file: dict[str, list[str]] = {}
    for name, file in served.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        path = folder / file
        if not path.is_file():
            fail(file, names[0], f"shard file {file} on disk (listed in {INDEX})", "no file")
        header, data_bytes = read_header(path)
        for name in names:
            shape, dtype = specs[name]
            entry = header.get(name)
            if entry is None:
                fail(file, name, f"in this shard (listed in {INDEX})", "not in its header")
            if entry.get("dtype") != DTYPES[dtype]:
                fail(file, name, f"dtype {DTYPES[dtype]}", entry.get("dtype"))
            if tuple(entry.get("shape", ())) != tuple(shape):
                fail(file, name, f"shape {list(shape)}", entry.get("shape"))
            begin, end = entry.get("data_offsets", (0, -1))
            want = torch.Size(shape).numel() * dtype.itemsize
            if end - begin != want:
                fail(file, name, f"{want} data bytes", f"{end - begin}")
            if end > data_bytes:
                fail(file, name, f"data bytes [{begin}, {end}) inside the shard's {data_bytes}",
                     "a truncated shard")
    return served
