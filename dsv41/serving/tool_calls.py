"""The tool-call parser: DSML tool calls in an answer's content become OpenAI ``tool_calls``.

The DeepSeek formats write tool calls after the content as one DSML block (``checkpoint/chat.py``
renders them the same way in history)::

    <｜DSML｜ calls>                     (V4: <｜DSML｜tool_calls>)
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

Each invoke is one call: its name, and its parameters as a JSON object (``string="true"``: the
text as it is; ``"false"``: JSON) in ``arguments``, a JSON string as OpenAI sends it. The content
is the text before the block (trailing blank lines, which the format puts before the block,
removed); text after the block is content too. A block in which no invoke parses is left in the
content as it was written.

The model writes these values, so nothing it writes may break the answer: a ``string="false"``
value that is not standard JSON, or that JSON cannot carry to a client (NaN or Infinity, a number
past the range of a double or past Python's 4300 digits, a ``\\ud800`` escape that decodes to a
lone surrogate, arrays/objects nested deeper than ``MAX_NESTING``), stays the string it was
written as. ``arguments`` is always standard JSON (``allow_nan=False``) and valid UTF-8.

``ToolCallSplit`` takes the content as it streams: content up to the block (holding back what
could still be a tag), then one ``tool_calls`` delta per invoke as soon as it closes; the whole
answer is the same split fed at once. It scans each character a bounded number of times
(``_Tags``: text between tags passes through, only a tag in progress is held, at most
``MAX_TAG`` characters), so an answer costs time linear in its length however it is streamed.
Inside the block a tag is one of: invoke, parameter (open and close), the block's close; an
invoke ends at its close tag, and a block close before it ends the block (the unclosed invoke is
no call); a parameter's value runs to its close tag, other tags in it are its text.
"""
from __future__ import annotations

import json
import re
import uuid
from itertools import accumulate

from dsv41.checkpoint.chat import DSML
from dsv41.serving.reasoning import held_prefix

MAX_TAG = 512          # characters of one tag (a parameter name longer than ~470 is text, not a tag)
MAX_NESTING = 64       # arrays/objects in a value; a value nested deeper stays text

_D = re.escape(DSML)
_ATTRS = r'(?:[^"<>]|"[^"<]*")*'                      # a tag's inside: no "<"; a ">" only in quotes
TAG_START = re.compile(f"</?{_D}")
TAG = re.compile(f"</?{_D}{_ATTRS}>")
OPEN_TAG = re.compile(f'</?{_D}{_ATTRS}(?:"[^"<]*)?')   # a tag not yet closed (fullmatch to the end)
OPENER = re.compile(f"<{_D} ?(?:tool_)?calls>")
BLOCK_END = re.compile(f"</{_D} ?(?:tool_)?calls>")
INVOKE = re.compile(f'<{_D} ?invoke name="([^"]*)">')
INVOKE_END = re.compile(f"</{_D} ?invoke>")
PARAMETER = re.compile(f'<{_D} ?parameter name="([^"]*)" string="(true|false)">')
PARAMETER_END = re.compile(f"</{_D} ?parameter>")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.S)      # a JSON string (to the end if unterminated)
_BRACKET = re.compile(r"[\[\]{}]")
_DEPTH = {"[": 1, "{": 1, "]": -1, "}": -1}


def _nesting(text: str) -> int:
    """How deep arrays/objects nest in JSON text (brackets inside strings not counted)."""
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return 0
    return max(accumulate(map(_DEPTH.__getitem__, _BRACKET.findall(_STRING.sub("", text)))), default=0)


def _value(text: str, is_string: str):
    """A parameter's value: its text (string="true"), else its JSON where it is standard JSON a
    client can read, else its text."""
    if is_string == "true" or _nesting(text) > MAX_NESTING:
        return text
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError):     # not JSON, digits past the limit, NaN/inf, a lone surrogate
        return text
    return value


def call(name: str, args: dict, index: int) -> dict:
    """One OpenAI tool call (with its index, as a streamed delta carries it)."""
    return {"index": index, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False, allow_nan=False)}}


class _Tags:
    """Text as it streams, cut into plain text and DSML tags; holds back only what could still
    become a tag (a tag's start split across pieces, or a tag not yet closed)."""

    def __init__(self):
        self.held = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """(is a tag, text) pieces that ``text`` settles, in order."""
        s, i, out = self.held + text, 0, []
        while True:
            m = TAG_START.search(s, i)
            if m is None:
                keep = min(len(s) - i, max(held_prefix(s, "<" + DSML), held_prefix(s, "</" + DSML)))
                out.append((False, s[i:len(s) - keep]))
                self.held = s[len(s) - keep:]
                return out
            start = m.start()
            out.append((False, s[i:start]))
            tag = TAG.match(s, start, start + MAX_TAG)
            if tag is not None:
                out.append((True, tag.group()))
                i = tag.end()
            elif len(s) - start < MAX_TAG and OPEN_TAG.fullmatch(s, start):
                self.held = s[start:]               # may still close
                return out
            else:                                   # never a tag: its start is text
                out.append((False, s[start:m.end()]))
                i = m.end()

    def take(self) -> str:
        rest, self.held = self.held, ""
        return rest


class ToolCallSplit:
    def __init__(self):
        self.tags = _Tags()
        self.state = "content"      # content -> block (-> invoke -> value -> invoke ...) -> after
        self.space: list[str] = []  # content: trailing whitespace held (it goes with a block that follows)
        self.raw: list[str] = []    # the block's text since it opened or since the last call
        self.calls = 0
        self.name, self.args = "", {}           # the invoke being read
        self.key, self.is_string, self.value = "", "", []   # the parameter being read

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls) that ``text`` adds."""
        if self.state == "after":
            return self.tags.take() + text, []
        content: list[str] = []
        calls: list[dict] = []
        for is_tag, piece in self.tags.feed(text):
            if not piece:
                continue
            if self.state == "after":
                content.append(piece)
            elif self.state == "content":
                if is_tag and OPENER.fullmatch(piece):
                    self.raw, self.space, self.state = self.space + [piece], [], "block"
                else:
                    self._content(piece, content)
            else:
                self.raw.append(piece)
                self._block(is_tag, piece, content, calls)
        if self.state == "after":
            content.append(self.tags.take())
        return "".join(content), calls

    def _content(self, piece: str, out: list[str]):
        kept = piece.rstrip()
        if not kept:
            self.space.append(piece)
            return
        out += self.space
        out.append(kept)
        self.space = [piece[len(kept):]]

    def _block(self, is_tag: bool, piece: str, content: list[str], calls: list[dict]):
        if not is_tag:
            if self.state == "value":
                self.value.append(piece)
        elif BLOCK_END.fullmatch(piece):
            if not self.calls:                  # nothing parsed: the block stays text
                content += self.raw
            self.raw, self.state = [], "after"
        elif self.state == "block":
            m = INVOKE.fullmatch(piece)
            if m is not None:
                self.name, self.args, self.state = m.group(1), {}, "invoke"
        elif INVOKE_END.fullmatch(piece):
            calls.append(call(self.name, self.args, self.calls))
            self.calls += 1
            self.raw, self.state = [], "block"
        elif self.state == "invoke":
            m = PARAMETER.fullmatch(piece)
            if m is not None:
                self.key, self.is_string, self.value, self.state = m.group(1), m.group(2), [], "value"
        elif PARAMETER_END.fullmatch(piece):
            self.args[self.key] = _value("".join(self.value), self.is_string)
            self.state = "invoke"
        else:                                   # another tag inside a value is its text
            self.value.append(piece)

    def flush(self) -> str:
        """Content held back or left unparsed, once the answer has ended."""
        rest = self.tags.take()
        if self.state == "content":
            rest = "".join(self.space) + rest
            self.space = []
            return rest
        if self.state == "after":
            return rest
        text = "".join(self.raw) + rest         # cut off inside the block
        self.raw = []
        return text.strip() if self.calls else text


def split_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a whole answer's content."""
    split = ToolCallSplit()
    content, calls = split.feed(text)
    return content + split.flush(), calls
