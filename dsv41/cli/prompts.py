"""The prompts of a run as token ids: random ones drawn from the seed, or ``--prompt``/``--prompt-file``
texts encoded with ``--checkpoint``'s tokenizer before any work (the whole folder is validated by
``reader.open_checkpoint`` when the run starts)."""
from __future__ import annotations

import torch

from dsv41.checkpoint.text import TextCodec, read_prompts


def prompts_for(cfg, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=g).tolist()


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
