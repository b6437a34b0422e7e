"""Edits a test makes to a checkpoint folder on purpose, to reach a check past the SHA-256 per tensor.

A test of the value checks (NaN read, logits that overflow or cannot tell tokens apart) needs a folder
whose index agrees with its odd numbers, as one written that way would: ``reseal`` lists the shards'
digests as they now are. Damage the checksums must catch is made without it (test_checkpoint_damage).
"""
import json

import torch
from safetensors.torch import load_file, save_file

from dsv41.checkpoint.checksums import KEY, shard_digests
from dsv41.checkpoint.headers import INDEX


def reseal(folder) -> None:
    """The index's digest table made again from the shards' bytes, for every tensor it lists."""
    index = json.loads((folder / INDEX).read_text())
    digests = {}
    for file in set(index["weight_map"].values()):
        digests.update(shard_digests((folder / file).read_bytes()))
    index[KEY] = {n: digests[n] for n in index["weight_map"] if n in digests}
    (folder / INDEX).write_text(json.dumps(index))


def fill(folder, name: str, value: float) -> None:
    """Every value of one tensor set to ``value`` (finite in the file: the value checks pass it), resealed."""
    file = json.loads((folder / INDEX).read_text())["weight_map"][name]
    tensors = load_file(str(folder / file))
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(folder / file), metadata={"format": "pt"})
    reseal(folder)
