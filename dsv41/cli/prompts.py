"""The prompts of a run as token ids: random ones drawn from the seed, or ``--prompt``/``--prompt-file``
texts encoded with ``--checkpoint``'s tokenizer before any work (the whole folder is validated by
``reader.open_checkpoint`` when the run starts)."""
from __future__ import annotations

from pathlib import Path

import torch
from jinja2 import TemplateError

from dsv41.checkpoint.text import TOKENIZER_CONFIG, TextCodec


class PromptError(ValueError):
    """A prompt flag's input cannot be used; the message starts with the flag and names the file."""


def prompts_for(cfg, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=g).tolist()


def read_prompts(prompts: list[str] | None, prompt_file: str | None) -> list[str]:
    """--prompt values then --prompt-file lines (blank lines skipped); the file must be UTF-8 text. An
    empty --prompt is refused: it would run as BOS alone, an answer to nothing the user wrote."""
    out = list(prompts or [])
    for i, text in enumerate(out):
        if not text:
            raise PromptError(f"--prompt: prompt {i} is empty; give the text to continue")
    if prompt_file is None:
        return out
    try:
        data = Path(prompt_file).read_bytes()
    except OSError as e:
        raise PromptError(f"--prompt-file: {prompt_file}: cannot read ({e.strerror})") from e
    nul = data.find(b"\0")
    if nul >= 0:     # valid UTF-8, but no text file holds NUL
        raise PromptError(f"--prompt-file: {prompt_file}: expected UTF-8 text, found binary data "
                          f"(a NUL byte at offset {nul})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"--prompt-file: {prompt_file}: expected UTF-8 text, found byte 0x{data[e.start]:02x} "
                          f"at offset {e.start} ({e.reason})") from e
    out += [line for line in text.splitlines() if line.strip()]
    if not out:
        raise PromptError(f"--prompt-file: {prompt_file} holds no prompt")
    return out


def encode_prompts(path, prompts: list[str] | None, prompt_file: str | None, chat: bool = False,
                   allow_special: bool = False) -> tuple[TextCodec, list[list[int]]]:
    """(codec, encoded prompts); no prompts given: []. The prompts' text is never parsed for control
    tokens unless ``allow_special`` (--allow-special-tokens). Raises PromptError for the prompts and
    the chat template, CheckpointError (or OSError) for the folder's tokenizer files."""
    texts = read_prompts(prompts, prompt_file)
    codec = TextCodec.load(path)
    try:
        encoded = [codec.encode(t, chat, allow_special) for t in texts]
    except TemplateError as e:     # a syntax error, or the template's own raise_exception / undefined name
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise PromptError(f"--chat: {Path(path) / TOKENIZER_CONFIG}: chat_template{where}: "
                          f"{type(e).__name__}: {e.message}") from e
    for i, ids in enumerate(encoded):
        if not ids:
            raise PromptError(f"--prompt: prompt {i} ({texts[i]!r}) encodes to no tokens")
    return codec, encoded
