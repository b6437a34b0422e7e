"""The one scheduling loop: ``Engine.generate``, the command line and the server all run it.

Requests wait in arrival order and run while the engine holds them. Each turn runs one engine
step: waiting requests are admitted first (one prefill step for as many as the batch, the prefill
rows and the cache pools take), otherwise every running request decodes its newest token, with
the drafter's proposals to verify after it. When the pools cannot hold a decode step the newest
running request is preempted: its blocks are freed and it waits at the front of the queue, to be
recomputed from its token history (``Engine.restart``) when it fits again, with the sampling state
it had, so its tokens are those of a run that never preempted it. A request ends through its
``Stops``; the tokens a step made past that are dropped.
"""
from __future__ import annotations

import collections
import itertools
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable

import torch

from dsv41.engine.blocks import PoolExhausted
from dsv41.engine.sequence import Sequence
from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops


@dataclass(eq=False)
class Job:
    """One request's generation. Subclasses route what ``emit`` hears (the server's queues)."""
    prompt: list[int]
    params: SamplingParams
    stops: Stops
    _: KW_ONLY
    id: int = field(default_factory=itertools.count().__next__)
    made: list[int] = field(default_factory=list)      # every token made for it, a stop token included
    rid: int | None = None        # the engine's request id while it runs
    last: int | None = None       # its newest token, fed at its next decode step
    saved: Sequence | None = None  # its sampling state while preempted
    cancelled: bool = False
    finished: bool = False
    preemptions: int = 0
    final_logits: torch.Tensor | None = None   # the logits of its last token (Scheduler keep_logits)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.made

    def emit(self, kind: str, **fields):
        """A token (token, text, logprob, kept), the end (finish) or an error (error)."""


def jobs_for(prompts, sampling, max_new_tokens, decode_text, eos_id=None, cls=Job) -> list[Job]:
    """A job per prompt; sampling: one SamplingParams for all, or one per prompt (None: greedy)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    out = []
    for prompt, p in zip(prompts, sampling):
        p = p or SamplingParams()
        out.append(cls(list(prompt), p, Stops(p, max_new_tokens, eos_id, decode_text)))
    return out


@dataclass
class Turn:
    """One engine step the loop ran: prefill (admissions), restart (a preempted request
    recomputed) or decode; its wall time, the engine's stats and its output."""
    phase: str
    ms: float
    jobs: list[Job]
    stats: dict = field(default_factory=dict)
    out: object = None


@dataclass
class SpecStats:
    """Speculative decoding so far: steps, drafts proposed and accepted, acceptance by draft
    position, and how many tokens each request made per decode step."""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    by_position: list[list[int]] = field(default_factory=list)     # [proposed, accepted] per position
    tokens_per_step: dict[int, int] = field(default_factory=dict)   # tokens a request made -> count

    def add(self, proposed: list[int], tokens: list[list[int]]):
        self.steps += 1
        for k, toks in zip(proposed, tokens):
            a = len(toks) - 1
            self.drafted += k
            self.accepted += a
            while len(self.by_position) < k:
                self.by_position.append([0, 0])
            for j in range(k):
                self.by_position[j][0] += 1
                self.by_position[j][1] += j < a
            self.tokens_per_step[len(toks)] = self.tokens_per_step.get(len(toks), 0) + 1

    def summary(self) -> dict:
        made = sum(n * c for n, c in self.tokens_per_step.items())
        rows = sum(self.tokens_per_step.values())
        return {"decode_steps": self.steps, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else None,
                "acceptance_by_position": [a / p if p else None for p, a in self.by_position],
                "tokens_per_request_step": made / rows if rows else None,
                "tokens_per_request_step_histogram": dict(sorted(self.tokens_per_step.items()))}


class Scheduler:
    def __init__(self, engine, drafter=None, max_batch: int | None = None, prefill_rows: int | None = None,
                 keep_logits: bool = False, fail_fast: bool = True, context: int = 0,
                 on_finish: Callable[[Job, str], None] | None = None):
        """drafter: proposes tokens to verify (``engine.drafters``; None: plain steps). keep_logits:
        keep each job's last token's logits (a fetch in the steps where jobs end). fail_fast: a
        failed step raises (the command line); otherwise its jobs get an error and the rest go on
        (the server). context: new requests first hold that many drawn tokens (greedy only).
        on_finish(job, reason): a job ended (its finish reason, or "error")."""
        self.engine, self.drafter = engine, drafter
        self.max_batch = max_batch or engine.max_batch
        self.prefill_rows = prefill_rows or engine.cfg.prefill_max_tokens
        self.keep_logits, self.fail_fast, self.context = keep_logits, fail_fast, context
        self.on_finish = on_finish
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}            # engine request id -> job, in admission order
        self.spec = SpecStats()
        self.last_out = None                         # the latest step's StepOutput

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, job: Job):
        self.waiting.append(job)

    def run(self, jobs: list[Job]) -> list[Turn]:
        """Every job to its end; the engine holds none of them afterwards, also when a step fails."""
        for job in jobs:
            self.add(job)
        turns = []
        try:
            while self.busy:
                turns.append(self.step())
        finally:
            self.release_all()
        return turns

    def release_all(self):
        for job in list(self.running.values()):
            self._leave(job)
        self.waiting.clear()

    # ---- one turn ---------------------------------------------------------------------------------
    def step(self) -> Turn | None:
        """Run one engine step (None: nothing could run)."""
        self._drop_cancelled()
        if self.waiting and len(self.running) < self.max_batch:
            turn = self._admit()
            if turn is not None:
                return turn
        ready = [j for j in self.running.values() if j.last is not None]
        if ready:
            return self._decode(ready)
        if self.waiting and not self.running:      # nothing runs, and the first waiting job does not fit
            job = self.waiting.popleft()
            self._fail(job, "the cache pools cannot hold this request", PoolExhausted)
        return None

    def _admit(self) -> Turn | None:
        head = self.waiting[0]
        if head.saved is not None:                # a preempted job: recompute its caches first
            t0 = time.perf_counter()
            try:
                seen = None if self.drafter is None else lambda out: self.drafter.observe("prefill", [head], out)
                rid = self.engine.restart(head.history[:-1], head.saved, seen)
            except PoolExhausted:
                return None
            self.waiting.popleft()
            head.rid, head.saved = rid, None
            self.running[rid] = head
            return Turn("restart", (time.perf_counter() - t0) * 1e3, [head], dict(self.engine.last_stats))
        admit, rows = [], 0
        for job in self.waiting:
            if job.saved is not None or len(self.running) + len(admit) >= self.max_batch:
                break
            if admit and rows + len(job.prompt) > self.prefill_rows:
                break
            admit.append(job)
            rows += len(job.prompt)
        while admit:
            t0 = time.perf_counter()
            try:
                out = self.engine.prefill([j.prompt for j in admit], [j.params for j in admit], self.context)
            except PoolExhausted:
                admit.pop()                        # fewer at once; the rest wait for blocks
                continue
            except Exception as e:
                for job in admit:
                    self.waiting.remove(job)
                self._step_failed(admit, e)
                return Turn("prefill", (time.perf_counter() - t0) * 1e3, admit)
            ms = (time.perf_counter() - t0) * 1e3
            for job, rid in zip(admit, out.request_ids):
                self.waiting.remove(job)
                job.rid = rid
                self.running[rid] = job
            if self.drafter is not None:
                self.drafter.observe("prefill", admit, out)
            self._deliver(admit, out)
            return Turn("prefill", ms, admit, dict(self.engine.last_stats), out)
        return None

    def _drafts(self, jobs: list[Job]) -> tuple[list[list[int]] | None, list | None]:
        """Each job's drafts (capped by its token limit, the context and the step's rows) and,
        from a drafter that gives them, their distributions."""
        if self.drafter is None:
            return None, None
        cfg, cap = self.engine.cfg, self.engine.max_context
        rooms = [max(0, min(job.stops.limit - len(job.stops.tokens) - 1,      # past the limit: wasted rows
                            cap - self.engine.sequence(job.rid).kv_len - 1,
                            cfg.decode_rows_per_request - 1)) for job in jobs]
        return self.drafter.propose_batch(jobs, rooms)

    def _decode(self, jobs: list[Job]) -> Turn:
        while True:
            drafts, probs = self._drafts(jobs)
            t0 = time.perf_counter()
            try:
                out = self.engine.decode([j.last for j in jobs], [j.rid for j in jobs], drafts, probs)
            except PoolExhausted:
                if len(jobs) == 1 or self.context:     # a drawn history cannot be recomputed from tokens
                    self._fail(jobs.pop(), "the cache pools cannot hold this request" +
                               (" (started at a drawn context: not recomputable)" if self.context else ""),
                               PoolExhausted)
                    if not jobs:
                        return Turn("decode", (time.perf_counter() - t0) * 1e3, [])
                    continue
                self._preempt(jobs.pop())
                continue
            except Exception as e:
                self._step_failed(jobs, e)
                return Turn("decode", (time.perf_counter() - t0) * 1e3, jobs)
            ms = (time.perf_counter() - t0) * 1e3
            if drafts is not None:
                self.spec.add([len(d) for d in drafts], out.tokens)
                self.drafter.observe("decode", jobs, out)
            self._deliver(jobs, out)
            return Turn("decode", ms, jobs, dict(self.engine.last_stats), out)

    def _preempt(self, job: Job):
        if self.drafter is not None:
            self.drafter.forget(job)
        seq = self.engine.sequence(job.rid)
        job.saved = Sequence(-1, [], sampling=seq.sampling, seed=seq.seed, drawn=seq.drawn,
                             prompt_len=seq.prompt_len)
        del self.running[job.rid]
        self.engine.release(job.rid)
        job.rid = None
        job.preemptions += 1
        self.waiting.appendleft(job)

    def _deliver(self, jobs: list[Job], out):
        self.last_out = out
        for i, job in enumerate(jobs):
            lps = out.logprobs[i] if out.logprobs is not None else None
            for j, token in enumerate(out.tokens[i]):
                job.made.append(token)
                if job.cancelled:
                    break
                before = len(job.stops.tokens)
                text = job.stops.push(token)
                job.emit("token", token=token, text=text, logprob=lps[j] if lps else None,
                         kept=len(job.stops.tokens) > before)
                if job.stops.finish is not None:
                    if self.keep_logits:
                        job.final_logits = out.token_logits(i, j)
                    self._finish(job, job.stops.finish)
                    break
            else:
                job.last = job.made[-1]

    # ---- leaving ----------------------------------------------------------------------------------
    def _leave(self, job: Job):
        if self.drafter is not None:
            self.drafter.forget(job)
        if job.rid is not None and job.rid in self.running:
            del self.running[job.rid]
            self.engine.release(job.rid)
        job.rid, job.finished, job.last = None, True, None

    def _finish(self, job: Job, reason: str):
        self._leave(job)
        job.emit("done", finish=reason)
        if self.on_finish is not None:
            self.on_finish(job, reason)

    def _drop_cancelled(self):
        for job in [j for j in self.running.values() if j.cancelled]:
            self._leave(job)
        for job in [j for j in self.waiting if j.cancelled]:
            self.waiting.remove(job)
            job.finished = True

    def _fail(self, job: Job, message: str, kind=RuntimeError):
        if self.fail_fast:
            self.release_all()
            raise kind(message)
        self._leave(job)
        job.emit("error", error=message)
        if self.on_finish is not None:
            self.on_finish(job, "error")

    def _step_failed(self, jobs: list[Job], e: Exception):
        """A failed step changed nothing in the engine: its jobs end with the error."""
        if self.fail_fast:
            raise e
        for job in jobs:
            self._fail(job, f"{type(e).__name__}: {e}")
