"""A chat answer's text as OpenAI message fields: the reasoning parser (thinking mode) then the
tool-call parser (when the request offers tools), whole or streamed as deltas.

Streamed deltas add up to the whole answer's fields: both are the same splitters fed the text
(``serving/reasoning.py``, ``serving/tool_calls.py``).
"""
from __future__ import annotations

from dsv41.serving.reasoning import ReasoningSplit
from dsv41.serving.tool_calls import ToolCallSplit

STOP, TOOL_CALLS = "stop", "tool_calls"


class ChatAnswer:
    def __init__(self, thinking: bool, tools: bool):
        """thinking: split off reasoning_content; tools: parse tool calls out of the content."""
        self.reasoning = ReasoningSplit() if thinking else None
        self.tools = ToolCallSplit() if tools else None
        self.called = False

    @property
    def parsing(self) -> bool:
        """Whether a parser reads the answer (the server then feeds it off the event loop)."""
        return self.reasoning is not None or self.tools is not None

    def feed(self, text: str) -> dict:
        """The delta fields (reasoning_content, content, tool_calls) that ``text`` adds; empty
        fields left out."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._fields(reasoning, content)

    def flush(self) -> dict:
        """The delta fields held back until the answer ended."""
        reasoning, content = self.reasoning.flush() if self.reasoning is not None else ("", "")
        fields = self._fields(reasoning, content)
        if self.tools is not None:
            rest = self.tools.flush()
            if rest:
                fields["content"] = fields.get("content", "") + rest
        return fields

    def _fields(self, reasoning: str, content: str) -> dict:
        calls = []
        if self.tools is not None and content:
            content, calls = self.tools.feed(content)
        self.called = self.called or bool(calls)
        out = {}
        if reasoning:     # vLLM >= 0.11 names it reasoning and keeps the older reasoning_content
            out["reasoning"] = out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, finish: str) -> str:
        """As vLLM: an answer that called a tool ends with "tool_calls" (one cut short: "abort")."""
        return TOOL_CALLS if self.called and finish != "abort" else finish

    def message(self, text: str) -> dict:
        """The whole answer as an assistant message."""
        fields = [self.feed(text), self.flush()]
        joined = {k: "".join(f.get(k, "") for f in fields) for k in ("reasoning_content", "content")}
        calls = [c for f in fields for c in f.get("tool_calls", [])]
        msg = {"role": "assistant", "content": joined["content"] or (None if calls else "")}
        if self.reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = joined["reasoning_content"] or None
        if calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return msg
