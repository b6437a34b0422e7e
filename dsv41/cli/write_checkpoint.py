"""Test checkpoints in the released layout: ``python -m dsv41.checkpoint.write DIR --config tiny``.

Random weights of a preset, reduced as a run reduces it (``--layers``, ``--experts``,
``--engram-rows``: ``ModelConfig.reduced``); ``dsv41.checkpoint.writer`` writes the folder and says
what it holds. FLASH is written only reduced to what this disk holds.
"""
from __future__ import annotations

import argparse
import os

import shutil

from dsv41.checkpoint.writer import write_checkpoint
from dsv41.cli.args import UsageError, add_reductions, resolve_model
from dsv41.config import PRESETS
from dsv41.plan.sizing import checkpoint_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41.checkpoint.write", description=__doc__.splitlines()[0])
    p.add_argument("path", help="folder to write (created if missing)")
    p.add_argument("--config", choices=sorted(PRESETS), default="tiny")
    add_reductions(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=256.0, help="largest shard size in MB")
    a = p.parse_args(argv)
    if a.shard_mb <= 0:
        p.error("--shard-mb: must be > 0")
    try:
        cfg = resolve_model(a)
    except UsageError as e:
        p.error(str(e))
    need, free = checkpoint_bytes(cfg), shutil.disk_usage(os.path.dirname(os.path.abspath(a.path))).free
    if need > free:
        p.error(f"--config: {cfg.name} is {need / 1e9:.1f} GB of tensors and the disk has {free / 1e9:.1f} GB free; "
                "reduce it with --layers, --experts or --engram-rows")
    cfg = write_checkpoint(cfg, a.path, a.seed, int(a.shard_mb * 1e6))
    print(f"wrote {cfg.name} checkpoint (seed {a.seed}, engram_compressed_vocab_size "
          f"{cfg.engram_compressed_vocab_size}) to {a.path}")
    return 0
