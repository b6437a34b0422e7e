"""Engram compressed token map (spec 04 §3) against hand-worked cases on a hand-made tokenizer."""
import pytest
from tokenizers import Tokenizer, decoders, models

from dsv41.checkpoint.token_map import build_token_map

# (token text or raw bytes, expected compressed id), in token-id order. Ids are handed out in
# order of first appearance of each normalised key.
CASES = [
    ("The", 0),          # lower-cased
    (" the", 0),         # stripped
    (" THE", 0),
    (" ", 1),            # the lone space stays a space (not stripped to nothing)
    ("\n\n", 1),         # whitespace runs collapse to one space, which is then a lone space
    (b"\xc3", 2),        # half of a UTF-8 pair decodes to U+FFFD: keyed by its raw token string
    ("é", 3),            # NFD + accent stripping
    ("e", 3),
    ("\ufb01", 4),       # the ligature U+FB01 is "fi" after NFKC
    ("fi", 4),
    ("\t A", 5),         # tab+space collapse, strip, lower-case
    ("a", 5),
    ("\u0301", 6),       # a lone combining accent strips to nothing: falls back to its text
    ("  ", 1),
    (b"\xc4", 7),        # another partial byte: a different raw string, a different key
    (" Café", 8),
    ("CAFÉ", 8),
]


def _bytes_to_unicode(raw: bytes) -> str:
    """GPT-2's byte -> printable character table (what a ByteLevel vocabulary is written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in raw)


def _tokenizer() -> Tokenizer:
    vocab = {_bytes_to_unicode(p if isinstance(p, bytes) else p.encode()): i for i, (p, _) in enumerate(CASES)}
    assert len(vocab) == len(CASES)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>"])          # added tokens count too, decoded with their text
    return tok


def test_hand_worked_cases():
    tok = _tokenizer()
    assert tok.decode([5], skip_special_tokens=False) == "\ufffd"
    token_map, count = build_token_map(tok, vocab_size=len(CASES) + 1, pad_id=0)
    assert token_map.tolist() == [want for _, want in CASES] + [9]
    assert count == 10


def test_ids_past_the_tokenizer_hash_as_the_pad_token():
    token_map, count = build_token_map(_tokenizer(), vocab_size=len(CASES) + 4, pad_id=3)
    assert count == 10 and token_map[-3:].tolist() == [1, 1, 1]


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="tokenizer: 18 tokens exceed the model's vocab_size 10"):
        build_token_map(_tokenizer(), vocab_size=10, pad_id=0)
    with pytest.raises(ValueError, match=r"engram_pad_id: must be a token id in \[0, 17\], got 30"):
        build_token_map(_tokenizer(), vocab_size=40, pad_id=30)
