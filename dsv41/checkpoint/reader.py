"""A checkpoint folder opened for serving: validated config, tensors read slice by slice.

``open_checkpoint`` checks ``config.json``, the index and every shard header, builds the
Engram token map from ``tokenizer.json`` (its size must be the config's compressed vocabulary)
and, when the index lists a SHA-256 per tensor (``checksums``), hashes every served tensor's bytes
against it, before anything is served. ``get`` serves a whole tensor or a block of its leading rows straight
from the shard's memory map (pages of the file, which the OS may drop and read again: a checkpoint
larger than free memory still serves), any other slice as a copy read through
``safe_open(...).get_slice``, and checks its values as read: BF16/FP32 finite, FP8 E4M3 payload
codes not NaN (E4M3FN has no infinities), E8M0 scale codes not 0xFF (NaN). Packed FP4 bytes are
always finite values.
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch
from safetensors import safe_open

from dsv41.checkpoint import checksums, config_json
from dsv41.checkpoint.confine import folder_file
from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.headers import DTYPES, INDEX, check_headers, fail, without_dspark
from dsv41.checkpoint.text import TextCodec
from dsv41.checkpoint.token_map import build_token_map
from dsv41.config import ModelConfig
from dsv41.capacity import Capacity, capacity_of


# dtype -> (the payload's bits as integers, the magnitude mask, the lowest magnitude that may not appear,
# what is allowed): a value is bad when (bits & mask) >= that bound (BF16/FP32 inf and NaN, E4M3 NaN
# 0x7F/0xFF, E8M0 NaN 0xFF), so one max over each chunk finds whether any is (torch.isfinite on BF16
# took 8.5 ns a value here, 17 of a 4-layer FLASH checkpoint's 28 s start)
_BAD = {torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000, "finite values"),
        torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80, "finite values"),
        torch.float8_e4m3fn: (torch.uint8, 0x7F, 0x7F, "E4M3 codes that are not NaN (0x7F, 0xFF)"),
        torch.float8_e8m0fnu: (torch.uint8, 0xFF, 0xFF, "E8M0 scale codes below 0xFF (NaN)")}
_CHUNK = 1 << 24        # values masked at a time: the mask's copy stays small beside the tensor


def _bad_values(t: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """(bool mask of values that may not appear, what is allowed), or None when every code is allowed."""
    rule = _BAD.get(t.dtype)
    if rule is None or not t.numel():
        return None
    bits_type, mask, bound, allowed = rule
    flat = t.reshape(-1).view(bits_type)
    if all(int((flat[i:i + _CHUNK] & mask).max()) < bound for i in range(0, flat.numel(), _CHUNK)):
        return None
    return ((t.view(bits_type) & mask) >= bound), allowed


class Checkpoint:
    """Served tensors of one validated folder. Pickles without its open files (workers reopen).
    ``cfg`` is the config served: config.json's, less DSpark when the folder has no ``mtp.*`` tensors
    (``declared`` keeps config.json's own); ``capacity`` the limits it runs with (its ``dsv41`` section)."""

    def __init__(self, path: Path, cfg: ModelConfig, files: dict[str, str], token_map: torch.Tensor,
                 declared: ModelConfig | None = None, capacity: Capacity | None = None):
        self.path, self.cfg, self.files, self.token_map = path, cfg, files, token_map
        self.declared = declared or cfg
        self.capacity = capacity or capacity_of(cfg)
        self._open: dict[str, object] = {}
        self._maps: dict[str, tuple] = {}
        self.digests_listed = False

    @property
    def has_dspark(self) -> bool:
        """Whether DSpark's draft stages are served (config.json declares them and the folder has them)."""
        return self.cfg.dspark

    def require_dspark(self) -> None:
        """CheckpointError, one line saying what is missing, unless DSpark's stages are served."""
        if self.has_dspark:
            return
        if self.declared.dspark:
            found = (f"no mtp.* tensors in {INDEX} (config.json declares {self.declared.n_mtp_layers} stages): "
                     "it serves the backbone alone")
        else:
            found = "none declared (config.json: no num_nextn_predict_layers with dspark_block_size)"
        raise CheckpointError(f"{self.path}: expected DSpark draft stages (mtp.*) for DSpark drafting, found {found}")

    def __getstate__(self):
        return {**self.__dict__, "_open": {}, "_maps": {}}

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str, index: tuple = ()) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r}: expected a served tensor, found no such name")
        t = self._mapped(file, name, index)
        if t is None:
            if file not in self._open:
                self._open[file] = safe_open(str(self.path / file), framework="pt")
            t = self._open[file].get_slice(name)[index]
        check = _bad_values(t)
        if check is not None:
            bad, allowed = check
            at = [int(i) for i in bad.nonzero()[0]]
            code = t.view(torch.uint8)[tuple(at)] if t.dtype.itemsize == 1 else t[tuple(at)]
            fail(file, name, allowed, f"{int(bad.sum())} non-finite, first {code.item()!r} at {at} of the slice read")
        return t


    def verify(self, digests: dict[str, str]) -> None:
        """Every served tensor's stored bytes against its listed SHA-256 (one read of each shard);
        the first that differs raises CheckpointError naming it."""
        for name, file in self.files.items():
            mapped, header, start = self._shard(file)
            begin, end = header[name]["data_offsets"]
            found = checksums.digest(memoryview(mapped)[start + begin:start + end])
            if found != digests[name]:
                fail(file, name, f"bytes whose sha256 is {digests[name][:16]}... as {INDEX} lists",
                     f"{found[:16]}... (damaged, or another tensor's bytes)")

    def _shard(self, file: str) -> tuple:
        if file not in self._maps:
            self._maps[file] = _map_shard(self.path / file)
        return self._maps[file]

    def _mapped(self, file: str, name: str, index: tuple) -> torch.Tensor | None:
        """The rows [a, b) (or all) of a tensor as a view of the shard's map, None for other slices."""
        rows = index[0] if len(index) == 1 and isinstance(index[0], slice) and index[0].step is None else None
        if index != () and rows is None:
            return None
        mapped, header, start = self._shard(file)
        entry = header[name]
        dtype, shape = TORCH_DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        if rows is not None and shape:
            a, b, _ = rows.indices(shape[0])
            row = (end - begin) // shape[0] if shape[0] else 0
            begin, shape[0] = begin + a * row, max(0, b - a)
            end = begin + shape[0] * row
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(mapped, dtype=torch.uint8, offset=start + begin,
                                count=end - begin).view(dtype).reshape(shape)


TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


def _map_shard(path: Path):
    """(copy-on-write map of the file, its header, where the data starts): the map is private, so a
    tensor viewing it can never write the file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), header, 8 + n


def read_config(path) -> tuple[ModelConfig, Capacity]:
    """The folder's validated ``config.json`` alone (what sizing a run needs): the model and the
    capacity it runs with; raises CheckpointError."""
    path = Path(path)
    cfg_path = folder_file(path, config_json.FILE)
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: expected the model config, found no file")
    try:
        doc = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: expected JSON, found: {e}") from None
    return config_json.from_json(doc, path.name), config_json.capacity_from_json(doc)


def open_checkpoint(path, verify: bool = True) -> Checkpoint:
    """Validate a folder in the released layout (spec 03 §8); raises CheckpointError. verify: hash every
    served tensor against the index's SHA-256 table (``checksums``) when it has one; ``digests_listed``
    on the result says whether it had."""
    path = Path(path)
    declared, capacity = read_config(path)
    files, digests = check_headers(path, declared)
    cfg = declared if any(n.startswith("mtp.") for n in files) else without_dspark(declared)
    codec = TextCodec.load(path)
    try:
        token_map, compressed = build_token_map(codec.tokenizer, cfg.vocab_size, cfg.engram_pad_token_id)
    except ValueError as e:
        raise CheckpointError(f"{path / 'tokenizer.json'}: {e}") from None
    if compressed != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'}: expected config.json's engram_compressed_vocab_size="
                              f"{cfg.engram_compressed_vocab_size} compressed token ids, found {compressed}")
    ckpt = Checkpoint(path, cfg, files, token_map, declared, capacity)
    ckpt.digests_listed = digests is not None
    if verify and digests is not None:
        ckpt.verify(digests)
    return ckpt
