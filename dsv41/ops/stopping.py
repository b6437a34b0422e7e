"""When one request's generation ends, and how much of its text may be shown so far.

A request ends at a stop token id (EOS among them unless ``ignore_eos``; the token is not part of
the output), at a stop string in its text (the text is cut before it, or after it with vLLM's
``include_stop_str_in_output``) or at its token limit; stop
ids and strings count only once ``min_tokens`` tokens are out (the sampler keeps the stop ids from
being drawn before that). Text is shown as it
grows, holding back a partial UTF-8 sequence and any tail that could still become a stop string,
so what was shown never has to be taken back. The command line, ``Engine.generate`` and the
server all end requests through this one class.

The text is decoded incrementally: only the tokens whose text is not settled yet (text is settled
when it does not end in U+FFFD, which a partial UTF-8 sequence decodes to), after ``CONTEXT``
tokens before them (a decoder may write a text's first token apart, e.g. without its leading
space), so a token costs the same however long the answer is (decoding every token again at each
step made a 7,000-token answer cost 3.26 s of CPU on the engine thread, 4x per 2x; now 0.042 s:
``bench/answer_text_cost.py``).
Where the window's text does not begin as the settled text did (a decoder that is not local), the
whole text is decoded as before.
"""
from __future__ import annotations

from typing import Callable

from dsv41.ops.sampling import SamplingParams

STOP, LENGTH = "stop", "length"          # OpenAI's finish reasons
CONTEXT = 4       # settled tokens decoded again before the new ones


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
        self.settled: list[str] = []     # the text of tokens[:read], in pieces (joined when read)
        self.settled_chars = 0
        self.settled_kept = 0            # settled_chars less the U+FFFD it ends in
        self.read = 0
        self.context = ""                # the text of the CONTEXT tokens before tokens[read]
        self.tail = ""                   # the text of tokens[read:]
        self.shown = 0                   # characters of text handed out by push
        self.finish: str | None = None   # STOP or LENGTH once ended
        self.eos = eos if not params.ignore_eos else None
        # vLLM's stop_reason: the stop token id or stop string that ended it (None: EOS, the limit)
        self.reason: int | str | None = None

    def push(self, token: int) -> str:
        """Take the next generated token; returns the text it lets through (all of the rest once
        the request ends)."""
        if self.finish is not None:
            raise ValueError("token: the request has already ended")
        if token in self.stop_ids and len(self.tokens) >= self.params.min_tokens:
            self.finish = STOP
            self.reason = None if token == self.eos and token not in self.params.stop_token_ids else token
        else:
            self.tokens.append(token)
            if self.decode_text is not None:
                settled = self._kept()           # text that more tokens cannot change
                self._decode()
                if len(self.tokens) >= self.params.min_tokens:
                    self._cut(settled)
            if self.finish is None and len(self.tokens) >= self.limit:
                self.finish = LENGTH
        size = self.settled_chars + len(self.tail)
        end = size if self.finish is not None else self._safe_end()
        if self.finish is not None and self._kept() < size:
            end = size                   # a partial sequence at the end stays what it is
        delta = self._span(self.shown, max(end, self.shown))
        self.shown = max(end, self.shown)
        return delta

    @property
    def text(self) -> str:
        """The text of the tokens, cut before a stop string."""
        if len(self.settled) > 1:
            self.settled = ["".join(self.settled)]
        return (self.settled[0] if self.settled else "") + self.tail

    def _kept(self) -> int:
        """The text's length less the U+FFFD it ends in (a partial UTF-8 sequence, so far)."""
        kept = self.tail.rstrip("\ufffd")
        return self.settled_chars + len(kept) if kept else self.settled_kept

    def _span(self, start: int, end: int) -> str:
        """text[start:end] for a span near the end: from the tail and the last settled pieces, so
        a step never joins the whole text."""
        if start >= self.settled_chars:
            return self.tail[start - self.settled_chars:end - self.settled_chars]
        parts, at = [self.tail], self.settled_chars
        for piece in reversed(self.settled):
            if at <= start:
                break
            at -= len(piece)
            parts.append(piece[max(0, start - at):])
        return "".join(reversed(parts))[:end - start]

    def _decode(self):
        """The tail's text with the new token; settled once it cannot change."""
        window = self.decode_text(self.tokens[max(0, self.read - CONTEXT):])
        if window.startswith(self.context):
            self.tail = window[len(self.context):]
        else:                            # the decoder is not local here: the whole text, as it grows
            self.tail = self.decode_text(self.tokens)[self.settled_chars:]
        if not self.tail.endswith("\ufffd"):    # a U+FFFD at the end may still become a character
            self.settled_kept = self._kept()
            self.settled.append(self.tail)
            self.settled_chars += len(self.tail)
            self.read, self.tail = len(self.tokens), ""
            self.context = self.decode_text(self.tokens[max(0, self.read - CONTEXT):])

    def _cut(self, settled: int):
        """End at the first stop string the new text completes (text before ``settled`` was searched
        already, or came before min_tokens, where stop strings do not count, as in vLLM)."""
        if not self.params.stop:
            return
        starts = [max(0, settled - len(s) + 1) for s in self.params.stop]
        base = min(starts)
        recent = self._span(base, self.settled_chars + len(self.tail))
        found = [(i, len(s), s) for s, start in zip(self.params.stop, starts)
                 if (i := recent.find(s, start - base)) >= 0]
        if found:
            at, length, self.reason = min(found)
            text = self.text[:base + at + length * self.params.include_stop_str_in_output]
            self.settled, self.settled_chars, self.settled_kept, self.tail = [text], len(text), len(text), ""
            self.finish = STOP

    def _safe_end(self) -> int:
        """How much of the text cannot change or turn into a stop string with more tokens."""
        end = self._kept()
        longest = max((len(s) for s in self.params.stop), default=1)
        recent = self._span(max(0, end - longest + 1), end)
        hold = max((k for s in self.params.stop for k in range(min(len(s) - 1, len(recent)), 0, -1)
                    if recent.endswith(s[:k])), default=0)
        return end - hold
