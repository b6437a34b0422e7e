"""The OpenAI-compatible server with real clients: the official ``openai`` package against
``python -m dsv41.serve`` started in a subprocess (killed by its PID at the end), bad input
refused with an error object naming the field, a full queue answered 429, hung-up clients' blocks
returned, and a bounded load (``bench/serve_load.py``) whose every answer equals its solo run.

Oracle for the answers: ``ReferenceEngine`` in this process with the same weights, capacity and
sampling settings (the server's head draws from (seed, draw index) alone)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from dsv41.config import TINY
from dsv41.engine.reference import ReferenceEngine
from dsv41.ops.sampling import SamplingParams
from ports import listening_port

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX, BATCH = 64, 4


class Served:
    """A server subprocess; stop() kills it by PID."""

    def __init__(self, *extra):
        env = {**os.environ, "PYTHONPATH": ROOT}
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv41.serve", "--executor", "reference",
                                      "--max-context", str(CTX), "--max-batch", str(BATCH), "--port", "0", *extra],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            self.port, self.started = listening_port(self.proc)     # the port the OS gave it
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 180           # a hang guard: the start-up probe runs first
        while httpx.get(self.url + "/health", timeout=60).status_code != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready: {self.started}{self.proc.stdout.read()}")
            time.sleep(0.2)

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def settled(self) -> dict:
        """Health once no request runs or waits (a server that never settles: the test's timeout;
        a loaded machine can take longer than any fixed wait to end hung-up requests)."""
        while True:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0:
                return h
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, 9)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ids_server():
    server = Served("--max-queue", "2")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def text_server(tiny_checkpoint):
    server = Served("--checkpoint", str(tiny_checkpoint), "--served-model-name", "tiny-text")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference():
    return ReferenceEngine(TINY, seed=0, max_batch=BATCH, max_context=CTX)


PROMPT = [5, 9, 100, 7, 300, 2]


@pytest.mark.timeout(600)
def test_openai_completions_equal_the_reference(ids_server, reference):
    client = openai.OpenAI(base_url=ids_server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["tiny"]
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    assert greedy.choices[0].token_ids == reference.generate([PROMPT], 5)[0]
    assert greedy.choices[0].finish_reason == "length" and greedy.usage.completion_tokens == 5
    kw = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=5)
    want = reference.generate([PROMPT], sampling=SamplingParams(**kw))[0]
    sampled = client.completions.create(model="tiny", prompt=PROMPT, **kw)
    assert sampled.choices[0].token_ids == want != greedy.choices[0].token_ids
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, logprobs=2, **kw))
    assert [t for c in chunks for t in c.choices[0].token_ids] == want
    assert chunks[-1].choices[0].finish_reason == "length"
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert len(lps) == 5 and all(len(lp.top_logprobs[0]) == 2 for lp in lps)
    # a stop token id ends the answer and is left out of it
    stopped = client.completions.create(model="tiny", prompt=PROMPT, extra_body={"stop_token_ids": [want[2]]}, **kw)
    assert stopped.choices[0].token_ids == want[:want.index(want[2])]
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.timeout(600)
def test_vllm_sampling_fields_change_the_answer_as_vllm_documents(ids_server, reference):
    """vLLM's own sampling fields reach the draw: each answer is the reference engine's under the
    same SamplingParams (whose rules tests/test_sampling.py checks against vLLM's), and the field
    changes it as vLLM documents."""
    client = openai.OpenAI(base_url=ids_server.url + "/v1", api_key="none")
    base = dict(temperature=1.0, seed=3, max_tokens=8)

    def served(**extra):
        kw = {**base, **{k: extra.pop(k) for k in list(extra) if k in base}}
        choice = client.completions.create(model="tiny", prompt=PROMPT, **kw, extra_body=extra).choices[0]
        want = reference.generate([PROMPT], sampling=SamplingParams(**kw, **{
            k: tuple(v) if k == "stop_token_ids" else v for k, v in extra.items()}))[0]
        assert choice.token_ids == want, extra
        return choice.token_ids

    plain, greedy = served(), reference.generate([PROMPT], 8)[0]
    assert plain != greedy
    # top_k: only the k likeliest tokens are drawn from (k = 1: the greedy answer); top_p likewise
    # keeps the likeliest tokens whose probabilities add up to p (a tiny p: the likeliest alone)
    assert served(top_k=1) == greedy
    assert served(top_k=40) != plain
    assert served(top_p=1e-6) == greedy
    # min_p: tokens below min_p times the likeliest's probability are dropped (1: only the likeliest)
    assert served(min_p=1.0) == greedy
    assert served(min_p=0.2) != plain
    # repetition_penalty: tokens already in the prompt or the answer are made less likely; a strong
    # one keeps greedy decoding off every token it has seen (random weights leave unseen tokens with
    # positive logits)
    assert len(set(greedy)) < len(greedy)                 # greedy decoding repeats itself
    penalized = served(temperature=0, repetition_penalty=1e4)
    assert penalized != greedy and len(set(PROMPT + penalized)) == len(PROMPT) + len(penalized)
    # presence and frequency penalties (OpenAI's, over the answer's tokens) reach the draw too
    assert served(presence_penalty=2.0) != plain and served(frequency_penalty=2.0) != plain
    # min_tokens: a stop token id is not drawn before min_tokens tokens are out
    assert served(stop_token_ids=[plain[0]]) == []
    late = served(stop_token_ids=[plain[0]], min_tokens=3)
    assert len(late) >= 3 and plain[0] not in late[:3]


@pytest.mark.timeout(600)
def test_openai_chat_and_text_completions(text_server, tiny_checkpoint):
    from dsv41.checkpoint.text import TextCodec
    codec = TextCodec.load(tiny_checkpoint)
    client = openai.OpenAI(base_url=text_server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "The river runs past"}]
    kw = dict(model="tiny-text", temperature=0.8, seed=3, max_tokens=6)
    whole = client.chat.completions.create(messages=messages, **kw)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(codec.encode_chat(messages))
    parts = list(client.chat.completions.create(messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole.choices[0].message.content
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = client.completions.create(prompt="The river runs past", **kw)
    assert isinstance(text.choices[0].text, str) and text.usage.prompt_tokens == len(codec.encode("The river runs past"))


BAD = [
    ({"model": "other", "prompt": [1]}, 404, "model"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": 5}, 400, "prompt"),
    ({"model": "tiny", "prompt": "text"}, 400, "prompt"),            # no tokenizer here
    ({"model": "tiny", "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": "tiny", "prompt": list(range(CTX))}, 400, "prompt"),   # longer than the model takes
    ({"model": "tiny", "prompt": [1], "max_tokens": CTX}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [1], "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [1], "temperature": -0.1}, 400, "temperature"),
    ({"model": "tiny", "prompt": [1], "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": [1], "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": [1], "n": 17}, 400, "n"),      # past schema.MAX_N
    ({"model": "tiny", "prompt": [1], "stream": "yes"}, 400, "stream"),
    ({"model": "tiny", "prompt": [1], "stop": "x"}, 400, "stop"),
    ({"model": "tiny", "prompt": [1], "logprobs": 21}, 400, "logprobs"),
]


@pytest.mark.timeout(300)
def test_bad_input_is_refused_naming_the_field(ids_server):
    before = ids_server.settled()
    with httpx.Client(base_url=ids_server.url) as c:
        for body, status, param in BAD:
            r = c.post("/v1/completions", json=body)
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (status, param), body
            assert err["message"].startswith(param) and err["type"]
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")  # chat needs a tokenizer
        for raw, status in ((b'{"model": "tiny", "prompt": [1]\xff}', 400), (b"{not json", 400), (b"[1]", 400),
                            (b" " * (2 << 20), 413)):
            r = c.post("/v1/completions", content=raw)
            assert (r.status_code, r.json()["error"]["param"]) == (status, "body")
        metrics = c.get("/metrics").text
    assert re.search(r'^dsv41_requests_total\{(?=.*model_name="tiny")(?=.*endpoint="/v1/completions")'
                     r'(?=.*status="400")', metrics, re.M)
    after = ids_server.health()
    assert after["cache_blocks_in_use"] == before["cache_blocks_in_use"] == 0   # nothing reached the engine


@pytest.mark.timeout(300)
def test_full_queue_is_429_and_hung_up_clients_free_their_blocks(ids_server):
    """BATCH running and 2 waiting (--max-queue 2): one more is refused; once every client hangs up
    the server holds no request and no block."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": CTX - len(PROMPT), "temperature": 0, "stream": True}
    with httpx.Client(base_url=ids_server.url, timeout=120) as c:
        streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(BATCH + 2)]
        opened = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in opened] == [200] * (BATCH + 2)
            lines = [r.iter_lines() for r in opened]
            for it in lines[:BATCH]:               # the running ones have answered a first token
                assert next(line for line in it if line.startswith("data: "))
            h = ids_server.health()
            assert (h["running"], h["waiting"]) == (BATCH, 2) and h["cache_blocks_in_use"] > 0
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    h = ids_server.settled()
    assert (h["running"], h["waiting"], h["cache_blocks_in_use"]) == (0, 0, 0)


def _load(server, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve_load.py"), "--url", server.url, *args],
                         capture_output=True, text=True, timeout=3000)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, result
    return result


def _check_load(result, requests):
    assert not result["errors"] and not result["mismatches"]
    assert result["completed"] + result["cancelled"] + result["rejected_429"] == requests
    assert result["cancelled"] > 0 and result["cancellations_seen_by_server"] > 0
    assert result["blocks_in_use_end"] == 0 and result["running_end"] == 0
    rss = result["rss_mb"]
    assert rss["after_load"] < rss["after_solo_runs"] * 1.1 + 20      # memory flat


@pytest.mark.timeout(600)
def test_small_load_answers_equal_solo_runs(ids_server):
    _check_load(_load(ids_server, "--clients", "6", "--requests", "16", "--specs", "4", "--max-tokens", "4",
                      "--cancel", "0.3"), 16)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_load_32_clients_answers_equal_solo_runs(tmp_path):
    server = Served("--max-batch", "8", "--max-queue", "64")
    try:
        _check_load(_load(server, "--clients", "32", "--requests", "300"), 300)
    finally:
        server.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("drafter", ["ngram", "dspark"])
def test_speculative_server_answers_the_plain_tokens_and_counts_drafts(reference, drafter):
    server = Served("--speculative", drafter)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        prompt = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
        greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert greedy.choices[0].token_ids == reference.generate([prompt], 8)[0]
        streamed = [c.choices[0].token_ids for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices[0].token_ids]
        assert sum(streamed, []) == greedy.choices[0].token_ids
        text = httpx.get(server.url + "/metrics").text
        drafted = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('dsv41_spec_decode_draft_tokens_total{model_name="tiny"} ')]
        # DSpark drafts every step; n-gram only where the history repeats its tail (random weights' tokens
        # seldom do)
        assert drafted and (drafted[0] > 0 if drafter == "dspark" else drafted[0] >= 0)
        if drafter == "dspark":
            assert re.search(r'^dsv41_spec_decode_draft_tokens_by_position_total\{(?=.*model_name="tiny")'
                             r'(?=.*position="0")', text, re.M)
        assert server.settled()["cache_blocks_in_use"] == 0
    finally:
        server.stop()
