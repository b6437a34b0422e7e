"""Text in, text out: a checkpoint's ``tokenizer.json`` (+ optional ``tokenizer_config.json``).

Prompts are encoded without the tokenizer's own post-processing; BOS is prepended when
``tokenizer_config.json`` names one (unless ``add_bos_token`` is false). A chat (``--chat``: the
prompt as one user turn; the server: the request's messages) is rendered in the codec's chat
format: the config's Jinja ``chat_template`` when it has one (BOS then comes from the template),
else the DeepSeek encoding (``checkpoint/chat.py``), as the V4 releases, which ship no template,
are: the family ``config.json``'s ``model_type`` names (``deepseek_v41``: V4.1, ``deepseek_v4``:
V4), and for a folder that names neither, V4.1 when the tokenizer has V4.1's ``<｜System｜>``
control token, else V4 (``use_chat_format`` overrides, and refuses a tokenizer missing a control
token the format needs). User text
never becomes a control token: it is encoded by a copy of the tokenizer that knows no added tokens
(:func:`plain_tokenizer`), so typing the text of EOS gives those characters; only the template's
own text (or ``allow_special=True``, the ``--allow-special-tokens`` flag) is parsed for them.
Generated ids are streamed as text through ``ops.stopping.Stops``: a request's new text is what
decoding all its ids adds to what was already shown, held back while it ends in a partial UTF-8
sequence or could still become a stop string.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders

from dsv41.checkpoint.chat import CONTROLS, DSML, END_THINK, SYSTEM, THINK, VARIANTS, ChatTokenizer, check_messages
from dsv41.checkpoint.confine import folder_file
from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.plain import plain_tokenizer

TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
CONFIG = "config.json"
# config.json's model_type -> the chat format of that family's releases
FAMILY_FORMATS = {"deepseek_v41": "v4.1", "deepseek_v4": "v4"}
# stands for the user text while the chat template renders, so the template's text and the user's
# can be encoded apart (NUL and a private-use character: no template writes them)
_USER_TEXT = "\x00\ue000dsv41-user-text\ue000\x00"
TEMPLATE = "template"
CHAT_FORMATS = (*VARIANTS, TEMPLATE)
# the controls an answer's text keeps (the reasoning and tool-call parsers read them)
ANSWER_MARKERS = (THINK, END_THINK, DSML)


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet's characters back to their bytes (GPT-2's printable remapping:
    printable Latin-1 bytes stand for themselves, the other 68 bytes for chr(256 + k) in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """text's ids; encode_batch lets go of the GIL while it runs (encode does not), so a long prompt
    tokenized on a server's worker thread does not stall its event loop."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def _joined_text(content) -> str:
    """A checked message content (``chat.check_messages``): a string, or text parts joined as the
    V4 encoding joins them."""
    return content if isinstance(content, str) else "\n\n".join(part["text"] for part in content)


def _token(value, source: str, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": str}."""
    token = value.get("content") if isinstance(value, dict) else value
    if token is not None and not isinstance(token, str):
        raise CheckpointError(f"{source}: {key}: expected a token string or {{\"content\": string}}, "
                              f"found {value!r}")
    return token


def _family(folder: Path) -> str | None:
    """The chat format of the model family config.json names (None: no such file, or another name;
    the file's own checks are ``reader.read_config``'s)."""
    path = folder_file(folder, CONFIG)
    try:
        doc = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    kind = doc.get("model_type") if isinstance(doc, dict) else None
    return FAMILY_FORMATS.get(kind) if isinstance(kind, str) else None


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, config: dict, source: str = TOKENIZER_CONFIG,
                 family: str | None = None):
        """family: the chat format config.json's model_type names (None: found from the tokenizer)."""
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
        self._chat: ChatTokenizer | None = None    # made on first use; shares self.plain
        self.chosen_format: str | None = None      # use_chat_format's choice; None: found from the files
        self.family = family
        self.source = source
        self.markers = {tid: t for t in ANSWER_MARKERS if (tid := tokenizer.token_to_id(t)) is not None}
        self.added = {tid: t.content for tid, t in tokenizer.get_added_tokens_decoder().items()}
        self._bytes = _byte_decoder() if isinstance(tokenizer.decoder, decoders.ByteLevel) else None

    def _id(self, token: str | None, source: str, key: str) -> int | None:
        if token is None:
            return None
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise CheckpointError(f"{source}: {key}: expected a token of {TOKENIZER}, found {token!r}")
        return tid

    @property
    def chat_format(self) -> str:
        if self.chosen_format is not None:
            return self.chosen_format
        if self.chat_template:
            return TEMPLATE
        if self.family is not None:
            return self.family
        return "v4.1" if self.tokenizer.token_to_id(SYSTEM) is not None else "v4"

    def use_chat_format(self, name: str | None) -> str | None:
        """Render chats in ``name`` (None: the format found at load); returns what is wrong (the
        format unknown, no template for "template", a control token the format needs missing from
        the tokenizer), else None."""
        name = name or self.chat_format
        if name not in CHAT_FORMATS:
            return f"expected one of {', '.join(CHAT_FORMATS)}, found {name!r}"
        if name == TEMPLATE and not self.chat_template:
            return f"{self.source}: has no chat_template to render chats with"
        tokenizer_file = str(Path(self.source).with_name(TOKENIZER))
        for token in (CONTROLS[name] if name != TEMPLATE else ()):
            if self.tokenizer.token_to_id(token) is None:
                return (f"{tokenizer_file}: expected the control token {token!r} that the {name} chat format "
                        f"needs, found none (--chat-format chooses another format)")
        self.chosen_format = name
        return None

    @classmethod
    def load(cls, folder) -> "TextCodec":
        folder = Path(folder)
        if not folder_file(folder, TOKENIZER).is_file():
            raise CheckpointError(f"{folder / TOKENIZER}: expected the checkpoint's tokenizer, found no file")
        try:
            tokenizer = Tokenizer.from_file(str(folder / TOKENIZER))
        except Exception as e:  # the Rust parser's own message says what is wrong
            raise CheckpointError(f"{folder / TOKENIZER}: expected a tokenizers JSON file, found: {e}") from None
        path = folder_file(folder, TOKENIZER_CONFIG)
        config = {}
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path}: expected JSON, found: {e}") from None
        return cls(tokenizer, config, str(path), _family(folder))

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_text(self, text: str, allow_special: bool = False) -> list[int]:
        """User text as ids: control tokens in it are plain characters unless ``allow_special``."""
        return _ids(self.tokenizer if allow_special else self.plain, text)

    def encode(self, prompt: str, chat: bool = False, allow_special: bool = False) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}], allow_special=allow_special)
        ids = self.encode_text(prompt, allow_special)
        return [self.bos_id] + ids if self.add_bos else ids

    def encode_chat(self, messages: list[dict], thinking: bool = False, tools=None,
                    allow_special: bool = False, effort: int | str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """A chat's prompt ids (ending in the generation prompt unless add_generation_prompt is
        false) in the chat format: the Jinja chat_template, or the DeepSeek V4 / V4.1 encoding
        (raises ValueError naming a bad field). effort: V4.1's reasoning effort."""
        if self.chat_format == TEMPLATE:
            if effort is not None:
                raise ValueError("reasoning_effort: the checkpoint's chat_template takes no reasoning effort")
            return self._encode_template(messages, thinking, tools, allow_special, add_generation_prompt)
        if self._chat is None:
            self._chat = ChatTokenizer(self.tokenizer, self.plain)
        return self._chat.encode(messages, thinking=thinking, tools=tools, variant=self.chat_format,
                                 effort=effort, add_generation_prompt=add_generation_prompt,
                                 allow_special=allow_special)

    def _encode_template(self, messages: list[dict], thinking: bool, tools, allow_special: bool,
                         add_generation_prompt: bool = True) -> list[int]:
        """The template's text with its control tokens, each message's text as plain text: the
        messages render with stand-ins, which must each come out once and unchanged. The messages
        are first held to the chat schema (``chat.check_messages``), so no repr of a list or an
        object reaches the template as text; any other string a template may write (names, tool
        calls and schemas) must hold no control token's text, as it is encoded with the full
        tokenizer."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        check_messages(messages, tools)
        self._refuse_control_text(messages, "messages", skip="content")
        if tools is not None:
            self._refuse_control_text(tools, "tools")
        texts = [None if m.get("content") is None else _joined_text(m["content"]) for m in messages]
        stand_in = [None if t is None else _USER_TEXT.replace("user-text", f"text-{i}") for i, t in enumerate(texts)]
        shown = [{**m, "content": c} for m, c in zip(messages, stand_in)]
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        rendered = env.from_string(self.chat_template).render(
            messages=shown, add_generation_prompt=add_generation_prompt, tools=tools, thinking=thinking,
            bos_token=self.bos or "", eos_token=self.eos or "")
        ids = []
        for marker, text in ((c, t) for c, t in zip(stand_in, texts) if t is not None):
            parts = rendered.split(marker)
            if len(parts) != 2:
                raise ValueError(f"--chat: the checkpoint's {TOKENIZER_CONFIG} chat_template does not write the "
                                 f"user text once and unchanged (found {len(parts) - 1} copies of message "
                                 f"{stand_in.index(marker)}'s), so it cannot be kept apart from the template's "
                                 "control tokens")
            ids += _ids(self.tokenizer, parts[0]) + self.encode_text(text, allow_special)
            rendered = parts[1]
        return ids + _ids(self.tokenizer, rendered)

    def _refuse_control_text(self, value, where: str, skip: str | None = None):
        """ValueError naming the first string under ``value`` (keys too) that holds an added
        token's text; ``skip``: a key whose values are encoded apart (as plain text)."""
        controls = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        todo = [(value, where)]
        while todo:
            item, at = todo.pop()
            if isinstance(item, str):
                found = next((c for c in controls if c in item), None)
                if found is not None:
                    raise ValueError(f"{at}: holds the control token {found!r}; only message content may "
                                     "carry that text")
            elif isinstance(item, list):
                todo += [(x, f"{at}[{i}]") for i, x in enumerate(item)]
            elif isinstance(item, dict):
                todo += [(x, f"{at}.{k}") for k, x in item.items() if k != skip]
                todo += [(k, at) for k in item if isinstance(k, str)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_answer(self, ids: list[int]) -> str:
        """A chat answer's text: as ``decode``, but ``<think>``, ``</think>`` and the DSML marker keep
        their text, for the reasoning and tool-call parsers (``serving/reasoning.py``,
        ``serving/tool_calls.py``) to find."""
        return self._decode_keeping(ids, self.markers, "")

    def decode_special(self, ids: list[int], spaces: bool) -> str:
        """vLLM's skip_special_tokens false: every added token keeps its text; with
        spaces_between_special_tokens the pieces (each added token, each run of text between them)
        are joined by one space, as vLLM's detokenizer joins them."""
        return self._decode_keeping(ids, self.added, " " if spaces else "")

    def _decode_keeping(self, ids: list[int], kept: dict, sep: str) -> str:
        parts, run = [], []
        for t in ids:
            if t in kept:
                parts += [self.decode(run)] if run else []
                parts.append(kept[t])
                run = []
            else:
                run.append(t)
        return sep.join(parts + ([self.decode(run)] if run else []))

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a byte-level token can be part of one UTF-8 character, whose
        decoded text alone is only U+FFFD); an added token: its text's UTF-8."""
        if token in self.added:
            return self.added[token].encode()
        piece = self.tokenizer.id_to_token(token)
        if self._bytes is not None and piece is not None and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece)
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

