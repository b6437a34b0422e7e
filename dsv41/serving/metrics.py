"""The server's Prometheus metrics, in a registry of the server's own (two servers in one process,
as in the tests, keep theirs apart).

The per-request latencies are vLLM's (docs/serving.md puts the names side by side): time to first
token and end-to-end latency from the moment the request was accepted, the time it waited for a
batch slot, the time between its tokens, and its prompt and generation lengths; requests that
ended are counted by finish reason. The engine loop reports a request's admission, each of its
tokens and its end (``on_admit``, ``on_token``, ``on_finish``).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# request latencies: from milliseconds (a device) to the minutes a CPU queue can reach
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))    # 1 .. 5M tokens, 1-2-5 steps


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dsv41_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "Prompt tokens admitted to the engine", registry=r)
        self.generation_tokens = Counter("dsv41_generation_tokens", "Tokens generated", registry=r)
        self.step_seconds = Histogram("dsv41_step_seconds", "Engine step wall time, by phase", ["phase"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.queue_depth = Gauge("dsv41_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("dsv41_running_requests", "Requests holding a batch slot", registry=r)
        self.blocks_in_use = Gauge("dsv41_cache_blocks_in_use", "Paged-cache blocks held by requests", registry=r)
        self.blocks_total = Gauge("dsv41_cache_blocks_total", "Paged-cache blocks in all pools", registry=r)
        self.errors = Counter("dsv41_errors", "Requests that ended in an error, by kind", ["kind"], registry=r)
        ProcessCollector(registry=r)          # process_resident_memory_bytes and friends
        self.cancelled = Counter("dsv41_cancelled_requests", "Requests whose client went away", registry=r)
        self.draft_tokens = Counter("dsv41_spec_decode_draft_tokens", "Draft tokens verified (speculative decoding)",
                                    registry=r)
        self.accepted_tokens = Counter("dsv41_spec_decode_accepted_tokens",
                                       "Draft tokens accepted (speculative decoding)", registry=r)
        self.draft_by_position = Counter("dsv41_spec_decode_draft_tokens_by_position",
                                         "Draft tokens verified, by position in the draft block", ["position"],
                                         registry=r)
        self.accepted_by_position = Counter("dsv41_spec_decode_accepted_tokens_by_position",
                                            "Draft tokens accepted, by position in the draft block", ["position"],
                                            registry=r)
        latency = dict(buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds", "From acceptance to the first token", **latency)
        self.itl = Histogram("dsv41_inter_token_latency_seconds", "Between two tokens of one request", **latency)
        self.e2e = Histogram("dsv41_e2e_request_latency_seconds", "From acceptance to the end of a request",
                             **latency)
        self.queue_time = Histogram("dsv41_request_queue_time_seconds", "From acceptance to a batch slot",
                                    **latency)
        self.success = Counter("dsv41_request_success", "Requests that ended, by finish reason", ["finished_reason"],
                               registry=r)
        self.prompt_lengths = Histogram("dsv41_request_prompt_tokens", "Prompt tokens per request",
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.generation_lengths = Histogram("dsv41_request_generation_tokens", "Generated tokens per request",
                                            buckets=TOKEN_BUCKETS, registry=r)
        for reason in ("stop", "length"):
            self.success.labels(reason)           # both series exist (at 0) before the first request ends

    # ---- a request's life, as the engine loop sees it ----------------------------------------------------
    def on_admit(self, job, now: float):
        self.queue_time.observe(now - job.accepted)
        self.prompt_lengths.observe(len(job.prompt))

    def on_token(self, job, now: float):
        """A token of ``job`` came out (its first: time to first token; later: the gap since the last)."""
        if job.last_token_at is None:
            self.ttft.observe(now - job.accepted)
        else:
            self.itl.observe(now - job.last_token_at)
        job.last_token_at = now

    def on_finish(self, job, reason: str, now: float):
        self.e2e.observe(now - job.accepted)
        self.success.labels(reason).inc()
        self.generation_lengths.observe(job.generated)

    def text(self) -> bytes:
        return generate_latest(self.registry)
