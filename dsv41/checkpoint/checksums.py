"""A SHA-256 per tensor in the checkpoint index, so a tensor whose bytes are not the ones written is refused.

The header checks (``headers.check_headers``) see names, shapes, dtypes and byte ranges, and the reader
checks values for NaN as it reads; neither sees two same-shaped tensors whose data offsets were swapped,
random bytes in a packed FP4 tensor (every byte is a finite FP4 pair) or a finite value changed. The
writer lists ``"sha256": {tensor: hex digest of its stored bytes}`` beside the index's ``weight_map``
(``shard_digests`` hashes each shard as serialized); ``open_checkpoint`` hashes every tensor it serves
against that table before anything is served (``--no-verify-checksums`` skips it). An index without
the table (the released checkpoint's, written by Hugging Face tools) is served with a warning; a table
that misses a served tensor, or names one the weight_map does not list, is refused.
"""
from __future__ import annotations

import hashlib
import json
import re

KEY = "sha256"
_HEX = re.compile(r"[0-9a-f]{64}")


def digest(data) -> str:
    """The hex SHA-256 of a buffer (hashlib reads bytes, memoryviews and maps without a copy)."""
    return hashlib.sha256(data).hexdigest()


def shard_digests(data: bytes) -> dict[str, str]:
    """Tensor name -> digest of its bytes, for one serialized safetensors file."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    view = memoryview(data)[8 + n:]
    return {name: digest(view[e["data_offsets"][0]:e["data_offsets"][1]])
            for name, e in header.items() if name != "__metadata__"}


def table(doc: dict, fail) -> dict[str, str] | None:
    """The index's digests (None when it lists none), each a 64-digit lowercase hex string;
    ``fail(tensor, expected, found)`` refuses anything else."""
    listed = doc.get(KEY)
    if listed is None:
        return None
    if not isinstance(listed, dict):
        fail(None, f"{KEY}: an object of tensor name -> hex digest", type(listed).__name__)
    for name, value in listed.items():
        if not isinstance(value, str) or not _HEX.fullmatch(value):
            fail(name, f"a {KEY} of 64 lowercase hex digits", repr(value)[:80])
    return listed


def check_listed(digests: dict[str, str], weight_map: dict, served, fail) -> None:
    """A digest for every served tensor, and none for a tensor the weight_map does not list (the table
    and the map disagree: one of them was edited)."""
    for name in served:
        if name not in digests:
            fail(name, f"a {KEY} for every served tensor (it lists them for others)", "none")
    for name in digests:
        if name not in weight_map:
            fail(name, f"a {KEY} only for tensors the weight_map lists", "one for a tensor it does not list")
