"""The server's Prometheus metrics, in a registry of the server's own (two servers in one process,
as in the tests, keep theirs apart)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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

    def text(self) -> bytes:
        return generate_latest(self.registry)
