"""Every file of a checkpoint is read from inside its folder.

A path the folder names (a shard in the index) or holds (``config.json``, the index, the tokenizer
files) must resolve under the folder: no absolute path, no ``..``, no symlink that leads out, so a
folder cannot make the server read and serve some other file. A path that cannot be resolved at
all (a symlink loop, a NUL byte) is refused the same way, in one line.
"""
from __future__ import annotations

from pathlib import Path

from dsv41.checkpoint.errors import CheckpointError


def outside(root: Path, file: str) -> str | None:
    """Why ``file`` (relative to the resolved folder ``root``) is not a path inside it, or None."""
    if not isinstance(file, str) or not file:
        return "which is empty"
    if "\x00" in file:
        return "which holds a NUL byte"
    rel = Path(file)
    if rel.is_absolute() or ".." in rel.parts:
        return "which is outside it"
    try:
        resolved = (root / rel).resolve()
    except RuntimeError:                  # Path.resolve's "Symlink loop from ..."
        return "which is a symlink loop"
    except OSError as e:
        return f"which cannot be resolved ({e.strerror})"
    return None if resolved.is_relative_to(root) else "which is outside it (through a symlink)"


def folder_file(folder: Path, name: str) -> Path:
    """folder/name, refused (CheckpointError) when it leads outside the folder."""
    why = outside(Path(folder).resolve(), name)
    if why is not None:
        raise CheckpointError(f"{Path(folder) / name}: expected a file inside the checkpoint folder, "
                              f"found a path {why}")
    return Path(folder) / name
