"""n > 1 with the official ``openai`` client: the samples of one request share one prefill.

Two in-process servers over TINY reference engines (random weights, token-id prompts): one caching
prefixes (serve's default), one not. The engine under each counts the prompt rows it computed
(each new request's fed rows, and the cached prefix it started after). With caching, the first
sample computes the prompt and the others wait for its spans and feed only the rows the cache cannot
cut (here the last one, whose logits draw their first token); without, each sample is its own
prefill. Either way every sample's tokens are those of a request of its own seeded ``seed + i``
(vLLM's rule), sent one at a time to the server that caches nothing.
"""
import pytest

from dsv41.config import TINY
from dsv41.engine.prefix_cache import span
from dsv41.engine.reference import ReferenceEngine

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve_features import InProcess  # noqa: E402
from test_serve_metrics import _samples, _value  # noqa: E402

N, NEW, SEED = 4, 8, 5
PROMPT = [(7 * i + 3) % TINY.vocab_size for i in range(3 * span(TINY) + 1)]   # 97 tokens: 96 cacheable
CUT = (len(PROMPT) - 1) // span(TINY) * span(TINY)


class Counting(ReferenceEngine):
    """Keeps, for each request a step starts, (the cached prefix it starts after, the rows it feeds)."""

    def __init__(self, **kw):
        super().__init__(TINY, seed=0, max_batch=8, max_context=256, **kw)
        self.started: list[tuple[list[int], list[int]]] = []

    def run(self, parts, phase):
        out = super().run(parts, phase)
        self.started += [(p.cached or [], list(p.tokens)) for p in parts if p.start]
        return out

    def prompt_rows(self) -> list[int]:
        """Rows fed by each request started over PROMPT so far (the count is reset)."""
        rows = [len(t) for c, t in self.started if c + t == PROMPT]
        self.started = []
        return rows


@pytest.fixture(scope="module")
def servers():
    caching = InProcess(None, Counting(prefix_caching=True))
    plain = InProcess(None, Counting())
    try:
        yield caching, plain
    finally:
        caching.stop()
        plain.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _complete(server, **kw):
    return _client(server).completions.create(model="scripted", prompt=PROMPT, max_tokens=NEW, temperature=1.0,
                                              top_p=0.95, extra_body={"ignore_eos": True}, **kw)


def _streamed(server, **kw) -> tuple[list[list[int]], dict]:
    """Each choice's token ids and the usage of a streamed answer."""
    ids, usage = [[] for _ in range(N)], None
    for chunk in _client(server).completions.create(model="scripted", prompt=PROMPT, max_tokens=NEW, temperature=1.0,
                                                   top_p=0.95, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}, **kw):
        for c in chunk.choices:
            ids[c.index] += c.model_extra["token_ids"]
        usage = chunk.usage or usage
    return ids, usage


def _tokens(answer) -> list[list[int]]:
    return [c.model_extra["token_ids"] for c in sorted(answer.choices, key=lambda c: c.index)]


def _metrics(server) -> dict:
    return _samples(httpx.get(server.url + "/metrics").text)


@pytest.mark.timeout(600)
def test_n_samples_share_one_prefill_and_equal_separate_requests(servers):
    caching, plain = servers
    # the oracle: n requests of their own, seeds seed + i, on the server that caches nothing
    singles = [_tokens(_complete(plain, seed=SEED + i))[0] for i in range(N)]
    assert len({tuple(s) for s in singles}) == N             # the seeds give different answers
    assert plain.engine.prompt_rows() == [len(PROMPT)] * N
    before = _metrics(caching)

    many = _complete(caching, seed=SEED, n=N)
    assert _tokens(many) == singles
    # the first sample computed the prompt; the others only the row after the cached spans
    assert caching.engine.prompt_rows() == [len(PROMPT)] + [len(PROMPT) - CUT] * (N - 1)
    assert many.usage.prompt_tokens == len(PROMPT) and many.usage.completion_tokens == N * NEW
    assert many.usage.prompt_tokens_details.cached_tokens == 0    # nothing of it was cached before
    # vLLM's counters: each sample's prompt is admitted (as vLLM's child requests), the computed rows
    # are local_compute, the reused ones local_cache_hit, and the prefix cache's counters agree
    after = _metrics(caching)

    def grew(name, **labels):
        return _value(after, name, model_name="", **labels) - _value(before, name, model_name="", **labels)

    computed = len(PROMPT) + (N - 1) * (len(PROMPT) - CUT)
    assert grew("dsv41_prompt_tokens_total") == N * len(PROMPT)
    assert grew("dsv41_prompt_tokens_cached_total") == (N - 1) * CUT
    assert grew("dsv41_prompt_tokens_by_source_total", source="local_compute") == computed
    assert grew("dsv41_prompt_tokens_by_source_total", source="local_cache_hit") == (N - 1) * CUT
    assert grew("dsv41_prefix_cache_queries_total") == N * len(PROMPT)
    assert grew("dsv41_prefix_cache_hits_total") == (N - 1) * CUT

    # sent again, streamed: the prompt's spans are cached for every sample now, and the usage says so
    ids, usage = _streamed(caching, seed=SEED, n=N)
    assert ids == singles
    assert caching.engine.prompt_rows() == [len(PROMPT) - CUT] * N
    assert usage.prompt_tokens == len(PROMPT) and usage.prompt_tokens_details.cached_tokens == CUT
    assert caching.engine.blocks_in_use()[0] == 0


@pytest.mark.timeout(600)
def test_without_prefix_caching_each_sample_has_its_own_prefill(servers):
    _, plain = servers
    singles = [_tokens(_complete(plain, seed=SEED + i))[0] for i in range(N)]
    plain.engine.prompt_rows()
    many = _complete(plain, seed=SEED, n=N)
    assert _tokens(many) == singles
    assert plain.engine.prompt_rows() == [len(PROMPT)] * N
    assert many.usage.prompt_tokens == len(PROMPT) and many.usage.prompt_tokens_details is None



def _batch(max_batch: int, budget: int | None, cancel: int | None = None):
    """A request's 4 samples (greedy, 2 tokens) and then another request through a Batcher over a
    caching engine, sample ``cancel`` hung up before the engine starts; (engine, samples, later)."""
    import asyncio
    import time

    from dsv41.ops.sampling import SamplingParams
    from dsv41.ops.stopping import Stops
    from dsv41.serving.batcher import Batcher, Job
    from dsv41.serving.metrics import Metrics

    engine, loop = Counting(prefix_caching=True), asyncio.new_event_loop()
    batcher = Batcher(engine, Metrics(), max_batch=max_batch, max_queue=8, budget=budget)
    p = SamplingParams(max_tokens=2)
    samples = [Job(PROMPT, p, Stops(p), loop, choice=i) for i in range(4)]
    later = Job(PROMPT[::-1], p, Stops(p), loop)
    try:
        for job in samples + [later]:
            batcher.submit(job)
        if cancel is not None:
            batcher.cancel(samples[cancel])
        batcher.start()
        deadline = time.monotonic() + 240
        while not all(j.ended for j in samples + [later]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        batcher.stop()
        loop.close()
    assert batcher.waiting == [] and engine.blocks_in_use()[0] == 0
    return engine, samples, later


@pytest.mark.timeout(300)
def test_waiting_samples_keep_their_place_in_the_queue():
    """One batch slot: a request's later samples, waiting while its first sample runs, start after
    its cached prompt before a request that arrived after them; one whose client hung up while
    waiting never runs."""
    engine, samples, later = _batch(1, None, cancel=2)
    order = ["later" if not c and t == PROMPT[::-1] else len(c) for c, t in engine.started]
    assert order == [0, CUT, CUT, "later"]
    assert samples[2].made == [] and all(len(j.made) == 2 for j in samples if j is not samples[2])


@pytest.mark.timeout(300)
def test_samples_wait_for_the_whole_of_a_chunked_prompt():
    """A prompt fed in chunks of 40 rows: the later samples (deferred by the scheduler while the
    first computes the spans they share) start after its last chunk, on every span of it, beside the
    first sample's decoding; the request after them, sharing nothing, starts in the room they leave."""
    engine, samples, later = _batch(4, 40)
    assert [j.cached for j in samples] == [0, CUT, CUT, CUT]
    assert [len(t) for c, t in engine.started if len(c) == CUT] == [len(PROMPT) - CUT] * 3
    assert all(j.made == samples[0].made for j in samples) and len(later.made) == 2
    assert ["later" if not c and t == PROMPT[::-1][:len(t)] else len(c) for c, t in engine.started] == [0, "later", CUT, CUT, CUT]
