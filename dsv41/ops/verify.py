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

from dsv41.ops.sampling import RequestGenerator, draw_from, filtered_probs, processed


@dataclass(frozen=True)
class Accepted:
    tokens: list[list[int]]             # per request, the tokens the step made (1 + accepted drafts)
    logprobs: list[list] | None         # per request, one (logprob, top) entry per token; None: nobody asked
    keep_rows: torch.Tensor | None      # bool [T] rows whose cache writes are published; None: all
    last_rows: torch.Tensor             # i64 [B] index into the logit rows of each request's last token


def accept(ids: torch.Tensor, logprobs: list | None, layout, decided: list | None = None) -> Accepted:
    """ids: the token of every logit row (each request's k + 1 rows, in batch order); layout: the
    step's ``engine.layout.StepLayout`` (each request's rows, its k drafts last); decided: per
    request, the tokens the speculative-sampling rule already made (``sampled_rule``), or None where
    drafts are accepted while they equal ids."""
    ids = ids.tolist()
    tokens, lps, last = [], [], []
    for i, drafts in enumerate(layout.drafts):
        span = layout.logit_span(i)
        made = ids[span.start:span.stop]
        n = 1
        while n <= len(drafts) and made[n - 1] == drafts[n - 1]:
            n += 1
        if decided is not None and decided[i] is not None:
            made, n = decided[i], len(decided[i])
        tokens.append(made[:n])
        lps.append(None if logprobs is None else logprobs[span.start:span.start + n])
        last.append(span.start + n - 1)
    keep = [j < n for r, n in zip(layout.rows, layout.kept(tokens)) for j in range(r)]
    return Accepted(tokens, None if logprobs is None else lps,
                    None if all(keep) else torch.tensor(keep, dtype=torch.bool), torch.tensor(last, dtype=torch.long))


def speculative_tokens(target: torch.Tensor, draft: torch.Tensor, drafts: list[int], generators) -> list[int]:
    """The speculative-sampling rule for a drafter with its own distribution (Leviathan et al.,
    Chen et al.): draft j, drawn from draft[j], is accepted with probability
    min(1, target[j][x] / draft[j][x]); the first rejected one is replaced by a draw from the
    normalized max(0, target[j] - draft[j]); when every draft is accepted, one more token is drawn
    from target[k]. The tokens made follow the target distribution exactly whatever the drafts.

    target: FP64 [k + 1, V] the model's (filtered) probabilities at each row; draft: FP64 [k, V];
    generators(j): the torch.Generator of row j (the request's draw at that position), used for
    the acceptance test and, at the row where it stops, the replacement draw."""
    out = []
    for j, x in enumerate(drafts):
        g = generators(j)
        p, q = float(target[j, x]), float(draft[j, x])
        u = torch.rand((), generator=g, dtype=torch.float64).item()
        if q > 0 and u * q < p:
            out.append(x)
            continue
        residual = (target[j] - draft[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:         # p <= q everywhere but x: the target row itself
            residual = target[j]
        out.append(draw_from(residual / residual.sum(), g))
        return out
    out.append(draw_from(target[len(drafts)], generators(len(drafts))))
    return out


def _target(row: torch.Tensor, draw) -> torch.Tensor:
    """A logit row's filtered probabilities as its plain draw would see them (edits, penalties)."""
    p = draw.params
    return filtered_probs(processed(row, p, draw.output_ids, draw.prompt_ids, draw.generated, draw.allowed), p)


def sampled_rule(logits: torch.Tensor, draws: list | None, layout, logprobs: list | None):
    """Per request with drafts, their distribution (``layout.probs[i]``: FP64 [k, V]) and temperature
    > 0: the tokens ``speculative_tokens`` makes from its rows' filtered target probabilities, each
    row with its own draw (the request's generator at that position); None elsewhere. Returns
    (decided, logprobs) with each decided token's raw-row logprob entry where one was asked."""
    decided = []
    lps = None if logprobs is None else list(logprobs)
    for i, (drafts, q) in enumerate(zip(layout.drafts, layout.probs)):
        rows = list(layout.logit_span(i))
        if q is None or not drafts or draws is None or draws[rows[0]].params.greedy:
            decided.append(None)
            continue
        target = torch.stack([_target(logits[r], draws[r]) for r in rows])
        toks = speculative_tokens(target, q.to(torch.float64), drafts,
                                  lambda j: RequestGenerator(draws[rows[j]].seed, draws[rows[j]].draw).next())
        decided.append(toks)
        if lps is not None and draws[rows[0]].params.logprob:
            for j, t in enumerate(toks):
                raw = torch.log_softmax(logits[rows[j]].to(torch.float32), dim=-1)
                n = draws[rows[j]].params.logprobs
                top = [(int(x), float(raw[x])) for x in torch.sort(raw, descending=True, stable=True).indices[:n]]
                lps[rows[j]] = (float(raw[t]), top if n else [])
    return decided, lps
