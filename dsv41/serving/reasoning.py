"""The reasoning parser: a thinking-mode answer split into ``reasoning_content`` and ``content``.

In thinking mode the DeepSeek prompt ends in ``<think>``, so an answer opens with its reasoning
and closes it with ``</think>`` (``checkpoint/chat.py`` renders an assistant turn the same way:
reasoning, ``</think>``, content). As vLLM's and SGLang's DeepSeek reasoning parsers do: the text
before the first ``</think>`` is the reasoning (a ``<think>`` the model repeats at the start is
dropped), the rest is the content, and an answer that never closes its reasoning (cut by
``max_tokens``) is reasoning only. The answer's text must keep the control tokens' text
(``TextCodec.decode_answer``).

``ReasoningSplit`` takes the text as it streams; the whole answer is the same split fed at once,
so the streamed deltas always add up to the whole answer's fields. It holds back at most a
marker's length and searches only that and the new text, so an answer costs time linear in its
length however it is streamed; it never raises (the text passes through as it is).
"""
from __future__ import annotations

import re

from dsv41.checkpoint.chat import END_THINK, THINK

END = re.compile(re.escape(END_THINK))


def held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker`` (to hold back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplit:
    def __init__(self):
        self.buffer = ""
        self.started = False        # past a possible leading <think>
        self.reasoning = True       # still before </think>

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that ``text`` adds; a possible marker's start is held back."""
        self.buffer += text
        if not self.started:
            if THINK.startswith(self.buffer):
                return "", ""       # could still become the leading <think>
            self.buffer = self.buffer.removeprefix(THINK)
            self.started = True
        if not self.reasoning:
            content, self.buffer = self.buffer, ""
            return "", content
        end = END.search(self.buffer)
        if end is not None:
            reasoning, content = self.buffer[:end.start()], self.buffer[end.end():]
            self.buffer, self.reasoning = "", False
            return reasoning, content
        keep = held_prefix(self.buffer, END_THINK)
        reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return reasoning, ""

    def flush(self) -> tuple[str, str]:
        """What was held back, once the answer has ended."""
        rest = self.buffer if self.started else self.buffer.removeprefix(THINK)
        self.buffer, self.started = "", True
        return (rest, "") if self.reasoning else ("", rest)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning_content, content) of a whole thinking-mode answer."""
    split = ReasoningSplit()
    (r1, c1), (r2, c2) = split.feed(text), split.flush()
    return r1 + r2, c1 + c2
