"""What ``python -m dsv41.run`` needs from ``--checkpoint``: the opened folder, its text codec and
the prompts as token ids."""
from __future__ import annotations

from dsv41.checkpoint.reader import Checkpoint, open_checkpoint
from dsv41.checkpoint.text import TextCodec, read_prompts


def open_for_text(path, prompts: list[str] | None, prompt_file: str | None, chat: bool = False
                  ) -> tuple[Checkpoint | None, TextCodec | None, list[list[int]]]:
    """(checkpoint, codec, encoded prompts); (None, None, []) without a path. Raises ValueError
    (CheckpointError for the folder) before anything is served."""
    texts = read_prompts(prompts, prompt_file)
    if path is None:
        return None, None, []
    checkpoint, codec = open_checkpoint(path), TextCodec.load(path)
    encoded = [codec.encode(t, chat) for t in texts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"--prompt: prompt {i} ({texts[i]!r}) encodes to no tokens")
    return checkpoint, codec, encoded
