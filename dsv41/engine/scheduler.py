"""The one scheduling loop: ``Engine.generate``, the command line and the server all run it.

Requests wait in arrival order and run while the engine holds them. A request's prompt is fed in
chunks of at most the step's token budget per DP group (``max_num_batched_tokens``); the last
chunk's logits give its first token, and the chunks before it draw nothing (the request's sampling
state is set back after each, ``HostState.settle``), so a chunked prompt makes the tokens of one long
prefill step. Each turn runs one engine step: with ``interleave`` (the default, as vLLM v1 does) a
step that feeds prompt chunks first gives every decoding request its one row, and the chunks of
ingesting and newly admitted requests fill the rest of each group's budget; a turn with no prompt
to feed decodes every running request with the drafter's proposals to verify after it.

Admission walks the waiting requests in arrival order (preempted ones first) and asks the requests'
host state (the engine's ``host``, ``HostState.needs``/``fits``: the block managers), per DP group,
whether the step fits before it runs; the scheduler reads sequences, places and releases requests
there too, and the engine only runs the steps. The first request that does not fit stops it, so no
later arrival overtakes a request that waits for room. A new request starts after the longest prefix
its DP group has cached (``prefix_cache.py``; which group: below).

A shared prompt prefix is computed once, also by requests that arrive together (the n samples of
one request, a system prompt sent by many). A request's spans are cached as each chunk of it
commits, so a waiting request whose first uncached span is one that a request of the same DP group
(admitted in this step, or still ingesting) is about to compute is *deferred*: skipped in this
step, keeping its place in the queue. The requests behind it are admitted as usual (one that shares
nothing is not delayed by it); once the span is cached the deferred request is admitted in its
place, ahead of later arrivals, after the longer cached prefix. It waits only while others ingest
the spans it would start after (one behind it in its group sharing them is deferred as well), and
ingesting chunks take a step's room before admissions, so the wait ends when that ingest does.

The DP groups cache apart, so a new request is placed by its prefix (cache-aware placement,
``HostState.place``/``Router.choose``): in the group where the prompt tokens it would start after
(cached there, or spans a request of that group is computing) are the most, unless that group is
full or more than ``max(1, max_batch // 4)`` requests ahead of the least loaded group; then, and on
a tie or with nothing shared, the least loaded group, as before. There it is deferred as above; if
the group has no rows or blocks left for it in this step it starts in the least loaded group instead,
computing its prefix there. The group chosen here travels with the step (``Part.group``), so the
engine plans the request where it was admitted.

When a group's running requests cannot decode in its pools, the newest request of that group is
preempted: its blocks are freed and it waits at the front of the queue, to be fed again from its
token history (its recompute is chunked as a prompt is) with the sampling state it had, so its
tokens are those of a run that never preempted it. A request ends through its ``Stops``; the tokens
a step made past that are dropped.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from dsv41.engine.blocks import PoolExhausted
from dsv41.engine.layout import Part
from dsv41.engine.request import Request
from dsv41.engine.sequence import Sequence
from dsv41.ops.sampling import SamplingParams


@dataclass
class Turn:
    """One engine step the loop ran: prefill (prompt chunks, and decode rows beside them), restart
    (only preempted requests recomputed, and decode rows) or decode; its wall time, the engine's
    stats, its output and the requests it started."""
    phase: str
    ms: float
    requests: list[Request]
    stats: dict = field(default_factory=dict)
    out: object = None
    started: list[Request] = field(default_factory=list)


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
                 on_finish: Callable[[Request, str], None] | None = None, interleave: bool = True):
        """drafter: proposes tokens to verify (``engine.drafters``; None: plain steps). budget: the
        rows a step feeds per DP group (``--max-num-batched-tokens``; default and at most the
        engine's prefill capacity). keep_logits: keep each request's last token's logits (a fetch in
        the steps where requests end). fail_fast: a failed step raises (the command line); otherwise
        its requests get an error and the rest go on (the server). context: new requests first hold
        that many drawn tokens (greedy only). on_finish(req, reason): a request ended (its finish
        reason, or "error"). interleave: steps that feed prompt chunks also decode the running
        requests (False: prompts first, decoding waits until no prompt is left to feed)."""
        self.engine, self.drafter = engine, drafter
        self.host = engine.host                      # the requests' host state: what fits, where, their sequences
        self.max_batch = max_batch or self.host.max_batch
        capacity = engine.capacity.prefill_max_tokens
        if budget is not None and not 1 <= budget <= capacity:
            raise ValueError(f"max_num_batched_tokens: must be in [1, {capacity}] rows per DP group, got {budget}")
        self.budget = budget or capacity
        # rows fed after a cached prefix: the last prompt row makes the first token; DSpark's window
        # is rebuilt from the last ``window`` rows (prefix_cache.py)
        self.min_feed = engine.cfg.sliding_window if getattr(drafter, "reads_states", False) else 1
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens looked up / found cached, first admissions
        # ingesting request id -> (tokens it is fed in all, the spans past its cut: Hit.ahead)
        self.publishing: dict[int, tuple[int, list[tuple[int, bytes]]]] = {}
        self.keep_logits, self.fail_fast, self.context = keep_logits, fail_fast, context
        self.on_finish, self.interleave = on_finish, interleave
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}            # request id -> request, in admission order
        self.spec = SpecStats()
        self.last_out = None                         # the latest step's StepOutput
        self.victims: list[tuple[Request, int]] = []     # (request, DP group) of every preemption, oldest first

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request):
        self.waiting.append(req)

    def run(self, requests: list[Request]) -> list[Turn]:
        """Every request to its end; the engine holds none of them afterwards, also when a step fails."""
        for req in requests:
            self.add(req)
        turns = []
        try:
            while self.busy:
                turns.append(self.step())
        finally:
            self.release_all()
        return turns

    def release_all(self):
        for req in list(self.running.values()):
            self._leave(req)
        self.waiting.clear()

    # ---- one turn ---------------------------------------------------------------------------------
    def step(self) -> Turn | None:
        """Run one engine step (None: nothing could run)."""
        self._drop_cancelled()
        for req in [j for j in self.waiting if len(j.history) > self.host.max_context]:
            self.waiting.remove(req)
            self._fail(req, f"prompt: {len(req.prompt)} tokens exceed the context limit "
                            f"{self.host.max_context}", ValueError)
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
        if self.waiting and not self.running:      # nothing runs, and the first waiting request does not fit
            self._fail(self.waiting.popleft(), "the cache pools cannot hold this request", PoolExhausted)
        return None

    def _group(self, req: Request) -> int:
        return self.host.group_of(req.id)

    def _schedule_chunks(self, decoding: list[Request], ingesting: list[Request]):
        """(items, drafts, probs, placed) of a step that feeds prompt chunks: (req, tokens) per request,
        decode rows first (with their drafts), then the chunks of ingesting requests, then admissions
        in arrival order, each in the DP group ``HostState.place`` picks (placed: request id -> group)
        as far as that group's budget and free blocks take it, a request waiting for a span another
        computes skipped; None when no chunk fits."""
        budget, host = self.budget, self.host
        rows: dict[int, int] = collections.defaultdict(int)
        needs: dict[int, list[dict]] = collections.defaultdict(list)
        items: list[tuple[Request, list[int]]] = []

        def take(req: Request, group: int, tokens: list[int], drawn: int = 0, hit=None) -> bool:
            need = host.needs(req.id if req.id in self.running else None, len(tokens), drawn, hit, group)
            if not host.fits(group, needs[group] + [need]):
                return False
            needs[group].append(need)
            rows[group] += len(tokens)
            items.append((req, tokens))
            return True

        drafts, probs = self._drafts(decoding) if decoding else (None, None)
        for i, req in enumerate(decoding):         # decode rows first; a group short of blocks decodes alone
            if not take(req, self._group(req), [req.last] + (drafts[i] if drafts else [])):
                return None
        for item in items:                         # the draft rows are fed with the row, as a decode step's
            del item[1][1:]
        chunked = False
        for req in ingesting:
            g = self._group(req)
            room = budget - rows[g]
            if room > 0 and take(req, g, req.feed[:room]):
                chunked = True
        placed: dict[int, int] = {}              # admitted request id -> its DP group
        per_group = [0] * host.dp
        computing = self._computing(ingesting)
        for req in self.waiting:
            if len(self.running) + len(placed) >= self.max_batch:
                break
            feed = req.history[:-1] if req.made else req.prompt
            hits = [None] * host.dp if self.context else host.cached_prefixes(feed, len(req.prompt), self.min_feed,
                                                                               req.cache_root)
            reach = [0 if h is None else self._reach(h, len(feed), computing[g]) for g, h in enumerate(hits)]
            best, least = host.place(reach, per_group)
            outcome = None
            for g in dict.fromkeys([best, least]):     # the preferred group; short of room, the least loaded
                hit = hits[g]
                if hit is not None and reach[g] > hit.length:
                    outcome = "wait"               # for the spans a request of group g computes past its cut
                    break
                skip = hit.length if hit is not None else 0
                room = budget - rows[g]
                if room > 0 and take(req, g, feed[skip:skip + room], self.context, hit):
                    outcome = "start"
                    break
            if outcome is None:
                break                              # first come, first served: the rest wait behind it
            if outcome == "wait":
                continue
            req.feed, req.prefix = list(feed[skip:]), list(feed[:skip])
            if hit is not None:
                self.publishing[req.id] = (len(feed), hit.ahead)
                computing[g].update(h for _, h in hit.ahead)
            placed[req.id] = g
            per_group[g] += 1
            chunked = True
        if not chunked:
            return None
        rest = len(items) - len(decoding)
        if drafts is not None:
            drafts = drafts + [[]] * rest
            probs = None if probs is None else probs + [None] * rest
        return items, drafts, probs, placed

    def _computing(self, ingesting: list[Request]) -> dict[int, set[bytes]]:
        """Per DP group, the hashes of the spans its ingesting requests will register (their rows
        have not reached the span's end yet); forgets the requests no longer ingesting."""
        self.publishing = {r.id: self.publishing[r.id] for r in ingesting if r.id in self.publishing}
        out: dict[int, set[bytes]] = collections.defaultdict(set)
        for req in ingesting:
            total, ahead = self.publishing.get(req.id, (0, []))
            fed = total - len(req.feed)
            out[self._group(req)].update(h for end, h in ahead if end > fed)
        return out

    def _reach(self, hit, n: int, computing: set[bytes]) -> int:
        """The prompt tokens a new request of n tokens to feed would start after in a DP group: the
        group's cached prefix, and past it the spans the group's requests are computing (each one it
        could start after: the cut leaves min_feed rows). Past the cached prefix: the request waits."""
        end = hit.length
        for stop, h in hit.ahead:
            if stop > n - self.min_feed or h not in computing:
                break
            end = stop
        return end

    def _feed(self, items: list[tuple[Request, list[int]]], drafts, probs, placed: dict[int, int]) -> Turn:
        """One step of prompt chunks (and decode rows): new requests start in the DP groups placed
        (request id -> group, ``_schedule_chunks``), the chunks before a
        request's last draw nothing, its last one makes its first token (a recomputed request's
        newest token is known already: that one is dropped)."""
        new = [req for req, _ in items if req.id not in self.running]
        fed = [bool(req.feed) for req, _ in items]          # a prompt chunk, not a decode row
        phase = "prefill" if any(not r.made for (r, _), f in zip(items, fed) if f) else "restart"
        t0 = time.perf_counter()
        drawn = []
        try:
            if self.context and new:
                drawn = self.engine.start_at_context([r.id for r in new], self.context, placed)
            parts = []
            for i, (req, tokens) in enumerate(items):
                start = req in new and not self.context
                parts.append(Part(req.id, tokens, drafts[i] if drafts else [], probs[i] if probs else None,
                                  self._params(req) if start else None, start,
                                  req.prefix if start and req.prefix else None, placed[req.id] if start else None,
                                  len(req.prompt) if start else None, req.cache_root))
            out = self.engine.run(parts, "prefill")
        except Exception as e:
            for rid in drawn:
                self.host.release(rid)
            for req in new:
                req.feed, req.prefix = [], []
                self.waiting.remove(req)
            requests = [r for r, _ in items]
            self._step_failed(requests, e)
            return Turn(phase, (time.perf_counter() - t0) * 1e3, requests)
        ms = (time.perf_counter() - t0) * 1e3
        for req in new:
            self.waiting.remove(req)
            self.running[req.id] = req
            req.running = True
            if not req.preemptions:                # a request's own prompt, not its recompute
                req.cached = len(req.prefix)
                self.prefix_queries += len(req.prompt)
                self.prefix_hits += req.cached
            req.prefix = []
        if self.drafter is not None:
            self.drafter.observe("prefill", [r if f else None for (r, _), f in zip(items, fed)], out)
            decoded = [r if not f else None for (r, _), f in zip(items, fed)]
            self.drafter.observe("decode", decoded, out)
            if drafts is not None:
                at = [i for i, f in enumerate(fed) if not f]
                self.spec.add([out.layout.proposed[i] for i in at], [out.tokens[i] for i in at])
        deliver = []
        for i, ((req, tokens), f) in enumerate(zip(items, fed)):
            if not f:                              # a decode row
                deliver.append((i, req))
                continue
            del req.feed[:len(tokens)]
            if req.feed or req.made:               # more to feed, or a recompute done: nothing drawn
                if req.saved is None:              # the state a prompt's later chunks hold: no draws yet
                    seq = self.host.sequence(req.id)
                    req.saved = Sequence(-1, [], sampling=seq.sampling, seed=seq.seed, prompt_len=len(req.prompt))
                self.host.settle(req.id, req.saved)
            else:
                deliver.append((i, req))
            if not req.feed:
                req.saved = None
        self._deliver(deliver, out)
        return Turn(phase, ms, [r for r, _ in items], dict(self.engine.last_stats), out, new)

    @staticmethod
    def _params(req: Request) -> SamplingParams:
        """A starting request's settings: a recompute (or a restarted prompt) keeps its seed."""
        if req.saved is None or req.saved.sampling.greedy:
            return req.params
        return replace(req.saved.sampling, seed=req.saved.seed)

    def _drafts(self, requests: list[Request]) -> tuple[list[list[int]] | None, list | None]:
        """Each request's drafts (capped by its token limit, the context and the step's rows) and,
        from a drafter that gives them, their distributions."""
        if self.drafter is None:
            return None, None
        cap = self.host.max_context
        rooms = [max(0, min(req.stops.limit - len(req.stops.tokens) - 1,      # past the limit: wasted rows
                            cap - self.host.sequence(req.id).kv_len - 1,
                            self.engine.capacity.max_drafts)) for req in requests]
        return self.drafter.propose_batch(requests, rooms)

    def _short_group(self, requests: list[Request], drafts) -> int | None:
        """The first DP group whose free blocks cannot hold its requests' decode rows (None: all fit)."""
        needs: dict[int, list[dict]] = collections.defaultdict(list)
        for i, req in enumerate(requests):
            rows = 1 + (len(drafts[i]) if drafts is not None else 0)
            needs[self._group(req)].append(self.host.needs(req.id, rows))
        return next((g for g, n in sorted(needs.items()) if not self.host.fits(g, n)), None)

    def _decode(self, requests: list[Request]) -> Turn:
        while True:
            drafts, probs = self._drafts(requests)
            short = self._short_group(requests, drafts)
            if short is not None:
                victim = self._make_room(requests[-1], short)
                if victim in requests:
                    requests.remove(victim)
                if not requests:
                    return Turn("decode", 0.0, [])
                continue
            t0 = time.perf_counter()
            try:
                out = self.engine.run([Part(r.id, [r.last], drafts[i] if drafts else [], probs[i] if probs else None)
                                       for i, r in enumerate(requests)], "decode")
            except Exception as e:
                self._step_failed(requests, e)
                return Turn("decode", (time.perf_counter() - t0) * 1e3, requests)
            ms = (time.perf_counter() - t0) * 1e3
            if drafts is not None:
                self.spec.add(out.layout.proposed, out.tokens)
                self.drafter.observe("decode", requests, out)
            self._deliver(list(enumerate(requests)), out)
            return Turn("decode", ms, requests, dict(self.engine.last_stats), out)

    def _make_room(self, fallback: Request, group: int) -> Request | None:
        """Preempt the newest running request of a DP group short of blocks; alone there (or started at
        a drawn context, which has no tokens to recompute from), it fails instead. Returns the request
        that left."""
        in_group = [j for j in self.running.values() if self._group(j) == group]
        victim = in_group[-1] if in_group else fallback
        if len(in_group) == 1 or self.context:
            self._fail(victim, "the cache pools cannot hold this request" +
                       (" (started at a drawn context: not recomputable)" if self.context else ""), PoolExhausted)
        else:
            self._preempt(victim, group)
        return victim

    def _preempt(self, req: Request, group: int):
        if self.drafter is not None:
            self.drafter.forget(req)
        seq = self.host.sequence(req.id)
        req.saved = Sequence(-1, [], sampling=seq.sampling, seed=seq.seed, drawn=seq.drawn,
                             prompt_len=seq.prompt_len)
        del self.running[req.id]
        self.host.release(req.id)
        req.feed, req.running = [], False
        req.preemptions += 1
        self.victims.append((req, group))
        self.waiting.appendleft(req)

    def _deliver(self, rows: list[tuple[int, Request]], out):
        """rows: (index of the request in the step's output, request)."""
        self.last_out = out
        for i, req in rows:
            lps = out.logprobs[i] if out.logprobs is not None else None
            for j, token in enumerate(out.tokens[i]):
                req.made.append(token)
                if req.cancelled:
                    break
                before = len(req.stops.tokens)
                text = req.stops.push(token)
                req.emit("token", token=token, text=text, logprob=lps[j] if lps else None,
                         kept=len(req.stops.tokens) > before)
                if req.stops.finish is not None:
                    if self.keep_logits:
                        req.final_logits = out.token_logits(i, j)
                    self._finish(req, req.stops.finish)
                    break
            else:
                req.last = req.made[-1]

    # ---- leaving ----------------------------------------------------------------------------------
    def _leave(self, req: Request):
        if self.drafter is not None:
            self.drafter.forget(req)
        if req.id in self.running:
            del self.running[req.id]
            self.host.release(req.id)
        req.finished, req.last, req.feed, req.running = True, None, [], False

    def _finish(self, req: Request, reason: str):
        self._leave(req)
        req.emit("done", finish=reason)
        if self.on_finish is not None:
            self.on_finish(req, reason)

    def _drop_cancelled(self):
        for req in [j for j in self.running.values() if j.cancelled]:
            self._leave(req)
        for req in [j for j in self.waiting if j.cancelled]:
            self.waiting.remove(req)
            req.finished = True

    def _fail(self, req: Request, message: str, kind=RuntimeError):
        if self.fail_fast:
            self.release_all()
            raise kind(message)
        self._leave(req)
        req.emit("error", error=message)
        if self.on_finish is not None:
            self.on_finish(req, "error")

    def _step_failed(self, requests: list[Request], e: Exception):
        """A failed step changed nothing in the engine: its requests end with the error."""
        if self.fail_fast:
            raise e
        for req in requests:
            self._fail(req, f"{type(e).__name__}: {e}")
