"""Structured output and forced tool calls with thinking on: the reasoning is free, the grammar
constrains what follows ``</think>`` (vLLM's reasoning parsers apply a constraint to the answer
after the reasoning ends).

The row masks (``engine.grammar.Constraint``) against a plain grammar matcher fed only the answer
after ``</think>``, through verify steps whose drafts cross the end of the reasoning; then served
(TINY, random weights: only the grammar makes an answer valid) with a JSON schema, a regex and a
forced tool call, greedy and seeded, whole and streamed, plain and under ``-m slow`` with n-gram and
DSpark drafts; every answer validated with ``jsonschema``. ``thinking_token_budget`` (vLLM's) ends
the reasoning after a few tokens, so the answers are short enough to test; the reasoning itself is
the unconstrained request's, token for token.
"""
import concurrent.futures
import json
import re

import pytest
import torch

from dsv41.checkpoint.chat import END_THINK
from dsv41.config import TINY
from dsv41.engine.drafters import NgramDrafter
from dsv41.engine.dspark import dspark_drafter
from dsv41.engine.grammar import Constraint
from dsv41.ops.sampling import allowed_tokens
from dsv41.serving import structured

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_structured import RealInProcess  # noqa: E402

V = TINY.vocab_size
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}},
          "required": ["name", "age"]}
REGEX = r"[a-c]{2}-[0-9]{2}"
ADD = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}}]
BUDGET = 5               # reasoning tokens before </think> is the only token allowed
MAX_TOKENS = 120


def _allowed(mask) -> set[int] | None:
    return None if mask is None else set(allowed_tokens(mask, V).nonzero().flatten().tolist())


# ---- the masks ------------------------------------------------------------------------------------------

def test_masks_start_where_the_reasoning_ends_inside_a_verify_step(codec):
    compiler = structured.Compiler(codec, V)
    grammar = compiler.grammar("json", json.dumps(SCHEMA), "response_format")
    end = codec.tokenizer.token_to_id(END_THINK)
    ids = lambda text: codec.tokenizer.encode(text, add_special_tokens=False).ids     # noqa: E731
    thought, answer = ids("so, a name"), ids('{"name":"ab","age":7}')
    oracle = grammar.matcher()       # the answer alone, one token at a time: every row's mask after </think>
    plain = [_allowed(oracle.masks(answer[:i], [])[0]) for i in range(len(answer) + 1)]
    rows = Constraint(V, grammar, end).matcher()
    # a verify step whose drafts end the reasoning: the rows up to and including the one that draws
    # </think> are free, the next one is the grammar's first
    drafts = thought[2:] + [end] + answer[:3]
    masks = rows.masks(thought[:2], drafts)
    free = len(thought) - 2 + 1
    assert [_allowed(m) for m in masks] == [None] * free + plain[:4]
    # later steps: the grammar reads only what follows </think>
    assert [_allowed(m) for m in rows.masks(thought + [end] + answer[:3], answer[3:6])] == plain[3:7]
    # a draft the grammar refuses past the end: its row excludes it, the rows after repeat that mask
    wrong = ids("}")[0]
    masks = rows.masks(thought + [end], [answer[0], wrong, answer[2]])
    assert [_allowed(m) for m in masks[:2]] == plain[:2] and wrong not in _allowed(masks[1])
    assert torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    # without </think> anywhere every row is free: the reasoning is not constrained
    assert rows.masks(thought, thought[:3]) == [None] * 4
    # the reasoning budget: from the budget-th reasoning token on, only </think> may be drawn
    budget = Constraint(V, None, end, budget=3).matcher()
    assert [_allowed(m) for m in budget.masks(thought[:1], thought[1:4])] == [None, None, {end}, {end}]
    assert budget.masks(thought[:4] + [end], [5]) == [None, None]


def test_allowed_token_ids_and_bad_words_narrow_every_row(codec):
    """vLLM's allowed_token_ids (only those ids) and bad_words (a word's last token banned where
    the output ends in the tokens before it; a one-token word everywhere)."""
    rows = Constraint(V, allowed=(3, 4, 5, 6, 7), bad_words=((4,), (6, 7))).matcher()
    assert [_allowed(m) for m in rows.masks([1, 2], [6, 3])] == [{3, 5, 6, 7}, {3, 5, 6}, {3, 5, 6, 7}]
    # a word of two tokens is not banned before its first token is out
    assert _allowed(Constraint(V, bad_words=((6, 7),)).matcher().masks([], [])[0]) == set(range(V))


# ---- served ----------------------------------------------------------------------------------------------

def _server(codec, drafter=None):
    return RealInProcess(codec, drafter, max_batch=8)


@pytest.fixture(scope="module")
def plain(codec):
    with _server(codec) as s:
        yield s


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3000)


CASES = {   # constraint: (the request's fields, what checks an answer's content or calls)
    "json": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
    "regex": {"extra_body": {"structured_outputs": {"regex": REGEX}}},
    "tool": {"tools": ADD, "tool_choice": "required"},
}
SAMPLING = {"greedy": dict(temperature=0), "seeded": dict(temperature=1.0, seed=7)}


def _ask(client, case: str, sampling: str, stream: bool, budget: bool = True) -> dict:
    """One thinking-mode request's answer as (reasoning, content, calls, finish), whole or as the
    streamed deltas joined."""
    kw = {k: v for k, v in CASES[case].items() if k != "extra_body"}
    extra = {"chat_template_kwargs": {"thinking": True}, **CASES[case].get("extra_body", {})}
    if budget:
        extra["thinking_token_budget"] = BUDGET
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Go."}],
                                       max_tokens=MAX_TOKENS, stream=stream, extra_body=extra,
                                       **SAMPLING[sampling], **kw)
    if not stream:
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return {"reasoning": m.reasoning_content, "content": m.content, "calls": calls,
                "finish": r.choices[0].finish_reason}
    deltas, finish = [], None
    for chunk in r:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta)
            finish = chunk.choices[0].finish_reason or finish
    calls = [(c.function.name, json.loads(c.function.arguments)) for d in deltas for c in d.tool_calls or []]
    return {"reasoning": "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) or None,
            "content": "".join(d.content or "" for d in deltas) or (None if calls else ""), "calls": calls,
            "finish": finish}


def _valid(case: str, answer: dict):
    assert answer["reasoning"], answer                       # the reasoning is there, and free
    if case == "json":
        assert answer["finish"] == "stop", answer
        jsonschema.validate(json.loads(answer["content"]), SCHEMA)
    elif case == "regex":
        assert answer["finish"] == "stop" and re.fullmatch(REGEX, answer["content"]), answer
    else:
        assert answer["finish"] == "tool_calls" and answer["calls"], answer
        for name, arguments in answer["calls"]:
            assert name == "add"
            jsonschema.validate(arguments, ADD[0]["function"]["parameters"])


def _answers(server, cases=tuple(CASES)) -> dict:
    client = _client(server)
    keys = [(case, sampling, stream) for case in cases for sampling in SAMPLING for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
        return dict(zip(keys, pool.map(lambda k: _ask(client, *k), keys)))


def _check(server, answers, codec):
    for (case, sampling, stream), answer in answers.items():
        _valid(case, answer)
        assert answer == answers[case, sampling, False], (case, sampling)     # streamed == whole
    # the reasoning is free: a greedy request's reasoning is the unconstrained request's (the same
    # prompt; the tool case's prompt carries the tools)
    client = _client(server)
    for case in {"json", "regex"} & {k[0] for k in answers}:
        free = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "Go."}], max_tokens=BUDGET + 1, temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": True}, "thinking_token_budget": BUDGET,
                        "return_token_ids": True})
        assert free.choices[0].message.reasoning_content == answers[case, "greedy", False]["reasoning"]
        made = free.model_dump()["choices"][0]["token_ids"]
        assert codec.tokenizer.token_to_id(END_THINK) in made[:BUDGET + 1]
    assert server.batcher.engine.blocks_in_use()[0] == 0


@pytest.mark.timeout(900)
def test_a_json_schema_with_thinking_on(plain, codec):
    """The default run's share (the tool prompt's ~760 rows and its call's tokens take minutes
    on TINY's reference engine here: the whole matrix is -m slow, below)."""
    _check(plain, _answers(plain, ("json",)), codec)


@pytest.fixture(scope="module")
def plain_answers(plain):
    return _answers(plain)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_json_regex_and_forced_tools_with_thinking_on(plain, plain_answers, codec):
    _check(plain, plain_answers, codec)


DRAFTERS = {"ngram": lambda engine: NgramDrafter(4, 1, 3), "dspark": dspark_drafter}


@pytest.mark.slow
@pytest.mark.timeout(5400)
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_thinking_answers_with_drafts_equal_the_plain_ones(codec, plain_answers, drafter):
    """Drafts crossing </think> in a verify step: greedy answers equal the plain server's (and seeded
    ones with n-gram drafts; DSpark's seeded drafts follow the speculative-sampling rule, the same
    law but not the same tokens: validated instead)."""
    with _server(codec, DRAFTERS[drafter]) as server:
        answers = _answers(server)
    for key, answer in answers.items():
        _valid(key[0], answer)
        if key[1] == "greedy" or drafter == "ngram":
            assert answer == plain_answers[key], key
