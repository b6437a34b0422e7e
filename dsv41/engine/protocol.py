"""The engine protocol: what the command line, the server and the tests drive.

An engine executes a planned step (``execute``: each DP group's ``StepInputs``, planned by the
requests' host state, ``engine.host``). ``run`` is one scheduled step (one ``engine.layout.Part``
per request: its id, new tokens, drafts to verify after them and, for a request the step starts,
its ``SamplingParams``): the host plans it, the engine executes it, the host commits the verdict;
it answers with the tokens every request made, drawn where the logits are (the head)
from the request's own generator: one per request, or in a verify step the accepted drafts and the
model's own token after them. The logits themselves stay there; ``StepOutput.logits`` fetches
them, for the step just run only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv41.config import ModelConfig
from dsv41.capacity import Capacity
from dsv41.engine.context import draw_history
from dsv41.engine.host import HostState
from dsv41.engine.layout import Part, StepLayout
from dsv41.engine.request import new_id, requests_for
from dsv41.engine.requests import StepInputs
from dsv41.engine.scheduler import Scheduler
from dsv41.engine.sequence import Sequence
from dsv41.ops.sampling import SamplingParams


@dataclass(frozen=True)
class StepOutput:
    layout: StepLayout                          # the step's parts and rows, in batch order
    tokens: list[list[int]]                     # per request, in batch order, the tokens the step made
    fetch: Callable[[], torch.Tensor] = field(repr=False, compare=False)   # FP32 [R, vocab] every logit row
    logprobs: list | None = None                # per request, one (logprob, [(id, logprob)] top) per token; None: nobody asked
    taps: list[dict] | None = field(default=None, repr=False)   # per request, {DSpark target layer: [rows, D]}

    @property
    def request_ids(self) -> list[int]:
        return self.layout.ids

    @property
    def proposed(self) -> list[int] | None:
        """Per request, the drafts the step verified (None: none)."""
        return self.layout.proposed if self.layout.verifies else None

    @property
    def kept(self) -> list[int]:
        """Per request, the rows the step kept (its new tokens and the drafts it accepted)."""
        return self.layout.kept(self.tokens)

    @property
    def last(self) -> list[int]:
        """Each request's newest token: what it feeds next."""
        return [t[-1] for t in self.tokens]

    @property
    def accepted(self) -> list[int]:
        """Per request, the drafts the step accepted."""
        return [len(t) - 1 for t in self.tokens]

    def token_logits(self, i: int, j: int) -> torch.Tensor:
        """FP32 [vocab] logits that made token j of request i."""
        return self.fetch()[self._row(i, j)]

    @property
    def logits(self) -> torch.Tensor:
        """FP32 [B, vocab] logits of each request's newest token, in batch order (fetched on demand;
        raises once the engine has run another step)."""
        rows = self.fetch()
        return rows[[self._row(i, len(t) - 1) for i, t in enumerate(self.tokens)]]

    def _row(self, i: int, j: int) -> int:
        return self.layout.first_rows[i] + j


class StaleLogits(RuntimeError):
    """Logits asked for after the engine moved on: they are no longer kept."""


@dataclass
class Ran:
    """What an engine's step returned, per DP group: each request's tokens (in the group's order), their
    logprobs (None: nobody asked), DSpark's drafted blocks (None: none drafted) and the taps a drafter
    asked for; ``fetch`` gets every group's logit rows from where the step left them."""
    tokens: dict[int, list[list[int]]]
    fetch: Callable[[], dict[int, torch.Tensor]]
    logprobs: dict[int, list | None]
    drafted: dict[int, list] | None = None
    taps: dict[int, list[dict]] | None = None


class Engine(ABC):
    """The executor of a scheduled step (``execute``: each DP group's ``StepInputs`` in, what the
    step made out) over the caches its ``host`` state's pools index; ``run`` plans a step there,
    executes it and commits the verdict; ``step``/``prefill``/``decode``/``generate`` are built on
    it. ``last_stats`` describes the last step."""

    host: HostState             # the requests' host state (``engine.host``): the engine owns no Sequence or table
    cfg: ModelConfig
    capacity: Capacity          # the limits of a step and a DP group's table (``dsv41.capacity``)
    seed: int                   # drawn contexts (and random weights)
    last_request_ids: list[int]
    last_stats: dict
    taps: tuple = ()            # DSpark target layers whose taps each step hands back (the drafter sets them)
    starts = 0                  # requests this engine has started: the n-th one started at a context draws key n

    @abstractmethod
    def execute(self, inputs: dict[int, StepInputs], phase: str) -> Ran:
        """Run one planned step on the cards of these DP groups and publish its kept rows there, or
        leave every cache as it was and raise."""

    @abstractmethod
    def fill(self, fills: dict[int, list[tuple[int, Sequence]]]):
        """Write drawn histories into each DP group's caches: per group, (draw key, sequence)."""

    def run(self, parts: list[Part], phase: str) -> StepOutput:
        """Run one scheduled step; it publishes what it made or leaves every request and cache as
        it was. A part's drafts are verified after its new tokens (the step keeps the accepted
        prefix); with their distribution (FP64 [k, vocab]) a sampling request accepts them by the
        speculative-sampling rule (``ops.verify``)."""
        step = self.host.plan(parts, phase)
        try:
            ran = self.execute(step.inputs, phase)
        except BaseException:
            self.host.abort(step)
            raise
        self.host.commit(step, ran.tokens, ran.drafted)
        self.starts += step.started
        self.last_request_ids = step.layout.ids
        split, spans = step.split, step.spans()
        logprobs = split.gather({g: [None] * len(ran.tokens[g]) if lp is None else lp for g, lp in ran.logprobs.items()})

        def fetch() -> torch.Tensor:      # each request's logit rows, in batch order
            held = ran.fetch()
            return torch.cat([held[g][span.start:span.stop] for g, span in spans])
        return StepOutput(step.layout, split.gather(ran.tokens), self._steps.guard(self._steps.next(), fetch),
                          logprobs if any(x is not None for x in logprobs) else None,
                          None if ran.taps is None else split.gather(ran.taps))

    def step(self, batch: list[tuple[int | None, list[int]]], phase: str,
             sampling: list[SamplingParams | None] | None = None,
             drafts: list[list[int]] | None = None, draft_probs: list | None = None,
             cached: list[list[int] | None] | None = None) -> StepOutput:
        """``run`` over (request id, new tokens) pairs (id None starts a request under a new id) and
        per pair: sampling, the settings of the request it starts (None: greedy); drafts, tokens
        proposed after its new tokens (decode only); draft_probs, their distribution or None;
        cached, the prefix a starting request reuses from its group's prefix cache (its tokens come
        first; ``host.cached_prefixes`` finds it) or None."""
        return self.run(parts_of(batch, sampling, drafts, draft_probs, cached), phase)

    # ---- the host state, read through the engine ----------------------------------------------------
    @property
    def active(self) -> list[int]:
        """Live request ids."""
        return self.host.active

    @property
    def max_batch(self) -> int:
        """Requests the engine holds at once."""
        return self.host.max_batch

    @property
    def max_context(self) -> int:
        return self.host.max_context

    @property
    def prefix_caching(self) -> bool:
        return self.host.prefix_caching

    def sequence(self, rid: int) -> Sequence:
        """A live request's host state."""
        return self.host.sequence(rid)

    def release(self, rid: int):
        """Free a finished request's blocks."""
        self.host.release(rid)

    def blocks_in_use(self) -> tuple[int, int]:
        """(cache blocks held by live requests, blocks in all pools), over every DP group."""
        return self.host.blocks_in_use()

    def close(self):
        """Free what the engine holds (its cards' States, its cluster)."""

    def start_at_context(self, rids: list[int], context: int, groups: dict[int, int] | None = None) -> list[int]:
        """Start these requests as having read ``context`` tokens, without a step: host state and
        every cache replica as a prefill of that history would leave them, rows drawn from the seed
        and the request's place among the requests this engine started (``engine.context``); in
        the DP groups ``groups`` gives (request id -> group; default: as a prefill places them).
        Returns their ids; nothing runs on the model."""
        keys = dict(zip(rids, range(self.starts, self.starts + len(rids))))
        started = self.host.start_at(rids, {r: draw_history(self.cfg, self.seed, k, context) for r, k in keys.items()},
                                     groups)
        try:
            self.fill({g: [(keys[r], s.requests[r]) for r in s.rids] for g, s in started.items()})
        except BaseException:
            self.host.abort_started(started)
            raise
        self.host.commit_started(started)
        self.starts += len(rids)
        return list(rids)

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
        rids = self.start_at_context([new_id() for _ in prompts], context)
        try:
            return self.step([(r, list(p)) for r, p in zip(rids, prompts)], "prefill")
        except BaseException:
            for r in rids:
                self.release(r)
            raise

    def decode(self, token_ids: list[int], request_ids: list[int] | None = None,
               drafts: list[list[int]] | None = None, draft_probs: list | None = None) -> StepOutput:
        """One token per request (default: every active request, in admission order), and the
        drafts to verify after it."""
        rids = self.active if request_ids is None else list(request_ids)
        if len(token_ids) != len(rids):
            raise ValueError(f"token_ids: expected one token per request ({len(rids)}), got {len(token_ids)}")
        return self.step([(r, [t]) for r, t in zip(rids, token_ids)], "decode", drafts=drafts,
                         draft_probs=draft_probs)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None, sampling=None,
                 decode_text: Callable[[list[int]], str] | None = None, drafter=None) -> list[list[int]]:
        """The continuation of each prompt (greedy unless sampling says otherwise: one SamplingParams
        or one per prompt), scheduled by ``engine.scheduler`` (with a drafter: speculative steps). A
        request ends at max_new_tokens (default: its params' max_tokens), at one of its stop token
        ids (not returned) or, with decode_text, at one of its stop strings; every request is
        released at the end, also when a step fails."""
        requests = requests_for(prompts, sampling, max_new_tokens, decode_text)
        Scheduler(self, drafter).run(requests)
        return [r.stops.tokens for r in requests]


def parts_of(batch: list[tuple[int | None, list[int]]], sampling=None, drafts=None, draft_probs=None,
             cached=None) -> list[Part]:
    """A step's parts from (request id or None, new tokens) pairs and parallel per-pair lists."""
    n = len(batch)
    for name, given in (("sampling", sampling), ("drafts", drafts), ("draft_probs", draft_probs), ("cached", cached)):
        if given is not None and len(given) != n:
            raise ValueError(f"{name}: expected one entry per request ({n}), found {len(given)}")
    parts = []
    for i, (rid, toks) in enumerate(batch):
        parts.append(Part(new_id() if rid is None else rid, list(toks),
                          list((drafts[i] if drafts is not None else None) or []),
                          draft_probs[i] if draft_probs is not None else None,
                          sampling[i] if sampling is not None and rid is None else None, rid is None,
                          cached[i] if cached is not None else None))
    return parts


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
