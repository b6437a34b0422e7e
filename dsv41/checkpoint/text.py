"""Text in, text out: a checkpoint's ``tokenizer.json`` (+ optional ``tokenizer_config.json``).

Prompts are encoded without the tokenizer's own post-processing; BOS is prepended when
``tokenizer_config.json`` names one (unless ``add_bos_token`` is false), and with ``--chat`` the
config's Jinja ``chat_template`` renders the prompt as one user turn (BOS then comes from the
template). Generated ids are streamed as text: a request's new text is what decoding all its ids
adds to what was already shown, held back while it ends in a partial UTF-8 sequence.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from dsv41.checkpoint.errors import CheckpointError

TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, config: dict, source: str = TOKENIZER_CONFIG):
        self.tokenizer = tokenizer
        self.bos, self.eos = _token(config.get("bos_token")), _token(config.get("eos_token"))
        self.add_bos = self.bos is not None and config.get("add_bos_token", True)
        self.chat_template = config.get("chat_template")
        self.bos_id = self._id(self.bos, source, "bos_token")
        self.eos_id = self._id(self.eos, source, "eos_token")

    def _id(self, token: str | None, source: str, key: str) -> int | None:
        if token is None:
            return None
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise CheckpointError(f"{source}: {key}: expected a token of {TOKENIZER}, found {token!r}")
        return tid

    @classmethod
    def load(cls, folder) -> "TextCodec":
        folder = Path(folder)
        if not (folder / TOKENIZER).is_file():
            raise CheckpointError(f"{folder / TOKENIZER}: expected the checkpoint's tokenizer, found no file")
        try:
            tokenizer = Tokenizer.from_file(str(folder / TOKENIZER))
        except Exception as e:  # the Rust parser's own message says what is wrong
            raise CheckpointError(f"{folder / TOKENIZER}: expected a tokenizers JSON file, found: {e}") from None
        path = folder / TOKENIZER_CONFIG
        config = {}
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path}: expected JSON, found: {e}") from None
        return cls(tokenizer, config, str(path))

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            if not self.chat_template:
                raise ValueError(f"--chat: the checkpoint's {TOKENIZER_CONFIG} has no chat_template")
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            text = env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
                bos_token=self.bos or "", eos_token=self.eos or "")
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        return [self.bos_id] + ids if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """Per request: generated ids, the text shown so far, and whether EOS ended it."""

    def __init__(self, codec: TextCodec, requests: int):
        self.codec = codec
        self.ids = [[] for _ in range(requests)]
        self.shown = [""] * requests
        self.done = [False] * requests

    def push(self, request: int, token: int) -> str:
        """Take one generated token; returns the text it adds (EOS ends the request, adds none)."""
        if token == self.codec.eos_id:
            self.done[request] = True
            return ""
        self.ids[request].append(token)
        text = self.codec.decode(self.ids[request])
        if text.endswith("\ufffd") or not text.startswith(self.shown[request]):
            return ""
        delta, self.shown[request] = text[len(self.shown[request]):], text
        return delta

    def step(self, tokens: dict[int, int], say) -> list[int]:
        """One decode step's token per live request: prints each request's new text, returns the
        requests still live."""
        for request, token in tokens.items():
            delta = self.push(request, token)
            if delta or self.done[request]:
                say(f"    [{request}] {delta!r}" + (" <eos>" if self.done[request] else ""))
        return [r for r in tokens if not self.done[r]]

    def finish(self, say):
        """Show what was held back (generation ended inside a partial UTF-8 sequence)."""
        for request, ids in enumerate(self.ids):
            rest = self.codec.decode(ids)[len(self.shown[request]):]
            if rest:
                self.shown[request] += rest
                say(f"    [{request}] {rest!r}")

