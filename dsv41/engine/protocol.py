"""The engine protocol: what the command line, the server and the tests drive.

An engine runs steps over a batch of ``(request id, new tokens)`` pairs (``None`` starts a request,
with its ``SamplingParams``) and answers each step with the next token of every request, drawn
where the logits are (the head) from the request's own generator. The logits themselves stay
there; ``StepOutput.logits`` fetches them, for the step just run only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv41.ops.stopping import Stops
from dsv41.ops.sampling import SamplingParams


@dataclass(frozen=True)
class StepOutput:
    request_ids: list[int]
    tokens: list[int]                           # the next token of each request, in batch order
    fetch: Callable[[], torch.Tensor] = field(repr=False, compare=False)
    logprobs: list | None = None                # per request (logprob, [(id, logprob)] top) or None; None: nobody asked

    @property
    def logits(self) -> torch.Tensor:
        """FP32 [B, vocab] last-row logits, in batch order (fetched on demand; raises once the
        engine has run another step)."""
        return self.fetch()


class StaleLogits(RuntimeError):
    """Logits asked for after the engine moved on: they are no longer kept."""


class Engine(ABC):
    """prefill / decode / generate over a subclass's ``step``; ``last_stats`` describes the last step."""

    last_request_ids: list[int]
    last_stats: dict

    @abstractmethod
    def step(self, batch: list[tuple[int | None, list[int]]], phase: str,
             sampling: list[SamplingParams | None] | None = None) -> StepOutput:
        """Run one step; it commits whole or leaves every request and cache as it was. sampling: per
        pair, the settings of the request it starts (None: greedy)."""

    @property
    @abstractmethod
    def active(self) -> list[int]:
        """Live request ids in admission order."""

    @abstractmethod
    def release(self, rid: int):
        """Free a finished request's blocks."""

    @abstractmethod
    def blocks_in_use(self) -> tuple[int, int]:
        """(cache blocks held by live requests, blocks in all pools), over every DP group."""

    def close(self):
        """Free what the engine holds (its cards' States, its cluster)."""

    @abstractmethod
    def start_at_context(self, count: int, context: int) -> list[int]:
        """Start ``count`` requests that have read ``context`` tokens, without a step: host state and
        every cache replica as a prefill of that history would leave them, rows drawn from the seed
        and each request's id (``engine.context``). Returns their ids; nothing runs on the model."""

    def prefill(self, prompts: list[list[int]], sampling=None, context: int = 0) -> StepOutput:
        """Start one request per prompt, at positions from ``context``; sampling: one SamplingParams
        for all, or one per prompt (default greedy). With context > 0 each request first holds that
        many tokens of drawn history (``start_at_context``; released again if the prompt's step
        fails); such requests are greedy (their sampling state starts with the drawn history)."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if not context:
            return self.step([(None, list(p)) for p in prompts], "prefill", sampling)
        if any(s is not None and not s.greedy for s in sampling):
            raise ValueError("sampling: requests started at a drawn context (context > 0) are greedy only")
        rids = self.start_at_context(len(prompts), context)
        try:
            return self.step([(r, list(p)) for r, p in zip(rids, prompts)], "prefill")
        except BaseException:
            for r in rids:
                self.release(r)
            raise

    def decode(self, token_ids: list[int], request_ids: list[int] | None = None) -> StepOutput:
        """One token per request (default: every active request, in admission order)."""
        rids = self.active if request_ids is None else list(request_ids)
        if len(token_ids) != len(rids):
            raise ValueError(f"token_ids: expected one token per request ({len(rids)}), got {len(token_ids)}")
        return self.step([(r, [t]) for r, t in zip(rids, token_ids)], "decode")

    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None, sampling=None,
                 decode_text: Callable[[list[int]], str] | None = None) -> list[list[int]]:
        """The continuation of each prompt (greedy unless sampling says otherwise: one SamplingParams
        or one per prompt). A request ends at max_new_tokens (default: its params' max_tokens), at
        one of its stop token ids (not returned) or, with decode_text, at one of its stop strings;
        every request is released at the end, also when a step fails."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        stops = [Stops(p or SamplingParams(), max_new_tokens, decode_text=decode_text) for p in sampling]
        out = self.prefill(prompts, sampling)
        rids = list(out.request_ids)
        try:
            live = list(range(len(prompts)))
            while True:
                for j, t in zip(live, out.tokens):
                    stops[j].push(t)
                live = [j for j in live if stops[j].finish is None]
                if not live:
                    break
                out = self.decode([stops[j].tokens[-1] for j in live], [rids[j] for j in live])
        finally:
            for r in rids:
                self.release(r)
        return [s.tokens for s in stops]


class StepCounter:
    """Hands out step numbers and keeps ``StepOutput.logits`` honest: only the latest step's."""

    def __init__(self):
        self.latest = 0

    def next(self) -> int:
        self.latest += 1
        return self.latest

    def guard(self, step: int, fetch: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def guarded():
            if step != self.latest:
                raise StaleLogits(f"logits: step {step} is gone (the engine has run step {self.latest}); "
                                  "ask for them before the next step")
            return fetch()
        return guarded
