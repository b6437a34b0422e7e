"""Validation before serving: one pass over the index and the safetensors headers, no tensor data.

Every tensor the config implies must be listed in ``model.safetensors.index.json``, present in
its shard's header with its exact shape and dtype, and lie inside the shard's bytes; nothing
unexpected may be listed, and a shard may hold only tensors the index lists in it. Every shard
the index names must resolve inside the folder (no absolute path, no ``..``, no symlink that leads
out), and each shard's header must describe its data region exactly: entries are objects,
``__metadata__`` maps strings to strings, and the data offsets tile the region with no gap, no
overlap and nothing after the last tensor (safetensors' own rule). The index's SHA-256 table
(``checksums``), when it has one, must list every served tensor and nothing the map does not.
Tensors of parts this project does not serve (the image-token gate bias, draft layers numbered
past the backbone, the vision modules, ``hc_head``) are recognised and skipped. DSpark's stages
(``mtp.S.*``) are validated like any tensor when the config declares DSpark and the index lists
them; an index listing none of them serves the backbone alone (``dspark_listed`` tells which). The
first problem raises ``CheckpointError``.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from dsv41.checkpoint import checksums
from dsv41.checkpoint.confine import folder_file, outside
from dsv41.checkpoint.errors import CheckpointError
from dsv41.config import ModelConfig
from dsv41.weights import checkpoint_specs

INDEX = "model.safetensors.index.json"
DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8"}
_OUT_OF_SCOPE_MODULES = ("vision.", "aligner.", "hc_head")
# a DSpark stage's parts the official forward does not read: references to the shared embedding and
# LM head, and a final-collapse module (the stage collapses with its pre mix)
_DSPARK_UNREAD = re.compile(r"mtp\.\d+\.(embed\.|head\.|hc_head)")


def fail(file, tensor: str | None, expected, found):
    where = f"{file}: tensor {tensor!r}" if tensor else f"{file}"
    raise CheckpointError(f"{where}: expected {expected}, found {found}")


def out_of_scope(name: str, cfg: ModelConfig) -> bool:
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer:
        return int(layer.group(1)) >= cfg.num_hidden_layers or name.endswith(".gate.bias_vl")
    if name.startswith("mtp."):
        # without DSpark in the config, draft modules of any kind are not served
        return not cfg.dspark or bool(_DSPARK_UNREAD.match(name))
    return name.startswith(_OUT_OF_SCOPE_MODULES)


def dspark_listed(weight_map: dict, cfg: ModelConfig) -> bool:
    """Whether the index lists DSpark's stages (any ``mtp.*`` tensor the config implies)."""
    return cfg.dspark and any(n.startswith("mtp.") and not _DSPARK_UNREAD.match(n) for n in weight_map)


def read_index(folder: Path) -> tuple[dict[str, str], dict[str, str] | None]:
    """(the weight_map, the per-tensor SHA-256 table or None when the index has none: ``checksums``)."""
    path = folder_file(folder, INDEX)
    if not path.is_file():
        fail(path, None, "the checkpoint index", "no file")
    try:
        doc = json.loads(path.read_text())
        weight_map = doc.get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        fail(path, None, "a JSON object with a weight_map", f"unreadable JSON ({e})")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        fail(path, None, "weight_map: an object of tensor name -> shard file", type(weight_map).__name__)
    root = folder.resolve()
    for name, file in weight_map.items():
        why = outside(root, file)
        if why is not None:
            fail(INDEX, name, "a shard file inside the checkpoint folder", f"{file!r}, {why}")
    return weight_map, checksums.table(doc, partial(fail, INDEX))


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
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict):
        fail(path.name, "__metadata__", "an object of string -> string", type(meta).__name__)
    for key, value in meta.items():
        if not isinstance(value, str):
            fail(path.name, "__metadata__", f"string values, {key!r} too", f"{type(value).__name__} {value!r}")
    for name, entry in header.items():
        _check_entry(path.name, name, entry)
    data_bytes = size - 8 - n
    _check_coverage(path.name, header, data_bytes)
    return header, data_bytes


def _check_entry(file: str, name: str, entry) -> None:
    """One header entry: {"dtype": str, "shape": [int >= 0], "data_offsets": [begin, end]}."""
    if not isinstance(entry, dict):
        fail(file, name, "a header entry object with dtype, shape and data_offsets", type(entry).__name__)
    if not isinstance(entry.get("dtype"), str):
        fail(file, name, "a dtype string", entry.get("dtype"))
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        fail(file, name, "a shape of integers >= 0", shape)
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        fail(file, name, "data_offsets [begin, end] with 0 <= begin <= end", offsets)


def _check_coverage(file: str, header: dict, data_bytes: int) -> None:
    """The tensors' byte ranges tile the data region: no gap, no overlap, no bytes after the last."""
    at, previous = 0, None
    for name, entry in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = entry["data_offsets"]
        if end > data_bytes:
            fail(file, name, f"data bytes [{begin}, {end}) inside the shard's {data_bytes}", "a truncated shard")
        if begin < at:
            fail(file, name, f"data from byte {at} (where {previous!r} ends)",
                 f"[{begin}, {end}), overlapping {previous!r}")
        if begin > at:
            after = f"after {previous!r}" if previous else "at the start"
            fail(file, name, f"data from byte {at}", f"[{begin}, {end}): {begin - at} unlisted bytes {after}")
        at, previous = end, name
    if at != data_bytes:
        fail(file, previous, f"the data to end with this tensor at byte {at} (the last one listed)",
             f"{data_bytes - at} more bytes after it")


def check_headers(folder: Path, cfg: ModelConfig) -> tuple[dict[str, str], dict[str, str] | None]:
    """(tensor name -> shard file of every tensor served, in layout order, after checking them all; the
    index's SHA-256 per tensor, or None). With DSpark in ``cfg`` but no ``mtp.*`` tensor listed, the
    backbone's alone (served without DSpark); with some listed, every one the config implies must be
    there. A shard holding a tensor the index does not list is refused (bytes nobody accounts for)."""
    weight_map, digests = read_index(folder)
    specs = checkpoint_specs(cfg if dspark_listed(weight_map, cfg) else without_dspark(cfg))
    for name in specs:
        if name not in weight_map:
            fail(INDEX, name, "listed (the config implies it)", "missing")
    served = {n: weight_map[n] for n in specs}
    for name in weight_map:
        if name not in specs and not out_of_scope(name, cfg):
            fail(weight_map[name], name, "no such tensor (the config does not imply it)", "an unexpected tensor")
    if digests is not None:
        checksums.check_listed(digests, weight_map, served, partial(fail, INDEX))
    by_file: dict[str, list[str]] = {}
    for name, file in served.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        path = folder / file   # inside the folder: read_index confined it
        if not path.is_file():
            fail(file, names[0], f"shard file {file} on disk (listed in {INDEX})", "no file")
        header, data_bytes = read_header(path)
        for name in header:
            if weight_map.get(name) != file:
                fail(file, name, f"only tensors {INDEX} lists in this shard", "a tensor it does not list here")
        for name in names:
            shape, dtype = specs[name]
            entry = header.get(name)
            if entry is None:
                fail(file, name, f"in this shard (listed in {INDEX})", "not in its header")
            if entry.get("dtype") != DTYPES[dtype]:
                fail(file, name, f"dtype {DTYPES[dtype]}", entry.get("dtype"))
            if tuple(entry.get("shape", ())) != tuple(shape):
                fail(file, name, f"shape {list(shape)}", entry.get("shape"))
            begin, end = entry["data_offsets"]
            want = torch.Size(shape).numel() * dtype.itemsize
            if end - begin != want:
                fail(file, name, f"{want} data bytes", f"{end - begin}")
    return served, digests


def without_dspark(cfg: ModelConfig) -> ModelConfig:
    """The config served when the checkpoint has no DSpark stages: the backbone alone."""
    return replace(cfg, n_mtp_layers=0) if cfg.dspark else cfg
