"""The engine protocol: what the command line, the server and the tests drive.

An engine runs steps over a batch of ``(request id, new tokens)`` pairs (``None`` starts a request)
and answers each step with the next token of every request, made where the logits are (the head).
The logits themselves stay there; ``StepOutput.logits`` fetches them, for the step just run only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class StepOutput:
    request_ids: list[int]
    tokens: list[int]                           # the next token of each request, in batch order
    fetch: Callable[[], torch.Tensor] = field(repr=False, compare=False)

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
    def step(self, batch: list[tuple[int | None, list[int]]], phase: str) -> StepOutput:
        """Run one step; it commits whole or leaves every request and cache as it was."""

    @property
    @abstractmethod
    def active(self) -> list[int]:
        """Live request ids in admission order."""

    @abstractmethod
    def release(self, rid: int):
        """Free a finished request's blocks."""

    def close(self):
        """Free what the engine holds (its cards' States, its cluster)."""

    @abstractmethod
    def start_at_context(self, count: int, context: int) -> list[int]:
        """Start ``count`` requests that have read ``context`` tokens, without a step: host state and
        every cache replica as a prefill of that history would leave them, rows drawn from the seed
        and each request's id (``engine.context``). Returns their ids; nothing runs on the model."""

    def prefill(self, prompts: list[list[int]], context: int = 0) -> StepOutput:
        """Start one request per prompt, at positions from ``context``: with context > 0 each request
        first holds that many tokens of drawn history (``start_at_context``; released again if the
        prompt's step fails)."""
        if not context:
            return self.step([(None, list(p)) for p in prompts], "prefill")
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

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt; its requests are released at the end."""
        out = self.prefill(prompts)
        rids = list(out.request_ids)
        tokens = [[] for _ in prompts]
        for i in range(max_new_tokens):
            for got, t in zip(tokens, out.tokens):
                got.append(t)
            if i + 1 < max_new_tokens:
                out = self.decode(out.tokens, rids)
        for r in rids:
            self.release(r)
        return tokens


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
