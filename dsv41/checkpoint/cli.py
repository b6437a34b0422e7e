"""What ``python -m dsv41.run`` needs from ``--checkpoint``: the opened folder, its text codec and
the prompt texts."""
from __future__ import annotations

from dsv41.checkpoint.reader import Checkpoint, open_checkpoint
from dsv41.checkpoint.text import TextCodec, read_prompts


def open_for_text(path, prompts: list[str] | None, prompt_file: str | None
                  ) -> tuple[Checkpoint | None, TextCodec | None, list[str]]:
    """(checkpoint, codec, prompt texts); (None, None, []) without a path. Raises ValueError
    (CheckpointError for the folder) before anything is served."""
    texts = read_prompts(prompts, prompt_file)
    if path is None:
        return None, None, texts
    return open_checkpoint(path), TextCodec.load(path), texts
