"""Structured outputs and vLLM's request fields.

The mask (``engine.grammar``) against llguidance fed token by token, drawn rows against the
allowed set; then with the official ``openai`` client against ``python -m dsv41.serve`` on the
TINY checkpoint (random weights: only the grammar makes its answers JSON, so every answer that
parses and validates with ``jsonschema`` is the constraint working): >= 20 JSON schemas greedy and
sampled, guided choice/regex/grammar, each vLLM field changing the answer as vLLM documents, n
samples; forced tool calls on an in-process server (the tool prompt is longer than TINY's prefill
rows the command line allows); under ``-m slow`` TP2/DP2 (threads; a few schemas on distributed
TP2, where the masks cross to the cards' processes) and speculative decoding give the reference's
answers.
"""
import concurrent.futures
import functools
import json
import pickle
import re
from dataclasses import replace

import pytest
import torch

from dsv41.config import TINY
from dsv41.capacity import CAPACITIES
from dsv41.engine.grammar import TokenTable
from dsv41.ops.sampling import RowDraw, SamplingParams, allowed_tokens, sample_rows
from dsv41.serving import structured

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_serve import Served  # noqa: E402
from test_serve_features import InProcess  # noqa: E402

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    {**OBJ, "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]},
    {**OBJ, "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {**OBJ, "properties": {"t": {"type": "integer", "minimum": -40, "maximum": -5}}, "required": ["t"]},
    {**OBJ, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {**OBJ, "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {**OBJ, "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                    "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {**OBJ, "properties": {"v": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                 "maxItems": 4}}, "required": ["v"]},
    {**OBJ, "properties": {"p": {**OBJ, "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                       "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                                 "required": ["x", "y"]}}, "required": ["p"]},
    {**OBJ, "properties": {"a": {**OBJ, "properties": {"b": {**OBJ, "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {**OBJ, "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 3},
    {"enum": ["yes", "no"]},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "string", "pattern": "^[a-f0-9]{4}$"},
    {**OBJ, "properties": {"kind": {"const": "point"}, "n": {"type": "integer", "minimum": 0, "maximum": 5}},
     "required": ["kind", "n"]},
    {**OBJ, "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                           "note": {"type": "string", "maxLength": 3}}, "required": ["id"]},
    {**OBJ, "properties": {"pts": {"type": "array", "maxItems": 2, "items": {
        **OBJ, "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}},
     "required": ["pts"]},
    {**OBJ, "properties": {"r": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "boolean"}]}}, "required": ["r"]},
    {**OBJ, "properties": {"n": {"type": "null"}, "e": {"enum": ["a", "b"]}}, "required": ["n", "e"]},
    {**OBJ, "properties": {"day": {"type": "string", "enum": ["mon", "tue"]},
                           "h": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["day", "h"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
]
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 120


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


# ---- the mask ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler(codec):
    return structured.Compiler(codec, TINY.vocab_size)


def _allowed(mask) -> set[int]:
    return set(allowed_tokens(mask, TINY.vocab_size).nonzero().flatten().tolist())


def test_masks_follow_the_grammar_through_drafts_and_roll_them_back(codec, compiler):
    grammar = compiler.grammar("json", json.dumps(SCHEMAS[10]), "response_format")
    assert compiler.grammar("json", json.dumps(SCHEMAS[10]), "response_format") is grammar    # cached
    answer = codec.tokenizer.encode('{"name":"ab","age":7}', add_special_tokens=False).ids
    one = grammar.matcher()
    # a matcher fed one token at a time, as plain decode steps feed it: the oracle of every row's mask
    plain = [_allowed(one.masks(answer[:i], [])[0]) for i in range(len(answer) + 1)]
    assert plain[-1] == {codec.eos_id}                       # complete: only EOS may follow
    assert all(t in plain[i] for i, t in enumerate(answer))
    spec = grammar.matcher()
    for at, drafts in ((0, answer[:3]), (3, answer[3:8]), (8, answer[8:])):
        masks = spec.masks(answer[:at], drafts)
        assert [_allowed(m) for m in masks] == plain[at:at + len(drafts) + 1]
    # a draft the grammar refuses: its row's mask excludes it (the accepted prefix ends there), the
    # rows after repeat that mask, and nothing of the drafts stays in the matcher
    spec = grammar.matcher()
    wrong = codec.tokenizer.encode("}", add_special_tokens=False).ids[0]
    masks = spec.masks(answer[:2], [answer[2], wrong, answer[4]])
    assert [_allowed(m) for m in masks[:2]] == plain[2:4] and wrong not in _allowed(masks[1])
    assert torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    assert [_allowed(m) for m in spec.masks(answer[:5], [])] == [plain[5]]
    # a history that changed (a preempted request recomputed) starts the grammar over
    assert _allowed(spec.masks([], [])[0]) == plain[0]


def test_the_mask_is_applied_where_the_token_is_drawn():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, TINY.vocab_size, generator=g)
    allow = [5, 77, 300, 511]
    table_mask = torch.zeros((TINY.vocab_size + 31) // 32, dtype=torch.int32)
    for t in allow:
        table_mask.view(torch.uint8)[t // 8] |= 1 << (t % 8)
    assert _allowed(table_mask) == set(allow)
    greedy = [RowDraw(SamplingParams(), 0, 0, allowed=table_mask)] * 3
    ids, _ = sample_rows(logits, greedy)
    assert ids.tolist() == [allow[int(torch.argmax(row[allow]))] for row in logits]
    hot = [RowDraw(SamplingParams(temperature=5.0), s, d, allowed=table_mask) for s in range(3) for d in range(1)]
    for draw in range(40):
        ids, _ = sample_rows(logits, [replace(r, draw=draw) for r in hot])
        assert set(ids.tolist()) <= set(allow)
    # before min_tokens a stop is banned, unless the grammar allows nothing else (it is complete)
    only_eos, eos_or_2 = torch.zeros_like(table_mask), torch.zeros_like(table_mask)
    only_eos.view(torch.uint8)[0], eos_or_2.view(torch.uint8)[0] = 2, 6
    early = SamplingParams(min_tokens=4, max_tokens=8, eos_token_id=1)
    assert sample_rows(logits[:1], [RowDraw(early, 0, 0, allowed=only_eos)])[0].tolist() == [1]
    assert sample_rows(logits[:1], [RowDraw(early, 0, 0, allowed=eos_or_2)])[0].tolist() == [2]
    # no mask: still exactly the argmax (the plain path)
    assert torch.equal(sample_rows(logits, [RowDraw(SamplingParams(), 0, 0)] * 3)[0], torch.argmax(logits, -1))


def test_a_card_gets_the_mask_not_the_grammar(compiler):
    grammar = compiler.grammar("regex", "[ab]{2}", "guided_regex")
    params = SamplingParams(grammar=grammar)
    back = pickle.loads(pickle.dumps(params))
    assert back.grammar is None and replace(back, grammar=grammar) == params


def test_forced_tool_calls_are_the_block_the_parser_reads(codec, compiler):
    from dsv41.serving.tool_calls import ToolCallSplit
    d = "｜DSML｜"
    field, lark = structured.tool_grammar(WEATHER, "required", codec.chat_format, codec.tokenizer.token_to_id(d))
    grammar = compiler.grammar("lark", lark, field)
    text = (f"<{d} calls>\n<{d} invoke name=\"get_weather\">\n<{d} parameter name=\"city\" string=\"true\">Paris"
            f"</{d} parameter>\n<{d} parameter name=\"days\" string=\"false\">3</{d} parameter>\n</{d} invoke>\n"
            f"</{d} calls>")
    ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
    matcher = grammar.matcher()
    assert _allowed(matcher.masks(ids, [])[0]) == {codec.eos_id}
    split = ToolCallSplit()
    content, calls = split.feed(text)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    # a value outside the parameter's schema is not in the grammar
    bad = codec.tokenizer.encode(text.replace(">3<", ">9<"), add_special_tokens=False).ids
    assert grammar.matcher().ll.validate_tokens(bad) < len(bad)


# ---- served ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Served("--checkpoint", str(tiny_checkpoint), "--served-model-name", "tiny", "--max-context", "256",
               "--max-batch", "8")
    try:
        yield s
    finally:
        s.stop()


def _json_answers(server, temperature: float, seed=None, schemas=SCHEMAS) -> list:
    client = _client(server)

    def one(schema):
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
        return r.choices[0].finish_reason, r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, schemas))


def _check_answers(answers):
    for schema, (finish, content) in zip(SCHEMAS, answers):      # answers to the first len(answers) schemas
        assert finish == "stop", (schema, content)
        jsonschema.validate(json.loads(content), schema)


@pytest.mark.timeout(900)
def test_json_schema_answers_validate_greedy_and_sampled(server, codec):
    greedy = _json_answers(server, 0.0)
    _check_answers(greedy)
    sampled = _json_answers(server, 1.0, seed=11)
    _check_answers(sampled)
    assert sampled != greedy
    assert len({c for _, c in greedy}) > len(SCHEMAS) // 2         # the schemas make different answers
    client = _client(server)
    # json_object (any object: random weights would write a key for ever, the bias on '"' and '}' ends
    # them); a stream adds up to the whole answer
    ends = {str(codec.tokenizer.token_to_id(t)): 20 for t in ('"', "}")}
    kw = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, logit_bias=ends,
              response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    assert isinstance(json.loads(whole), dict)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    assert streamed == whole
    assert server.settled()["cache_blocks_in_use"] == 0


@pytest.mark.timeout(600)
def test_guided_fields_constrain_the_answer(server):
    client = _client(server)

    def text(**extra):
        r = client.completions.create(model="tiny", prompt="Pick:", max_tokens=40, temperature=0.8, seed=3,
                                      extra_body=extra)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].text

    assert text(guided_choice=["alpha", "beta", "gamma"]) in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text(guided_regex=r"[a-c]{3}-[0-9]{2}"))
    assert text(guided_grammar='start: "x" ("+" "x"){1,3}') in ("x+x", "x+x+x", "x+x+x+x")
    assert re.fullmatch(r"[0-9]{3}", text(structured_outputs={"regex": "[0-9]{3}"}))
    assert text(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")
    assert json.loads(text(guided_json={"type": "integer", "minimum": 5, "maximum": 6})) in (5, 6)
    # one constraint a request; a grammar that does not compile (thinking mode is served:
    # test_structured_thinking.py)
    for extra, param in (({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                         ({"guided_regex": "[a-"}, "guided_regex"),
                         ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param


def _complete(client, prompt: str, **extra):
    """The first choice of a completion (12 greedy tokens unless asked otherwise), vLLM's fields in the body."""
    kw = {"max_tokens": extra.pop("max_tokens", 12), "temperature": extra.pop("temperature", 0)}
    return client.completions.create(model="tiny", prompt=prompt, **kw, extra_body=extra).choices[0]


@pytest.mark.timeout(600)
def test_vllm_fields_change_the_answer_as_vllm_documents(server, codec):
    client = _client(server)
    prompt = "The story goes"

    complete = functools.partial(_complete, client, prompt)

    plain = complete()
    assert plain.finish_reason == "length" and len(plain.text) > 4
    # include_stop_str_in_output: the stop string stays at the end of the text
    stop = plain.text[3:5]
    cut, kept = complete(stop=[stop]), complete(stop=[stop], include_stop_str_in_output=True)
    assert cut.text == plain.text[:plain.text.index(stop)] and kept.text == cut.text + stop
    assert cut.finish_reason == kept.finish_reason == "stop"
    # skip_special_tokens false: a special token's text stays; spaces_between_special_tokens spaces it
    user = codec.tokenizer.token_to_id("<｜User｜>")
    forced = dict(logit_bias={str(user): 100}, max_tokens=2)
    assert "<｜User｜>" not in complete(**forced).text
    spaced = complete(**forced, skip_special_tokens=False)
    assert spaced.text == "<｜User｜> <｜User｜>"
    assert complete(**forced, skip_special_tokens=False, spaces_between_special_tokens=False).text == \
        "<｜User｜><｜User｜>"
    # truncate_prompt_tokens: only the prompt's last k tokens are read
    ids = codec.encode(prompt)
    truncated = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert truncated.usage.prompt_tokens == 3
    assert truncated.choices[0].text == client.completions.create(
        model="tiny", prompt=ids[-3:], max_tokens=12, temperature=0).choices[0].text != plain.text
    # n: n samples, sample i seeded seed + i (vLLM's rule); greedy samples are all the greedy answer
    many = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=5 + i)
               for i in range(3)]
    assert [c.text for c in many.choices] == [r.choices[0].text for r in singles]
    assert len({r.choices[0].text for r in singles}) > 1
    assert many.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=5,
                                            n=3, stream=True))
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(3)] == [r.choices[0].text for r in singles]
    # ignore_eos: EOS (here the likeliest token by far) does not end the answer; min_tokens: EOS is
    # not drawn before that many tokens are out. The EOS drawn is one of the answer's tokens, as in vLLM
    eos_text = codec.tokenizer.decode([codec.eos_id], skip_special_tokens=False)

    def eos_forced(**extra):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                      logit_bias={str(codec.eos_id): 100}, extra_body=extra)
        assert r.usage.completion_tokens == len(r.choices[0].logprobs.tokens)
        return r.choices[0].finish_reason, r.choices[0].logprobs.tokens

    assert eos_forced() == ("stop", [eos_text])
    assert eos_forced(ignore_eos=True) == ("length", [eos_text] * 4)
    finish, tokens = eos_forced(min_tokens=2)
    assert finish == "stop" and len(tokens) == 3 and eos_text not in tokens[:2] and tokens[2] == eos_text
    # priority: first come, first served, as vLLM's default policy: 0 only
    assert complete(priority=0).text == plain.text
    with pytest.raises(openai.BadRequestError) as e:
        complete(priority=1)
    assert e.value.body["param"] == "priority"


@pytest.mark.timeout(900)
def test_vllm_token_fields_change_the_answer(server, codec):
    """top_k -1, allowed_token_ids, bad_words, return_tokens_as_token_ids as vLLM documents them;
    use_beam_search, prompt_logprobs and completions' echo refused saying they are not served."""
    client = _client(server)
    prompt = "The story goes"

    complete = functools.partial(_complete, client, prompt)

    plain = complete()
    # top_k -1: vLLM's "off", the same draws as leaving it out (and not those of a real top-k)
    seeded = dict(temperature=1.0, seed=9, max_tokens=12)
    assert complete(**seeded, top_k=-1).text == complete(**seeded).text != complete(**seeded, top_k=2).text
    # allowed_token_ids: every token drawn is one of them
    allowed = sorted(set(codec.encode_text("abcde ")))
    drawn = complete(**seeded, allowed_token_ids=allowed, return_token_ids=True).model_dump()["token_ids"]
    assert len(drawn) == 12 and set(drawn) <= set(allowed)
    # bad_words: a one-token word of the greedy answer is never drawn; a two-token word's second
    # token never follows its first (vLLM tokenizes each word as written and after a space)
    made = complete(return_token_ids=True).model_dump()["token_ids"]
    word = next(w for t in made if (w := codec.tokenizer.decode([t])).strip().isalnum())
    banned = complete(bad_words=[word], return_token_ids=True).model_dump()["token_ids"]
    variants = {tuple(codec.tokenizer.encode(w, add_special_tokens=False).ids)
                for w in (word.lstrip(), " " + word.lstrip())}
    assert banned != made and not any(len(v) == 1 and v[0] in banned for v in variants)
    pair = codec.tokenizer.decode(made[2:4])
    seq = codec.tokenizer.encode(pair.lstrip(), add_special_tokens=False).ids
    out = complete(bad_words=[pair], return_token_ids=True, max_tokens=24).model_dump()["token_ids"]
    assert not any(out[i:i + len(seq)] == seq for i in range(len(out)))
    # return_tokens_as_token_ids: logprobs name tokens by id (completions and chat)
    lp = complete(logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True)
    assert lp.logprobs.tokens == [f"token_id:{t}" for t in lp.model_dump()["token_ids"]]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    assert [e.token for e in chat.choices[0].logprobs.content] == \
        [f"token_id:{t}" for t in chat.choices[0].model_dump()["token_ids"]]
    # refused, saying so: beam search and the prompt's logprobs are not served
    for field, value in (("use_beam_search", True), ("prompt_logprobs", 1), ("echo", True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field and "not served" in e.value.body["message"]
    assert complete(use_beam_search=False).text == plain.text


# ---- forced tool calls ------------------------------------------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"type": "string", "enum": ["c", "f"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}, "maxItems": 3}},
        "required": ["xs"]}}}]


class RealInProcess(InProcess):
    """The app over the reference engine with TINY's weights and room for the tool prompt (~760
    tokens of TINY's tokenizer; the command line's TINY prefills 512 rows a step)."""

    def __init__(self, codec, drafter=None, max_batch: int = 4):
        """drafter(engine): the speculative drafter over the engine (None: plain decode steps)."""
        from dsv41.engine.reference import ReferenceEngine
        capacity = replace(CAPACITIES["tiny"], prefill_max_tokens=2048)
        engine = ReferenceEngine(TINY, seed=0, max_batch=max_batch, max_context=1536, capacity=capacity)
        super().__init__(codec, engine, None if drafter is None else drafter(engine), max_batch)


@pytest.fixture(scope="module")
def tool_server(codec):
    with RealInProcess(codec) as s:
        yield s


@pytest.mark.timeout(900)
def test_forced_tool_calls_validate_against_their_parameters(tool_server):
    client = _client(tool_server)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    kw = dict(model="scripted", messages=[{"role": "user", "content": "Weather?"}], tools=WEATHER,
              max_tokens=160)
    for choice, temperature, seed in (("required", 0, None), ("required", 1.0, 2),
                                      ({"type": "function", "function": {"name": "add"}}, 0.8, 4)):
        r = client.chat.completions.create(**kw, tool_choice=choice, temperature=temperature, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        for call in c.message.tool_calls:
            if isinstance(choice, dict):
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# ---- layouts and speculative decoding ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_answers(server):
    return _json_answers(server, 0.0), _json_answers(server, 1.0, seed=11)


LAYOUTS = {   # served beside the reference: flags, how many of the schemas (the distributed TP2 cards run
    #           ~20 s a token on the 2-core machine), whether seeded answers must be equal too
    "tp2dp2": (("--executor", "threads", "--tp", "2", "--dp", "2"), len(SCHEMAS), True),
    "distributed-tp2": (("--executor", "distributed", "--tp", "2"), 3, True),
    "ngram": (("--speculative", "ngram"), len(SCHEMAS), True),
    # DSpark's sampled drafts are accepted by the speculative-sampling rule: the same law, not the same
    # tokens; its seeded answers are checked against their schemas
    "dspark": (("--speculative", "dspark"), len(SCHEMAS), False),
}


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_json_answers_equal_the_reference_on_layouts_and_drafters(reference_answers, tiny_checkpoint, layout):
    extra, count, sampled_equal = LAYOUTS[layout]
    other = Served("--checkpoint", str(tiny_checkpoint), "--served-model-name", "tiny", "--max-context", "256",
                   "--max-batch", "8", *extra)
    try:
        assert _json_answers(other, 0.0, schemas=SCHEMAS[:count]) == reference_answers[0][:count]
        sampled = _json_answers(other, 1.0, seed=11, schemas=SCHEMAS[:count])
        if sampled_equal:
            assert sampled == reference_answers[1][:count]
        else:
            _check_answers(sampled)
    finally:
        other.stop()
