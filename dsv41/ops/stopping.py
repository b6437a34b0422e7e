"""When one request's generation ends, and how much of its text may be shown so far.

A request ends at a stop token id (EOS among them unless ``ignore_eos``; the token is not part of
the output), at a stop string in its text (the text is cut before it) or at its token limit; stop
ids and strings count only once ``min_tokens`` tokens are out (the sampler keeps the stop ids from
being drawn before that). Text is shown as it
grows, holding back a partial UTF-8 sequence and any tail that could still become a stop string,
so what was shown never has to be taken back. The command line, ``Engine.generate`` and the
server all end requests through this one class.
"""
from __future__ import annotations

from typing import Callable

from dsv41.ops.sampling import SamplingParams

STOP, LENGTH = "stop", "length"          # OpenAI's finish reasons


class Stops:
    def __init__(self, params: SamplingParams, max_tokens: int | None = None, eos_id: int | None = None,
                 decode_text: Callable[[list[int]], str] | None = None):
        """max_tokens: the limit (default params.max_tokens); eos_id: a stop token besides
        params.stop_token_ids (default params.eos_token_id; neither with params.ignore_eos);
        decode_text: ids -> text, needed for stop strings and text."""
        if params.stop and decode_text is None:
            raise ValueError("stop: stop strings need text, and there is no tokenizer to make it")
        self.params = params
        self.limit = params.max_tokens if max_tokens is None else max_tokens
        eos = params.eos_token_id if eos_id is None else eos_id
        self.stop_ids = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
        self.decode_text = decode_text
        self.tokens: list[int] = []      # generated ids, a stop token left out
        self.text = ""                   # their text, cut before a stop string
        self.shown = 0                   # characters of text handed out by push
        self.finish: str | None = None   # STOP or LENGTH once ended

    def push(self, token: int) -> str:
        """Take the next generated token; returns the text it lets through (all of the rest once
        the request ends)."""
        if self.finish is not None:
            raise ValueError("token: the request has already ended")
        if token in self.stop_ids and len(self.tokens) >= self.params.min_tokens:
            self.finish = STOP
        else:
            self.tokens.append(token)
            if self.decode_text is not None:
                settled = len(self.text.rstrip("\ufffd"))     # text that more tokens cannot change
                self.text = self.decode_text(self.tokens)
                if len(self.tokens) >= self.params.min_tokens:
                    self._cut(settled)
            if self.finish is None and len(self.tokens) >= self.limit:
                self.finish = LENGTH
        end = len(self.text) if self.finish is not None else self._safe_end()
        if self.finish is not None and self.text.endswith("\ufffd"):
            end = len(self.text)         # a partial sequence at the end stays what it is
        delta, self.shown = self.text[self.shown:max(end, self.shown)], max(end, self.shown)
        return delta

    def _cut(self, settled: int):
        """End at the first stop string the new text completes (text before ``settled`` was searched
        already, or came before min_tokens, where stop strings do not count, as in vLLM)."""
        found = [i for s in self.params.stop if (i := self.text.find(s, max(0, settled - len(s) + 1))) >= 0]
        if found:
            self.text, self.finish = self.text[:min(found)], STOP

    def _safe_end(self) -> int:
        """How much of the text cannot change or turn into a stop string with more tokens."""
        text = self.text.rstrip("\ufffd")
        hold = max((k for s in self.params.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        return len(text) - hold
