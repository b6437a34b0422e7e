"""Hostile constraints and tools (issue 60): a malformed tool schema is a 400 naming the field, as a
malformed response_format schema is; ``truncate_prompt_tokens: -1`` keeps what the server takes.
The checks run as the server's check threads run them (``schema.generation``) on the TINY
checkpoint's V4.1 chat format."""
import json

import pytest

from dsv41.checkpoint.text import TextCodec
from dsv41.serving import schema, structured

LIMITS = schema.Limits(max_context=2048, max_prompt=2047, vocab_size=0, max_body_bytes=1 << 20)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def codec(tiny_checkpoint):
    return TextCodec.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def compiler(codec):
    return structured.Compiler(codec, codec.size)


def _limits(codec) -> schema.Limits:
    return schema.Limits(LIMITS.max_context, LIMITS.max_prompt, codec.size, LIMITS.max_body_bytes)


def _check(codec, compiler, chat=True, **fields) -> schema.Generation:
    body = {"messages": HI, **fields} if chat else fields
    return schema.generation(schema.parse_body(json.dumps({"max_tokens": 1, **body}).encode(), _limits(codec)),
                             chat, codec, _limits(codec), compiler)


def _refused(codec, compiler, param: str, chat=True, **fields) -> str:
    with pytest.raises(schema.ApiError) as e:
        _check(codec, compiler, chat, **fields)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert e.value.message.startswith(param + ":")
    return e.value.message


def _tool(parameters) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


P = "tools[0].function.parameters"
MALFORMED = [
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": "abc"}}}, P + ".properties.s.minLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": None}}}, P + ".properties.s.minLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": [1]}}}, P + ".properties.s.minLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": -1}}}, P + ".properties.s.maxLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 2}}},
     P + ".properties.s.maxLength"),
    ({"type": "object", "properties": {"s": {"type": "string", "enum": "ab"}}}, P + ".properties.s.enum"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": 5}}}, P + ".properties.s.pattern"),
    ({"type": "object", "properties": {"s": 5}}, P + ".properties.s"),
    ({"type": "object", "properties": ["s"]}, P + ".properties"),
    ({"type": "object", "properties": "s"}, P + ".properties"),
    ({"type": "object", "properties": {"s": {"type": "string"}}, "required": 5}, P + ".required"),
    ({"type": "object", "properties": {"s": {"type": "string"}}, "required": [5]}, P + ".required"),
    ([{"type": "object"}], P),
    ("object", P),
]


@pytest.mark.parametrize("parameters,param", MALFORMED, ids=[p for _, p in MALFORMED])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}],
                         ids=["required", "named"])
def test_a_malformed_tool_schema_is_a_400_naming_the_field(codec, compiler, parameters, param, choice):
    """Each used to be a 500 with a traceback (int("abc"), .items() of a list, set(5))."""
    _refused(codec, compiler, param, tools=_tool(parameters), tool_choice=choice)
    good = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}},
            "required": ["s"]}
    assert _check(codec, compiler, tools=_tool(good), tool_choice=choice).params.grammar is not None


def test_truncating_to_what_the_server_takes_keeps_max_model_len_less_one(codec, compiler):
    """-1 keeps as many tokens as the server accepts: max_model_len - 1 (a row is left for the
    answer's first token), the last ones; one more is refused as too long."""
    prompt = [(5 * i) % 300 + 3 for i in range(3000)]
    gen = _check(codec, compiler, chat=False, prompt=prompt, truncate_prompt_tokens=-1)
    assert gen.prompt == prompt[-2047:] and LIMITS.max_prompt == LIMITS.max_context - 1 == 2047
    assert _check(codec, compiler, chat=False, prompt=prompt, truncate_prompt_tokens=2047).prompt == gen.prompt
    _refused(codec, compiler, "prompt", chat=False, prompt=prompt, truncate_prompt_tokens=2048)
