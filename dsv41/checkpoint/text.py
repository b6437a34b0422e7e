"""Text in, text out: a checkpoint's ``tokenizer.json`` (+ optional ``tokenizer_config.json``).

Prompts are encoded without the tokenizer's own post-processing; BOS is prepended when
``tokenizer_config.json`` names one (unless ``add_bos_token`` is false), and with ``--chat`` the
config's Jinja ``chat_template`` renders the prompt as one user turn (BOS then comes from the
template). User text never becomes a control token: it is encoded by a copy of the tokenizer that
knows no added tokens (:func:`plain_tokenizer`), so typing the text of EOS gives those characters;
only the template's own text (or ``allow_special=True``, the ``--allow-special-tokens`` flag) is
parsed for them. Generated ids are streamed as text: a request's new text is what decoding all its ids
adds to what was already shown, held back while it ends in a partial UTF-8 sequence.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from dsv41.checkpoint.errors import CheckpointError

TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
# stands for the user text while the chat template renders, so the template's text and the user's
# can be encoded apart (NUL and a private-use character: no template writes them)
_USER_TEXT = "\x00\ue000dsv41-user-text\ue000\x00"


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` without its added tokens, for text that must never become one.

    (``encode(text, add_special_tokens=False)`` only skips the post-processor's BOS/EOS; added
    tokens in the text are still matched, special or not.)"""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


def _token(value, source: str, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": str}."""
    token = value.get("content") if isinstance(value, dict) else value
    if token is not None and not isinstance(token, str):
        raise CheckpointError(f"{source}: {key}: expected a token string or {{\"content\": string}}, "
                              f"found {value!r}")
    return token


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, config: dict, source: str = TOKENIZER_CONFIG):
        if not isinstance(config, dict):
            raise CheckpointError(f"{source}: expected a JSON object, found {type(config).__name__}")
        self.tokenizer = tokenizer
        self.plain = plain_tokenizer(tokenizer)
        self.bos = _token(config.get("bos_token"), source, "bos_token")
        self.eos = _token(config.get("eos_token"), source, "eos_token")
        add_bos = config.get("add_bos_token", True)
        if not isinstance(add_bos, bool):
            raise CheckpointError(f"{source}: add_bos_token: expected true or false, found {add_bos!r}")
        self.add_bos = self.bos is not None and add_bos
        self.chat_template = config.get("chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise CheckpointError(f"{source}: chat_template: expected a Jinja template string, "
                                  f"found {type(self.chat_template).__name__}")
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

    def encode_text(self, text: str, allow_special: bool = False) -> list[int]:
        """User text as ids: control tokens in it are plain characters unless ``allow_special``."""
        return (self.tokenizer if allow_special else self.plain).encode(text, add_special_tokens=False).ids

    def encode(self, prompt: str, chat: bool = False, allow_special: bool = False) -> list[int]:
        if chat:
            return self._encode_chat(prompt, allow_special)
        ids = self.encode_text(prompt, allow_special)
        return [self.bos_id] + ids if self.add_bos else ids

    def _encode_chat(self, prompt: str, allow_special: bool) -> list[int]:
        """The template's text with its control tokens, the user's text as plain text."""
        if not self.chat_template:
            raise ValueError(f"--chat: the checkpoint's {TOKENIZER_CONFIG} has no chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(self.chat_template).render(
            messages=[{"role": "user", "content": _USER_TEXT}], add_generation_prompt=True,
            bos_token=self.bos or "", eos_token=self.eos or "")
        parts = text.split(_USER_TEXT)
        if len(parts) != 2:
            raise ValueError(f"--chat: the checkpoint's {TOKENIZER_CONFIG} chat_template does not write the "
                             f"user text once and unchanged (found {len(parts) - 1} copies), so it cannot be kept "
                             "apart from the template's control tokens")
        before, after = (self.tokenizer.encode(t, add_special_tokens=False).ids for t in parts)
        return before + self.encode_text(prompt, allow_special) + after

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


def read_prompts(prompts: list[str] | None, prompt_file: str | None) -> list[str]:
    """--prompt values then --prompt-file lines (blank lines skipped)."""
    out = list(prompts or [])
    if prompt_file is not None:
        try:
            lines = Path(prompt_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--prompt-file: cannot read {prompt_file}: {e.strerror}") from None
        out += [line for line in lines if line.strip()]
        if not out:
            raise ValueError(f"--prompt-file: {prompt_file} holds no prompt")
    return out
