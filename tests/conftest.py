"""Session fixtures shared by several test files."""
import pytest

from dsv41.checkpoint.writer import write_checkpoint
from dsv41.config import TINY


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A TINY checkpoint folder (seed 0, several shards, trained tokenizer), written once."""
    path = tmp_path_factory.mktemp("tiny_checkpoint")
    write_checkpoint(TINY, path, seed=0, shard_bytes=2_000_000)
    return path
