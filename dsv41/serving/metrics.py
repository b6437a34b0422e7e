"""The server's Prometheus metrics, in a registry of the server's own (two servers in one process,
as in the tests, keep theirs apart).

The per-request latencies are vLLM's (docs/serving.md puts the names side by side): time to first
token and end-to-end latency from the moment the request was accepted, the time it waited for a
batch slot, its prefill (admission to first token), decode (first token to end) and inference
(admission to end) times, the time between its tokens and per output token, and its prompt and
generation lengths; requests that ended are counted by finish reason ("abort": ended by the
server, or its client went away). The engine loop reports a request's admission, each of its
tokens and its end (``on_admit``, ``on_token``, ``on_finish``) and each step (``on_step``).

Every series carries the served model's name as its first label, ``model_name`` (as vLLM's do),
so one Prometheus can scrape several servers and a dashboard can tell their models apart; only
the process's own series (``process_*``) have none, as in any Python exporter.
``names="vllm"`` (``--metrics-names vllm``) exports every series vLLM has a twin of under vLLM's
name, with its ``model_name`` and ``engine`` labels and its histogram buckets, so a dashboard
made for vLLM reads them unchanged; the series vLLM has no twin of keep their dsv41 names.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

NAMES = ("dsv41", "vllm", "both")
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# request latencies: from milliseconds (a device) to the minutes a CPU queue can reach
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))    # 1 .. 5M tokens, 1-2-5 steps
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's buckets, where they differ from dsv41's (its v1 Prometheus logger)
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0)
VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
VLLM_N = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
SLEEP_STATES = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}    # vLLM's states, and the one here
PROMPT_SOURCES = ("local_compute", "local_cache_hit")    # vLLM's, less the KV transfer dsv41 has not


def _one_two_five(top: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, ... up to top (vLLM's token-count buckets, up to the context)."""
    return tuple(v for v in (m * 10 ** e for e in range(len(str(top)) + 1) for m in (1, 2, 5)) if v <= top)


class _Bound:
    """A metric with its leading labels (model_name, and vLLM's engine) already given."""

    def __init__(self, metric, values: tuple):
        self.metric, self.values = metric, values

    def labels(self, *values):
        return self.metric.labels(*self.values, *values)


class _Fan:
    """One quantity under each name set asked for: what is counted, set or observed reaches each."""

    def __init__(self, parts: list):
        self.parts = parts

    def labels(self, *values) -> "_Fan":
        return _Fan([p.labels(*values) for p in self.parts])

    def inc(self, amount: float = 1):
        for p in self.parts:
            p.inc(amount)

    def set(self, value: float):
        for p in self.parts:
            p.set(value)

    def observe(self, value: float):
        for p in self.parts:
            p.observe(value)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, names: str = "dsv41", model: str = "", max_context: int = 5_000_000,
                 cache: dict | None = None, draft_positions: int = 0):
        """names: "dsv41", "vllm" (the series vLLM exports, under its names and labels) or "both"
        (every series under dsv41's name, and each that has a vLLM twin under vLLM's too: one
        server feeds both dashboards); model: the served model's name (every series' model_name
        label); max_context: where vLLM's token-count buckets end; cache: vLLM's cache_config_info
        labels (block size, block count, prefix caching; None: no such series); draft_positions:
        the drafts a verify step may hold (the per-position counters exist at 0 from the start)."""
        if names not in NAMES:
            raise ValueError(f"names: expected one of {', '.join(NAMES)}, found {names!r}")
        r = self.registry = CollectorRegistry()
        ours_too, theirs_too = names != "vllm", names != "dsv41"

        def make(kind, ours: str | None, theirs, doc: str, labels=(), buckets=None, their_buckets=None):
            """ours: dsv41's name (None: vLLM's only, exported with vLLM's names); theirs: vLLM's
            name or names (None: dsv41's only, exported under any name set)."""
            parts = []
            if ours is not None and (ours_too or theirs is None):
                kw = {} if buckets is None else {"buckets": buckets}
                parts.append(_Bound(kind(ours, doc, ["model_name", *labels], registry=r, **kw), (model,)))
            for name in ((theirs,) if isinstance(theirs, str) else theirs or ()) if theirs_too else ():
                kw = {} if buckets is None else {"buckets": their_buckets or buckets}
                parts.append(_Bound(kind(name, doc, ["model_name", "engine", *labels], registry=r, **kw),
                                    (model, "0")))
            fan = _Fan(parts)
            return fan if labels else fan.labels()

        def hist(ours, theirs, doc, buckets, their_buckets=None, labels=()):
            return make(Histogram, ours, theirs, doc, labels, buckets, their_buckets)

        self.requests = make(Counter, "dsv41_requests", None, "HTTP requests answered, by endpoint and status",
                             ["endpoint", "status"])
        self.prompt_tokens = make(Counter, "dsv41_prompt_tokens", "vllm:prompt_tokens",
                                  "Prompt tokens admitted to the engine (per sample, as vLLM counts child requests)")
        self.prompt_tokens_cached = make(Counter, "dsv41_prompt_tokens_cached", "vllm:prompt_tokens_cached",
                                         "Admitted prompt tokens found in the prefix cache (not computed)")
        self.prompt_by_source = make(Counter, "dsv41_prompt_tokens_by_source", "vllm:prompt_tokens_by_source",
                                     "Admitted prompt tokens by source: computed, or found in the prefix cache",
                                     ["source"])
        self.generation_tokens = make(Counter, "dsv41_generation_tokens", "vllm:generation_tokens",
                                      "Tokens generated")
        self.step_seconds = hist("dsv41_step_seconds", None, "Engine step wall time, by phase", STEP_BUCKETS,
                                 labels=["phase"])
        self.iteration_tokens = hist("dsv41_iteration_tokens", "vllm:iteration_tokens_total",
                                     "Tokens per engine step (prompt and generated)", ITERATION_BUCKETS)
        self.queue_depth = make(Gauge, "dsv41_queue_depth", "vllm:num_requests_waiting",
                                "Requests waiting for a batch slot")
        self.running = make(Gauge, "dsv41_running_requests", "vllm:num_requests_running",
                            "Requests holding a batch slot")
        self.blocks_in_use = make(Gauge, "dsv41_cache_blocks_in_use", None, "Paged-cache blocks held by requests")
        self.blocks_total = make(Gauge, "dsv41_cache_blocks_total", None, "Paged-cache blocks in all pools")
        # vLLM's gpu_cache_usage_perc is deprecated, but its example dashboard's Cache Utilization reads it
        self.cache_usage = make(Gauge, "dsv41_kv_cache_usage_perc", ("vllm:kv_cache_usage_perc",
                                                                     "vllm:gpu_cache_usage_perc"),
                                "Paged-cache blocks in use over all blocks (1 is full)")
        self.preemptions = make(Counter, "dsv41_num_preemptions", "vllm:num_preemptions",
                                "Preemptions: a running request's blocks freed, to be recomputed when it fits again")
        self.prefix_queries = make(Counter, "dsv41_prefix_cache_queries", "vllm:prefix_cache_queries",
                                   "Prompt tokens looked up in the prefix cache (a request's first admission)")
        self.prefix_hits = make(Counter, "dsv41_prefix_cache_hits", "vllm:prefix_cache_hits",
                                "Prompt tokens found in the prefix cache (a request's first admission)")
        self.prefix_hit_rate = make(Gauge, "dsv41_prefix_cache_hit_rate", None,
                                    "Prefix cache hits over queries so far, in prompt tokens")
        self.errors = make(Counter, "dsv41_errors", None, "Requests that ended in an error, by kind", ["kind"])
        ProcessCollector(registry=r)          # process_resident_memory_bytes and friends
        self.cancelled = make(Counter, "dsv41_cancelled_requests", None, "Requests whose client went away")
        self.drafts = make(Counter, "dsv41_spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
                           "Draft blocks verified: requests with drafts in a verify step (speculative decoding)")
        self.draft_tokens = make(Counter, "dsv41_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens",
                                 "Draft tokens verified (speculative decoding)")
        self.accepted_tokens = make(Counter, "dsv41_spec_decode_accepted_tokens",
                                    "vllm:spec_decode_num_accepted_tokens",
                                    "Draft tokens accepted (speculative decoding)")
        self.draft_by_position = make(Counter, "dsv41_spec_decode_draft_tokens_by_position", None,
                                      "Draft tokens verified, by position in the draft block", ["position"])
        self.accepted_by_position = make(Counter, "dsv41_spec_decode_accepted_tokens_by_position",
                                         "vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft block", ["position"])
        self.ttft = hist("dsv41_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                         "From acceptance to the first token", LATENCY_BUCKETS, VLLM_TTFT)
        self.itl = hist("dsv41_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
                        "Between two tokens of one request", LATENCY_BUCKETS, VLLM_TPOT)
        self.tpot = hist("dsv41_time_per_output_token_seconds", "vllm:time_per_output_token_seconds",
                         "Between two tokens of one request, one sample per token after the first (as vLLM, "
                         "where it is inter_token_latency's older name)", LATENCY_BUCKETS, VLLM_TPOT)
        self.request_tpot = hist("dsv41_request_time_per_output_token_seconds",
                                 "vllm:request_time_per_output_token_seconds",
                                 "A request's decode time over its tokens after the first", LATENCY_BUCKETS, VLLM_TPOT)
        self.e2e = hist("dsv41_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                        "From acceptance to the end of a request", LATENCY_BUCKETS, VLLM_REQUEST)
        self.queue_time = hist("dsv41_request_queue_time_seconds", "vllm:request_queue_time_seconds",
                               "From acceptance to a batch slot", LATENCY_BUCKETS, VLLM_REQUEST)
        self.prefill_time = hist("dsv41_request_prefill_time_seconds", "vllm:request_prefill_time_seconds",
                                 "From a batch slot to the first token", LATENCY_BUCKETS, VLLM_REQUEST)
        self.decode_time = hist("dsv41_request_decode_time_seconds", "vllm:request_decode_time_seconds",
                                "From the first token to the end", LATENCY_BUCKETS, VLLM_REQUEST)
        self.inference_time = hist("dsv41_request_inference_time_seconds", "vllm:request_inference_time_seconds",
                                   "From a batch slot to the end", LATENCY_BUCKETS, VLLM_REQUEST)
        self.success = make(Counter, "dsv41_request_success", "vllm:request_success",
                            "Requests that ended, by finish reason", ["finished_reason"])
        lengths = _one_two_five(max_context)
        self.prompt_lengths = hist("dsv41_request_prompt_tokens", "vllm:request_prompt_tokens",
                                   "Prompt tokens per request", TOKEN_BUCKETS, lengths)
        self.generation_lengths = hist("dsv41_request_generation_tokens", "vllm:request_generation_tokens",
                                       "Generated tokens per request", TOKEN_BUCKETS, lengths)
        self.params_n = hist("dsv41_request_params_n", "vllm:request_params_n", "The n of each request",
                             TOKEN_BUCKETS, VLLM_N)
        self.params_max_tokens = hist("dsv41_request_params_max_tokens", "vllm:request_params_max_tokens",
                                      "The max_tokens of each request (per sample)", TOKEN_BUCKETS, lengths)
        self.max_generation = hist("dsv41_request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
                                   "The most tokens a sample of a request generated", TOKEN_BUCKETS, lengths)
        self.kv_computed = hist("dsv41_request_prefill_kv_computed_tokens", "vllm:request_prefill_kv_computed_tokens",
                                "Prompt tokens a request computed (those not found in the prefix cache)",
                                TOKEN_BUCKETS, lengths)
        self.recomputed = make(Counter, "dsv41_prompt_tokens_recomputed", "vllm:prompt_tokens_recomputed",
                               "Tokens computed again: a preempted request's history when it is admitted again")
        sleep = make(Gauge, "dsv41_engine_sleep_state", "vllm:engine_sleep_state",
                     "The engine's sleep state (1: the state it is in); dsv41's engine is always awake",
                     ["sleep_state"])
        for state, value in SLEEP_STATES.items():
            sleep.labels(state).set(value)
        for name in ("vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:mm_cache_queries",
                     "vllm:mm_cache_hits"):    # vLLM's KV-connector and multimodal caches: none here, so 0
            make(Counter, None, name, "Tokens looked up / found in a cache dsv41 has not (always 0)")
        if cache is not None:
            info = make(Gauge, "dsv41_cache_config_info", "vllm:cache_config_info",
                        "The paged cache's configuration (labels; the value is 1)", tuple(cache))
            info.labels(*cache.values()).set(1)
        self._samples: dict[int, list] = {}     # a request's jobs (by their shared events queue), until all end
        self._lock = threading.Lock()
        self._looked = self._found = 0         # the hit rate's prompt tokens so far
        for reason in FINISH_REASONS:
            self.success.labels(reason)           # every series exists (at 0) before the first request ends
        for source in PROMPT_SOURCES:
            self.prompt_by_source.labels(source)
        for j in range(draft_positions):       # every position a dashboard plots exists before it accepts
            self.draft_by_position.labels(str(j))
            self.accepted_by_position.labels(str(j))

    # ---- a request's life, as the engine loop sees it ----------------------------------------------------
    def on_admit(self, job, started: float):
        """job got a batch slot: its prefill step began at ``started`` (reported after that step,
        whose tokens, and maybe the job's end, were already heard)."""
        job.admitted_at = started
        self.queue_time.observe(started - job.accepted)
        self.prompt_lengths.observe(len(job.prompt))
        if job.first_token_at is not None:
            self.prefill_time.observe(job.first_token_at - started)
        if job.ended_at is not None:
            self._ran(job)

    def on_prefix(self, queried: int, hit: int):
        """A request's first admission looked up ``queried`` prompt tokens and found ``hit`` cached."""
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)
        self._looked, self._found = self._looked + queried, self._found + hit
        self.prefix_hit_rate.set(self._found / self._looked if self._looked else 0.0)

    def on_token(self, job, now: float):
        """A token of ``job`` came out (its first: time to first token; later: the gap since the last)."""
        if job.last_token_at is None:
            job.first_token_at = now
            self.ttft.observe(now - job.accepted)
        else:
            self.itl.observe(now - job.last_token_at)
            self.tpot.observe(now - job.last_token_at)
        job.last_token_at = now

    def on_finish(self, job, reason: str, now: float):
        job.ended_at = now
        self.e2e.observe(now - job.accepted)
        self.success.labels(reason).inc()
        self.generation_lengths.observe(job.generated)
        self.params_max_tokens.observe(job.params.max_tokens)
        self.kv_computed.observe(len(job.prompt) - job.cached)
        self._sample_ended(job)
        if job.admitted_at is not None:
            self._ran(job)

    def _sample_ended(self, job):
        """A request's n and the most tokens one of its samples generated, once all have ended (its
        samples share one events queue)."""
        with self._lock:
            group = self._samples.setdefault(id(job.events), [])
            group.append(job.generated)
            if len(group) < job.samples:
                return
            del self._samples[id(job.events)]
        self.params_n.observe(job.samples)
        self.max_generation.observe(max(group))

    def _ran(self, job):
        """The times of a request that held a slot and ended: inference, decode, per output token."""
        self.inference_time.observe(job.ended_at - job.admitted_at)
        if job.first_token_at is not None:
            self.decode_time.observe(job.ended_at - job.first_token_at)
            if job.generated > 1:
                self.request_tpot.observe((job.ended_at - job.first_token_at) / (job.generated - 1))

    def on_step(self, prompt_tokens: int, cached: int, generated: int, proposed: list[int] | None,
                accepted: list[int] | None):
        """One engine step's tokens (the prompts of the requests it admitted, ``cached`` of them found
        in the prefix cache) and, with drafts, each request's proposed and accepted drafts."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_cached.inc(cached)
        self.prompt_by_source.labels("local_compute").inc(prompt_tokens - cached)
        self.prompt_by_source.labels("local_cache_hit").inc(cached)
        self.generation_tokens.inc(generated)
        self.iteration_tokens.observe(prompt_tokens + generated)
        if proposed is None:
            return
        self.drafts.inc(sum(1 for k in proposed if k))
        self.draft_tokens.inc(sum(proposed))
        self.accepted_tokens.inc(sum(accepted))
        for k, a in zip(proposed, accepted):
            for j in range(k):           # vLLM's acceptance by draft position
                self.draft_by_position.labels(str(j)).inc()
                if j < a:
                    self.accepted_by_position.labels(str(j)).inc()

    def cache(self, used: int, total: int):
        self.blocks_in_use.set(used)
        self.blocks_total.set(total)
        self.cache_usage.set(used / total if total else 0.0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
