"""Continuous batching: one thread owns the engine and runs its steps; requests join and leave
between steps.

Each turn of the loop frees the requests whose client went away, admits waiting requests while
the batch has slots and the prefill step has rows (one prefill step for all of them), then runs
one decode step over every running request that has a token to feed. A request ends through its
``ops.stopping.Stops`` (stop ids, EOS, stop strings, its max tokens) and its blocks go back at
once. Requests past the batch's free slots wait in a bounded queue; a full queue refuses at once
(the server answers 429). A failed step changes nothing in the engine (steps are atomic): its requests get the
error and leave, the others carry on.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every batch slot is taken and the waiting queue is at its bound."""


@dataclass
class Event:
    """What the engine thread hands a request's handler: a token (with the text it lets through
    and, when asked, its logprob entry), the end (finish reason), or an error."""
    kind: str                     # "token" | "done" | "error"
    token: int | None = None
    text: str = ""
    logprob: tuple | None = None  # (logprob, [(id, logprob)] top)
    kept: bool = True             # the token is part of the output (a stop token is not)
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Job:
    """One request's generation: its prompt ids, settings and stops, and the queue its events go to
    (on the server's event loop)."""
    prompt: list[int]
    params: SamplingParams
    stops: Stops
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=itertools.count().__next__)
    rid: int | None = None        # the engine's request id while it holds a slot
    cancelled: bool = False
    finished: bool = False
    generated: int = 0            # tokens the engine made for it (a stop token included)
    last: int | None = None       # the token to feed at its next decode step

    def send(self, event: Event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Batcher:
    def __init__(self, engine, metrics, max_batch: int, max_queue: int, prefill_rows: int):
        """prefill_rows: the most prompt tokens one prefill step takes."""
        self.engine, self.metrics = engine, metrics
        self.max_batch, self.max_queue, self.prefill_rows = max_batch, max_queue, prefill_rows
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}            # engine request id -> job
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="dsv41-engine-loop", daemon=True)
        self._update_gauges()

    def start(self):
        self.thread.start()

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()

    def submit(self, job: Job):
        with self.cond:
            free = max(0, self.max_batch - len(self.running))     # slots the next turn fills
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull(f"{len(self.running)} requests running and {len(self.waiting)} waiting "
                                f"(the queue holds {self.max_queue}); retry later")
            self.waiting.append(job)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cond.notify()

    def cancel(self, job: Job):
        """The client went away: its slot and blocks are freed before the next step."""
        with self.cond:
            if not job.finished:
                job.cancelled = True
                self.cond.notify()

    # ---- the engine thread ------------------------------------------------------------------------
    def _loop(self):
        while True:
            with self.cond:
                while not self.stopping and not self.waiting and not self.running:
                    self.cond.wait()
                if self.stopping:
                    break
                admit = self._take()
            self._drop_cancelled()
            if admit:
                self._prefill(admit)
            ready = [j for j in self.running.values() if j.last is not None]
            if ready:
                self._decode(ready)
            self._update_gauges()
        for job in list(self.running.values()) + list(self.waiting):
            self._fail(job, "the server is shutting down")

    def _take(self) -> list[Job]:
        """Waiting requests that fit this turn's prefill step (under the lock)."""
        admit, rows = [], 0
        while self.waiting and len(self.running) + len(admit) < self.max_batch:
            job = self.waiting[0]
            if job.cancelled:
                self.waiting.popleft()
                self._finish(job, None)
                continue
            if admit and rows + len(job.prompt) > self.prefill_rows:
                break
            admit.append(self.waiting.popleft())
            rows += len(job.prompt)
        self.metrics.queue_depth.set(len(self.waiting))
        return admit

    def _drop_cancelled(self):
        for rid, job in list(self.running.items()):
            if job.cancelled:
                self.metrics.cancelled.inc()
                self._finish(job, None)

    def _prefill(self, jobs: list[Job]):
        t0 = time.perf_counter()
        try:
            out = self.engine.prefill([j.prompt for j in jobs], [j.params for j in jobs])
        except Exception as e:       # nothing was admitted: the step changed nothing
            log.exception("prefill step failed")
            for job in jobs:
                self._fail(job, f"{type(e).__name__}: {e}")
            return
        self.metrics.step_seconds.labels("prefill").observe(time.perf_counter() - t0)
        self.metrics.prompt_tokens.inc(sum(len(j.prompt) for j in jobs))
        for job, rid in zip(jobs, out.request_ids):
            job.rid = rid
            self.running[rid] = job
        self._deliver(jobs, out)

    def _decode(self, jobs: list[Job]):
        t0 = time.perf_counter()
        try:
            out = self.engine.decode([j.last for j in jobs], [j.rid for j in jobs])
        except Exception as e:       # the step changed nothing; its requests cannot go on
            log.exception("decode step failed")
            for job in jobs:
                self._fail(job, f"{type(e).__name__}: {e}")
            return
        self.metrics.step_seconds.labels("decode").observe(time.perf_counter() - t0)
        self._deliver(jobs, out)

    def _deliver(self, jobs: list[Job], out):
        self.metrics.generation_tokens.inc(len(jobs))
        for i, (job, token) in enumerate(zip(jobs, out.tokens)):
            job.generated += 1
            logprob = out.logprobs[i] if out.logprobs is not None else None
            if job.cancelled:
                continue             # freed at the next turn
            before = len(job.stops.tokens)
            text = job.stops.push(token)
            job.send(Event("token", token, text, logprob, kept=len(job.stops.tokens) > before))
            if job.stops.finish is not None:
                self._finish(job, job.stops.finish)
            else:
                job.last = token

    def _finish(self, job: Job, reason: str | None):
        if job.rid is not None and job.rid in self.running:
            del self.running[job.rid]
            self.engine.release(job.rid)
        job.finished, job.last = True, None
        if reason is not None:
            job.send(Event("done", finish=reason))

    def _fail(self, job: Job, message: str):
        self.metrics.errors.labels("engine").inc()
        if job.rid is not None and job.rid in self.running:    # a failed prefill made no request
            del self.running[job.rid]
            self.engine.release(job.rid)
        job.finished, job.last = True, None
        job.send(Event("error", error=message))

    def _update_gauges(self):
        used, total = self.engine.blocks_in_use()
        self.metrics.blocks_in_use.set(used)
        self.metrics.blocks_total.set(total)
        self.metrics.running.set(len(self.running))
        self.metrics.queue_depth.set(len(self.waiting))
