"""The Engram compressed token map, built from a tokenizer by the official rule (spec 04 §3).

Each id is decoded alone. A decode holding U+FFFD (a partial UTF-8 byte token) is keyed by its
raw token string; anything else by its text after NFKC, NFD, accent stripping, lower-casing and
collapsing runs of space/tab/CR/LF to one space, then stripping; a token whose text collapses to
exactly one space keeps that space, and an empty result falls back to the decoded text. Keys get
new ids in order of first appearance. Ids past the tokenizer (spare embedding rows) hash as the
Engram pad token: no text reaches them.
"""
from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, normalizers

# A private-use character stands in for a lone space while Strip() runs.
_SPACE = "\ue000"


def _normalizer():
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SPACE),
        normalizers.Strip(), normalizers.Replace(_SPACE, " "),
    ])


def compressed_keys(tokenizer: Tokenizer) -> list[str]:
    """The normalised key of every token id, in id order."""
    norm = _normalizer()
    keys = []
    for tid in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            keys.append(tokenizer.id_to_token(tid))
        else:
            keys.append(norm.normalize_str(text) or text)
    return keys


def build_token_map(tokenizer: Tokenizer, vocab_size: int, pad_id: int) -> tuple[torch.Tensor, int]:
    """(i64 [vocab_size] compressed id per token id, number of compressed ids)."""
    keys = compressed_keys(tokenizer)
    if len(keys) > vocab_size:
        raise ValueError(f"tokenizer: {len(keys)} tokens exceed the model's vocab_size {vocab_size}")
    first: dict[str, int] = {}
    ids = [first.setdefault(k, len(first)) for k in keys]
    if not 0 <= pad_id < len(ids):
        raise ValueError(f"engram_pad_id: must be a token id in [0, {len(ids) - 1}], got {pad_id}")
    ids += [ids[pad_id]] * (vocab_size - len(ids))
    return torch.tensor(ids, dtype=torch.int64), len(first)
