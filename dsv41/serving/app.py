"""The HTTP endpoints (Starlette): ``/v1/completions`` and ``/v1/chat/completions`` (server-sent
events with ``"stream": true``), ``/v1/models`` (and one model's card), ``/health`` and ``/metrics``,
and vLLM's ``/tokenize``, ``/detokenize``, ``/version`` and ``/ping``.

A request is read (up to the body limit, within the read timeout), checked (``schema.generation``)
and only then queued for the engine loop (``batcher.Batcher``); its handler turns the loop's events
into the answer. A client that goes away mid-answer is cancelled: the loop frees its slot and
blocks before its next step. Parsing, tokenizing and rendering a chat run on a small pool of worker
threads, not on the event loop, so one large request does not stall the others (``/health``
included); a structured output's constraint compiles after those checks, on threads of its own
(``structured.Compiler``), so a request without one never waits behind a compile. The answer's
parsers (reasoning, tool calls) and a whole answer's body run on a pool of their own too, so one
long tool call does not stall the others either. Every answer that is not a success is
OpenAI's error object (unknown paths and methods too) and counted in the error metrics; a 500
only for the server's own fault. ``/health`` is 503 until a one-token probe through the engine
has passed, and while the engine's last step failed.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsv41.engine import prefix_cache
from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops
from dsv41.serving import schema, structured, tokens
from dsv41.serving.batcher import Batcher, Job, QueueFull
from dsv41.serving.chat_answer import ChatAnswer
from dsv41.serving.metrics import Metrics
from dsv41.serving.schema import ApiError, Limits

POLL_S = 0.25      # how often a non-streaming handler looks whether its client is still there
CHECK_WORKERS = 2  # threads that parse and tokenize request bodies (the GIL is let go while tokenizing)
CHECK_BACKLOG = 64  # bodies waiting for those threads; one more is answered 429 (each may hold a MiB)
ANSWER_WORKERS = 2  # threads that parse answers (reasoning, tool calls) and build whole answers' bodies
PROBE_TOKEN = 0    # the start-up probe's one-token prompt (every vocabulary has id 0)
try:
    VERSION = importlib.metadata.version("dsv41")
except importlib.metadata.PackageNotFoundError:    # run from a checkout that was never installed
    VERSION = "0+unknown"

log = logging.getLogger(__name__)


class Server:
    """What the endpoints share: the batcher (and through it the engine), the codec (None: token
    ids only), the served model's name, the limits, the metrics and how long a body may take to
    arrive; and whether the engine can serve (``fault``: why not; ``probed``: the start-up probe is
    done)."""

    def __init__(self, batcher: Batcher, codec, model: str, limits: Limits, metrics: Metrics,
                 read_timeout_s: float = 30.0, compile_budget_s: float = structured.COMPILE_BUDGET_S):
        self.batcher, self.codec, self.model, self.limits, self.metrics = batcher, codec, model, limits, metrics
        self.read_timeout_s = read_timeout_s
        self.checks = ThreadPoolExecutor(CHECK_WORKERS, thread_name_prefix="dsv41-check")
        self.checking = 0                 # bodies handed to those threads and not yet back
        self.answers = ThreadPoolExecutor(ANSWER_WORKERS, thread_name_prefix="dsv41-answer")
        self.fault: str | None = None
        self.probed = False
        self.live: set[Job] = set()       # jobs whose handler still waits for their end
        self.stopping = False             # the server drains: new requests are refused (503)
        self.drain_over = asyncio.Event()  # the drain ran out: bodies still arriving are refused too
        self.grammars = None if codec is None else structured.Compiler(codec, limits.vocab_size, compile_budget_s)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model_card, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/ping", self.ping, methods=["GET", "POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], exception_handlers={HTTPException: self.http_error, Exception: self.server_error},
            lifespan=self.lifespan)

    @asynccontextmanager
    async def lifespan(self, app):
        probe = asyncio.create_task(self.probe())
        try:
            yield
        finally:
            probe.cancel()
            self.checks.shutdown(wait=False, cancel_futures=True)
            self.answers.shutdown(wait=False, cancel_futures=True)
            if self.grammars is not None:
                self.grammars.close()

    async def probe(self):
        """One greedy token of a one-token prompt through the engine: until it passes, /health is
        not ready; when it fails (weights that overflow, logits all equal), /health says why."""
        job = Job([PROBE_TOKEN], SamplingParams(max_tokens=1), Stops(SamplingParams(max_tokens=1)),
                  asyncio.get_running_loop())
        try:
            self.batcher.submit(job)
        except QueueFull:                 # clients came first; their answers tell health instead
            self.probed = True
            return
        while True:
            event = await job.events.get()
            if event.kind != "token":
                self.fault = event.error if event.kind == "error" else None
                self.probed = True
                return

    def drain(self):
        """The server stops: what is in flight may finish; what comes after is refused."""
        self.stopping = True

    def abort_all(self) -> int:
        """The drain ran out: every request still held ends now (finish reason "abort"), so each
        client gets its final event and ``[DONE]``. How many there were."""
        self.drain_over.set()
        jobs = [j for j in self.live if not j.ended]
        for job in jobs:
            self.batcher.abort(job)
        return len(jobs)

    def outcome(self, event):
        """An engine event's word on health: an error makes the server unready, an answer ready."""
        if event.kind == "error":
            self.fault = event.error
        elif event.kind == "done":
            self.fault = None

    # ---- errors outside the generation endpoints ---------------------------------------------------------
    async def http_error(self, request: Request, exc: HTTPException):
        """Unknown path (404), wrong method (405): OpenAI's error object, not Starlette's plain text."""
        self.metrics.errors.labels("bad_request").inc()
        self.metrics.requests.labels("other", str(exc.status_code)).inc()
        what = {404: f"no such endpoint: {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(ApiError(exc.status_code, what, code=code).body(), status_code=exc.status_code,
                            headers=exc.headers)

    async def server_error(self, request: Request, exc: Exception):
        """The server's own fault: logged with its traceback here, one line to the client."""
        log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
        self.metrics.errors.labels("server").inc()
        self.metrics.requests.labels("other", "500").inc()
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").body(),
                            status_code=500)

    # ---- small endpoints ------------------------------------------------------------------------------
    async def health(self, request: Request):
        used, total = self.batcher.engine.blocks_in_use()
        status = "error" if self.fault is not None else "ok" if self.probed else "starting"
        body = {"status": status, "running": len(self.batcher.running), "waiting": len(self.batcher.waiting),
                "cache_blocks_in_use": used, "cache_blocks_total": total}
        if self.fault is not None:
            body["error"] = self.fault
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics_text(self, request: Request):
        return Response(self.metrics.text(), media_type=self.metrics.content_type)

    def _card(self) -> dict:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "dsv41",
                "max_model_len": self.limits.max_context}

    async def models(self, request: Request):
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request):
        """OpenAI's model retrieval: the served model's card, 404 for any other name."""
        name = request.path_params["model"]
        if name != self.model:
            return self._refusal("/v1/models/{model}", ApiError(
                404, f"model: {schema.shown(name)} is not served here; the model is {self.model!r}", "model",
                code="model_not_found"))
        self.metrics.requests.labels("/v1/models/{model}", "200").inc()
        return JSONResponse(self._card())

    async def version(self, request: Request):
        self.metrics.requests.labels("/version", "200").inc()
        return JSONResponse({"version": VERSION})

    async def ping(self, request: Request):
        """vLLM's (SageMaker's) liveness probe: /health's status, no body."""
        ok = self.fault is None and self.probed
        self.metrics.requests.labels("/ping", "200" if ok else "503").inc()
        return Response(status_code=200 if ok else 503)

    async def tokenize(self, request: Request):
        return await self._utility(request, "/tokenize", tokens.tokenize)

    async def detokenize(self, request: Request):
        return await self._utility(request, "/detokenize", tokens.detokenize)

    async def _utility(self, request: Request, endpoint: str, answer):
        """A body read and checked as the generation endpoints' are, answered by ``answer(body,
        codec, limits)`` on the check threads (a large chat tokenizes there, off the event loop)."""
        def work(raw: bytes) -> dict:
            body = schema.parse_body(raw, self.limits)
            schema.check_model(body, self.model)
            return answer(body, self.codec, self.limits)
        try:
            out = await self._on_check_threads(work, await self._read(request))
        except (ApiError, QueueFull) as e:
            return self._refusal(endpoint, e)
        except ClientDisconnect:
            return Response(status_code=499)
        self.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(out)

    def _refusal(self, endpoint: str, e: ApiError | QueueFull) -> JSONResponse:
        """A request refused (its error counted): a 4xx naming the field, 429 for a full queue, 503."""
        if isinstance(e, QueueFull):
            self.metrics.errors.labels("queue_full").inc()
            e = ApiError(429, str(e), kind="rate_limit_error", code="queue_full")
        else:
            self.metrics.errors.labels("bad_request" if e.status < 429 else "server").inc()
        self.metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    # ---- generation ------------------------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def chat(self, request: Request):
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool):
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            raw = await self._read(request)
            gen = await self._checked(raw, chat)
            if gen.constraint is not None:
                gen = await self._compiled(gen)
            if self.stopping:
                raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")
            jobs = self._submit(gen)
        except (ApiError, QueueFull) as e:
            return self._refusal(endpoint, e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:                 # the server's own fault; a client's body never lands here
            log.exception("%s: checking the request failed", endpoint)
            self.metrics.errors.labels("server").inc()
            self.metrics.requests.labels(endpoint, "500").inc()
            return JSONResponse(ApiError(500, "internal error while checking the request", kind="server_error").body(),
                                status_code=500)
        # vLLM's order: the X-Request-Id header, the body's request_id, else a random id
        answer = Answer(self, jobs, gen, chat, request.headers.get("x-request-id") or gen.request_id)
        self.live.update(jobs)
        if gen.stream:
            self.metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(answer.events(), media_type="text/event-stream")
        try:
            status, body = await answer.whole(request)
        finally:
            self.live.difference_update(jobs)
        self.metrics.requests.labels(endpoint, str(status)).inc()
        return JSONResponse(body, status_code=status)

    def _submit(self, gen: schema.Generation) -> list[Job]:
        """The request's n samples queued, each its own job, all reporting to one queue; none queued
        when one does not fit. With prefix caching they share one prefill of the prompt (the
        scheduler defers the later samples until the first's spans are cached); without, each has
        its own."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        cache_root = prefix_cache.root(gen.cache_salt)
        jobs = [Job(gen.prompt, p, Stops(p, decode_text=self._decoder(gen)), loop, events, choice=i,
                    cache_root=cache_root, samples=gen.n) for i, p in enumerate(gen.samples())]
        submitted = []
        try:
            for job in jobs:
                self.batcher.submit(job)
                submitted.append(job)
        except QueueFull:
            for job in submitted:
                self.batcher.cancel(job)
            raise
        return jobs

    def _decoder(self, gen: schema.Generation):
        """ids -> text: a parsed chat answer keeps the control tokens its parsers read; vLLM's
        skip_special_tokens false keeps every special token's text (spaced from its neighbours
        with spaces_between_special_tokens, as vLLM's detokenizer joins them)."""
        if self.codec is None:
            return None
        if not gen.skip_special_tokens:
            return lambda ids: self.codec.decode_special(ids, gen.spaces_between_special_tokens)
        return self.codec.decode_answer if gen.thinking or gen.tool_calls else self.codec.decode

    async def _checked(self, raw: bytes, chat: bool) -> schema.Generation:
        """The body parsed, checked and tokenized on the check threads."""
        return await self._on_check_threads(self._check, raw, chat)

    async def _on_check_threads(self, fn, *args):
        """fn(*args) on the check threads, at most CHECK_BACKLOG waiting at once."""
        if self.checking >= CHECK_BACKLOG:
            raise QueueFull(f"{self.checking} request bodies are waiting to be checked; retry later")
        self.checking += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.checks, fn, *args)
        finally:
            self.checking -= 1

    def _check(self, raw: bytes, chat: bool) -> schema.Generation:
        """Parse, check and tokenize (on a worker thread)."""
        body = schema.parse_body(raw, self.limits)
        schema.check_model(body, self.model)
        return schema.generation(body, chat, self.codec, self.limits)

    async def _compiled(self, gen: schema.Generation) -> schema.Generation:
        """A checked request's constraint compiled on the compile threads (at once when cached), so a
        request without one never waits behind a compile; 429 past their backlog."""
        if self.grammars.cached(*gen.constraint[1:]):
            return schema.constrained(gen, self.grammars)
        try:
            future = self.grammars.submit(schema.constrained, gen, self.grammars)
        except structured.Busy as e:
            raise QueueFull(str(e)) from None
        return await asyncio.wrap_future(future)

    async def _read(self, request: Request) -> bytes:
        """The body within the read timeout (408 for a client that stalls or sends half), or until
        a stopping server's drain runs out (503)."""
        body = asyncio.ensure_future(self._read_body(request))
        over = asyncio.ensure_future(self.drain_over.wait())
        try:
            done, _ = await asyncio.wait((body, over), timeout=self.read_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            over.cancel()
            if not body.done():
                body.cancel()
        if body in done:
            return body.result()
        if over in done:
            raise ApiError(503, "body: the server is shutting down", "body", kind="server_error",
                           code="shutting_down")
        raise ApiError(408, f"body: not received in full within {self.read_timeout_s:g} s", "body",
                       code="request_timeout")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused as soon as it passes the limit (a lying Content-Length too)."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"body: {declared} bytes is over the limit of {limit}", "body")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"body: over the limit of {limit} bytes", "body")
            chunks.append(chunk)
        return b"".join(chunks)


class Answer:
    """One request's answer built from the engine loop's events: whole, or as server-sent events;
    with n > 1 one choice per sample (``Event.choice``), streamed as their tokens come."""

    def __init__(self, server: Server, jobs: list[Job], gen: schema.Generation, chat: bool,
                 request_id: str | None = None):
        self.server, self.jobs, self.gen, self.chat = server, jobs, gen, chat
        self.events_in = jobs[0].events               # every sample's events
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex[:24])
        self.counted = [0] * len(jobs)                # per choice, tokens its events brought so far
        self.counted_out = [False] * len(jobs)        # per choice, whether a chunk of it went out
        self.logprobs: list[list] = [[] for _ in jobs]   # per choice, (token, (logprob, top)) per token
        self.parsed = [ChatAnswer(gen.thinking, gen.tool_calls) if chat else None for _ in jobs]
        self.finish: dict[int, str] = {}              # choice -> its finish reason, once done

    async def _off_loop(self, fn, *args):
        """fn(*args) on the answer threads: parsing or building an answer is linear in its text,
        which can be megabytes, and the event loop serves every other client meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.server.answers, fn, *args)

    def _take(self, event):
        self.counted[event.choice] += 1
        if self.gen.top_logprobs is not None and event.logprob is not None:
            self.logprobs[event.choice].append((event.token, event.logprob))

    def _logprobs(self, entries):
        if self.gen.top_logprobs is None:
            return None
        codec, as_ids = self.server.codec, self.gen.tokens_as_ids
        return schema.chat_logprobs(entries, codec, as_ids) if self.chat else \
            schema.completion_logprobs(entries, codec, as_ids)

    def _usage(self) -> dict:
        # the choices share the prompt: its cached part is the first choice's (the others' may differ
        # only by what the first computed before them)
        cached = self.jobs[0].cached if self.server.batcher.prefix_caching else None
        return schema.usage(len(self.gen.prompt), sum(j.generated for j in self.jobs), cached)

    def _stop_reason(self, i: int, finish: str):
        """vLLM's stop_reason: the stop token id or stop string that ended choice i (None: EOS,
        the token limit, an abort)."""
        return self.jobs[i].stops.reason if finish != "abort" else None

    def _choice(self, i: int) -> dict:
        job = self.jobs[i]
        c = {"index": i, "logprobs": self._logprobs(self.logprobs[i]), "finish_reason": self.finish[i],
             "stop_reason": self._stop_reason(i, self.finish[i])}
        if self.chat:
            c["message"] = self.parsed[i].message(job.stops.text)
            if self.gen.echo:
                c["message"]["content"] = self.gen.echo + (c["message"]["content"] or "")
            c["finish_reason"] = self.parsed[i].finish_reason(self.finish[i])
        else:
            c["text"] = job.stops.text
        if self.gen.token_ids:
            c["token_ids"] = list(job.made)            # vLLM's: every token made, a stop token included
            if not self.chat:
                c["prompt_token_ids"] = self.gen.prompt
        elif self.server.codec is None:
            c["token_ids"] = job.stops.tokens          # no tokenizer: the answer is token ids
        return c

    def _cancel(self):
        for job in self.jobs:
            if not job.finished:
                self.server.batcher.cancel(job)

    async def whole(self, request: Request) -> tuple[int, dict]:
        while True:
            try:
                event = await asyncio.wait_for(self.events_in.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self._cancel()
                    return 499, {}
                continue
            self.server.outcome(event)
            if event.kind == "token":
                self._take(event)
            elif event.kind == "error":
                self._cancel()
                return 500, ApiError(500, f"generation failed: {event.error}", kind="server_error").body()
            else:
                self.finish[event.choice] = event.finish
                if len(self.finish) < len(self.jobs):
                    continue
                body = schema.envelope("chat.completion" if self.chat else "text_completion", self.id,
                                       self.server.model)
                body["choices"] = [await self._off_loop(self._choice, i) for i in range(len(self.jobs))]
                body["usage"] = self._usage()
                if self.gen.token_ids and self.chat:
                    body["prompt_token_ids"] = self.gen.prompt
                return 200, body

    async def events(self):
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            if self.chat:
                for i in range(len(self.jobs)):
                    first = {"prompt_token_ids": self.gen.prompt} if self.gen.token_ids else {}
                    yield self._sse(kind, {"index": i, "delta": {"role": "assistant", "content": self.gen.echo},
                                           "logprobs": None, "finish_reason": None, "stop_reason": None}, **first)
            while True:
                event = await self.events_in.get()
                self.server.outcome(event)
                i = event.choice
                if event.kind == "error":
                    yield f"data: {json.dumps(ApiError(500, event.error, kind='server_error').body())}\n\n"
                    break
                if event.kind == "token":
                    self._take(event)
                    tokens = [event.token] if event.kept or self.gen.token_ids else []
                    entries = self.logprobs[i][-1:] if event.logprob is not None else []
                    fields = await self._fields(i, event.text)
                    if not fields and self.server.codec is not None and not entries and not self.gen.token_ids:
                        continue
                    yield self._sse(kind, self._delta(i, fields, tokens, entries, None))
                    continue
                rest = await self._off_loop(self.parsed[i].flush) if self.chat and self.parsed[i].parsing else {}
                if rest:
                    yield self._sse(kind, self._delta(i, rest, [], [], None))
                finish = self.parsed[i].finish_reason(event.finish) if self.chat else event.finish
                yield self._sse(kind, self._delta(i, {}, [], [], finish, self._stop_reason(i, event.finish)))
                self.finish[i] = finish
                if len(self.finish) < len(self.jobs):
                    continue
                if self.gen.include_usage:
                    body = schema.envelope(kind, self.id, self.server.model)
                    body["choices"], body["usage"] = [], self._usage()
                    yield f"data: {json.dumps(body)}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:
            self.server.live.difference_update(self.jobs)
            self._cancel()                   # the client went away (or the server is stopping)

    async def _fields(self, i: int, text: str) -> dict:
        """A streamed chunk's fields for new answer text: chat deltas (reasoning_content, content,
        tool_calls) through the parsers (off the loop), or the completion's text."""
        if not text:
            return {}
        if not self.chat:
            return {"text": text}
        parsed = self.parsed[i]
        return await self._off_loop(parsed.feed, text) if parsed.parsing else parsed.feed(text)

    def _delta(self, i: int, fields: dict, tokens: list[int], entries, finish, stop_reason=None) -> dict:
        c = {"index": i, "logprobs": self._logprobs(entries) if entries else None, "finish_reason": finish,
             "stop_reason": stop_reason}
        if self.chat:
            c["delta"] = fields
        else:
            c["text"] = fields.get("text", "")
            if self.gen.token_ids and not self.counted_out[i]:     # vLLM: the prompt's ids in a choice's first chunk
                c["prompt_token_ids"] = self.gen.prompt
        if self.server.codec is None or self.gen.token_ids:
            c["token_ids"] = tokens
        self.counted_out[i] = True
        return c

    def _sse(self, kind: str, choice: dict, **extra) -> str:
        body = schema.envelope(kind, self.id, self.server.model)
        body["choices"] = [choice]
        body.update(extra)
        if self.gen.continuous_usage:    # vLLM's continuous_usage_stats: this choice's tokens so far
            body["usage"] = schema.usage(len(self.gen.prompt), self.counted[choice["index"]])
        return f"data: {json.dumps(body)}\n\n"
