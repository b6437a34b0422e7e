"""Structured output on the host: a request's grammar (llguidance) and, per step, the mask of the
tokens it allows at each logit row the step draws (``ops.sampling.RowDraw.allowed``; the head
applies it where it draws the token, so every layout draws the same tokens).

A ``Grammar`` is compiled once per constraint (``serving.structured`` caches them) over a
``TokenTable``: the tokenizer's tokens at the model's vocabulary width (ids past the tokenizer are
never allowed). Each request gets its own ``Matcher``, a copy of the compiled one, which reads the
request's generated tokens as they become its history. With drafts to verify, row j's mask is the
grammar's state after the drafts before it; a draft the grammar rejects ends the rows that get
their own mask (the rows after repeat it: the draft cannot be drawn there, so the accepted prefix
ends at it), and the drafts are rolled back at once, as vLLM v1 does: the matcher keeps only what
the request published.

A ``Constraint`` is everything a request asks of its rows' masks on the host: its grammar, which
with thinking on starts only after the token that ends the reasoning (the reasoning is free, as
vLLM's reasoning parsers apply structured output to the answer after it), a reasoning budget
(vLLM's ``thinking_token_budget``: past it only that end token may be drawn), vLLM's
``allowed_token_ids`` and its ``bad_words`` (a word's last token is banned where the tokens
before it end the output). Its ``matcher`` gives each request the masks of its rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class GrammarError(ValueError):
    """A constraint llguidance cannot compile (its message says where)."""


class TokenTable:
    """The tokens a grammar is matched over: a ``tokenizers.Tokenizer`` at ``vocab`` ids."""

    def __init__(self, tokenizer, vocab: int, eos_id: int | None):
        import llguidance
        self.vocab, self.eos_id = vocab, eos_id
        self.words = words(vocab)
        self.ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos_id)

    def only(self, token: int | None) -> torch.Tensor:
        """The mask allowing one token (none: every token)."""
        return only(token, self.vocab)


def words(vocab: int) -> int:
    return (vocab + 31) // 32


def only(token: int | None, vocab: int) -> torch.Tensor:
    """The mask allowing one token (none: every token)."""
    mask = torch.zeros(words(vocab), dtype=torch.int32)
    if token is None:
        return mask - 1
    mask.view(torch.uint8)[token // 8] = 1 << (token % 8)     # little-endian words: byte t // 8, bit t % 8
    return mask


def of(tokens, vocab: int) -> torch.Tensor:
    """The mask allowing ``tokens``."""
    bits = np.zeros(words(vocab) * 32, dtype=bool)
    bits[list(tokens)] = True
    return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())


class Grammar:
    """A compiled llguidance grammar (its JSON form, ``llguidance.grammar_from``)."""

    def __init__(self, table: TokenTable, grammar: str, name: str):
        import llguidance
        self.table, self.name = table, name
        self.proto = llguidance.LLMatcher(table.ll, grammar, log_level=0)
        if self.proto.is_error():
            raise GrammarError(self.proto.get_error())

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """One request's grammar state; ``masks`` is all the engine asks of it."""

    def __init__(self, grammar: Grammar):
        self.table = grammar.table
        self.ll = grammar.proto.deep_copy()
        self.seen: list[int] = []            # the generated tokens it has read

    def masks(self, generated: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """The masks of the rows after ``generated`` (the request's tokens so far) and after each
        of ``drafts``: one more than there are drafts."""
        n = len(self.seen)
        if generated[:n] != self.seen:       # a history recomputed (a preempted request restarting)
            self.ll.reset()
            self.seen, n = [], 0
        if len(generated) > n:
            self.ll.consume_tokens(generated[n:])   # a token it refuses leaves it in its error state
            self.seen = list(generated)
        out = [self._mask()]
        valid = self.ll.validate_tokens(drafts) if drafts and not self.ll.is_error() else 0
        for token in drafts[:valid]:
            self.ll.consume_token(token)
            out.append(self._mask())
        if valid:
            self.ll.rollback(valid)
        return out + [out[-1]] * (len(drafts) - valid)

    def _mask(self) -> torch.Tensor:
        """The grammar's mask, or EOS alone once it is in an error state or allows nothing (the
        answer ends; no token outside the grammar is drawn)."""
        if not self.ll.is_error():
            mask = torch.frombuffer(bytearray(self.ll.compute_bitmask()), dtype=torch.int32)
            if bool(mask.any()):
                return mask
        return self.table.only(self.table.eos_id)


@dataclass(frozen=True)
class Constraint:
    """What decides, on the host, which tokens each row of a request may draw (see the module's
    docstring). grammar: None, or the compiled grammar; reasoning_end: the token after which the
    grammar starts (None: from the first token); budget: reasoning tokens before reasoning_end is
    the only token allowed (None: no budget); allowed: vLLM's allowed_token_ids (None: all);
    bad_words: token sequences whose last token is banned where the output ends in the others;
    eos: the token a row that allows nothing else draws."""
    vocab: int
    grammar: Grammar | None = None
    reasoning_end: int | None = None
    budget: int | None = None
    allowed: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    eos: int | None = None

    def matcher(self) -> "Rows":
        return Rows(self)


class Rows:
    """One request's row masks under its ``Constraint`` (None: a row any token may follow)."""

    def __init__(self, c: Constraint):
        self.c = c
        self.grammar = None if c.grammar is None else c.grammar.matcher()
        self.allowed = None if c.allowed is None else of(c.allowed, c.vocab)

    def masks(self, generated: list[int], drafts: list[int]) -> list[torch.Tensor | None]:
        """The masks of the rows after ``generated`` and after each of ``drafts`` (one more than
        there are drafts), as ``Matcher.masks``."""
        c, rows = self.c, len(drafts) + 1
        out: list[torch.Tensor | None] = [None] * rows
        free = rows               # rows still inside the reasoning (their history has no end token)
        if c.reasoning_end is not None:
            seen = generated + drafts
            end = seen.index(c.reasoning_end) if c.reasoning_end in seen else None
            free = rows if end is None else max(0, end + 1 - len(generated))
            if c.budget is not None:
                for j in range(free):
                    if len(generated) + j >= c.budget:
                        out[j] = only(c.reasoning_end, c.vocab)
            answer = [] if end is None else generated[end + 1:]
        else:
            free, answer = 0, generated
        if self.grammar is not None and free < rows:
            out[free:] = self.grammar.masks(answer, drafts[free:])
        if self.allowed is not None or c.bad_words:
            out = [self._ban(m, generated + drafts[:j]) for j, m in enumerate(out)]
        return out

    def _ban(self, mask: torch.Tensor | None, seen: list[int]) -> torch.Tensor:
        """``mask`` narrowed to allowed_token_ids and without the bad words' tokens due after ``seen``."""
        mask = only(None, self.c.vocab) if mask is None else mask.clone()
        if self.allowed is not None:
            mask &= self.allowed
        banned = [w[-1] for w in self.c.bad_words
                  if len(w) == 1 or (len(seen) >= len(w) - 1 and tuple(seen[len(seen) - len(w) + 1:]) == w[:-1])]
        if banned:
            mask &= ~of(banned, self.c.vocab)
        if not bool(mask.any()) and self.c.eos is not None:    # nothing left: the answer ends
            return only(self.c.eos, self.c.vocab)
        return mask
