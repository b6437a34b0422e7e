"""A checkpoint folder opened for serving: validated config, tensors read slice by slice.

``open_checkpoint`` checks ``config.json``, the index and every shard header, and builds the
Engram token map from ``tokenizer.json`` (its size must be the config's compressed vocabulary),
before anything is served. ``get`` reads only the requested slice of one tensor through
``safe_open(...).get_slice`` and checks its values as read: BF16/FP32 finite, FP8 E4M3 payload
codes not NaN (E4M3FN has no infinities), E8M0 scale codes not 0xFF (NaN). Packed FP4 bytes are
always finite values.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dsv41.checkpoint import config_json
from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.headers import check_headers, fail
from dsv41.checkpoint.text import TextCodec
from dsv41.checkpoint.token_map import build_token_map
from dsv41.config import ModelConfig


def _bad_values(t: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """(bool mask of values that may not appear, what is allowed), or None when every code is finite."""
    if t.dtype in (torch.float32, torch.bfloat16):
        return ~torch.isfinite(t), "finite values"
    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) & 0x7F) == 0x7F, "E4M3 codes that are not NaN (0x7F, 0xFF)"
    if t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8) == 0xFF, "E8M0 scale codes below 0xFF (NaN)"
    return None


class Checkpoint:
    """Served tensors of one validated folder. Pickles without its open files (workers reopen)."""

    def __init__(self, path: Path, cfg: ModelConfig, files: dict[str, str], token_map: torch.Tensor):
        self.path, self.cfg, self.files, self.token_map = path, cfg, files, token_map
        self._open: dict[str, object] = {}

    def __getstate__(self):
        return {**self.__dict__, "_open": {}}

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str, index: tuple = ()) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r}: expected a served tensor, found no such name")
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
        t = self._open[file].get_slice(name)[index]
        check = _bad_values(t)
        if check is not None and bool(check[0].any()):
            bad, allowed = check
            at = [int(i) for i in bad.nonzero()[0]]
            code = t.view(torch.uint8)[tuple(at)] if t.dtype.itemsize == 1 else t[tuple(at)]
            fail(file, name, allowed, f"{int(bad.sum())} non-finite, first {code.item()!r} at {at} of the slice read")
        return t


def read_config(path) -> ModelConfig:
    """The folder's validated ``config.json`` alone (what sizing a run needs); raises CheckpointError."""
    path = Path(path)
    cfg_path = path / config_json.FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: expected the model config, found no file")
    try:
        doc = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: expected JSON, found: {e}") from None
    return config_json.from_json(doc, path.name)


def open_checkpoint(path) -> Checkpoint:
    """Validate a folder in the released layout (spec 03 §8); raises CheckpointError."""
    path = Path(path)
    cfg = read_config(path)
    files = check_headers(path, cfg)
    codec = TextCodec.load(path)
    try:
        token_map, compressed = build_token_map(codec.tokenizer, cfg.vocab_size, cfg.engram_pad_token_id)
    except ValueError as e:
        raise CheckpointError(f"{path / 'tokenizer.json'}: {e}") from None
    if compressed != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'}: expected config.json's engram_compressed_vocab_size="
                              f"{cfg.engram_compressed_vocab_size} compressed token ids, found {compressed}")
    return Checkpoint(path, cfg, files, token_map)
