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
text as it is; ``"false"``: JSON, kept as text where it does not parse) in ``arguments``, a JSON
string as OpenAI sends it. The content is the text before the block (trailing blank lines, which
the format puts before the block, removed); text after the block is content too. A block in which
no invoke parses is left in the content as it was written.

``ToolCallSplit`` takes the content as it streams: content up to the block (holding back what
could still be its start), then one ``tool_calls`` delta per invoke as soon as it closes; the
whole answer is the same split fed at once.
"""
from __future__ import annotations

import json
import re
import uuid

from dsv41.checkpoint.chat import DSML
from dsv41.serving.reasoning import held_prefix

_D = re.escape(DSML)
BLOCK = re.compile(f"<{_D} ?(?:tool_)?calls>")
BLOCK_END = re.compile(f"</{_D} ?(?:tool_)?calls>")
INVOKE = re.compile(f'<{_D} ?invoke name="([^"]*)">(.*?)</{_D} ?invoke>', re.S)
PARAMETER = re.compile(f'<{_D} ?parameter name="([^"]*)" string="(true|false)">(.*?)</{_D} ?parameter>', re.S)
OPENERS = (f"<{DSML} calls>", f"<{DSML}tool_calls>")     # the two spellings of the block's start


def _value(text: str, is_string: str):
    if is_string == "true":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def call(name: str, body: str, index: int) -> dict:
    """One OpenAI tool call (with its index, as a streamed delta carries it)."""
    args = {key: _value(value, s) for key, s, value in PARAMETER.findall(body)}
    return {"index": index, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallSplit:
    def __init__(self):
        self.buffer = ""
        self.state = "content"      # content -> block -> after
        self.calls = 0
        self.block = ""             # the block's text so far (given back as content if no call parses)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls) that ``text`` adds."""
        self.buffer += text
        content, calls = "", []
        while True:
            if self.state == "content":
                m = BLOCK.search(self.buffer)
                if m is None:
                    keep = max(held_prefix(self.buffer, o) for o in OPENERS)
                    body = self.buffer[:len(self.buffer) - keep]
                    keep += len(body) - len(body.rstrip())      # blank lines may precede the block
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                before = self.buffer[:m.start()]
                content += before.rstrip()
                # the block's text, with the blank lines before it, in case no call parses
                self.block = before[len(before.rstrip()):] + self.buffer[m.start():m.end()]
                self.buffer, self.state = self.buffer[m.end():], "block"
            elif self.state == "block":
                invoke, end = INVOKE.search(self.buffer), BLOCK_END.search(self.buffer)
                if invoke is not None and (end is None or invoke.start() < end.start()):
                    calls.append(call(invoke.group(1), invoke.group(2), self.calls))
                    self.calls += 1
                    self.block += self.buffer[:invoke.end()]
                    self.buffer = self.buffer[invoke.end():]
                    continue
                if end is None:
                    return content, calls
                self.block += self.buffer[:end.end()]
                self.buffer, self.state = self.buffer[end.end():], "after"
                if not self.calls:              # nothing parsed: the block stays text
                    content += self.block
            else:
                content += self.buffer
                self.buffer = ""
                return content, calls

    def flush(self) -> str:
        """Content held back or left unparsed, once the answer has ended."""
        rest, self.buffer = self.buffer, ""
        if self.state == "block" and not self.calls:
            return self.block + rest
        return rest.strip() if self.state == "block" else rest


def split_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a whole answer's content."""
    split = ToolCallSplit()
    content, calls = split.feed(text)
    return content + split.flush(), calls
