"""A request's text as it grows (``ops/stopping.Stops``) is decoded incrementally: the same deltas,
text and finish as decoding every token again at each step (the reference below, what the class
did before), and a cost per token that does not grow with the answer."""
import random

import pytest

from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops

FFFD = "\ufffd"


class Reference:
    """Decode all tokens at every step; show the text up to a partial UTF-8 sequence or a tail that
    could still be a stop string; cut before the first stop string once min_tokens are out."""

    def __init__(self, params: SamplingParams, decode):
        self.p, self.decode, self.tokens, self.text, self.shown, self.finish = params, decode, [], "", 0, None

    def push(self, token: int) -> str:
        if token in self.p.stop_ids and len(self.tokens) >= self.p.min_tokens:
            self.finish = "stop"
        else:
            self.tokens.append(token)
            settled = len(self.text.rstrip(FFFD))
            self.text = self.decode(self.tokens)
            if len(self.tokens) >= self.p.min_tokens:
                found = [i for s in self.p.stop if (i := self.text.find(s, max(0, settled - len(s) + 1))) >= 0]
                if found:
                    self.text, self.finish = self.text[:min(found)], "stop"
            if self.finish is None and len(self.tokens) >= self.p.max_tokens:
                self.finish = "length"
        if self.finish is not None:
            end = len(self.text)
        else:
            text = self.text.rstrip(FFFD)
            end = len(text) - max((k for s in self.p.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                                   if text.endswith(s[:k])), default=0)
        delta, self.shown = self.text[self.shown:max(end, self.shown)], max(end, self.shown)
        return delta


def test_incremental_text_is_the_text_decoded_whole(codec):
    rng = random.Random(0)
    texts = ["héllo wörld 😀 日本語 END stop", "<think>abc</think> ｜DSML｜ calls", "plain words " * 5]
    for trial in range(600):
        if trial % 3 == 0:       # any ids: broken UTF-8 sequences, control tokens
            ids = [rng.randrange(codec.size) for _ in range(rng.randint(1, 60))]
        else:
            ids = codec.tokenizer.encode(rng.choice(texts) * rng.randint(1, 3), add_special_tokens=False).ids
            if trial % 3 == 2:
                ids = [t if rng.random() < 0.7 else rng.randrange(codec.size) for t in ids]
        limit = rng.randint(1, 70)
        p = SamplingParams(max_tokens=limit, min_tokens=rng.randint(0, min(3, limit)), eos_token_id=codec.eos_id,
                           stop=tuple(rng.sample(["END", "o w", FFFD, "abc", "ds", "語 E", "e"], rng.randint(0, 2))))
        decode = rng.choice([codec.decode, codec.decode_answer])
        got, want = Stops(p, decode_text=decode), Reference(p, decode)
        for t in ids:
            if want.finish is not None:
                break
            assert got.push(t) == want.push(t), (ids, p.stop)
        assert (got.text, got.finish, got.tokens) == (want.text, want.finish, want.tokens), (ids, p.stop)


def test_a_token_costs_the_same_however_long_the_answer(codec):
    """Tokens handed to the decoder for an answer 4 times as long: about 4 times as many (decoding
    every token again at each step made it 16)."""
    ids = codec.tokenizer.encode("some words, 日本語 and 😀 here " * 1500, add_special_tokens=False).ids

    def decoded(n: int) -> int:
        count = [0]

        def decode(tokens):
            count[0] += len(tokens)
            return codec.decode_answer(tokens)
        stops = Stops(SamplingParams(max_tokens=10 ** 6, stop=("never",)), decode_text=decode)
        for t in ids[:n]:
            stops.push(t)
        assert stops.text == codec.decode_answer(ids[:n])
        return count[0]
    small, large = decoded(len(ids) // 4), decoded(len(ids))
    assert large <= 4.5 * small, (small, large)
