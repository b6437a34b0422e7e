"""Text that must never become a control token is encoded by a tokenizer that knows none."""
from __future__ import annotations

import json

from tokenizers import Tokenizer


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` without its added tokens, for text that must never become one.

    (``encode(text, add_special_tokens=False)`` only skips the post-processor's BOS/EOS; added
    tokens in the text are still matched, special or not.)"""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))
