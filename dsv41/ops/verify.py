"""Verifying drafts: the prefix of a request's proposed tokens the model itself would have made.

A verify step feeds a request's last token and k drafts; its rows make k + 1 tokens, row j's being
the model's token after the draft before it. Draft j is accepted while every draft before it was
and it equals row j's token; the request keeps the tokens of its accepted drafts and the model's
own token after them, and publishes the rows that fed them. Each row's token is drawn exactly as a
plain step at that position would draw it (the same draw index and history), so generation with
any drafter gives the tokens of generation without one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accepted:
    tokens: list[list[int]]             # per request, the tokens the step made (1 + accepted drafts)
    logprobs: list[list] | None         # per request, one (logprob, top) entry per token; None: nobody asked
    keep_rows: torch.Tensor | None      # bool [T] rows whose cache writes are published; None: all
    last_rows: torch.Tensor             # i64 [B] index into the logit rows of each request's last token


def accept(ids: torch.Tensor, logprobs: list | None, fed: list[list[int]], proposed: list[int],
           num_tokens: int) -> Accepted:
    """ids: the token of every logit row (each request's k + 1 rows, in batch order); fed: the rows
    each request fed, its k drafts last."""
    ids = ids.tolist()
    tokens, lps, keep, last = [], [], [], []
    at = 0
    for f, k in zip(fed, proposed):
        made = ids[at:at + k + 1]
        n = 1
        while n <= k and made[n - 1] == f[len(f) - k + n - 1]:
            n += 1
        tokens.append(made[:n])
        lps.append(None if logprobs is None else logprobs[at:at + n])
        keep += [True] * (len(f) - k + n - 1) + [False] * (k - n + 1)
        last.append(at + n - 1)
        at += k + 1
    if len(keep) != num_tokens:
        raise ValueError(f"fed: {len(keep)} rows, the step has {num_tokens}")
    return Accepted(tokens, None if logprobs is None else lps,
                    None if all(keep) else torch.tensor(keep, dtype=torch.bool), torch.tensor(last, dtype=torch.long))
