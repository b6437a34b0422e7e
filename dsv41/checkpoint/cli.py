"""What ``python -m dsv41.run`` needs from ``--checkpoint`` before any work, besides its config
(``reader.read_config``): the prompts as token ids and the text codec. The whole folder is validated
by ``reader.open_checkpoint`` when the run starts."""
from __future__ import annotations

from dsv41.checkpoint.text import TextCodec, read_prompts


def encode_prompts(path, prompts: list[str] | None, prompt_file: str | None, chat: bool = False
                   ) -> tuple[TextCodec, list[list[int]]]:
    """(codec, encoded prompts); no prompts given: []. Raises ValueError (CheckpointError for the
    folder's tokenizer files)."""
    texts = read_prompts(prompts, prompt_file)
    codec = TextCodec.load(path)
    encoded = [codec.encode(t, chat) for t in texts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"--prompt: prompt {i} ({texts[i]!r}) encodes to no tokens")
    return codec, encoded
