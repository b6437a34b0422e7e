"""Test checkpoints in the released layout: ``python -m dsv41.checkpoint.write DIR --config tiny``.

Random weights of a preset, reduced as a run reduces it (``--layers``, ``--experts``,
``--engram-rows``: ``ModelConfig.reduced``); ``dsv41.checkpoint.writer`` writes the folder and says
what it holds. FLASH is written only reduced to what this disk holds. DIR must be new or an empty
folder: the checkpoint is written beside it and renamed into place when complete; Ctrl-C or SIGTERM
removes what was written and ends with one line and status 130 / 143.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import threading
from pathlib import Path

from dsv41.checkpoint.writer import check_target, write_checkpoint
from dsv41.cli.args import MAX_SEED, Parser, UsageError, add_reductions, resolve_model
from dsv41.cli.interrupt import raise_terminated, stopped
from dsv41.config import PRESETS
from dsv41.plan.sizing import checkpoint_bytes

PROG = "python -m dsv41.checkpoint.write"
MAX_SHARD_MB = 100_000.0    # a shard is held whole (and once more as its serialized bytes) while written


def _existing_ancestor(path: str) -> str:
    """The deepest part of ``path`` that exists (missing folders are created): where the disk-space
    check looks."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def size(n: int) -> str:
    """Bytes in the unit that shows them with three significant digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _check(a) -> None:
    if not a.path:
        raise UsageError("path: is empty; give the folder to write")
    if not (math.isfinite(a.shard_mb) and 0 < a.shard_mb <= MAX_SHARD_MB):
        raise UsageError(f"--shard-mb: must be in (0, {MAX_SHARD_MB:g}] MB, got {a.shard_mb:g}")
    if not 0 <= a.seed <= MAX_SEED:
        raise UsageError(f"--seed: must be in [0, {MAX_SEED}], got {a.seed}")


def main(argv=None) -> int:
    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("path", help="folder to write (created if missing; an existing one must be empty)")
    p.add_argument("--config", choices=sorted(PRESETS), default="tiny")
    add_reductions(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=256.0, help="largest shard size in MB")
    a = p.parse_args(argv)
    try:
        _check(a)
        cfg = resolve_model(a)
    except UsageError as e:
        p.error(str(e))
    base = _existing_ancestor(a.path)
    if base != os.path.abspath(a.path) and not os.path.isdir(base):
        p.error(f"path: {base} is a file; expected a folder to write into")
    main_thread = threading.current_thread() is threading.main_thread()   # where signals are handled
    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None
    try:
        check_target(Path(a.path))      # before the sizing: a folder in the way is named first
        need, free = checkpoint_bytes(cfg), shutil.disk_usage(base).free
        if need > free:
            p.error(f"--config: {cfg.name} is {size(need)} of tensors and the disk has {size(free)} free; "
                    "reduce it with --layers, --experts or --engram-rows")
        cfg = write_checkpoint(cfg, a.path, a.seed, int(a.shard_mb * 1e6))   # removes its work when stopped
    except OSError as e:
        p.error(f"path: cannot write {e.filename or a.path}: {e.strerror}")
    except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM (raise_terminated)
        return stopped(PROG, e, leave=main_thread and argv is None)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(f"wrote {cfg.name} checkpoint (seed {a.seed}, engram_compressed_vocab_size "
          f"{cfg.engram_compressed_vocab_size}) to {a.path}")
    return 0
