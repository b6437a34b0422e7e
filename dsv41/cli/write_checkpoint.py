"""Test checkpoints in the released layout: ``python -m dsv41.checkpoint.write DIR --config tiny``.

Random weights of a preset; ``dsv41.checkpoint.writer`` writes the folder and says what it holds.
"""
from __future__ import annotations

import argparse

from dsv41.checkpoint.writer import write_checkpoint
from dsv41.config import PRESETS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41.checkpoint.write", description=__doc__.splitlines()[0])
    p.add_argument("path", help="folder to write (created if missing)")
    p.add_argument("--config", choices=sorted(n for n in PRESETS if n != "flash"), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=256.0, help="largest shard size in MB")
    a = p.parse_args(argv)
    if a.shard_mb <= 0:
        p.error("--shard-mb: must be > 0")
    cfg = write_checkpoint(PRESETS[a.config], a.path, a.seed, int(a.shard_mb * 1e6))
    print(f"wrote {a.config} checkpoint (seed {a.seed}, engram_compressed_vocab_size "
          f"{cfg.engram_compressed_vocab_size}) to {a.path}")
    return 0
