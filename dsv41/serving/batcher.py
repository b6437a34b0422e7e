"""Continuous batching for the server: one thread owns the engine and runs the scheduling loop
(``engine.scheduler``, the same loop as the command line's); requests join and leave between steps.

Handlers submit jobs from the event loop; the engine thread moves them into the scheduler, which
admits them (one prefill step), decodes (with a drafter: verify steps, several tokens a step),
preempts the newest request when the cache pools run out, and ends requests through their
``Stops``. Jobs past the batch's free slots wait in a bounded queue; a full queue refuses at once
(the server answers 429). A failed step changes nothing in the engine (steps are atomic): its jobs
get the error and leave, the others carry on.

The n samples of one request are n jobs queued together; with prefix caching they share one prefill
as any requests sharing a prompt do: the scheduler admits the first, defers the others until its
prompt's spans are cached, and each then feeds only the rows the cache cannot cut (at least the
last, whose logits draw its first token). With prefix caching off each has its own prefill.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from dsv41.engine.request import Request
from dsv41.engine.scheduler import Scheduler

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
    choice: int = 0               # which of the request's n samples (the job's ``choice``)


@dataclass(eq=False)
class Job(Request):
    """A request's generation, its events sent to the queue its handler reads (on the server's
    event loop)."""
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    metrics: object = None        # the server's Metrics (set at submit): hears each token and the end
    accepted: float = field(default_factory=time.monotonic)     # the latency metrics' times
    admitted_at: float | None = None   # its prefill step began
    first_token_at: float | None = None
    last_token_at: float | None = None
    ended_at: float | None = None
    ended: bool = False           # its end (done or error) was sent: nothing follows it
    _emitting: threading.Lock = field(default_factory=threading.Lock, repr=False)
    choice: int = 0               # its index among the request's samples (n > 1 share one events queue)
    samples: int = 1              # the request's n

    @property
    def generated(self) -> int:
        """Tokens the engine made for it (a stop token included)."""
        return len(self.made)

    def emit(self, kind: str, **fields):
        """Send an event to the handler. Both threads send (the engine's tokens and ends, the event
        loop's abort when a drain runs out): one end per job, and nothing after it, so each end is
        counted once; once the event loop is closed no one reads, and the event is dropped."""
        with self._emitting:
            if self.ended:
                return
            self.ended = kind != "token"
            if self.metrics is not None and kind == "token":
                self.metrics.on_token(self, time.monotonic())
            elif self.metrics is not None and kind == "done":
                self.metrics.on_finish(self, fields["finish"], time.monotonic())
            if not self.loop.is_closed():
                try:
                    self.loop.call_soon_threadsafe(self.events.put_nowait, Event(kind, choice=self.choice, **fields))
                except RuntimeError:      # closed between the look and the call
                    pass


class Batcher:
    def __init__(self, engine, metrics, max_batch: int, max_queue: int, budget: int | None = None, drafter=None):
        """budget: the rows one step feeds per DP group (None: the engine's prefill capacity; a longer
        prompt is fed in chunks); drafter: speculative steps."""
        self.engine, self.metrics = engine, metrics
        self.prefix_caching = engine.prefix_caching
        self.max_batch, self.max_queue = max_batch, max_queue
        self.scheduler = Scheduler(engine, drafter, max_batch, budget, fail_fast=False,
                                   on_finish=self._finished)
        self.incoming: list[Job] = []                 # submitted, not yet seen by the engine thread
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="dsv41-engine-loop", daemon=True)
        self._update_gauges()

    @property
    def running(self) -> dict:
        return self.scheduler.running

    @property
    def waiting(self) -> list:
        return list(self.scheduler.waiting) + self.incoming

    def _queued(self) -> int:
        return len(self.scheduler.waiting) + len(self.incoming)

    def start(self):
        self.thread.start()

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()

    def submit(self, job: Job):
        with self.cond:
            waiting = self._queued()
            free = max(0, self.max_batch - len(self.scheduler.running))     # slots the next turn fills
            if waiting >= self.max_queue + free:
                raise QueueFull(f"{len(self.scheduler.running)} requests running and {waiting} waiting "
                                f"(the queue holds {self.max_queue}); retry later")
            job.metrics = self.metrics
            self.incoming.append(job)
            self.metrics.queue_depth.set(waiting + 1)
            self.cond.notify()

    def cancel(self, job: Job):
        """The client went away: its slot and blocks are freed before the next step, and it ends
        as vLLM counts it, with finish reason "abort"."""
        with self.cond:
            if job.finished or job.cancelled:
                return
            job.cancelled = True
            self.metrics.cancelled.inc()
            self.cond.notify()
        job.emit("done", finish="abort")

    def abort(self, job: Job):
        """End a job now, from the event loop (a stopping server's drain ran out): its handler gets
        the end at once, with finish reason "abort", even while the engine is inside a step; the
        engine frees its slot and blocks before its next step."""
        with self.cond:
            if not job.finished and not job.cancelled:
                job.cancelled = True
                self.cond.notify()
        job.emit("done", finish="abort")

    # ---- the engine thread ------------------------------------------------------------------------
    def _loop(self):
        sched = self.scheduler
        while True:
            with self.cond:
                while not self.stopping and not self.incoming and not sched.busy:
                    self.cond.wait()
                if self.stopping:
                    break
                for job in self.incoming:
                    sched.add(job)
                self.incoming = []
            before = {job: job.preemptions for job in (*sched.running.values(), *sched.waiting)}
            try:
                turn = sched.step()
            except Exception:            # the loop itself must not die: every job it holds gets the error
                log.exception("scheduler turn failed")
                for job in list(sched.running.values()) + list(sched.waiting):
                    job.emit("error", error="the engine loop failed")
                sched.release_all()
                turn = None
            if turn is not None:
                self._count(turn)
            # preempted in this turn (a step either admits or decodes: no job both joins and is preempted)
            self.metrics.preemptions.inc(sum(job.preemptions - n for job, n in before.items()))
            self._update_gauges()
        for job in list(sched.running.values()) + list(sched.waiting) + self.incoming:
            if not job.ended:                 # not already ended by the drain (finish reason "abort")
                job.emit("error", error="the server is shutting down")
                self.metrics.errors.labels("engine").inc()
        sched.release_all()

    def _count(self, turn):
        m = self.metrics
        m.step_seconds.labels(turn.phase).observe(turn.ms / 1e3)
        if turn.out is None:
            return
        fresh = [j for j in turn.started if not j.preemptions]     # a recompute was admitted before
        m.recomputed.inc(sum(len(j.prompt) + len(j.made) for j in turn.started if j.preemptions))
        prompt = sum(len(j.prompt) for j in fresh)
        if fresh:
            started = time.monotonic() - turn.ms / 1e3
            for job in fresh:
                m.on_admit(job, started)
                if self.prefix_caching:
                    m.on_prefix(len(job.prompt), job.cached)
        m.on_step(prompt, sum(j.cached for j in fresh), sum(map(len, turn.out.tokens)), turn.out.proposed,
                  turn.out.accepted)

    def _finished(self, job: Job, reason: str):
        if reason == "error":
            self.metrics.errors.labels("engine").inc()

    def _update_gauges(self):
        self.metrics.cache(*self.engine.blocks_in_use())
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.queue_depth.set(self._queued())
