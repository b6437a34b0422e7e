"""The one scheduling loop: ``Engine.generate``, the command line and the server all run it.

Requests wait in arrival order and run while the engine holds them. A request's prompt is fed in
chunks of at most the step's token budget per DP group (``max_num_batched_tokens``); the last
chunk's logits give its first token, and the chunks before it draw nothing (the request's sampling
state is set back after each, ``Engine.settle``), so a chunked prompt makes the tokens of one long
prefill step. Each turn runs one engine step: with ``interleave`` (the default, as vLLM v1 does) a
step that feeds prompt chunks first gives every decoding request its one row, and the chunks of
ingesting and newly admitted requests fill the rest of each group's budget; a turn with no prompt
to feed decodes every running request with the drafter's proposals to verify after it.

Admission asks the engine's block manager, per DP group, whether the step fits before it runs
(``Engine.needs`` / ``Engine.fits``). When a group's running requests cannot decode in its pools,
the newest request of that group is preempted: its blocks are freed and it waits at the front of
the queue, to be fed again from its token history (its recompute is chunked as a prompt is) with
the sampling state it had, so its tokens are those of a run that never preempted it. A request
ends through its ``Stops``; the tokens a step made past that are dropped.
"""
from __future__ import annotations

import collections
import itertools
import time
from dataclasses import KW_ONLY, dataclass, field, replace
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
    feed: list[int] = field(default_factory=list)   # tokens still to feed before it decodes (prompt chunks)
    prefix: list[int] = field(default_factory=list)  # the cached prefix its first step reuses (prefix caching)
    cached: int = 0               # prompt tokens its first admission found cached (the answer's usage)
    saved: Sequence | None = None  # the sampling state it holds while preempted or fed in chunks
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
    """One engine step the loop ran: prefill (prompt chunks, and decode rows beside them), restart
    (only preempted requests recomputed, and decode rows) or decode; its wall time, the engine's
    stats, its output and the jobs it started."""
    phase: str
    ms: float
    jobs: list[Job]
    stats: dict = field(default_factory=dict)
    out: object = None
    started: list[Job] = field(default_factory=list)


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
    def __init__(self, engine, drafter=None, max_batch: int | None = None, budget: int | None = None,
                 keep_logits: bool = False, fail_fast: bool = True, context: int = 0,
                 on_finish: Callable[[Job, str], None] | None = None, interleave: bool = True):
        """drafter: proposes tokens to verify (``engine.drafters``; None: plain steps). budget: the
        rows a step feeds per DP group (``--max-num-batched-tokens``; default and at most the
        engine's prefill capacity). keep_logits: keep each job's last token's logits (a fetch in
        the steps where jobs end). fail_fast: a failed step raises (the command line); otherwise
        its jobs get an error and the rest go on (the server). context: new requests first hold
        that many drawn tokens (greedy only). on_finish(job, reason): a job ended (its finish
        reason, or "error"). interleave: steps that feed prompt chunks also decode the running
        requests (False: prompts first, decoding waits until no prompt is left to feed)."""
        self.engine, self.drafter = engine, drafter
        self.max_batch = max_batch or engine.max_batch
        capacity = engine.cfg.prefill_max_tokens
        if budget is not None and not 1 <= budget <= capacity:
            raise ValueError(f"max_num_batched_tokens: must be in [1, {capacity}] rows per DP group, got {budget}")
        self.budget = budget or capacity
        # rows fed after a cached prefix: the last prompt row makes the first token; DSpark's window
        # is rebuilt from the last ``window`` rows (prefix_cache.py)
        self.min_feed = engine.cfg.sliding_window if getattr(drafter, "reads_states", False) else 1
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens looked up / found cached, first admissions
        self.keep_logits, self.fail_fast, self.context = keep_logits, fail_fast, context
        self.on_finish, self.interleave = on_finish, interleave
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}            # engine request id -> job, in admission order
        self.spec = SpecStats()
        self.last_out = None                         # the latest step's StepOutput
        self.victims: list[tuple[Job, int]] = []     # (job, DP group) of every preemption, oldest first

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
        for job in [j for j in self.waiting if len(j.history) > self.engine.max_context]:
            self.waiting.remove(job)
            self._fail(job, f"prompt: {len(job.prompt)} tokens exceed the context limit "
                            f"{self.engine.max_context}", ValueError)
        decoding = [j for j in self.running.values() if not j.feed]
        ingesting = [j for j in self.running.values() if j.feed]
        if ingesting or (self.waiting and len(self.running) < self.max_batch):
            chunks = self._schedule_chunks(decoding if self.interleave else [], ingesting)
            if chunks is not None:
                return self._feed(*chunks)
        if decoding:
            return self._decode(decoding)
        if ingesting:                              # nothing decodes, and no chunk fits: make room
            self._make_room(ingesting[-1], self._group(ingesting[-1]))
            return None
        if self.waiting and not self.running:      # nothing runs, and the first waiting job does not fit
            self._fail(self.waiting.popleft(), "the cache pools cannot hold this request", PoolExhausted)
        return None

    def _group(self, job: Job) -> int:
        return self.engine.group_of(job.rid)

    def _schedule_chunks(self, decoding: list[Job], ingesting: list[Job]):
        """(items, drafts, probs) of a step that feeds prompt chunks: (job, tokens) per request, decode
        rows first (with their drafts), then the chunks of ingesting jobs, then admissions in arrival
        order, each as far as its group's budget and free blocks take it; None when no chunk fits."""
        budget, engine = self.budget, self.engine
        rows: dict[int, int] = collections.defaultdict(int)
        needs: dict[int, list[dict]] = collections.defaultdict(list)
        items: list[tuple[Job, list[int]]] = []

        def take(job: Job, group: int, tokens: list[int], drawn: int = 0, hit=None) -> bool:
            need = engine.needs(job.rid, len(tokens), drawn, hit, group)
            if not engine.fits(group, needs[group] + [need]):
                return False
            needs[group].append(need)
            rows[group] += len(tokens)
            items.append((job, tokens))
            return True

        drafts, probs = self._drafts(decoding) if decoding else (None, None)
        for i, job in enumerate(decoding):         # decode rows first; a group short of blocks decodes alone
            if not take(job, self._group(job), [job.last] + (drafts[i] if drafts else [])):
                return None
        for item in items:                         # the draft rows are fed with the row, as a decode step's
            del item[1][1:]
        chunked = False
        for job in ingesting:
            g = self._group(job)
            room = budget - rows[g]
            if room > 0 and take(job, g, job.feed[:room]):
                chunked = True
        admitted = 0
        for job in self.waiting:
            if len(self.running) + admitted >= self.max_batch:
                break
            g = engine.place(admitted + 1)[-1]
            room = budget - rows[g]
            feed = job.history[:-1] if job.made else job.prompt
            hit = None if self.context or room <= 0 else engine.cached_prefix(g, feed, self.min_feed)
            skip = hit.length if hit is not None else 0
            if room <= 0 or not take(job, g, feed[skip:skip + room], self.context, hit):
                break                              # first come, first served: the rest wait behind it
            job.feed, job.prefix = list(feed[skip:]), list(feed[:skip])
            admitted += 1
            chunked = True
        if not chunked:
            return None
        rest = len(items) - len(decoding)
        if drafts is not None:
            drafts = drafts + [[]] * rest
            probs = None if probs is None else probs + [None] * rest
        return items, drafts, probs

    def _feed(self, items: list[tuple[Job, list[int]]], drafts, probs) -> Turn:
        """One step of prompt chunks (and decode rows): new requests start, the chunks before a
        request's last draw nothing, its last one makes its first token (a recomputed request's
        newest token is known already: that one is dropped)."""
        new = [job for job, _ in items if job.rid is None]
        fed = [bool(job.feed) for job, _ in items]          # a prompt chunk, not a decode row
        phase = "prefill" if any(not j.made for (j, _), f in zip(items, fed) if f) else "restart"
        t0 = time.perf_counter()
        rids = []
        try:
            if self.context and new:
                rids = self.engine.start_at_context(len(new), self.context)
            ids = iter(rids)
            batch, sampling, cached = [], [], []
            for job, tokens in items:
                rid = next(ids) if job.rid is None and self.context else job.rid
                batch.append((rid, tokens))
                sampling.append(self._params(job) if rid is None else None)
                cached.append(job.prefix if rid is None and job.prefix else None)
            out = self.engine.step(batch, "prefill", sampling, drafts, probs,
                                   **({"cached": cached} if any(cached) else {}))
        except Exception as e:
            for rid in rids:
                self.engine.release(rid)
            for job in new:
                job.feed, job.prefix = [], []
                self.waiting.remove(job)
            jobs = [j for j, _ in items]
            self._step_failed(jobs, e)
            return Turn(phase, (time.perf_counter() - t0) * 1e3, jobs)
        ms = (time.perf_counter() - t0) * 1e3
        for job, rid in zip(new, [r for (j, _), r in zip(items, out.request_ids) if j in new]):
            self.waiting.remove(job)
            job.rid = rid
            self.running[rid] = job
            if not job.preemptions:                # a request's own prompt, not its recompute
                job.cached = len(job.prefix)
                self.prefix_queries += len(job.prompt)
                self.prefix_hits += job.cached
            job.prefix = []
        if self.drafter is not None:
            self.drafter.observe("prefill", [j if f else None for (j, _), f in zip(items, fed)], out)
            decoded = [j if not f else None for (j, _), f in zip(items, fed)]
            self.drafter.observe("decode", decoded, out)
            if drafts is not None:
                at = [i for i, f in enumerate(fed) if not f]
                self.spec.add([len(drafts[i]) for i in at], [out.tokens[i] for i in at])
        deliver = []
        for i, ((job, tokens), f) in enumerate(zip(items, fed)):
            if not f:                              # a decode row
                deliver.append((i, job))
                continue
            del job.feed[:len(tokens)]
            if job.feed or job.made:               # more to feed, or a recompute done: nothing drawn
                if job.saved is None:              # the state a prompt's later chunks hold: no draws yet
                    seq = self.engine.sequence(job.rid)
                    job.saved = Sequence(-1, [], sampling=seq.sampling, seed=seq.seed, prompt_len=len(job.prompt))
                self.engine.settle(job.rid, job.saved)
            else:
                deliver.append((i, job))
            if not job.feed:
                job.saved = None
        self._deliver(deliver, out)
        return Turn(phase, ms, [j for j, _ in items], dict(self.engine.last_stats), out, new)

    @staticmethod
    def _params(job: Job) -> SamplingParams:
        """A starting request's settings: a recompute (or a restarted prompt) keeps its seed."""
        if job.saved is None or job.saved.sampling.greedy:
            return job.params
        return replace(job.saved.sampling, seed=job.saved.seed)

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

    def _short_group(self, jobs: list[Job], drafts) -> int | None:
        """The first DP group whose free blocks cannot hold its jobs' decode rows (None: all fit)."""
        needs: dict[int, list[dict]] = collections.defaultdict(list)
        for i, job in enumerate(jobs):
            rows = 1 + (len(drafts[i]) if drafts is not None else 0)
            needs[self._group(job)].append(self.engine.needs(job.rid, rows))
        return next((g for g, n in sorted(needs.items()) if not self.engine.fits(g, n)), None)

    def _decode(self, jobs: list[Job]) -> Turn:
        while True:
            drafts, probs = self._drafts(jobs)
            short = self._short_group(jobs, drafts)
            if short is not None:
                victim = self._make_room(jobs[-1], short)
                if victim in jobs:
                    jobs.remove(victim)
                if not jobs:
                    return Turn("decode", 0.0, [])
                continue
            t0 = time.perf_counter()
            try:
                out = self.engine.decode([j.last for j in jobs], [j.rid for j in jobs], drafts, probs)
            except Exception as e:
                self._step_failed(jobs, e)
                return Turn("decode", (time.perf_counter() - t0) * 1e3, jobs)
            ms = (time.perf_counter() - t0) * 1e3
            if drafts is not None:
                self.spec.add([len(d) for d in drafts], out.tokens)
                self.drafter.observe("decode", jobs, out)
            self._deliver(list(enumerate(jobs)), out)
            return Turn("decode", ms, jobs, dict(self.engine.last_stats), out)

    def _make_room(self, fallback: Job, group: int) -> Job | None:
        """Preempt the newest running job of a DP group short of blocks; alone there (or started at
        a drawn context, which has no tokens to recompute from), it fails instead. Returns the job
        that left."""
        in_group = [j for j in self.running.values() if self._group(j) == group]
        victim = in_group[-1] if in_group else fallback
        if len(in_group) == 1 or self.context:
            self._fail(victim, "the cache pools cannot hold this request" +
                       (" (started at a drawn context: not recomputable)" if self.context else ""), PoolExhausted)
        else:
            self._preempt(victim, group)
        return victim

    def _preempt(self, job: Job, group: int):
        if self.drafter is not None:
            self.drafter.forget(job)
        seq = self.engine.sequence(job.rid)
        job.saved = Sequence(-1, [], sampling=seq.sampling, seed=seq.seed, drawn=seq.drawn,
                             prompt_len=seq.prompt_len)
        del self.running[job.rid]
        self.engine.release(job.rid)
        job.rid, job.feed = None, []
        job.preemptions += 1
        self.victims.append((job, group))
        self.waiting.appendleft(job)

    def _deliver(self, rows: list[tuple[int, Job]], out):
        """rows: (index of the job in the step's output, job)."""
        self.last_out = out
        for i, job in rows:
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
        job.rid, job.finished, job.last, job.feed = None, True, None, []

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
