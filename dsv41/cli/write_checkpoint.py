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


def _existing_ancestor(path: str) -> str:
    """The deepest part of ``path`` that exists (missing folders are created): where the disk-space
    check looks."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


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
    base = _existing_ancestor(a.path)
    if not os.path.isdir(base):
        p.error(f"path: {base} is a file; expected a folder to write into")
    need, free = checkpoint_bytes(cfg), shutil.disk_usage(base).free
    if need > free:
        p.error(f"--config: {cfg.name} is {need / 1e9:.1f} GB of tensors and the disk has {free / 1e9:.1f} GB free; "
                "reduce it with --layers, --experts or --engram-rows")
    try:
        cfg = write_checkpoint(cfg, a.path, a.seed, int(a.shard_mb * 1e6))
    except OSError as e:
        p.error(f"path: cannot write {e.filename or a.path}: {e.strerror}")
    print(f"wrote {cfg.name} checkpoint (seed {a.seed}, engram_compressed_vocab_size "
          f"{cfg.engram_compressed_vocab_size}) to {a.path}")
    return 0
