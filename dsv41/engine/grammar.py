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
"""
from __future__ import annotations

import torch


class GrammarError(ValueError):
    """A constraint llguidance cannot compile (its message says where)."""


class TokenTable:
    """The tokens a grammar is matched over: a ``tokenizers.Tokenizer`` at ``vocab`` ids."""

    def __init__(self, tokenizer, vocab: int, eos_id: int | None):
        import llguidance
        self.vocab, self.eos_id = vocab, eos_id
        self.words = (vocab + 31) // 32
        self.ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos_id)

    def only(self, token: int | None) -> torch.Tensor:
        """The mask allowing one token (none: every token)."""
        mask = torch.zeros(self.words, dtype=torch.int32)
        if token is None:
            return mask - 1
        mask.view(torch.uint8)[token // 8] = 1 << (token % 8)     # little-endian words: byte t // 8, bit t % 8
        return mask


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
