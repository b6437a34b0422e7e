"""What vLLM and SGLang users rely on, driven with the official ``openai`` client.

Two kinds of server:
- the HTTP layer over a scripted engine (in this process, stopped at the end of the module): its
  answers are texts written here, so the reasoning and tool-call parsers are checked end to end
  (whole and streamed) against known answers; every OpenAI request field is served or refused;
  the latency histograms count what happened;
- ``python -m dsv41.serve`` in a subprocess (``test_serve.Served``, killed by its PID) on the TINY
  checkpoint (V4.1 thinking chat with a reasoning effort, logit_bias, logprob bytes) and on a
  reduced TINY (the answer of ``python -m dsv41.run`` with the same reduction).
"""
import asyncio
import json
import os
import threading
import time
import typing
from dataclasses import replace

import pytest

from dsv41.checkpoint.chat import encode_messages
from dsv41.checkpoint.text import TextCodec
from dsv41.config import TINY
from dsv41.capacity import CAPACITIES
from dsv41.serving import schema
from dsv41.serving.reasoning import split_reasoning

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from fake_engine import OneGroupEngine  # noqa: E402
from ports import bound_socket  # noqa: E402
from test_serve import Served  # noqa: E402  (the subprocess server of tests/test_serve.py)

D = "｜DSML｜"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL_ANSWER = (f"The user wants Paris.</think>Checking.\n\n<{D} calls>\n<{D} invoke name=\"get_weather\">\n"
               f"<{D} parameter name=\"city\" string=\"true\">Paris</{D} parameter>\n"
               f"<{D} parameter name=\"days\" string=\"false\">3</{D} parameter>\n</{D} invoke>\n</{D} calls>")


# ---- the HTTP layer over a scripted engine -----------------------------------------------------------

class ScriptedEngine(OneGroupEngine):
    """Answers every request with the ids of one text (then EOS): the model stand-in that lets a test
    know the answer the parsers must take apart."""

    cfg = TINY
    capacity = replace(CAPACITIES["tiny"], prefill_max_tokens=4096)     # one step takes any prompt the app lets in

    def __init__(self, codec: TextCodec):
        super().__init__()
        self.codec, self.script, self.at = codec, [], {}

    def answer(self, text: str):
        self.script = self.codec.tokenizer.encode(text, add_special_tokens=False).ids + [self.codec.eos_id]

    def started(self, rid):
        self.at[rid] = 0

    def token(self, rid):
        token = self.script[min(self.at[rid], len(self.script) - 1)]
        self.at[rid] += 1
        return token

    def release(self, rid):
        self.at.pop(rid, None)


class InProcess:
    """The app over an engine (a scripted one unless given), served by uvicorn on a thread of this process."""

    def __init__(self, codec: TextCodec, engine=None, drafter=None, max_batch: int = 4):
        """engine: the model (default: a ScriptedEngine); drafter: speculative steps (None: plain)."""
        from dsv41.serving.app import Server
        from dsv41.serving.batcher import Batcher
        from dsv41.serving.metrics import Metrics
        self.engine = engine or ScriptedEngine(codec)
        metrics = Metrics()
        self.batcher = Batcher(self.engine, metrics, max_batch=max_batch, max_queue=max_batch, budget=None,
                               drafter=drafter)
        self.batcher.start()
        limits = schema.Limits(max_context=4096, max_prompt=4000, vocab_size=TINY.vocab_size, max_body_bytes=1 << 20)
        sock = bound_socket()              # bound until uvicorn serves it: no other program can take the port
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(Server(self.batcher, codec, "scripted", limits, metrics).app(),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True)
        self.thread.start()
        while not self.server.started:     # a server that never starts: the test's timeout
            assert self.thread.is_alive(), "the in-process server did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.batcher.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture(scope="module")
def scripted(tiny_checkpoint):
    server = InProcess(TextCodec.load(tiny_checkpoint))
    try:
        yield server
    finally:
        server.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.timeout(120)
def test_reasoning_and_tool_calls_whole_and_streamed(scripted):
    scripted.engine.answer(CALL_ANSWER)
    c = _client(scripted)
    kw = dict(model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
              temperature=0, extra_body={"chat_template_kwargs": {"thinking": True}})
    whole = c.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.reasoning_content == "The user wants Paris." and msg.content == "Checking."
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert msg.tool_calls[0].type == "function" and msg.tool_calls[0].id.startswith("call_")

    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants Paris."
    assert "".join(d.content or "" for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_weather", {"city": "Paris", "days": 3})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the client's own stream accumulator builds the same message
    with c.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0].message
    assert final.tool_calls[0].function.arguments == calls[0].function.arguments

    # tool_choice "none": the tools are not offered, nothing is parsed (the DSML stays text)
    none = c.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert none.finish_reason == "stop" and none.message.tool_calls is None and D in none.message.content
    # without thinking mode the whole answer is content (</think> included)
    plain = c.chat.completions.create(model="scripted", messages=kw["messages"], temperature=0).choices[0]
    assert plain.message.content.startswith("The user wants Paris.") and plain.finish_reason == "stop"


@pytest.mark.timeout(120)
def test_hostile_tool_calls_are_parsed_off_the_event_loop(scripted, monkeypatch):
    """Values JSON cannot carry come back as their text in standard-JSON arguments, whole and
    streamed, and the parsers run on the answer threads, never on the event loop's."""
    from dsv41.serving.chat_answer import ChatAnswer
    threads = set()
    for name in ("feed", "flush", "message"):
        method = getattr(ChatAnswer, name)
        monkeypatch.setattr(ChatAnswer, name, lambda self, *a, _m=method: threads.add(
            threading.current_thread().name) or _m(self, *a))
    values = {"n": "NaN", "s": '"\\ud800"', "deep": "[" * 70 + "]" * 70, "big": "1e999"}
    scripted.engine.answer(f"Checking.\n\n<{D} calls>\n<{D} invoke name=\"f\">\n" + "\n".join(
        f'<{D} parameter name="{k}" string="false">{v}</{D} parameter>' for k, v in values.items())
        + f"\n</{D} invoke>\n</{D} calls>")
    kw = dict(model="scripted", messages=[{"role": "user", "content": "go"}], tools=WEATHER, temperature=0)
    with httpx.Client(base_url=scripted.url, timeout=60) as c:
        whole = c.post("/v1/chat/completions", json=kw)
        assert whole.status_code == 200, whole.text
        args = whole.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        lines = [ln for ln in c.post("/v1/chat/completions", json={**kw, "stream": True}).text.splitlines()
                 if ln.startswith("data: {")]
    streamed = [tc["function"]["arguments"] for ln in lines
                for tc in json.loads(ln[6:])["choices"][0]["delta"].get("tool_calls", [])]
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in arguments"))
    assert strict(args) == values and [strict(a) for a in streamed] == [values]
    assert threads and all(t.startswith("dsv41-answer") for t in threads), threads


@pytest.mark.timeout(120)
def test_thinking_prompt_and_reasoning_effort_reach_the_encoder(scripted):
    """The prompt the server builds is the V4.1 encoding with the effort asked (usage counts it)."""
    codec = scripted.engine.codec
    scripted.engine.answer("ok</think>done")
    c = _client(scripted)
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    def prompt_tokens(**kw):
        return c.chat.completions.create(model="scripted", messages=msgs, max_tokens=2, **kw).usage.prompt_tokens

    def encoded(**kw):
        return len(codec.tokenizer.encode(encode_messages(msgs, variant="v4.1", **kw),
                                          add_special_tokens=False).ids)

    assert prompt_tokens() == encoded()
    assert prompt_tokens(reasoning_effort="high") == encoded(thinking=True, effort=50)
    assert prompt_tokens(extra_body={"reasoning_effort": "xhigh"}) == encoded(thinking=True, effort=75)
    assert prompt_tokens(extra_body={"reasoning_effort": 7}) == encoded(thinking=True, effort=7) != encoded()
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == encoded(thinking=True)
    r = c.chat.completions.create(model="scripted", messages=msgs, reasoning_effort="high")
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("ok", "done")
    # add_generation_prompt false: the chat as it is, no assistant turn opened
    assert prompt_tokens(extra_body={"add_generation_prompt": False}) == \
        encoded(add_generation_prompt=False) < encoded()
    # model may be left out (the openai client insists on one: send the body by hand)
    r = httpx.post(scripted.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "scripted"


@pytest.mark.timeout(120)
def test_vllm_answer_fields(scripted):
    """stop_reason, reasoning, request_id, return_token_ids, continuous_usage_stats, chat echo, add_special_tokens and the top-level enable_thinking, each as
    vLLM answers them (its protocol's and serving code's rules), on a known answer."""
    codec = scripted.engine.codec
    scripted.engine.answer("ok</think>done here")
    script = list(scripted.engine.script)                  # the answer's ids, EOS last
    msgs = [{"role": "user", "content": "Hi"}]
    think = {"chat_template_kwargs": {"thinking": True}}
    with httpx.Client(base_url=scripted.url, timeout=60) as c:
        def chat(**body):
            r = c.post("/v1/chat/completions", json={"model": "scripted", "messages": msgs, "temperature": 0, **body})
            assert r.status_code == 200, r.text
            return r.json()

        def chunks(path="/v1/chat/completions", **body):
            body = {"model": "scripted", "temperature": 0, "stream": True, **body}
            if path.endswith("chat/completions"):
                body.setdefault("messages", msgs)
            text = c.post(path, json=body).text
            return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]

        # stop_reason: the stop string or stop token id that ended it; null for EOS and the limit
        reasons = [chat(**kw)["choices"][0] for kw in ({}, {"stop": ["here"]}, {"stop_token_ids": [script[2]]},
                                                       {"max_tokens": 2})]
        assert [(r["finish_reason"], r["stop_reason"]) for r in reasons] == \
            [("stop", None), ("stop", "here"), ("stop", script[2]), ("length", None)]
        streamed = chunks(stop=["here"])
        assert streamed[-1]["choices"][0]["stop_reason"] == "here"
        assert all(ch["choices"][0]["stop_reason"] is None for ch in streamed[:-1])
        # reasoning beside reasoning_content (vLLM >= 0.11), whole and in deltas
        msg = chat(**think)["choices"][0]["message"]
        assert msg["reasoning"] == msg["reasoning_content"] == "ok" and msg["content"] == "done here"
        deltas = [ch["choices"][0]["delta"] for ch in chunks(**think)]
        assert "".join(d.get("reasoning", "") for d in deltas) == "ok"
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
        # request_id: the answer's id after its prefix; vLLM's X-Request-Id header comes first
        assert chat(request_id="abc")["id"] == "chatcmpl-abc"
        r = c.post("/v1/completions", json={"model": "scripted", "prompt": "x", "request_id": "abc"},
                   headers={"X-Request-Id": "hdr"})
        assert r.json()["id"] == "cmpl-hdr"
        # return_token_ids: the prompt's ids and every id made (EOS included, as completion_tokens counts)
        whole = chat(return_token_ids=True)
        prompt = codec.encode_chat(msgs)
        assert whole["prompt_token_ids"] == prompt and whole["choices"][0]["token_ids"] == script
        assert whole["usage"]["completion_tokens"] == len(script)
        streamed = chunks(return_token_ids=True)
        assert streamed[0]["prompt_token_ids"] == prompt
        assert [t for ch in streamed for t in ch["choices"][0].get("token_ids", [])] == script
        done = c.post("/v1/completions", json={"model": "scripted", "prompt": "x", "max_tokens": 3,
                                               "return_token_ids": True}).json()["choices"][0]
        assert done["prompt_token_ids"] == codec.encode("x") and done["token_ids"] == script[:3]
        streamed = chunks("/v1/completions", prompt="x", max_tokens=3, return_token_ids=True)
        assert streamed[0]["choices"][0]["prompt_token_ids"] == codec.encode("x")
        assert [t for ch in streamed for t in ch["choices"][0]["token_ids"]] == script[:3]
        # continuous_usage_stats: each chunk carries the usage so far
        streamed = chunks(stream_options={"include_usage": True, "continuous_usage_stats": True})
        counts = [ch["usage"]["completion_tokens"] for ch in streamed if ch["choices"]]
        assert counts == sorted(counts) and counts[-1] == len(script) and counts[0] == 0
        assert all(ch["usage"]["prompt_tokens"] == len(prompt) for ch in streamed)
        assert "usage" not in chunks(stream_options={"include_usage": False, "continuous_usage_stats": True})[0]
        # chat echo: an answer continuing the assistant's last message starts with its text
        cont = msgs + [{"role": "assistant", "content": "Once"}]
        echoed = chat(messages=cont, add_generation_prompt=False, echo=True)["choices"][0]["message"]["content"]
        assert echoed == "Once" + chat(messages=cont, add_generation_prompt=False)["choices"][0]["message"]["content"]
        assert "".join(ch["choices"][0]["delta"].get("content", "")
                       for ch in chunks(messages=cont, add_generation_prompt=False, echo=True)) == echoed
        assert chat(echo=True)["choices"][0]["message"] == chat()["choices"][0]["message"]    # a new turn: nothing
        # add_special_tokens: chat adds BOS on top of the template's; completions' default BOS can be left out
        assert chat(add_special_tokens=True, max_tokens=1)["usage"]["prompt_tokens"] == len(prompt) + 1
        plain_prompt = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()["usage"]
        bare = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "add_special_tokens": False}).json()
        assert bare["usage"]["prompt_tokens"] == plain_prompt["prompt_tokens"] - 1 == len(codec.encode_text("x"))
        # the top-level enable_thinking is chat_template_kwargs' (and may not contradict it)
        assert chat(enable_thinking=True, max_tokens=1)["usage"]["prompt_tokens"] == \
            len(codec.encode_chat(msgs, thinking=True))
        r = c.post("/v1/chat/completions", json={"messages": msgs, "enable_thinking": True,
                                                 "chat_template_kwargs": {"thinking": False}})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "enable_thinking")


@pytest.mark.timeout(120)
def test_vllm_utility_endpoints(scripted):
    """/tokenize, /detokenize, /version, /ping and /v1/models/{id} with vLLM's bodies."""
    codec = scripted.engine.codec
    msgs = [{"role": "user", "content": "Hi there"}]
    with httpx.Client(base_url=scripted.url, timeout=60) as c:
        t = c.post("/tokenize", json={"model": "scripted", "prompt": "Hello world"}).json()
        assert t == {"count": len(codec.encode("Hello world")), "max_model_len": 4096,
                     "tokens": codec.encode("Hello world"), "token_strs": None}
        t = c.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True}).json()
        assert t["tokens"] == codec.encode_text("Hello")
        assert t["token_strs"] == [codec.tokenizer.id_to_token(i) for i in t["tokens"]]
        # a chat: the ids the chat endpoint feeds (its usage counts them)
        t = c.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": {"thinking": True}}).json()
        assert t["tokens"] == codec.encode_chat(msgs, thinking=True)
        usage = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                                     "chat_template_kwargs": {"thinking": True}}).json()["usage"]
        assert usage["prompt_tokens"] == t["count"]
        d = c.post("/detokenize", json={"model": "scripted", "tokens": codec.encode_text("Hello world")}).json()
        assert d == {"prompt": "Hello world"}
        for path, body, param in (("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
                                  ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
                                  ("/detokenize", {"tokens": [1], "model": "other"}, "model")):
            r = c.post(path, json=body)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, r.text)
        assert c.get("/version").json()["version"]
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        assert c.get("/v1/models/scripted").json() == c.get("/v1/models").json()["data"][0]
        r = c.get("/v1/models/other")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


def _openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


# Each field the openai client can send, with what this server does with it. Served ones are
# exercised by the tests named; the others are sent with a value that asks for what is not
# implemented and must come back 400 naming the field.
SERVED_CHAT = {  # field: where it is tested
    "messages": "every chat test", "model": "test_thinking_prompt...", "max_tokens": "here",
    "max_completion_tokens": "test_serve", "temperature": "test_serve", "top_p": "test_serve", "seed": "test_serve",
    "stop": "test_serve", "stream": "here", "stream_options": "test_serve", "n": "test_structured",
    "logprobs": "test_logit_bias...", "top_logprobs": "test_logit_bias...", "presence_penalty": "test_serve",
    "frequency_penalty": "test_serve", "logit_bias": "test_logit_bias...", "tools": "here",
    "tool_choice": "here (auto, none), test_structured (required, named)", "parallel_tool_calls": "true only",
    "reasoning_effort": "here", "response_format": "test_structured", "modalities": "[text] only",
    "store": "false only",
    "user": "identifier", "safety_identifier": "identifier", "prompt_cache_key": "identifier",
}
REFUSED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "metadata": {"k": "v"}, "moderation": True,
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_options": {}, "prompt_cache_retention": "24h",
    "service_tier": "flex", "verbosity": "low", "web_search_options": {},
    "response_format": {"type": "structural_tag"}, "modalities": ["text", "audio"], "store": True,
    "parallel_tool_calls": False, "tool_choice": {"type": "function", "function": {"name": "not_offered"}},
    "n": schema.MAX_N + 1, "continue_final_message": True,
    "reasoning_effort": "medium", "frobnicate": 1, "use_beam_search": True, "prompt_logprobs": 0,
}
SERVED_COMPLETIONS = {"prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                      "stream_options", "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                      "echo", "best_of", "suffix", "user"}
REFUSED_COMPLETIONS = {"best_of": 2, "suffix": "tail", "echo": True, "n": 0, "messages": [], "frobnicate": 1,
                       "priority": 1, "truncate_prompt_tokens": 0, "guided_regex": "[a-"}


def test_every_openai_field_is_served_or_refused():
    """The openai package's own list of request fields: each is one this server serves (the
    schema's tables agree) or one the refusal table below sends."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    chat, completions = _openai_fields(chat_params), _openai_fields(completion_create_params)
    assert chat <= set(SERVED_CHAT) | set(REFUSED_CHAT), chat - set(SERVED_CHAT) - set(REFUSED_CHAT)
    assert completions <= SERVED_COMPLETIONS | set(REFUSED_COMPLETIONS)
    for name in SERVED_CHAT:
        assert name in schema.SERVED[True] or name in schema.IDENTIFIERS, name
    for name in SERVED_COMPLETIONS:
        assert name in schema.SERVED[False] or name in schema.IDENTIFIERS, name


# vLLM's own request fields (beyond OpenAI's) this server serves, each with the test that asserts its
# effect as vLLM documents it ("file::test"); those served with one value only are refused otherwise
# (REFUSED_CHAT / REFUSED_COMPLETIONS send that)
SAMPLING_TEST = "test_serve.py::test_vllm_sampling_fields_change_the_answer_as_vllm_documents"
FIELDS_TEST = "test_structured.py::test_vllm_fields_change_the_answer_as_vllm_documents"
GUIDED_TEST = "test_structured.py::test_guided_fields_constrain_the_answer"
TOKEN_TEST = "test_structured.py::test_vllm_token_fields_change_the_answer"
ANSWER_TEST = "test_serve_features.py::test_vllm_answer_fields"
VLLM_SERVED = {
    "top_k": SAMPLING_TEST, "min_p": SAMPLING_TEST, "repetition_penalty": SAMPLING_TEST,
    "min_tokens": SAMPLING_TEST + " (stop ids), " + FIELDS_TEST + " (EOS)",
    "stop_token_ids": "test_serve.py::test_openai_completions_equal_the_reference", "ignore_eos": FIELDS_TEST,
    "include_stop_str_in_output": FIELDS_TEST, "skip_special_tokens": FIELDS_TEST,
    "spaces_between_special_tokens": FIELDS_TEST, "truncate_prompt_tokens": FIELDS_TEST,
    "priority": FIELDS_TEST + " (0 only, as vLLM's first-come-first-served policy)",
    "structured_outputs": GUIDED_TEST, "guided_json": GUIDED_TEST, "guided_regex": GUIDED_TEST,
    "guided_choice": GUIDED_TEST, "guided_grammar": GUIDED_TEST,
    "chat_template_kwargs": "test_serve_features.py::test_thinking_prompt_and_reasoning_effort_reach_the_encoder",
    "add_generation_prompt": "test_serve_features.py::test_thinking_prompt_and_reasoning_effort_reach_the_encoder",
    "continue_final_message": "false only",
    "request_id": ANSWER_TEST, "return_token_ids": ANSWER_TEST, "add_special_tokens": ANSWER_TEST,
    "enable_thinking": ANSWER_TEST, "bad_words": TOKEN_TEST, "allowed_token_ids": TOKEN_TEST,
    "return_tokens_as_token_ids": TOKEN_TEST,
    "use_beam_search": TOKEN_TEST + " (false only: beam search is not served)",
    "prompt_logprobs": TOKEN_TEST + " (null only: the head computes no prompt rows' logits)",
    "thinking_token_budget": "test_structured_thinking.py::test_masks_start_where_the_reasoning_ends_inside_a_verify_step",
    "cache_salt": "test_prefix_cache.py::test_tenants_with_their_own_cache_salt_never_share_a_cached_prefix",
}


def test_every_vllm_field_has_a_test_of_its_effect():
    """Every field served beyond OpenAI's is one of vLLM's with a test that exists."""
    import re
    from pathlib import Path
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    openai_fields = _openai_fields(chat_params) | _openai_fields(completion_create_params)
    assert (schema.SERVED[True] | schema.SERVED[False]) - openai_fields == set(VLLM_SERVED)
    here = Path(__file__).parent
    for name, where in VLLM_SERVED.items():
        for file, test in re.findall(r"(test_\w+\.py)::(test_\w+)", where):
            assert f"\ndef {test}(" in (here / file).read_text(), (name, file, test)


@pytest.mark.timeout(120)
def test_unsupported_fields_are_refused_naming_them(scripted):
    base = {"model": "scripted", "max_tokens": 1}
    with httpx.Client(base_url=scripted.url) as c:
        for endpoint, extra, refused in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                          REFUSED_CHAT),
                                         ("/v1/completions", {"prompt": "x"}, REFUSED_COMPLETIONS)):
            for name, value in refused.items():
                r = c.post(endpoint, json={**base, **extra, name: value})
                err = r.json()["error"]
                assert (r.status_code, err["param"]) == (400, name), (endpoint, name, err)
                assert err["message"].startswith(name + ":")
        # the accepted values of the same fields go through
        ok = {**base, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"},
              "modalities": ["text"], "store": False, "parallel_tool_calls": True, "tool_choice": "auto",
              "user": "u1", "metadata": None}
        assert c.post("/v1/chat/completions", json=ok).status_code == 200
        for kwargs, param in (({"thinking": False, "reasoning_effort": "high"},
                               "chat_template_kwargs.reasoning_effort"),
                              ({"temperature": 1}, "chat_template_kwargs")):
            r = c.post("/v1/chat/completions", json={**ok, "chat_template_kwargs": kwargs})
            assert (r.status_code, r.json()["error"]["param"]) == (400, param)
        r = c.post("/v1/chat/completions", json={**ok, "logit_bias": {"99999": 1}})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "logit_bias")
        r = c.post("/v1/chat/completions", json={**ok, "min_tokens": 5})      # more than max_tokens (1)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "min_tokens")


@pytest.mark.timeout(120)
def test_metrics_have_the_latency_histograms(scripted):
    from prometheus_client.parser import text_string_to_metric_families
    scripted.engine.answer("four tokens or so")
    c = _client(scripted)
    for _ in range(2):
        c.completions.create(model="scripted", prompt="The river", max_tokens=3, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(scripted.url + "/metrics").text)}

    def value(family, sample, **labels):
        return sum(s.value for s in families[family].samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

    for name in ("dsv41_time_to_first_token_seconds", "dsv41_inter_token_latency_seconds",
                 "dsv41_e2e_request_latency_seconds", "dsv41_request_queue_time_seconds",
                 "dsv41_request_prompt_tokens", "dsv41_request_generation_tokens"):
        assert families[name].type == "histogram", name
    done = value("dsv41_request_success", "dsv41_request_success_total")
    assert done >= 2 and value("dsv41_request_success", "dsv41_request_success_total", finished_reason="length") >= 2
    assert value("dsv41_time_to_first_token_seconds", "dsv41_time_to_first_token_seconds_count") == done
    assert value("dsv41_e2e_request_latency_seconds", "dsv41_e2e_request_latency_seconds_count") == done
    # each request made 3 tokens: 2 gaps between them
    assert value("dsv41_inter_token_latency_seconds", "dsv41_inter_token_latency_seconds_count") >= 4
    assert value("dsv41_request_generation_tokens", "dsv41_request_generation_tokens_bucket", le="5.0") >= 2


# ---- python -m dsv41.serve on the TINY checkpoint ---------------------------------------------------

@pytest.fixture(scope="module")
def text_server(tiny_checkpoint):
    server = Served("--checkpoint", str(tiny_checkpoint), "--served-model-name", "tiny-text", "--max-context", "128")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_logit_bias_logprob_bytes_and_v41_thinking(text_server, tiny_checkpoint):
    codec = TextCodec.load(tiny_checkpoint)
    c = _client(text_server)
    msgs = [{"role": "user", "content": "The river"}]
    kw = dict(model="tiny-text", messages=msgs, max_tokens=4, temperature=0)
    greedy = c.chat.completions.create(logprobs=True, **kw)
    first = greedy.choices[0].logprobs.content[0]
    # +100 on a byte token that is half of "é" (0xC3): the greedy answer becomes that token
    half = codec.tokenizer.token_to_id("Ã")
    biased = c.chat.completions.create(logit_bias={str(half): 100}, logprobs=True, top_logprobs=1, **kw)
    lps = biased.choices[0].logprobs.content
    assert len(lps) == 4 and all(lp.bytes == [0xC3] for lp in lps)          # the token's byte, not U+FFFD's
    assert first.token != lps[0].token and lps[0].token == "\ufffd"
    # V4.1 thinking with an effort: the prompt is the encoder's, the answer split as the parser splits
    # the same text (the model is random: its text has no </think>, so all of it is reasoning)
    thinking = c.chat.completions.create(reasoning_effort="high", **{**kw, "max_tokens": 5})
    assert thinking.usage.prompt_tokens == len(codec.tokenizer.encode(
        encode_messages(msgs, thinking=True, variant="v4.1", effort=50), add_special_tokens=False).ids)
    m = thinking.choices[0].message
    assert (m.reasoning_content or "", m.content) == split_reasoning(m.reasoning_content or "")
    streamed = list(c.chat.completions.create(reasoning_effort="high", stream=True, **{**kw, "max_tokens": 5}))
    assert "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in streamed if ch.choices) \
        == (m.reasoning_content or "")


# ---- a reduced config: what run computes is what the server serves -------------------------------

@pytest.mark.timeout(600)
def test_serve_a_reduced_config_answers_as_run(capsys):
    from dsv41.cli.prompts import prompts_for
    from dsv41.run import main
    reduction = ["--layers", "4", "--experts", "8"]
    assert main(["--executor", "reference", *reduction, "--batch", "1", "--prompt-len", "8", "--new-tokens", "4",
                 "--json"]) == 0
    ran = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    reduced = TINY.reduced(4, 8, None)
    prompt = prompts_for(reduced, 1, 8, 0)[0]
    server = Served(*reduction)
    try:
        c = _client(server)
        models = c.models.list().data
        assert [m.id for m in models] == [ran["config"]] == [reduced.name] != [TINY.name]
        got = c.completions.create(model=reduced.name, prompt=prompt, max_tokens=4, temperature=0)
        assert got.choices[0].token_ids == ran["tokens"][0]
    finally:
        server.stop()


# ---- start-up refusals -------------------------------------------------------------------------------

def _serve_error(capsys, argv) -> str:
    from dsv41.cli import serve
    with pytest.raises(SystemExit) as exit_:
        serve.main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith("usage:")
    return lines[-1]


def test_a_tokenizer_missing_a_control_token_is_refused_at_start_up(capsys, tiny_checkpoint, tmp_path,
                                                                      v4_tokenizer_checkpoint):
    prog = "python -m dsv41.serve: error: "
    # the real V4 tokenizer has no <｜System｜>: V4 is found, V4.1 asked for is refused
    v4 = v4_tokenizer_checkpoint
    msg = _serve_error(capsys, ["--checkpoint", str(v4), "--chat-format", "v4.1", "--executor", "reference"])
    assert msg == prog + (f"--chat-format: {v4 / 'tokenizer.json'}: expected the control token '<｜System｜>' that "
                          "the v4.1 chat format needs, found none (--chat-format chooses another format)")
    # a tokenizer without <think>: no format the encoder writes can serve it, refused without the flag too
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.name != "tokenizer.json":
            os.link(f, broken / f.name)
    text = (tiny_checkpoint / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text.replace('"<think>"', '"<thonk>"'))
    msg = _serve_error(capsys, ["--checkpoint", str(broken), "--executor", "reference"])
    assert msg.startswith(prog + f"--checkpoint: {broken / 'tokenizer.json'}: expected the control token '<think>'")
    assert _serve_error(capsys, ["--chat-format", "v4"]) == prog + "--chat-format: needs --checkpoint (chats need " \
                                                                   "its tokenizer)"
    assert "--dashboard" in _serve_error(capsys, ["--executor", "threads", "--dashboard"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_distributed_prints_the_dashboard_link():
    server = Served("--executor", "distributed", "--tp", "1", "--dp", "1", "--dashboard")
    try:
        c = _client(server)
        assert c.completions.create(model="tiny", prompt=[5, 9, 100], max_tokens=2, temperature=0).usage \
            .completion_tokens == 2
    finally:
        server.stop()
    out = server.started + server.proc.stdout.read()
    assert "  dashboard: http://" in out, out
