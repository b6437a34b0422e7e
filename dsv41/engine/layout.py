"""A step's layout, computed once from what the scheduler put in it and read by everyone after.

A step is a list of ``Part``: per request, its id (one id from arrival to end, ``engine.request``),
the tokens it feeds, the drafts to verify after them (with the distribution they were drawn from,
or None) and, for a request the step starts, its settings. The parts stay on the host.
``StepLayout`` places them: the rows each request feeds (its tokens, then its drafts), its logit
rows (its last row, and with k drafts the k rows before it too), and once the verdict is in, the
rows each kept. The request tables, the engines, the verifier on the head card, the drafters and
the scheduler read it; nobody recounts them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from dsv41.ops.sampling import SamplingParams


@dataclass
class Part:
    """One request's part of a step."""
    id: int
    tokens: list[int]
    drafts: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None           # FP64 [drafts, vocab] they were drawn from; None: none given
    sampling: SamplingParams | None = None      # the settings of a request the step starts (None: greedy)
    start: bool = False                         # the step starts this request under its id
    cached: list[int] | None = None             # a starting request's prefix its group's prefix cache holds:
    #                                             it shares those pages and feeds only its tokens after them
    group: int | None = None                    # the DP group a starting request goes to (the scheduler's
    #                                             cache-aware choice, ``Router.choose``); None: the least loaded
    prompt_len: int | None = None               # a starting request's whole prompt (its later chunks included;
    #                                             a recompute's rows past it are generated tokens); None: its
    #                                             cached prefix and tokens are the whole prompt
    cache_root: bytes = b""                     # a starting request's cache salt's root (``prefix_cache.root``):
    #                                             it shares only spans hashed from it


class StepLayout:
    """Where each request of a step sits in its rows, and (``kept``) what the verdict keeps. It holds
    counts, drafts and their distributions only, no prompt tokens or settings: it travels with the
    step's device inputs to the cards, whose head verifies with it."""

    def __init__(self, ids: list[int], rows: list[int], drafts: list[list[int]], probs: list):
        self.ids, self.rows, self.drafts, self.probs = ids, rows, drafts, probs
        self.proposed = [len(d) for d in drafts]
        ends = list(itertools.accumulate(rows))
        self.starts = [0] + ends                 # request i feeds rows starts[i]:starts[i + 1], its drafts last
        self.first_rows = list(itertools.accumulate([0] + [k + 1 for k in self.proposed]))[:-1]
        self.logit_rows = [r for end, k in zip(ends, self.proposed) for r in range(end - 1 - k, end)]

    @classmethod
    def of(cls, parts: list[Part]) -> StepLayout:
        return cls([p.id for p in parts], [len(p.tokens) + len(p.drafts) for p in parts],
                   [list(p.drafts) for p in parts], [p.probs for p in parts])

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def total(self) -> int:
        """Rows the step feeds in all."""
        return self.starts[-1]

    @property
    def verifies(self) -> bool:
        return any(self.proposed)

    @property
    def draft_probs(self) -> list | None:
        """Per request, its drafts' distribution or None; None when no request gave one."""
        return self.probs if any(q is not None for q in self.probs) else None

    def logit_span(self, i: int) -> range:
        """Request i's logit rows, among the step's logit rows."""
        return range(self.first_rows[i], self.first_rows[i] + self.proposed[i] + 1)

    def kept(self, made: list[list[int]]) -> list[int]:
        """Per request, the rows the step keeps given the tokens it made: its new tokens and the
        drafts it accepted (a request that made n tokens accepted n - 1 drafts)."""
        return [r - k + len(m) - 1 for r, k, m in zip(self.rows, self.proposed, made)]
